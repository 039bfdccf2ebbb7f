"""What a run leaves behind: a Hugging Face model that plain transformers loads and generates with, a
metrics.jsonl with the global-batch loss, and a real offline W&B run holding the same values."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import read_metrics, run_recipe


def test_zero3_output_loads_generates_and_is_tracked(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    run_recipe(output_dir, tiny_assets, "--max_steps", "8", "--report_to", "wandb", "--eval_steps", "4",
               "--save_steps", "4", config="ds_zero3", processes=2)

    model = AutoModelForCausalLM.from_pretrained(output_dir)  # vanilla transformers, no shardtune
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    initial = AutoModelForCausalLM.from_pretrained(tiny_assets[0])
    assert not torch.equal(model.lm_head.weight.float(), initial.lm_head.weight), "saved weights are untrained"
    prompt = tokenizer("rev abcd=", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert prompt["input_ids"].shape[1] < generated.shape[1] <= prompt["input_ids"].shape[1] + 5

    metrics = read_metrics(output_dir)
    losses = [row for row in metrics if "loss" in row]
    assert [row["step"] for row in losses] == list(range(1, 9))
    assert [row["step"] for row in metrics if "eval_loss" in row] == [4, 8]
    assert all(row["tokens_per_second_per_device"] > 0 for row in losses)

    runs = list((output_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "expected one offline W&B run under output_dir/wandb"
    records = runs[0].read_bytes()
    for row in losses:  # every logged loss is in the run's records, as W&B's JSON encoding of the float
        assert repr(row["loss"]).encode() in records

    # A resumed run continues the same W&B run: same run id, a second offline segment to sync.
    run_recipe(output_dir, tiny_assets, "--max_steps", "8", "--report_to", "wandb", "--save_steps", "4",
               "--resume_from_checkpoint", str(output_dir / "checkpoint-4"), config="ds_zero3", processes=2)
    runs = sorted((output_dir / "wandb").glob("offline-run-*"))
    run_id = (output_dir / "wandb_run_id").read_text().strip()
    assert len(runs) == 2 and all(run.name.endswith(f"-{run_id}") for run in runs)
