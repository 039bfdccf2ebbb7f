"""DPO across strategies, reference modes and a resume, on the tiny recipe's pairs (fp32, 4 steps of 16 pairs):
- ZeRO-3 (the reference an engine of its own, partitioned) and FSDP2 (its reference log-probs precomputed on the
  sharded policy) on 2 ranks give the single process's losses, gradient norms and rewards per step;
- under LoRA the base with its adapter switched off is the same reference as a live frozen copy of the base, and
  as the base's log-probs precomputed from --ref_model_name_or_path;
- a run killed mid-step and resumed reads its precomputed reference log-probs from the output dir (it does not
  recompute them) and ends bitwise where the uninterrupted run does.
The peer (TRL's DPOTrainer) is tests/launch/test_peer_trl_dpo.py."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from shardtune.methods.dpo_loss import PAIR_METRICS
from shardtune.preemption import FAULT_ENV
from shardtune.tiny import preference_examples
from tests.conftest import read_metrics, run_recipe
from tests.launch.test_strategies import FP32_RTOL
from tests.unit.test_formats import write_jsonl

DPO_ARGS = ("--method", "dpo", "--max_steps", "4", "--mixed_precision", "no", "--per_device_train_batch_size", "4",
            "--global_batch_size", "16", "--learning_rate", "1e-3", "--warmup_steps", "1", "--max_seq_length", "32",
            "--save_model", "false")
REWARD_ATOL = 1e-6  # rewards start at 0 (policy = reference)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", preference_examples(96, seed=11))


@pytest.fixture(scope="module")
def single(tiny_assets, pairs, tmp_path_factory):
    """The one-process run with a live reference, which every strategy must reproduce."""
    out = tmp_path_factory.mktemp("dpo-single") / "out"
    run_recipe(out, tiny_assets, "--dataset", pairs, *DPO_ARGS, "--save_steps", "0")
    return steps_of(out)


def steps_of(output_dir) -> list[dict]:
    return [row for row in read_metrics(output_dir) if "loss" in row]


def assert_same_steps(steps: list[dict], reference: list[dict]) -> None:
    assert [row["step"] for row in steps] == [row["step"] for row in reference] == [1, 2, 3, 4]
    for mine, theirs in zip(steps, reference, strict=True):
        for name in ("loss", "grad_norm"):
            assert mine[name] == pytest.approx(theirs[name], rel=FP32_RTOL), (name, mine, theirs)
        for name in PAIR_METRICS:
            assert mine[name] == pytest.approx(theirs[name], rel=FP32_RTOL, abs=REWARD_ATOL), (name, mine, theirs)
    assert reference[-1]["rewards/margins"] != 0 and reference[-1]["loss"] != reference[0]["loss"]  # they trained


@pytest.mark.parametrize(("config", "extra"), [("ds_zero3", ()), ("fsdp_full_shard",
                                                                 ("--precompute_ref_log_probs", "true"))])
def test_two_ranks_equal_one_process(config, extra, single, tiny_assets, pairs, tmp_path):
    result = run_recipe(tmp_path / "out", tiny_assets, "--dataset", pairs, *DPO_ARGS, "--save_steps", "0", *extra,
                        config=config, processes=2)
    reference = "log-probs precomputed" if extra else "a frozen copy of"
    assert f"reference: {reference}" in result.stdout, result.stdout[-3000:]
    assert_same_steps(steps_of(tmp_path / "out"), single)


def test_adapter_off_is_the_live_base(tiny_assets, pairs, tmp_path):
    lora = ("--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0.1", "--save_steps", "0")
    off = run_recipe(tmp_path / "off", tiny_assets, "--dataset", pairs, *DPO_ARGS, *lora)
    live = run_recipe(tmp_path / "live", tiny_assets, "--dataset", pairs, *DPO_ARGS, *lora,
                      "--ref_model_name_or_path", tiny_assets[0])
    named = run_recipe(tmp_path / "named", tiny_assets, "--dataset", pairs, *DPO_ARGS, *lora,
                       "--ref_model_name_or_path", tiny_assets[0], "--precompute_ref_log_probs", "true")
    assert "reference: the base, adapter off" in off.stdout and "a frozen copy of" in live.stdout
    assert "reference log-probs of 91 train pairs computed" in named.stdout
    assert_same_steps(steps_of(tmp_path / "off"), steps_of(tmp_path / "live"))
    assert_same_steps(steps_of(tmp_path / "named"), steps_of(tmp_path / "live"))


def test_killed_run_resumes_exactly_from_cached_reference(tiny_assets, pairs, tmp_path):
    args = ("--dataset", pairs, *DPO_ARGS, "--precompute_ref_log_probs", "true", "--save_steps", "2",
            "--save_model", "true")
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
