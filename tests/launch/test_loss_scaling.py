"""fp16 under DeepSpeed's dynamic loss scaler, started at a scale whose gradients overflow fp16: the engine skips
those steps and halves its scale (an infinite gradient norm each), and the run trains on. On CPU only DeepSpeed
has a loss scaler (accelerate's GradScaler needs a GPU: checks.check_loss_scaler); DDP's and FSDP2's skip the
same way, through the same step vector (tests/unit/test_step.py)."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import read_metrics, run_recipe, tiny_deepspeed_json


@pytest.mark.parametrize(("enabled", "precision"), [("auto", "fp16"), (True, "no")])
def test_fp16_overflows_are_skipped_steps_not_a_stop(enabled, precision, tiny_assets, tmp_path):
    """fp16 from the recipe (the JSON's "auto"), or from the JSON itself, which wins over the recipe's."""
    settings = json.loads(tiny_deepspeed_json("ds_zero2").read_text())
    # 2**30 times a gradient of order 1 / targets overflows fp16 (65,504); one overflow halves the scale.
    settings["fp16"] = {"enabled": enabled, "initial_scale_power": 30, "hysteresis": 1}
    config = tmp_path / "zero2_fp16.json"
    config.write_text(json.dumps(settings))
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--max_steps", "24", "--save_steps", "0", "--logging_steps", "1",
                        "--mixed_precision", precision, "--eval_steps", "0", "--warmup_ratio", "0", config="ds_zero2",
                        processes=1, launch_args=("--deepspeed_config_file", str(config)), check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [row for row in read_metrics(output_dir) if "loss" in row]
    skipped = [row["skipped_steps"] for row in rows]
    assert len(rows) == 24 and 1 <= sum(skipped) < 24 and skipped[0] == 1 and skipped[-1] == 0, skipped
    # a skipped step's norm (inf) is not logged; the schedule waits for the first step taken, as transformers' does
    assert all(("grad_norm" in row) != bool(row["skipped_steps"]) for row in rows)
    assert all(math.isfinite(row["loss"]) for row in rows)
    first_taken = skipped.index(0)
    assert {row["lr"] for row in rows[:first_taken + 1]} == {rows[0]["lr"]} != {rows[first_taken + 1]["lr"]}
