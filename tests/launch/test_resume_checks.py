"""A resume trains the run it resumes, or is refused before anything loads: against the checkpoints of the
one-process reference run, a resume that changes what its optimizer, schedule, weights or data order hold is
refused with one line per difference; one that changes only the split of the global batch is carried over, said
in the start-up line, and trains the reference run's losses."""

from __future__ import annotations

import shutil

import torch

from tests.conftest import REFERENCE_ARGS, read_metrics, run_recipe, train_losses


def errors(result) -> list[str]:
    assert result.returncode == 2, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith("shardtune: error: ")]


def test_a_resume_that_would_train_another_run_is_refused(reference_run, tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    shutil.copytree(reference_run(None), output_dir)
    checkpoint = output_dir / "checkpoint-4"
    # Every difference at once: the optimizer's rate, the data order's seed and batch, the weights' adapters and
    # the schedule's length (whose cosine would jump: the reference runs 8 steps without warm-up).
    lines = errors(run_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, "--learning_rate", "3e-4", "--seed", "7",
                              "--global_batch_size", "16", "--use_peft", "true", "--max_steps", "16",
                              "--resume_from_checkpoint", str(checkpoint), check=False))
    assert len(lines) == 5, lines
    text = "\n".join(lines)
    assert "--learning_rate 0.0003 differs from the checkpoint's 0.003 (its optimizer state holds it): resume " \
           "with --learning_rate 0.003, or start a new run from its weights (scripts/export_hf.py " in text
    assert "--seed 7 differs from the checkpoint's 42 (the order of the rows it continues follows it)" in text
    assert "--use_peft true differs from the checkpoint's false (its weights depend on it)" in text
    assert "global batch is 16 and" in text and "resume with --global_batch_size 32" in text
    # transformers' cosine after 4 of 8 steps is half the tiny recipe's rate of 3e-3; after 4 of 16, 85% of it
    assert "--max_steps 16 differs from the checkpoint's run of 8 steps" in text
    assert "the learning rate after step 4 would be 0.00256 instead of 0.0015" in text

    lines = errors(run_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, "--max_steps", "4",
                              "--resume_from_checkpoint", str(output_dir / "checkpoint-6"), check=False))
    assert len(lines) == 1 and "is at step 6, past --max_steps 4: nothing would train" in lines[0], lines

    # Nothing was written: the run's files are as they were.
    assert len(read_metrics(output_dir)) == len(read_metrics(reference_run(None)))


def test_a_new_split_of_the_same_global_batch_is_carried_over(reference_run, tiny_assets, tmp_path):
    reference = reference_run(None)
    output_dir = tmp_path / "out"
    shutil.copytree(reference, output_dir)
    result = run_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, "--per_device_train_batch_size", "4",
                        "--resume_from_checkpoint", str(output_dir / "checkpoint-6"))
    assert ("resumed from" in result.stdout and "at step 6" in result.stdout and "; micro-batch 4 x 8 accumulation "
            "where the checkpoint had 8 x 4: the same global batch of 32, the same losses" in result.stdout)
    torch.testing.assert_close(train_losses(output_dir), train_losses(reference), rtol=1e-6, atol=0)
