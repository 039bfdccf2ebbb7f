"""--gradient_checkpointing_mode selective on 2 real ranks under DeepSpeed ZeRO-3, whose parameter hooks gather
the weights again inside the recompute: the same losses and gradient norms as the reference run without
recomputation, and each phase's peak against the plan with the selective policy's kept outputs counted."""

from __future__ import annotations

import pytest

from tests.conftest import REFERENCE_ARGS, grad_norms, measured_run, strategy_as_launched, train_losses
from tests.launch.test_memory_phases import compare

STEPS = 2  # the reference run's first steps: warm-up 0, so step 1 updates at the same rate in both runs


@pytest.mark.parametrize("config", ["ds_zero3"])
def test_selective_checkpointing_matches_the_reference(config, reference_run, tiny_assets, tmp_path):
    out = measured_run(tmp_path, tiny_assets, *REFERENCE_ARGS, "--max_steps", str(STEPS), "--save_steps", "0",
                       "--gradient_checkpointing", "true", "--gradient_checkpointing_mode", "selective",
                       config=config, processes=2)
    reference = reference_run(config)
    # fp32 on CPU: the recompute replays the same ops on the same gathered weights, and the ranks reduce in the same
    # order, so the figures agree to fp32 rounding of the logged values (the in-process test finds them bit-equal).
    assert train_losses(out) == pytest.approx(train_losses(reference)[:STEPS], rel=1e-6)
    assert grad_norms(out) == pytest.approx(grad_norms(reference)[:STEPS], rel=1e-6)
    compare(strategy_as_launched(config), tiny_assets, 2, True, tmp_path / "memory", checkpointing_mode="selective")
