"""--mixed_precision fp8 on 2 real ranks under FSDP2 (fsdp_full_shard: rank 0 reads the weights, the other starts on
the meta device), with torchao's emulated float8 matmuls (tests/launch/float8_probe.py): every rank's decoder
linears train in float8 and gather their weights in float8, the scales precomputed after each step agree across
ranks, the losses track the bf16 run, a run resumed from a mid-run checkpoint repeats the same steps, and hybrid
sharding on 2 loopback machines trains as FULL_SHARD does. The float8 matmuls themselves need a GPU of compute
capability 8.9 or more (scripts/gpu_check.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, machine_log, run_recipe, start_machines, train_losses, wait_all

PROBE = REPO / "tests" / "launch" / "float8_probe.py"
ARGS = ("--mixed_precision", "bf16", "--max_steps", "6", "--per_device_train_batch_size", "8", "--global_batch_size",
        "16", "--learning_rate", "3e-3", "--warmup_ratio", "0", "--save_steps", "0")
# The tiny model's linears: 2 layers x (q, k, v, o, gate, up, down); lm_head stays bf16 (shardtune.levers.float8).
FLOAT8_LINEARS = 14
# e4m3's 3 mantissa bits round each operand by up to 6%; over 6 steps the mean loss drifts by far less (measured
# under 1% on this model), and a float8 path that broke training (wrong scales, unsharded weights) misses by more.
LOSS_RTOL = 0.03


def probed(result) -> list[list[float]]:
    """The probe's figures per rank: float8 linears, shards wrapped, sum and count of the precomputed scales,
    trainable parameters the optimizer does not step, float8 calls whose token count is not a multiple of 16."""
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("probe: ")]
    return json.loads(line.removeprefix("probe: "))["per_rank"]


FLOAT8 = {"env": {"SHARDTUNE_PROBE_FLOAT8": "1"}, "recipe": PROBE}
SAVED = ("--save_steps", "3", "--save_total_limit", "0")


@pytest.fixture(scope="module")
def float8_run(tiny_assets, tmp_path_factory) -> dict:
    """The bf16 run and the fp8 run (a checkpoint at step 3) on fsdp_full_shard, 2 processes: their output dirs, the
    fp8 run's losses and what the probe found on each of its ranks."""
    root = tmp_path_factory.mktemp("float8")
    run_recipe(root / "bf16", tiny_assets, *ARGS, config="fsdp_full_shard", processes=2, recipe=PROBE)
    per_rank = probed(run_recipe(root / "fp8", tiny_assets, *ARGS, *SAVED, config="fsdp_full_shard", processes=2,
                                 **FLOAT8))
    return {"bf16": root / "bf16", "fp8": root / "fp8", "losses": train_losses(root / "fp8"), "per_rank": per_rank}


def test_float8_linears_gather_in_float8_on_every_rank_and_track_bf16(float8_run):
    bf16, fp8, per_rank = float8_run["bf16"], float8_run["fp8"], float8_run["per_rank"]
    print("bf16", train_losses(bf16), "fp8", float8_run["losses"], "per rank", per_rank)
    for linears, wrapped, _, scales, unstepped, odd_token_calls in per_rank:
        assert linears == wrapped == scales == FLOAT8_LINEARS  # rank 1's loaded shards wrapped again too
        assert unstepped == 0  # the optimizer steps every sharded weight, the float8-wrapped ones too
        assert odd_token_calls == 0  # fp8 pads each micro-batch to a multiple of 16 tokens (config.token_multiple)
    assert per_rank[0][2] == per_rank[1][2] > 0  # one all-reduce of the amaxes: the same scales on every rank
    assert float8_run["losses"] != train_losses(bf16)  # the float8 casts acted
    assert float8_run["losses"] == pytest.approx(train_losses(bf16), rel=LOSS_RTOL)
    # The export gathers the float8-wrapped shards into the plain Hugging Face weights a bf16 run writes.
    exported = {name: load_file(path) for name, path in (("bf16", bf16 / "model.safetensors"),
                                                         ("fp8", fp8 / "model.safetensors"))}
    assert {key: (tensor.dtype, tensor.shape) for key, tensor in exported["fp8"].items()} == \
        {key: (tensor.dtype, tensor.shape) for key, tensor in exported["bf16"].items()}
    assert all(type(tensor) is torch.Tensor for tensor in exported["fp8"].values())


def test_a_resumed_float8_run_repeats_its_steps(float8_run, tiny_assets):
    """Resumed from step 3 (the sharded float8-wrapped weights and AdamW's states read back in place): steps 4 to 6
    repeat exactly, and the scales precomputed after the last step are the first run's."""
    fp8 = float8_run["fp8"]
    resumed = probed(run_recipe(fp8, tiny_assets, *ARGS, *SAVED, "--resume_from_checkpoint", str(fp8 / "checkpoint-3"),
                                config="fsdp_full_shard", processes=2, **FLOAT8))
    assert train_losses(fp8) == float8_run["losses"]
    assert resumed == float8_run["per_rank"]


def test_float8_under_hybrid_sharding_on_two_machines_trains_as_under_full_shard(float8_run, tiny_assets, tmp_path):
    """fsdp_hybrid_shard on 2 loopback machines x 2 processes (a (replicate 2, shard 2) mesh; rank 0 loads): every
    rank's linears gather in float8 within its machine, the scales agree on all 4 ranks, and the run trains as
    FULL_SHARD's on 2 ranks does with the same global batch. The float8 roundings differ only where a sum's order
    moved an operand across a rounding boundary: LOSS_RTOL."""
    output_dir = tmp_path / "hybrid"
    machines = start_machines(output_dir, tiny_assets, *ARGS, "--per_device_train_batch_size", "4",
                              configs=["fsdp_hybrid_shard"] * 2, processes_per_machine=2,
                              launch_args=("--parallelism_config_dp_shard_size", "2"),
                              machine_env=[FLOAT8["env"]] * 2, recipe=PROBE)
    wait_all(machines, timeout=600)
    log = machine_log(output_dir, 0)
    assert [machine.returncode for machine in machines] == [0, 0], log[-4000:]
    assert "FSDP2 FULL_SHARD over 2 ranks, replicated x2" in log
    (line,) = [line for line in log.splitlines() if line.startswith("probe: ")]
    per_rank = json.loads(line.removeprefix("probe: "))["per_rank"]
    assert [rank[:2] + rank[3:] for rank in per_rank] == [[FLOAT8_LINEARS] * 3 + [0, 0]] * 4
    assert len({rank[2] for rank in per_rank}) == 1
    print("hybrid", train_losses(output_dir), "full shard", float8_run["losses"])
    assert train_losses(output_dir) == pytest.approx(float8_run["losses"], rel=LOSS_RTOL)
