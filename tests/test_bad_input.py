"""Bad configuration stops with one clear line and exit code 2, before any model is loaded or file written."""

from __future__ import annotations

import pytest

from shardtune import Recipe, main
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
    "4-bit without LoRA": (["--load_in_4bit", "true"], "add --use_peft true"),
    "QLoRA without a GPU": (["--use_peft", "true", "--load_in_4bit", "true"], "--load_in_4bit needs a CUDA GPU"),
    "unknown data format": (["--dataset_format", "sharegpt"], "--dataset_format must be one of"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_before_loading(case, tiny_assets, tmp_path, capsys):
    """The recipe entry point itself, in this process (a launched refusal is tested below): exit code 2, one
    line naming the problem and the fix, no traceback, nothing loaded, nothing written."""
    args, message = CASES[case]
    output_dir = tmp_path / "out"
    model_dir, data_file = tiny_assets
    argv = ["--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir", str(output_dir),
            "--report_to", "none", *args]
    with pytest.raises(SystemExit) as exit_info:
        main(Recipe(name="tiny", max_seq_length=64, per_device_train_batch_size=16, global_batch_size=32), argv)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    error_lines = [line for line in stderr.splitlines() if line.startswith("shardtune: error:")]
    assert len(error_lines) == 1 and message in error_lines[0], stderr[-2000:]
    assert "Traceback" not in stderr and "Loading weights" not in stderr
    assert not output_dir.exists()


def test_batch_must_divide_over_ranks(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--global_batch_size", "48", "--per_device_train_batch_size", "16",
                        config="ddp", processes=2, check=False)
    assert result.returncode != 0
    assert "= 16 x 2 = 32. Pick a global batch that is a multiple of 32" in result.stderr
    assert not output_dir.exists()
