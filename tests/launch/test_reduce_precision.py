"""Gradients are reduced and accumulated in fp32 under bf16: FSDP2 reduce-scatters in fp32 (its
MixedPrecisionPolicy), DeepSpeed ZeRO-2/3 accumulate in fp32 (data_types.grad_accum_dtype). Each run prints what
the live objects use, and holds the gradient bytes the planner counts for it (the bf16 runs of conftest.bf16_run,
2 ranks, and ZeRO-2's of conftest.three_rank_run, 3 ranks; 2 micro-batches each)."""

from __future__ import annotations

import pytest

from shardtune.models.flops import resolve_model
from shardtune.plan.states import model_states
from tests.conftest import THREE_RANKS, read_metrics, strategy_as_launched

CASES = {  # config -> what the start-up line reports
    "fsdp_full_shard": "FSDP reduce float32",
    "ds_zero2": "DeepSpeed gradient accumulation float32",
    "ds_zero3": "DeepSpeed gradient accumulation float32",
}


@pytest.mark.parametrize("config", CASES)
def test_bf16_reduces_in_fp32_and_holds_the_planned_gradients(config, bf16_run, three_rank_run, tiny_assets):
    world = THREE_RANKS if config == "ds_zero2" else 2
    output_dir = three_rank_run(config) if world == THREE_RANKS else bf16_run(config)
    (start,) = [line for line in (output_dir.parent / "launch.log").read_text().splitlines()
                if line.startswith(f"shardtune: {'tiny'} |")]
    assert start.endswith(f"precision bf16 {CASES[config]}"), start
    (row,) = [row for row in read_metrics(output_dir) if "held_gradients_bytes" in row]
    strategy = strategy_as_launched(config, mixed_precision="bf16")
    shape = resolve_model(tiny_assets[0])
    planned = model_states(strategy, shape.params, world=world, shape=shape).gradients
    # ZeRO-2 also holds the embedding's full 16-bit gradient until the step: 3% of this 98k-parameter model.
    assert row["held_gradients_bytes"] == pytest.approx(planned, rel=0.05)
