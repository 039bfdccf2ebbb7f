"""DPO across strategies, reference modes and a resume, on the tiny recipe's pairs (fp32, 4 steps of 16 pairs):
- ZeRO-3 (the reference an engine of its own, partitioned) and FSDP2 (its reference log-probs precomputed on the
  sharded policy) on 2 ranks give the single process's losses, gradient norms and rewards per step;
- under LoRA the base with its adapter switched off is the same reference as a live frozen copy of the base, and
  as the base's log-probs precomputed from --ref_model_name_or_path;
- a run killed mid-step and resumed reads its precomputed reference log-probs from the output dir (it does not
  recompute them) and ends bitwise where the uninterrupted run does;
- each run's phases (the reference's forward inside the step, the precompute pass) measured against the plan of
  its reference mode, as tests/launch/test_memory_phases.py measures SFT's.
The peer (TRL's DPOTrainer) is tests/launch/test_peer_trl_dpo.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from shardtune.checkpoint.preemption import FAULT_ENV
from shardtune.methods.dpo_loss import PAIR_METRICS
from shardtune.models.flops import resolve_model
from shardtune.models.tiny_assets import preference_examples
from shardtune.plan.hardware import parse_hardware
from shardtune.plan.phases import PHASES
from shardtune.plan.planner import plan
from shardtune.plan.preference import profiled_phase_totals
from shardtune.plan.states import Peft
from tests.conftest import read_metrics, run_recipe, strategy_as_launched
from tests.launch.test_memory_phases import RTOL, measured_peaks
from tests.launch.test_strategies import FP32_RTOL
from tests.unit.data.test_formats import write_jsonl

DPO_ARGS = ("--method", "dpo", "--max_steps", "4", "--mixed_precision", "no", "--per_device_train_batch_size", "4",
            "--global_batch_size", "16", "--learning_rate", "1e-3", "--warmup_steps", "1", "--max_seq_length", "32")
LORA_ARGS = ("--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0.1", "--save_steps", "0")
REWARD_ATOL = 1e-6  # rewards start at 0 (policy = reference)
PROFILE = "SHARDTUNE_PROFILE_MEMORY"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", preference_examples(96, seed=11))


def measured_dpo_run(root: Path, assets: tuple[str, str], pairs: str, *args: str, **options):
    """A DPO run into root/out with its phases measured (root/memory)."""
    root.mkdir(parents=True, exist_ok=True)
    return run_recipe(root / "out", assets, "--dataset", pairs, *DPO_ARGS, *args,
                      env={PROFILE: str(root / "memory"), **options.pop("env", {})}, **options)


@pytest.fixture(scope="module")
def single(tiny_assets, pairs, tmp_path_factory) -> Path:
    """The one-process run with a live reference, which every strategy must reproduce."""
    root = tmp_path_factory.mktemp("dpo-single")
    measured_dpo_run(root, tiny_assets, pairs, "--save_steps", "0")
    return root


def steps_of(output_dir: Path) -> list[dict]:
    return [row for row in read_metrics(output_dir) if "loss" in row]


def assert_same_steps(steps: list[dict], reference: list[dict]) -> None:
    assert [row["step"] for row in steps] == [row["step"] for row in reference] == [1, 2, 3, 4]
    for mine, theirs in zip(steps, reference, strict=True):
        for name in ("loss", "grad_norm"):
            assert mine[name] == pytest.approx(theirs[name], rel=FP32_RTOL), (name, mine, theirs)
        for name in PAIR_METRICS:
            assert mine[name] == pytest.approx(theirs[name], rel=FP32_RTOL, abs=REWARD_ATOL), (name, mine, theirs)
    assert reference[-1]["rewards/margins"] != 0 and reference[-1]["loss"] != reference[0]["loss"]  # they trained


def compare_phases(config: str, assets: tuple[str, str], world: int, folder: Path, reference: str,
                   peft: Peft | None = None) -> None:
    """Each phase's plan for the run's reference mode, at the largest batches it ran (a micro-batch of N pairs is
    2N sequences), against the peak the profiler measured; host and device are one memory on CPU."""
    shape, hardware = resolve_model(assets[0]), parse_hardware(f"{world}x80gb")
    measured, batches = measured_peaks(folder, world)
    (rows, length), (eval_rows, eval_length) = batches["forward_backward"], batches["eval"]
    names = [*PHASES, *(["reference_precompute"] if reference == "precomputed" else [])]
    if reference == "precomputed":
        measured.update(measured_peaks(folder, world, ("reference_precompute",))[0])
    options = dict(checkpointing=False, peft=peft, foreach=False, export_bytes=4, chunked_cross_entropy=True,
                   reference=reference, strategy=strategy_as_launched(config))
    training = plan(shape, hardware, micro_batch=rows // 2, seq=length, eval_batch=eval_rows // 2, **options)
    evaluation = plan(shape, hardware, micro_batch=rows // 2, seq=eval_length, eval_batch=eval_rows // 2, **options)
    planned = {**profiled_phase_totals(training.phases),
               **{name: profiled_phase_totals(evaluation.phases)[name] for name in ("eval", "save")}}
    on_host = {name: max(parts["on_host"] for key, parts in plans.phases.items()
                         if key == name or (name == "forward_backward" and key == "reference_forward"))
               for name, plans in (*((name, training) for name in names if name not in ("eval", "save")),
                                   *((name, evaluation) for name in ("eval", "save")))}
    errors = {name: (planned[name] + on_host[name]) / measured[name] - 1 for name in names}
    worst = max(errors, key=lambda name: abs(errors[name]))
    table = "\n".join([f"{config} x {world}, reference {reference}{' LoRA' if peft else ''} (batches {batches}): "
                       "phase, planned, measured, error",
                       *(f"{name:<21}{planned[name] + on_host[name]:>14,.0f}{measured[name]:>14,}{errors[name]:>+9.1%}"
                         for name in names), f"worst: {worst} {errors[worst]:+.1%}"])
    print(table)
    assert abs(errors[worst]) < RTOL, table


def test_one_process_phases_match_the_plan(single, tiny_assets):
    compare_phases("ddp", tiny_assets, 1, single / "memory", "live")


@pytest.mark.parametrize(("config", "reference"), [("ds_zero3", "live"), ("fsdp_full_shard", "precomputed")])
def test_two_ranks_equal_one_process(config, reference, single, tiny_assets, pairs, tmp_path):
    extra = ("--precompute_ref_log_probs", "true") if reference == "precomputed" else ()
    result = measured_dpo_run(tmp_path, tiny_assets, pairs, "--save_steps", "0", *extra, config=config,
                              processes=2)
    shown = "log-probs precomputed" if extra else "a frozen copy of"
    assert f"reference: {shown}" in result.stdout, result.stdout[-3000:]
    assert_same_steps(steps_of(tmp_path / "out"), steps_of(single / "out"))
    compare_phases(config, tiny_assets, 2, tmp_path / "memory", reference)


def test_adapter_off_is_the_live_base(tiny_assets, pairs, tmp_path):
    off = measured_dpo_run(tmp_path / "off", tiny_assets, pairs, *LORA_ARGS)
    live = run_recipe(tmp_path / "live", tiny_assets, "--dataset", pairs, *DPO_ARGS, *LORA_ARGS,
                      "--ref_model_name_or_path", tiny_assets[0])
    named = run_recipe(tmp_path / "named", tiny_assets, "--dataset", pairs, *DPO_ARGS, *LORA_ARGS,
                       "--ref_model_name_or_path", tiny_assets[0], "--precompute_ref_log_probs", "true")
    assert "reference: the base, adapter off" in off.stdout and "a frozen copy of" in live.stdout
    assert "reference log-probs of 91 train pairs computed" in named.stdout
    assert_same_steps(steps_of(tmp_path / "off" / "out"), steps_of(tmp_path / "live"))
    assert_same_steps(steps_of(tmp_path / "named"), steps_of(tmp_path / "live"))
    compare_phases("ddp", tiny_assets, 1, tmp_path / "off" / "memory", "adapter", Peft(rank=4))


def test_killed_run_resumes_exactly_from_cached_reference(tiny_assets, pairs, tmp_path):
    args = ("--dataset", pairs, *DPO_ARGS, "--precompute_ref_log_probs", "true", "--save_steps", "2")
    whole = run_recipe(tmp_path / "whole", tiny_assets, *args)
    assert "reference log-probs of 91 train pairs computed" in whole.stdout, whole.stdout[-3000:]
    killed = run_recipe(tmp_path / "killed", tiny_assets, *args, check=False,
                        env={FAULT_ENV: "rank=0,step=3,micro_batch=1,signal=SIGKILL"})
    assert killed.returncode != 0 and not (tmp_path / "killed" / "model.safetensors").exists()
    resumed = run_recipe(tmp_path / "killed", tiny_assets, *args, "--resume_from_checkpoint", "auto")
    assert "reference log-probs of 91 train pairs read from the cache" in resumed.stdout, resumed.stdout[-3000:]
    assert "resumed from" in resumed.stdout
    assert steps_of(tmp_path / "killed") == [{**row, **timing(row_after)} for row, row_after in
                                             zip(steps_of(tmp_path / "whole"), steps_of(tmp_path / "killed"),
                                                 strict=True)]
    saved = [load_file(str(tmp_path / name / "model.safetensors")) for name in ("whole", "killed")]
    assert saved[0].keys() == saved[1].keys() and all(saved[0][key].equal(saved[1][key]) for key in saved[0])


TIMING = ("tokens_per_second", "tokens_per_second_per_device", "step_time_s")


def timing(row: dict) -> dict:
    """A step's measured times and peaks: the only values of a resumed step that may differ."""
    return {key: value for key, value in row.items() if key in TIMING or "peak" in key or "rss" in key}
