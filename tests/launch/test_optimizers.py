"""--optim adamw_torch_8bit (torchao) with 2 real processes, under DDP and FSDP2 (its states are DTensor shards):
the reference run's arguments (fp32, 8 steps) with the 8-bit optimizer, compiled as torchao compiles it. Its losses
and gradient norms follow adamw_torch's within the quantization error, and each rank holds the optimizer bytes
the planner plans. One launch per strategy serves every assertion."""

from __future__ import annotations

import pytest

from shardtune.flops import resolve_model
from shardtune.plan.states import model_states
from tests.conftest import REFERENCE_ARGS, grad_norms, read_metrics, run_recipe, strategy_as_launched, train_losses

pytest.importorskip("torchao", reason="--optim adamw_torch_8bit needs torchao (requirements.txt)")

EIGHT_BIT_CONFIGS = ("ddp", "fsdp_full_shard")
# Step 1 is computed before any update: the same loss and gradient norm as adamw_torch to fp32 reduction order.
FIRST_STEP_RTOL = 1e-5
# Afterwards each update reads Adam's moments back from 8-bit codes (the dynamic map keeps a value to a few per
# mille of its block's largest magnitude). Adam's update is a ratio of the two moments, so most of that error
# cancels: over 8 steps the losses moved by 8e-6 and the gradient norms by 6e-5 at most (DDP; FSDP2 1e-6 and 9e-6).
# The tolerances leave about 10x that room; a lost, doubled or unquantized-vs-quantized slip in the update rule
# (bias correction, decay) moves them by 1e-3 or more.
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-3


@pytest.fixture(scope="module")
def eight_bit_run(tiny_assets, tmp_path_factory):
    done = {}

    def run(config: str):
        if config not in done:
            root = tmp_path_factory.mktemp(f"optim-8bit-{config}")
            run_recipe(root / "out", tiny_assets, *REFERENCE_ARGS, "--save_steps", "0", "--optim", "adamw_torch_8bit",
                       config=config, processes=2)
            done[config] = root / "out"
        return done[config]

    return run


@pytest.mark.parametrize("config", EIGHT_BIT_CONFIGS)
def test_eight_bit_adam_tracks_adamw_torch_and_holds_the_planned_bytes(config, eight_bit_run, reference_run,
                                                                        tiny_assets):
    output_dir = eight_bit_run(config)
    losses, reference = train_losses(output_dir), train_losses(reference_run(config))
    norms, reference_norms = grad_norms(output_dir), grad_norms(reference_run(config))
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses
    assert losses[0] == pytest.approx(reference[0], rel=FIRST_STEP_RTOL)
    assert norms[0] == pytest.approx(reference_norms[0], rel=FIRST_STEP_RTOL)
    assert losses == pytest.approx(reference, rel=LOSS_RTOL)
    assert norms == pytest.approx(reference_norms, rel=GRAD_NORM_RTOL)
    (row,) = [row for row in read_metrics(output_dir) if "held_optimizer_bytes" in row]
    shape = resolve_model(tiny_assets[0])
    strategy = strategy_as_launched(config)
    planned = model_states(strategy, shape.params, 2, shape, "adamw_torch_8bit")
    # Exact: every state tensor, scale, lookup table and step counter of the largest rank. Well under Adam's fp32
    # states: the 8-bit ones were made (the tiny model's small tensors stay fp32, so not a quarter).
    assert row["held_optimizer_bytes"] == planned.optimizer
    assert planned.optimizer < 0.6 * model_states(strategy, shape.params, 2, shape).optimizer
