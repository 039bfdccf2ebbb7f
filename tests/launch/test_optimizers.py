"""torchao's 8-bit AdamW with 2 real processes: --optim adamw_torch_8bit in fp32 under DDP, against the reference
run; and under FSDP2 (its states are DTensor shards) the headline's optimizer, 8-bit states over bf16 weights with
--bf16_stochastic_round (no fp32 master), against the bf16 run. Each run's losses and gradient norms follow the
plain run's, and each rank holds the model-state bytes the planner plans. One launch per run serves every
assertion; the plain runs are the session's own.

The launches set TORCHDYNAMO_DISABLE=1: torchao wraps its per-tensor update in torch.compile, and inductor compiles
it once per parameter shape, minutes on 2 CPU cores; eager, the update rule and the states are the same (the states
are allocated outside the compiled function)."""

from __future__ import annotations

import pytest

from shardtune.models.flops import resolve_model
from shardtune.plan.states import model_states
from tests.conftest import REFERENCE_ARGS, grad_norms, read_metrics, run_recipe, strategy_as_launched, train_losses

EAGER = {"TORCHDYNAMO_DISABLE": "1"}
# (config, extra arguments). FSDP2 with 8-bit states in fp32 tracks the reference as closely (measured: losses
# 1e-6, gradient norms 9e-6) but would cost a third launch; its DTensor states are stepped by the run below.
RUNS = {"ddp-8bit": ("ddp", ("--optim", "adamw_torch_8bit")),
        "fsdp-8bit-sr": ("fsdp_full_shard", ("--optim", "adamw_torch_8bit", "--mixed_precision", "bf16",
                                             "--bf16_stochastic_round", "true"))}
# Step 1 is computed before any update: the same loss and gradient norm as adamw_torch to fp32 reduction order.
FIRST_STEP_RTOL = 1e-5
# Afterwards each update reads Adam's moments back from 8-bit codes (the dynamic map keeps a value to a few per
# mille of its block's largest magnitude). Adam's update is a ratio of the two moments, so most of that error
# cancels: over 8 steps the losses moved by 8e-6 and the gradient norms by 6e-5 at most.
# The tolerances leave about 10x that room; a lost, doubled or unquantized-vs-quantized slip in the update rule
# (bias correction, decay) moves them by 1e-3 or more.
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-3
# bf16 weights rounded stochastically against the bf16 run's fp32 master (its compute cast to bf16 by FSDP2's
# policy). Step 1's forward sees the same bf16 weights: the same loss (measured equal). The gradient norm is
# computed over bf16 gradients, in bf16 (2.875 against 2.8783): within bf16's rounding, 2^-8 relative. Afterwards
# each update is rounded to bf16 with a random draw where the master keeps it whole: over 8 steps the losses
# moved by 4.5e-4 and the norms by 4.0e-3 at most; the loss tolerance leaves 10x that room, the norm's 2.5x
# (bf16's rounding of the norm dominates). At this learning rate the losses cannot tell a kept master from none:
# the held bytes below (2 per parameter for weights and gradients) prove no master is kept.
STOCHASTIC_NORM_RTOL = 1e-2
STOCHASTIC_LOSS_RTOL = 5e-3


@pytest.fixture(scope="module")
def optim_run(tiny_assets, tmp_path_factory):
    done = {}

    def run(name: str):
        if name not in done:
            config, args = RUNS[name]
            root = tmp_path_factory.mktemp(f"optim-{name}")
            run_recipe(root / "out", tiny_assets, *REFERENCE_ARGS, "--save_steps", "0", *args, config=config,
                       processes=2, env=EAGER)
            done[name] = root / "out"
        return done[name]

    return run


def held_and_planned(output_dir, config: str, tiny_assets, optim: str, stochastic: bool = False
                     ) -> tuple[dict[str, int], dict[str, float]]:
    (row,) = [row for row in read_metrics(output_dir) if "held_optimizer_bytes" in row]
    shape = resolve_model(tiny_assets[0])
    planned = model_states(strategy_as_launched(config), shape.params, 2, shape, optim,
                           bf16_stochastic_round=stochastic)
    keys = ("weights", "gradients", "optimizer")
    return ({key: row[f"held_{key}_bytes"] for key in keys}, {key: getattr(planned, key) for key in keys})


def test_eight_bit_adam_tracks_adamw_torch_and_holds_the_planned_bytes(optim_run, reference_run, tiny_assets):
    config = "ddp"
    output_dir = optim_run("ddp-8bit")
    losses, reference = train_losses(output_dir), train_losses(reference_run(config))
    norms, reference_norms = grad_norms(output_dir), grad_norms(reference_run(config))
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses
    assert losses[0] == pytest.approx(reference[0], rel=FIRST_STEP_RTOL)
    assert norms[0] == pytest.approx(reference_norms[0], rel=FIRST_STEP_RTOL)
    assert losses == pytest.approx(reference, rel=LOSS_RTOL)
    assert norms == pytest.approx(reference_norms, rel=GRAD_NORM_RTOL)
    held, planned = held_and_planned(output_dir, config, tiny_assets, "adamw_torch_8bit")
    # Exact: every state tensor, scale, lookup table and step counter of the largest rank. Well under Adam's fp32
    # states: the 8-bit ones were made (the tiny model's small tensors stay fp32, so not a quarter).
    assert held == planned
    shape = resolve_model(tiny_assets[0])
    assert planned["optimizer"] < 0.6 * model_states(strategy_as_launched(config), shape.params, 2, shape).optimizer


def test_stochastic_rounding_under_fsdp2_holds_bf16_weights_and_tracks_the_master(optim_run, bf16_run, tiny_assets):
    output_dir = optim_run("fsdp-8bit-sr")
    losses, reference = train_losses(output_dir), train_losses(bf16_run("fsdp_full_shard"))
    norms, reference_norms = grad_norms(output_dir), grad_norms(bf16_run("fsdp_full_shard"))
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses
    assert losses[0] == pytest.approx(reference[0], rel=FIRST_STEP_RTOL)
    assert losses == pytest.approx(reference, rel=STOCHASTIC_LOSS_RTOL)
    assert norms == pytest.approx(reference_norms, rel=STOCHASTIC_NORM_RTOL)
    held, planned = held_and_planned(output_dir, "fsdp_full_shard", tiny_assets, "adamw_torch_8bit", True)
    assert held == planned
    shape = resolve_model(tiny_assets[0])
    # bf16 weights and gradients on each rank, half of what the fp32 master run holds: no master copy anywhere.
    assert held["weights"] == held["gradients"] == pytest.approx(2 * shape.params / 2, rel=0.02)
