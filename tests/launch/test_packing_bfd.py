"""--packing_strategy bfd, launched: two DDP ranks on CPU train rows packed to --max_seq_length from a
micro-batch of 1, --global_batch_size counts rows, and metrics.jsonl shows the sequences and tokens of each step."""

from __future__ import annotations

import math
import re

import pytest

from tests.conftest import read_metrics, run_recipe

MAX_SEQ_LENGTH, ROWS_PER_STEP, STEPS = 64, 4, 4


def test_bfd_run_trains_full_rows_and_logs_sequences_per_step(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--packing", "true", "--packing_strategy", "bfd",
                        "--max_seq_length", str(MAX_SEQ_LENGTH), "--per_device_train_batch_size", "1",
                        "--global_batch_size", str(ROWS_PER_STEP), "--max_steps", str(STEPS), "--save_steps", "0",
                        "--save_model", "false", "--warmup_ratio", "0", config="ddp", processes=2)
    packed = re.search(r"train data packed \(bfd\): (\d+) sequences into (\d+) rows of up to 64 tokens", result.stderr)
    assert packed, result.stderr[-3000:]
    sequences, rows = int(packed[1]), int(packed[2])
    assert rows < sequences / 3  # the demo's sequences are 13-23 tokens long
    steps = [row for row in read_metrics(output_dir) if "loss" in row]
    assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
    for row in steps:
        assert math.isfinite(row["loss"]) and row["token_utilization"] == 1.0  # no padding
        # --global_batch_size counts rows: an epoch is the packed rows' count over it
        assert row["epoch"] == pytest.approx(row["step"] / (rows // ROWS_PER_STEP))
        # Four rows of up to 64 tokens, about three quarters full and more, several sequences each.
        assert 0.75 * ROWS_PER_STEP * MAX_SEQ_LENGTH <= row["tokens_per_step"] <= ROWS_PER_STEP * MAX_SEQ_LENGTH
        assert 13 <= row["tokens_per_step"] / row["sequences_per_step"] <= 23
        assert row["tokens_per_step"] == pytest.approx(row["tokens_per_second"] * row["step_time_s"])
    assert len({row["sequences_per_step"] for row in steps}) > 1  # it varies from step to step
