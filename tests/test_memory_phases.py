"""The planner's peak per phase (shardtune.plan.phase_bytes) against the peak of live tensor bytes each rank
measured with the PyTorch profiler's allocator events (shardtune.profiling, SHARDTUNE_PROFILE_MEMORY): whole runs
of steps of 2 or more micro-batches, then the final save and eval. Measured: every shipped config's 2-rank
reference run (fp32, micro-batch 8, no recomputation; DeepSpeed with its buffers and sub-groups scaled to the
tiny model, conftest.TINY_ZERO_SIZES) and the one-process run, one bf16 run per precision mechanism (autocast
with gradient checkpointing, FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16 engine). On a CPU machine host and
device are one memory, so each phase is compared with the plan's GPU part plus the host RAM it plans for that
phase (offloaded states, NVMe swap buffers, the save's host copy). torch AdamW steps with its per-tensor loop on
CPU (foreach is its CUDA default): planned with foreach=False."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune import Recipe
from shardtune.data import load_splits
from shardtune.flops import resolve_model
from shardtune.hardware import parse_hardware
from shardtune.model import load_tokenizer
from shardtune.plan import PHASES, Strategy, optimizer_step_bytes, plan
from tests.conftest import BF16_CONFIGS, CONFIGS, strategy_as_launched
from tests.test_strategies import CONFIG_NAMES

# The bar; the worst phase of these runs is printed with every comparison.
RTOL = 0.10
TINY = dict(name="tiny", max_seq_length=64, per_device_train_batch_size=16, global_batch_size=32)


def longest_row(assets: tuple[str, str]) -> int:
    """Tokens of the longest training or eval row: batches are padded to their longest, and with 8 or more rows
    of uniformly drawn word lengths nearly every batch holds one of the longest."""
    recipe = Recipe(model_name_or_path=assets[0], dataset=assets[1], **TINY)
    train, held_out = load_splits(recipe, load_tokenizer(recipe))
    return max(len(row["input_ids"]) for split in (train, held_out) for row in split)


def measured_peaks(folder: Path, ranks: int) -> dict[str, int]:
    """Per phase, the most any rank held at once (each rank writes memory_rank<r>.json)."""
    figures = [json.loads((folder / f"memory_rank{rank}.json").read_text()) for rank in range(ranks)]
    return {name: max(rank["peak"][name] for rank in figures) for name in PHASES}


def compare(strategy: Strategy, assets: tuple[str, str], world: int, micro: int, checkpointing: bool,
            folder: Path) -> None:
    shape, hardware = resolve_model(assets[0]), parse_hardware(f"{world}x80gb")
    planned = plan(shape, hardware, strategy, micro, longest_row(assets), checkpointing, eval_batch=8, foreach=False,
                   export_bytes=4)  # the tiny model is stored in fp32: its export is fp32
    measured = measured_peaks(folder, world)
    # What DeepSpeed would swap to NVMe it keeps in host RAM at the tiny size (partitions below its smallest
    # asynchronous I/O, aio block_size): measured here as host RAM.
    kept_from_nvme = planned.nvme_per_node / hardware.gpus_per_node
    rows, errors = [], {}
    for name in PHASES:
        parts = planned.phases[name]
        expected = parts["total"] + parts["on_host"] + kept_from_nvme  # one memory on CPU: host RAM is measured
        errors[name] = expected / measured[name] - 1
        rows.append(f"{name:<17}{expected:>14,.0f}{measured[name]:>14,}{errors[name]:>+9.1%}")
    worst = max(errors, key=lambda name: abs(errors[name]))
    table = "\n".join([f"{strategy.name} x {world}: phase, planned, measured, error", *rows,
                       f"worst: {worst} {errors[worst]:+.1%}"])
    print(table)
    assert planned.per_gpu["total"] == max(planned.phases[name]["total"] for name in PHASES)
    assert abs(errors[worst]) < RTOL, table


def test_one_process_phases_match_the_plan(reference_run, tiny_assets):
    """The one-process reference run (fp32, micro-batch 8 x 4 accumulation steps, no recomputation): the plan of
    a launch without accelerate (DDP's, one rank)."""
    compare(strategy_as_launched("ddp"), tiny_assets, 1, 8, False, reference_run(None).parent / "memory")


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_two_rank_phases_match_the_plan(config, reference_run, tiny_assets):
    """The strategy's reference run (fp32, 2 ranks, micro-batch 8, no recomputation; conftest.reference_run)
    measured its phases."""
    strategy = strategy_as_launched(config)
    compare(strategy, tiny_assets, 2, 8, False, reference_run(config).parent / "memory")


@pytest.mark.parametrize("config", [*BF16_CONFIGS, "ds_zero2"])  # ZeRO-2's run: tests/test_reduce_precision.py
def test_bf16_phases_match_the_plan(config, bf16_run, tiny_assets):
    """Each bf16 mechanism's run (conftest.bf16_run: micro-batch 8): autocast on one process with gradient
    checkpointing (DDP's plan at one rank), FSDP2's MixedPrecisionPolicy and DeepSpeed's bf16 engine (ZeRO-2 and
    ZeRO-3) without."""
    world = 1 if config is None else 2
    compare(strategy_as_launched(config or "ddp", "bf16"), tiny_assets, world, 8, config is None,
            bf16_run(config).parent / "memory")


@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_step_transient_is_planned(foreach, tiny_assets):
    """torch AdamW's own step on the tiny Llama, in this process, as the trainer groups its parameters: the
    bytes it allocates above the model states at its second step (states exist already) are optimizer_step_bytes,
    for foreach (the CUDA default, run here on CPU by request) and for the per-tensor loop."""
    import torch
    from transformers import AutoModelForCausalLM

    from shardtune.profiling import PhaseRecorder
    from shardtune.trainer import param_groups

    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0])
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, foreach=foreach)
    ids = torch.randint(3, model.config.vocab_size, (2, 16))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        recorder = PhaseRecorder()
        recorder.start()
        recorder.watch(model)
        recorder.begin("optimizer")
        optimizer.step()
        recorder.end()
        run = recorder.stop()["phases"]["optimizer"][0]
        optimizer.zero_grad()
    planned = optimizer_step_bytes(Strategy("DDP", "ddp", 0, mixed_precision="no"), resolve_model(tiny_assets[0]),
                                   world=1, foreach=foreach)
    assert run["peak"] - run["start"] == pytest.approx(planned, rel=0.01)


def test_json_lists_every_phase_and_the_total_is_the_largest(capsys):
    """The planner CLI's --json: each phase's parts and total, the peak phase named, per_gpu["total"] its total
    (no longer the sum of forward/backward's components and anything else)."""
    from shardtune.plan import main as plan_main

    code = plan_main(["--model", "llama-3.1-8b", "--hardware", "8xh100-80gb", "--config_file",
                      str(CONFIGS / "fsdp_full_shard.yaml"), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and set(result["phases"]) == set(PHASES)
    for parts in result["phases"].values():
        assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k not in ("total", "on_host")))
    assert result["per_gpu"]["total"] == result["phases"][result["peak_phase"]]["total"]
    assert result["per_gpu"]["total"] == max(parts["total"] for parts in result["phases"].values())
    assert result["phases"]["save"]["on_host"] == 4 * result["params"]  # FSDP's full state dict on rank 0's host
