"""Tensor parallelism on CPU (gloo) against one process: TP alone over 2 ranks (a DDP config with
parallelism_config_tp_size 2: accelerate runs it without DDP), and accelerate_configs/fsdp_tp.yaml over 4 ranks (tp 2 x
dp_shard 2), with the same global batch. fp32 losses, gradient norms and the final eval equal to one process; each
rank holds its slice of the split weights (the norms whole, FSDP-sharded over the data ranks), which shows that the
layers were split; the export gathers the full weights."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import CONFIGS, grad_norms, read_metrics, run_recipe, train_losses
from tests.launch.test_batch_split import WEIGHT_ATOL, WEIGHT_RTOL
from tests.launch.test_strategies import FP32_RTOL

# 4 fp32 steps of 32 sequences: 1 x 8 x 4 accumulation alone and under TP alone (one data rank), 2 data ranks x 8 x 2
# under tp 2 x dp_shard 2. No warm-up, so that step 1 updates.
TP_ARGS = ("--max_steps", "4", "--save_steps", "0", "--mixed_precision", "no", "--per_device_train_batch_size", "8",
           "--global_batch_size", "32", "--weight_decay", "0.1", "--warmup_ratio", "0")
TINY_NORM_PARAMS = 64 * (2 * 2 + 1)  # hidden 64: two norms per layer, two layers, and the final norm


@pytest.fixture(scope="module")
def single_run(tiny_assets, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("tp-single") / "out"
    run_recipe(output_dir, tiny_assets, *TP_ARGS)
    return output_dir


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


def test_tensor_parallel_alone_matches_one_process(single_run, tiny_assets, tmp_path):
    config = yaml.safe_load((CONFIGS / "ddp.yaml").read_text())
    config["parallelism_config"] = {"parallelism_config_tp_size": 2}
    config_file = tmp_path / "ddp_tp.yaml"
    config_file.write_text(yaml.safe_dump(config))
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, *TP_ARGS, config="ddp", processes=2,
                        launch_args=("--config_file", str(config_file)))
    assert "tensor parallel over 2 ranks | global batch 32 = 8 x 4 accumulation x 1 ranks" in result.stdout, \
        result.stdout[-3000:]
    assert held_weight_bytes(output_dir) == split_bytes(single_run, tp=2, dp=1)
    assert_equal_to_one_process(output_dir, single_run)


def test_fsdp_with_tensor_parallel_matches_one_process(single_run, tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, *TP_ARGS, config="fsdp_tp", processes=4,
                        launch_args=("--num_machines", "1", "--parallelism_config_tp_size", "2",
                                     "--parallelism_config_dp_shard_size", "2"))
    assert ("FSDP2 FULL_SHARD, tensor parallel over 2 ranks | global batch 32 = 8 x 2 accumulation x 2 ranks"
            in result.stdout), result.stdout[-3000:]
    assert held_weight_bytes(output_dir) == split_bytes(single_run, tp=2, dp=2)
    assert_equal_to_one_process(output_dir, single_run)
