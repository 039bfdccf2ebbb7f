"""Tensor parallelism on CPU (gloo) against one process: TP alone over 2 ranks (a DDP config with
parallelism_config_tp_size 2: accelerate runs it without DDP), and accelerate_configs/fsdp_tp.yaml over 4 ranks (tp 2 x
dp_shard 2), with the same global batch. fp32 losses, gradient norms and the final eval equal to one process; each
rank holds its slice of the split weights (the norms whole, FSDP-sharded over the data ranks), which shows that the
layers were split; the export gathers the full weights. Under fsdp_tp.yaml only rank 0 reads the weights
(RAM-efficient loading); a rank killed mid-run resumes from the last checkpoint to the uninterrupted run's losses
and weights, bit for bit; its checkpoint resumes under FSDP2 without TP (resharded); the run's export equals the
one-process export of its last checkpoint, bit for bit. Both launches measure their phases (SHARDTUNE_PROFILE_MEMORY),
each within test_memory_phases.RTOL of the plan of the config as launched; what the plan leaves out here is the
step's micro-batches (int64 ids, labels, masks), held for the whole step: tiny beside a real model's states."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from shardtune.checkpoint.markers import read_marker
from shardtune.checkpoint.preemption import FAULT_ENV
from shardtune.plan.strategy import read_accelerate_config
from tests.conftest import (
    CONFIGS,
    grad_norms,
    kill_tree,
    read_metrics,
    run_recipe,
    start_recipe,
    strategy_as_launched,
    tensor_parallel_launch_args,
    train_losses,
    wait_all,
    wait_for_ranks,
)
from tests.launch.test_batch_split import WEIGHT_ATOL, WEIGHT_RTOL
from tests.launch.test_checkpoint import export, wait_for_text
from tests.launch.test_memory_phases import compare
from tests.launch.test_strategies import FP32_RTOL

# 4 fp32 steps of 32 sequences: 1 x 8 x 4 accumulation alone and under TP alone (one data rank), 2 data ranks x 8 x 2
# under tp 2 x dp_shard 2. No warm-up, so that step 1 updates.
TP_ARGS = ("--max_steps", "4", "--save_steps", "0", "--mixed_precision", "no", "--per_device_train_batch_size", "8",
           "--global_batch_size", "32", "--weight_decay", "0.1", "--warmup_ratio", "0")
TINY_NORM_PARAMS = 64 * (2 * 2 + 1)  # hidden 64: two norms per layer, two layers, and the final norm
# tp 2 x dp_shard 2 on 4 processes, saving at steps 2 and 4.
FSDP_TP = dict(config="fsdp_tp", processes=4, launch_args=("--num_machines", "1", *tensor_parallel_launch_args(4)))
FSDP_TP_ARGS = (*TP_ARGS, "--save_steps", "2")
PROFILE = "SHARDTUNE_PROFILE_MEMORY"


@pytest.fixture(scope="module")
def single_run(tiny_assets, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("tp-single") / "out"
    run_recipe(output_dir, tiny_assets, *TP_ARGS)
    return output_dir


@pytest.fixture(scope="module")
def tp_alone_run(tiny_assets, tmp_path_factory):
    """TP 2 alone: ddp.yaml with a parallelism_config section, 2 processes; its phases measured (root/memory).
    -> (output dir, result, the config file)."""
    root = tmp_path_factory.mktemp("tp-alone")
    config = yaml.safe_load((CONFIGS / "ddp.yaml").read_text())
    config["parallelism_config"] = {"parallelism_config_tp_size": 2}
    config_file = root / "ddp_tp.yaml"
    config_file.write_text(yaml.safe_dump(config))
    result = run_recipe(root / "out", tiny_assets, *TP_ARGS, config="ddp", processes=2,
                        launch_args=("--config_file", str(config_file)), env={PROFILE: str(root / "memory")})
    return root / "out", result, config_file


@pytest.fixture(scope="module")
def fsdp_tp_run(tiny_assets, tmp_path_factory):
    """tp 2 x dp_shard 2 under fsdp_tp.yaml; its phases measured (<output dir>/../memory)."""
    root = tmp_path_factory.mktemp("fsdp-tp")
    result = run_recipe(root / "out", tiny_assets, *FSDP_TP_ARGS, env={PROFILE: str(root / "memory")}, **FSDP_TP)
    return root / "out", result


def final_eval(output_dir) -> dict[str, float]:
    (row,) = [row for row in read_metrics(output_dir) if "eval_loss" in row]
    return {key: row[key] for key in ("eval_loss", "eval_accuracy")}


def held_weight_bytes(output_dir) -> int:
    return next(row["held_weights_bytes"] for row in read_metrics(output_dir) if "held_weights_bytes" in row)


def assert_equal_to_one_process(output_dir, single_run) -> None:
    assert train_losses(output_dir) == pytest.approx(train_losses(single_run), rel=FP32_RTOL)
    assert grad_norms(output_dir) == pytest.approx(grad_norms(single_run), rel=FP32_RTOL)
    assert final_eval(output_dir) == pytest.approx(final_eval(single_run), rel=FP32_RTOL)
    reference = load_file(single_run / "model.safetensors")
    weights = load_file(output_dir / "model.safetensors")
    assert weights.keys() == reference.keys()
    for key, tensor in reference.items():
        torch.testing.assert_close(weights[key], tensor, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=key)


def split_bytes(single_run, tp: int, dp: int) -> int:
    """Weights per rank: the split ones over tp x dp ranks, the norms (whole on each tp rank) over the dp ranks."""
    total, norms = held_weight_bytes(single_run), 4 * TINY_NORM_PARAMS
    return (total - norms) // (tp * dp) + norms // dp


def test_tensor_parallel_alone_matches_one_process(single_run, tp_alone_run):
    output_dir, result, _ = tp_alone_run
    assert "tensor parallel over 2 ranks | global batch 32 = 8 x 4 accumulation x 1 ranks" in result.stdout, \
        result.stdout[-3000:]
    assert held_weight_bytes(output_dir) == split_bytes(single_run, tp=2, dp=1)
    assert_equal_to_one_process(output_dir, single_run)


def test_fsdp_with_tensor_parallel_matches_one_process(single_run, fsdp_tp_run):
    output_dir, result = fsdp_tp_run
    assert ("FSDP2 FULL_SHARD, tensor parallel over 2 ranks | global batch 32 = 8 x 2 accumulation x 2 ranks"
            in result.stdout), result.stdout[-3000:]
    assert held_weight_bytes(output_dir) == split_bytes(single_run, tp=2, dp=2)
    assert_equal_to_one_process(output_dir, single_run)


def test_fsdp_with_tensor_parallel_reads_the_weights_on_rank_0_only(single_run, fsdp_tp_run):
    """fsdp_tp.yaml's RAM-efficient loading: rank 0 holds the whole fp32 model after loading, every other rank
    nothing (its model on the meta device) until rank 0's tensors reach its shards one at a time."""
    output_dir, _ = fsdp_tp_run
    (row,) = [row for row in read_metrics(output_dir) if "held_weights_bytes" in row]
    loaded = [row[f"loaded_parameter_bytes_rank{rank}"] for rank in range(4)]
    assert loaded == [held_weight_bytes(single_run), 0, 0, 0]


def test_fsdp_with_tensor_parallel_resumes_a_killed_run_bit_for_bit(fsdp_tp_run, tiny_assets, tmp_path):
    """Rank 1 killed inside step 3's accumulation cycle; the resume from checkpoint-2 gives steps 3 and 4 and the
    final weights of the uninterrupted run bit for bit. The checkpoint records its tp_size."""
    reference, _ = fsdp_tp_run
    killed = tmp_path / "killed"
    fault = "rank=1,step=3,micro_batch=0,signal=SIGKILL"
    launcher = start_recipe(killed, tiny_assets, *FSDP_TP_ARGS, env={FAULT_ENV: fault}, **FSDP_TP)
    ranks = wait_for_ranks(launcher, 4)
    wait_for_text(tmp_path / "killed.log", "rank 1 sends itself SIGKILL at step 3, micro-batch 0", [launcher])
    kill_tree(launcher, ranks)
    assert max(row["step"] for row in read_metrics(killed) if "loss" in row) == 2
    assert read_marker(str(killed / "checkpoint-2"))["run"]["tp_size"] == 2

    resumed = start_recipe(killed, tiny_assets, *FSDP_TP_ARGS, "--resume_from_checkpoint", "auto",
                           log_name="resumed", **FSDP_TP)
    wait_all([resumed], timeout=600)
    log = (tmp_path / "resumed.log").read_text()
    assert resumed.returncode == 0, log[-4000:]
    assert f"resumed from {killed}/checkpoint-2 at step 2" in log, log[-4000:]
    assert [row["step"] for row in read_metrics(killed) if "loss" in row] == [1, 2, 3, 4]
    assert train_losses(killed) == train_losses(reference)  # bitwise
    assert grad_norms(killed) == grad_norms(reference)
    ours, theirs = load_file(killed / "model.safetensors"), load_file(reference / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key


def test_a_tensor_parallel_checkpoint_resumes_on_fewer_ranks_under_fsdp2_alone(fsdp_tp_run, tiny_assets, tmp_path):
    """torch.distributed.checkpoint reshards: tp 2 x dp_shard 2's checkpoint-2 (4 ranks) resumed under FSDP2 alone
    on 2 ranks trains steps 3 and 4 as the TP run did (the Adam moments came along: step 4 follows from them), the
    global batch of 32 kept (8 x 2 accumulation x 2 data ranks), to fp32 rounding. (Under fsdp_tp.yaml, 2 ranks
    would be tp 2 x dp_shard 1, which accelerate cannot shard: refused at start-up, checks of the launch.)"""
    reference, _ = fsdp_tp_run
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, *FSDP_TP_ARGS, "--resume_from_checkpoint",
                        str(reference / "checkpoint-2"), config="fsdp_full_shard", processes=2)
    assert ("tensor parallelism over 1 rank(s) where the checkpoint had 2: torch.distributed.checkpoint reshards"
            in result.stdout), result.stdout[-3000:]
    assert ("2 processes where the checkpoint had 4: micro-batch 8 x 2 accumulation x 2 data ranks where it had "
            "micro-batch 8 x 2 accumulation x 2 data ranks" in result.stdout), result.stdout[-3000:]
    assert [row["step"] for row in read_metrics(output_dir) if "loss" in row] == [3, 4]
    assert train_losses(output_dir) == pytest.approx(train_losses(reference)[2:], rel=FP32_RTOL)
    assert grad_norms(output_dir) == pytest.approx(grad_norms(reference)[2:], rel=FP32_RTOL)
    ours, theirs = load_file(output_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    for key, tensor in theirs.items():
        torch.testing.assert_close(ours[key], tensor, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=key)


def test_fsdp_with_tensor_parallel_export_equals_its_checkpoint(fsdp_tp_run, tmp_path):
    """The final export gathers each (dp_shard, tp) DTensor whole and writes it in the model's dtype: bit for bit
    what scripts/export_hf.py writes from the last checkpoint on one process (torch.distributed.checkpoint reads
    the 2-D shards as whole tensors)."""
    output_dir, _ = fsdp_tp_run
    export(output_dir / "checkpoint-4", tmp_path / "exported")
    ours, theirs = load_file(output_dir / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    stated = json.loads((output_dir / "config.json").read_text())["dtype"]
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert str(ours[key].dtype) == f"torch.{stated}", key
        assert torch.equal(ours[key], tensor), key


def test_tensor_parallel_alone_phases_match_the_plan(tp_alone_run, tiny_assets):
    """TP 2 alone's phases (fp32, micro-batch 8, no recomputation) against the plan of its config as launched:
    ddp.yaml with tp_size 2 over its 2 ranks."""
    output_dir, _, config_file = tp_alone_run
    strategy = read_accelerate_config(str(config_file), "no")
    assert strategy.tensor_parallel == 2
    compare(strategy, tiny_assets, 2, False, output_dir.parent / "memory")


def test_fsdp_with_tensor_parallel_phases_match_the_plan(fsdp_tp_run, tiny_assets):
    """tp 2 x dp_shard 2's phases (fp32, micro-batch 8, no recomputation) against the plan of fsdp_tp.yaml as
    launched (conftest.strategy_as_launched: tp 2 over the 4 ranks)."""
    output_dir, _ = fsdp_tp_run
    strategy = strategy_as_launched("fsdp_tp", processes=4)
    assert strategy.tensor_parallel == 2
    compare(strategy, tiny_assets, 4, False, output_dir.parent / "memory")
