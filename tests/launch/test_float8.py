"""--mixed_precision fp8 on 2 real ranks under FSDP2 (fsdp_full_shard: rank 0 reads the weights, the other starts on
the meta device), with torchao's emulated float8 matmuls (tests/launch/float8_probe.py): every rank's decoder
linears train in float8 and gather their weights in float8, the scales precomputed after each step agree across
ranks, the losses track the bf16 run, and a run resumed from a mid-run checkpoint repeats the same steps. The float8
matmuls themselves need a GPU of compute capability 8.9 or more (scripts/gpu_check.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, run_recipe, train_losses

PROBE = REPO / "tests" / "launch" / "float8_probe.py"
ARGS = ("--mixed_precision", "bf16", "--max_steps", "6", "--per_device_train_batch_size", "8", "--global_batch_size",
        "16", "--learning_rate", "3e-3", "--warmup_ratio", "0", "--save_steps", "0")
# The tiny model's linears: 2 layers x (q, k, v, o, gate, up, down); lm_head stays bf16 (shardtune.float8).
FLOAT8_LINEARS = 14
# e4m3's 3 mantissa bits round each operand by up to 6%; over 6 steps the mean loss drifts by far less (measured
# under 1% on this model), and a float8 path that broke training (wrong scales, unsharded weights) misses by more.
LOSS_RTOL = 0.03


def probed(result) -> list[list[float]]:
    """The probe's figures per rank: float8 linears, shards wrapped, sum and count of the precomputed scales."""
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("probe: ")]
    return json.loads(line.removeprefix("probe: "))["per_rank"]


def test_float8_linears_gather_in_float8_on_every_rank_and_track_bf16(tiny_assets, tmp_path):
    bf16 = tmp_path / "bf16"
    run_recipe(bf16, tiny_assets, *ARGS, config="fsdp_full_shard", processes=2, recipe=PROBE)
    fp8 = tmp_path / "fp8"
    float8 = {"env": {"SHARDTUNE_PROBE_FLOAT8": "1"}, "config": "fsdp_full_shard", "processes": 2, "recipe": PROBE}
    per_rank = probed(run_recipe(fp8, tiny_assets, *ARGS, "--save_steps", "3", "--save_total_limit", "0", **float8))
    print("bf16", train_losses(bf16), "fp8", train_losses(fp8), "per rank", per_rank)
    for linears, wrapped, _, scales in per_rank:
        assert linears == wrapped == scales == FLOAT8_LINEARS  # rank 1's loaded shards wrapped again too
    assert per_rank[0][2] == per_rank[1][2] > 0  # one all-reduce of the amaxes: the same scales on every rank
    assert train_losses(fp8) != train_losses(bf16)  # the float8 casts acted
    assert train_losses(fp8) == pytest.approx(train_losses(bf16), rel=LOSS_RTOL)
    # The export gathers the float8-wrapped shards into the plain Hugging Face weights a bf16 run writes.
    exported = {name: load_file(path) for name, path in (("bf16", bf16 / "model.safetensors"),
                                                         ("fp8", fp8 / "model.safetensors"))}
    assert {key: (tensor.dtype, tensor.shape) for key, tensor in exported["fp8"].items()} == \
        {key: (tensor.dtype, tensor.shape) for key, tensor in exported["bf16"].items()}
    assert all(type(tensor) is torch.Tensor for tensor in exported["fp8"].values())

    # Resumed from step 3 (the sharded float8-wrapped weights and AdamW's states read back in place): steps 4 to 6
    # repeat exactly, and the scales precomputed after the last step are the first run's.
    losses = train_losses(fp8)
    resumed = probed(run_recipe(fp8, tiny_assets, *ARGS, "--save_steps", "3", "--save_total_limit", "0",
                                "--resume_from_checkpoint", str(fp8 / "checkpoint-3"), **float8))
    assert train_losses(fp8) == losses
    assert resumed == per_rank
