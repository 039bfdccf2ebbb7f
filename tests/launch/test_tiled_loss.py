"""--chunked_cross_entropy under the sharded strategies, 2 real ranks in fp32: the reference run (the loss in tiles,
the default) against the same run with the plain loss, step by step. ZeRO-3 partitions the LM head's weight
outside its module's forward and FSDP2 reshards it after the root forward: a tiled loss that read it ungathered
would fail or train on an empty weight (the field's known failure)."""

from __future__ import annotations

import pytest

from tests.conftest import REFERENCE_ARGS, grad_norms, run_recipe, train_losses

# The same weights, batches and reductions; only the loss's fp32 sums run in another order (per tile, then the
# tiles) and the head's backward is a recomputation: about 1e-7 per step, 1e-5 over eight steps of drift.
TILED_RTOL = 1e-5


@pytest.mark.parametrize("config", ["ds_zero3", "fsdp_full_shard"])
def test_tiled_loss_trains_as_the_plain_loss(config, reference_run, tiny_assets, tmp_path):
    plain = tmp_path / "plain"
    run_recipe(plain, tiny_assets, *REFERENCE_ARGS, "--save_steps", "0", "--chunked_cross_entropy", "false",
               config=config, processes=2)
    tiled = reference_run(config)
    assert len(train_losses(tiled)) == 8
    assert train_losses(tiled) == pytest.approx(train_losses(plain), rel=TILED_RTOL)
    assert grad_norms(tiled) == pytest.approx(grad_norms(plain), rel=TILED_RTOL)
