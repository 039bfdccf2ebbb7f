"""Bad configuration stops with one clear line and exit code 2, before any model is loaded or file written."""

from __future__ import annotations

import pytest

from tests.conftest import run_recipe

CASES = {
    "unknown flag": (["--learning_rat", "1e-4"], "Unknown argument(s): --learning_rat"),
    "batch does not divide": (["--global_batch_size", "33", "--per_device_train_batch_size", "4"],
                              "--global_batch_size 33 is not divisible"),
    "accumulation disagrees": (["--global_batch_size", "32", "--per_device_train_batch_size", "4",
                                "--gradient_accumulation_steps", "4"], "disagrees with --global_batch_size"),
    "fp16 without a loss scaler": (["--mixed_precision", "fp16"], "needs a loss scaler"),
    "unknown precision": (["--mixed_precision", "fp8"], "--mixed_precision must be one of"),
    "missing dataset": (["--dataset", "no/such/file.jsonl"], "Dataset file not found: 'no/such/file.jsonl'"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_before_loading(case, tiny_assets, tmp_path):
    args, message = CASES[case]
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, *args, check=False)
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "Loading weights" not in result.stderr
    assert not output_dir.exists()


def test_batch_must_divide_over_ranks(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--global_batch_size", "48", "--per_device_train_batch_size", "16",
                        config="ddp", processes=2, check=False)
    assert result.returncode != 0
    assert "= 16 x 2 = 32. Pick a global batch that is a multiple of 32" in result.stderr
    assert not output_dir.exists()
