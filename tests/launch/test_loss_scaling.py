"""fp16 under DeepSpeed's dynamic loss scaler, started at a scale whose gradients overflow fp16: the engine skips
those steps and halves its scale (an infinite gradient norm each), and the run trains on. On CPU only DeepSpeed
has a loss scaler (accelerate's GradScaler needs a GPU: checks.check_loss_scaler); DDP's and FSDP2's skip the
same way, through the same step vector (tests/unit/test_step.py).

DeepSpeed trains fp16 on CPU only where its CPU accelerator reports fp16 (oneDNN's fp16 kernels: Intel's
AVX512-FP16 or AMX-FP16; no AMD processor has them). There the runs train; elsewhere the same recipe is refused in
one line before anything loads (distributed.check_deepspeed_fp16), and the training test skips saying why, or fails
where SHARDTUNE_REQUIRE names cpu_fp16 (a CI runner known to have the feature)."""

from __future__ import annotations

import json
import math
from functools import cache

import pytest

from tests.conftest import read_metrics, run_recipe, skip_unless_required, tiny_deepspeed_json
from tests.unit.checks.test_bad_input import Case, refused

# fp16 from the recipe (the JSON's "auto"), or from the JSON itself, which wins over the recipe's.
PRECISIONS = [("auto", "fp16"), (True, "no")]
NO_FP16 = ("DeepSpeed's CPU accelerator reports no fp16 on this processor (is_fp16_supported() is falsy: oneDNN's "
           "fp16 kernels need Intel AVX512-FP16 or AMX-FP16)")


@cache
def cpu_has_fp16() -> bool:
    """The question DeepSpeed's engine asks before it trains fp16 (its _do_sanity_check)."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def fp16_json(enabled, tmp_path):
    settings = json.loads(tiny_deepspeed_json("ds_zero2").read_text())
    # 2**30 times a gradient of order 1 / targets overflows fp16 (65,504); one overflow halves the scale.
    settings["fp16"] = {"enabled": enabled, "initial_scale_power": 30, "hysteresis": 1}
    config = tmp_path / "zero2_fp16.json"
    config.write_text(json.dumps(settings))
    return config


@pytest.mark.parametrize(("enabled", "precision"), PRECISIONS)
def test_fp16_overflows_are_skipped_steps_not_a_stop(enabled, precision, tiny_assets, tmp_path):
    if not cpu_has_fp16():
        skip_unless_required("cpu_fp16", f"{NO_FP16}: the refusal is tested instead")
    config = fp16_json(enabled, tmp_path)
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


@pytest.mark.parametrize(("enabled", "precision"), PRECISIONS)
def test_fp16_where_the_processor_has_none_is_refused_before_loading(enabled, precision, tiny_assets, tmp_path,
                                                                     capsys, monkeypatch):
    """The same recipe and JSON, in this process with the variables `accelerate launch` exports for them: one line
    naming the fix (in the JSON where the JSON asks for fp16), exit code 2, nothing loaded, instead of DeepSpeed's
    ValueError after the model has loaded."""
    if cpu_has_fp16():
        pytest.skip("this processor has fp16 under DeepSpeed: the runs above train it")
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(fp16_json(enabled, tmp_path))}
    fix = '"fp16": {"enabled": false} (or "auto") in the DeepSpeed JSON' if enabled is True else \
        "use --mixed_precision bf16 or no"
    spec = Case(("--mixed_precision", precision), "fp16 under DeepSpeed needs fp16 support on the device", env=env)
    error_lines, stderr = refused(spec, tiny_assets, tmp_path, capsys, monkeypatch)
    assert len(error_lines) == 1 and spec.message in error_lines[0] and error_lines[0].endswith(f"{fix}."), stderr
