"""The sequence split (DeepSpeed Ulysses over 2 CPU ranks, gloo) against one process, beyond what every shipped
config shows in tests/launch/test_strategies.py (ds_zero3_ulysses and ds_zero3_offload_optimizer_ulysses: fp32
losses, gradient norms and saved weights equal to one process): ZeRO-2 under the split, whose gradients DeepSpeed
divides by another count than ZeRO-3's; the eval run split; a checkpoint saved split and resumed without the
split; and in tests/launch/test_checkpoint.py a rank killed under the split and resumed exactly."""

from __future__ import annotations

import shutil

import pytest
import yaml

from tests.conftest import CONFIGS, REFERENCE_ARGS, grad_norms, read_metrics, run_recipe, train_losses
from tests.launch.test_strategies import FP32_RTOL


def final_eval(output_dir) -> dict[str, float]:
    (row,) = [row for row in read_metrics(output_dir) if "eval_loss" in row]
    return {key: row[key] for key in ("eval_loss", "eval_accuracy")}


def test_zero2_under_the_split_matches_one_process(reference_run, tiny_assets, tmp_path):
    """ZeRO-1/2 divide the gradients summed over the ranks by world / sp, ZeRO-3's reduce-scatter by world: with
    one loss scale for both, one of them would train at 1/sp or sp x the gradient (a doubled norm is what
    transformers' recipe gives under ZeRO-2, DeepSpeed issue #5248). The gradient norms show it; the losses
    alone would not (clipping and Adam hide a constant factor). Its eval batch (3 rows) is not its micro-batch
    (8): accelerate registers Ulysses for one row count, which the trainer fits to each batch."""
    config = yaml.safe_load((CONFIGS / "ds_zero2.yaml").read_text())
    config["parallelism_config"] = {"parallelism_config_sp_backend": "deepspeed", "parallelism_config_sp_size": 2}
    config["deepspeed_config"]["deepspeed_config_file"] = str(CONFIGS.parent / config["deepspeed_config"]
                                                              ["deepspeed_config_file"])
    config_file = tmp_path / "ds_zero2_ulysses.yaml"
    config_file.write_text(yaml.safe_dump(config))
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, "--save_steps", "0", "--per_device_eval_batch_size",
                        "3", config="ds_zero2", processes=2, launch_args=("--config_file", str(config_file)))
    assert "DeepSpeed ZeRO-2, sequences split over 2 ranks (Ulysses)" in result.stdout, result.stdout[-3000:]
    reference = reference_run(None)
    assert train_losses(output_dir) == pytest.approx(train_losses(reference), rel=FP32_RTOL)
    assert grad_norms(output_dir) == pytest.approx(grad_norms(reference), rel=FP32_RTOL)
    assert final_eval(output_dir) == pytest.approx(final_eval(reference), rel=FP32_RTOL)


def test_the_eval_runs_split_and_equals_one_process(reference_run):
    """The final eval of the split run: each rank its slice of every row of its group, the per-row statistics summed
    over the group (shardtune.evaluation.split_statistics)."""
    assert final_eval(reference_run("ds_zero3_ulysses")) == pytest.approx(final_eval(reference_run(None)),
                                                                          rel=FP32_RTOL)


def test_a_checkpoint_saved_split_resumes_without_the_split(reference_run, tiny_assets, tmp_path):
    """ZeRO-3 partitions every state over all ranks with the split or without it: a checkpoint of the split run
    resumes under plain ZeRO-3 on as many ranks and trains on as the split run did."""
    reference = reference_run("ds_zero3_ulysses")
    output_dir = tmp_path / "out"
    shutil.copytree(reference, output_dir)
    result = run_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, "--resume_from_checkpoint",
                        str(output_dir / "checkpoint-4"), config="ds_zero3", processes=2)
    assert f"resumed from {output_dir}/checkpoint-4 at step 4" in result.stdout, result.stdout[-3000:]
    assert [row["step"] for row in read_metrics(output_dir) if "loss" in row] == list(range(1, 9))
    assert train_losses(output_dir) == pytest.approx(train_losses(reference), rel=FP32_RTOL)
    assert grad_norms(output_dir) == pytest.approx(grad_norms(reference), rel=FP32_RTOL)
