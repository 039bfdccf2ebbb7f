"""What a run records, without a launch: run_config.json's memory plan against the planner's, the greedy samples
at eval, and the metrics plot. The launched runs' models, exports and W&B run are in tests/launch/test_outputs.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from datasets import Dataset
from transformers import AutoModelForCausalLM

from scripts import plot_metrics
from shardtune.config import Recipe
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.export.model import add_model_files
from shardtune.generation import generate_samples, held_out_prompts
from shardtune.launch import LaunchDescription
from shardtune.memory import rss_bytes
from shardtune.models.flops import resolve_model
from shardtune.models.tiny_assets import build_tokenizer
from shardtune.plan.launched import launch_hardware, plan_launch
from shardtune.tracking import json_values, memory_plan, run_config


def test_run_config_holds_the_memory_plan_given_hardware(tiny_assets):
    """With --hardware (or GPUs) the run config holds the plan the start-up line prints: the planner's own
    figures for this model and launch; without either there is none, and it says why."""
    recipe = Recipe(model_name_or_path=tiny_assets[0], hardware="8xh100-80gb", max_seq_length=64,
                    per_device_train_batch_size=16)
    launch = LaunchDescription.from_env()
    plan, why_none = memory_plan(recipe, launch)
    shape = resolve_model(tiny_assets[0])
    strategy = launch.strategy(recipe.mixed_precision)
    expected = plan_launch(shape, launch_hardware("8xh100-80gb", launch), recipe, strategy)[0].to_json()
    assert why_none is None and plan == json_values(expected) and plan["params"] == shape.params
    assert plan["per_gpu"]["total"] > 0 and plan["micro_batch"] == 16 and plan["max_seq_length"] == 64
    assert memory_plan(dataclasses.replace(recipe, hardware=""), launch) == (
        None, "no GPU visible and no --hardware given: nothing to plan against")


@pytest.fixture
def accelerator():
    """A real one-process Accelerator on CPU; its process-wide state is reset afterwards for other tests."""
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_run_config_records_local_paths_absolute_and_hub_names_as_given(tiny_assets, accelerator, monkeypatch):
    """Relative paths are recorded as the absolute paths they named from the run's working directory; names
    that are no local path (Hub ids, split names, bundled templates) stay as given."""
    assets = Path(tiny_assets[0]).parent
    monkeypatch.chdir(assets)
    recipe = Recipe(name="tiny", model_name_or_path="model", dataset="data.jsonl, tatsu-lab/alpaca",
                    eval_split="data.jsonl", chat_template="chatml")
    recorded = run_config(accelerator, recipe, LaunchDescription.from_env())["recipe"]
    assert recorded["model_name_or_path"] == str(assets / "model")
    assert recorded["dataset"] == f"{assets / 'data.jsonl'},tatsu-lab/alpaca"
    assert recorded["eval_split"] == str(assets / "data.jsonl") and recorded["chat_template"] == "chatml"
    assert recorded["output_dir"] == str(assets / "outputs" / "tiny")  # the default, resolved
    hub = Recipe(model_name_or_path="meta-llama/Llama-3.1-8B", dataset="tatsu-lab/alpaca", eval_split="test",
                 output_dir="runs/a")
    recorded = run_config(accelerator, hub, LaunchDescription.from_env())["recipe"]
    assert (recorded["model_name_or_path"], recorded["dataset"], recorded["eval_split"]) == (
        "meta-llama/Llama-3.1-8B", "tatsu-lab/alpaca", "test")
    assert recorded["output_dir"] == str(assets / "runs" / "a")
    assert recorded == {**dataclasses.asdict(hub), "output_dir": str(assets / "runs" / "a")}  # the rest as given


def test_checkpoint_model_files_include_the_final_exports_generation_config(tiny_assets, accelerator, tmp_path):
    """A checkpoint holds the generation_config.json the final export writes, so that its export (export_hf.py
    copies the checkpoint's model files) is the same model directory."""
    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0])
    tokenizer = build_tokenizer()
    add_model_files(accelerator, model, tokenizer, torch.bfloat16, str(tmp_path / "checkpoint"))
    model.save_pretrained(tmp_path / "final")
    written = json.loads((tmp_path / "checkpoint" / "generation_config.json").read_text())
    assert written == json.loads((tmp_path / "final" / "generation_config.json").read_text())
    assert written["eos_token_id"] == tokenizer.eos_token_id


def test_samples_are_greedy_answers_to_held_out_prompts(tiny_assets, accelerator):
    """Prompt and reference split where the labels start; the batched (left-padded) greedy answers equal
    one-prompt-at-a-time generation; the model's train mode and use_cache=False survive the call."""
    tokenizer = build_tokenizer()
    rows = [labelled(tokenizer("rev abc=")["input_ids"], tokenizer("cba", add_special_tokens=False)["input_ids"]),
            labelled(tokenizer("rev abcdefgh=")["input_ids"],
                     tokenizer("hgfedcba", add_special_tokens=False)["input_ids"])]
    chat = [{"role": "user", "content": "rev ij"}, {"role": "assistant", "content": "ji"}]
    prompt = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
    whole = tokenizer.apply_chat_template(chat, return_dict=True)["input_ids"]
    rows.append({"input_ids": whole, "labels": [IGNORE_INDEX] * len(prompt) + whole[len(prompt):]})
    tokenized = Dataset.from_list(rows)
    held_out = held_out_prompts(tokenized, 5, max_length=40)
    assert held_out_prompts(tokenized, 0, max_length=40) is None
    assert [tokenizer.decode(ids) for ids in held_out.prompts] == ["<s>rev abc=", "<s>rev abcdefgh=",
                                                                   "<s>user:rev ij>assistant:"]
    assert [tokenizer.decode(ids) for ids in held_out.references] == ["cba</s>", "hgfedcba</s>", "ji</s>"]
    assert all(label != IGNORE_INDEX for label in tokenized[0]["labels"][len(held_out.prompts[0]):])

    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0])
    model.config.use_cache = False  # as shardtune.model leaves it for training
    model.train()
    samples = generate_samples(accelerator, model, tokenizer, held_out)
    assert model.training and model.config.use_cache is False
    model.eval()
    for sample, prompt in zip(samples, held_out.prompts, strict=True):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=40 - len(held_out.prompts[2]),
                               do_sample=False, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id)
        assert sample["completion"] == tokenizer.decode(alone[0, len(prompt):], skip_special_tokens=True)
    assert any(len(sample["completion"]) > 5 for sample in samples), "the comparison must see some answer"
    assert [sample["reference"] for sample in samples] == ["cba", "hgfedcba", "ji"]
    assert [sample["prompt"] for sample in samples] == ["rev abc=", "rev abcdefgh=", "user:rev ij>assistant:"]


def test_plot_metrics_draws_four_panels(tmp_path, capsys):
    rows = [{"step": step, "loss": 3.0 / step, "lr": 1e-3 * (1 - step / 10), "tokens_per_second": 1000.0 + step}
            for step in range(1, 11)]
    rows += [{"step": 5, "eval_loss": 0.7, "eval_accuracy": 0.2}, {"step": 10, "eval_loss": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 11, "lo')
    assert plot_metrics.main([str(tmp_path), "--output", str(tmp_path / "plot.png")]) == 0
    png = (tmp_path / "plot.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    counts = {key: len(plot_metrics.series(plot_metrics.read_rows(tmp_path / "metrics.jsonl"), key)[0])
              for key, _ in plot_metrics.PANELS}
    assert counts == {"loss": 10, "eval_loss": 2, "lr": 10, "tokens_per_second": 10}
    assert plot_metrics.main([str(tmp_path / "missing")]) == 2
    assert "plot_metrics: error:" in capsys.readouterr().err


# --- reading what was written ------------------------------------------------------------------------------


def labelled(prompt: list[int], target: list[int]) -> dict[str, list[int]]:
    """A tokenized prompt/completion row as the data module makes it: loss on the target and eos only."""
    return {"input_ids": prompt + target + [2], "labels": [IGNORE_INDEX] * len(prompt) + target + [2]}


# The offline .wandb file: a 7-byte header (":W&B", magic, version), then W&B's protobuf Records in the LevelDB
# log format: 32 KiB blocks of chunks, each with a 7-byte header (CRC, length, type); a record may span blocks.
BLOCK, CHUNK_HEADER, FULL, LAST = 32768, 7, 1, 4








def test_a_window_leaves_out_the_saves_and_evals_it_paused_for(accelerator):
    """tokens/s and step time are training's: the time of a checkpoint save or an eval (metrics.paused) is left
    out, and the window's peak memory starts again after it, in GB (1e9 bytes, as the planner counts)."""
    import time

    from shardtune.config import BatchSizes
    from shardtune.data.batches import StepBatch
    from shardtune.metrics import TrainMetrics
    from shardtune.step import StepOutput

    metrics = TrainMetrics(accelerator, BatchSizes(1, 1, 1), 10, resolve_model("llama-3.1-8b"), None)
    counts = {"targets": 10, "tokens": 30, "processed": 40, "sequences": 4}
    summary = metrics.after_step(StepOutput(torch.tensor(1.5), torch.tensor(2.0), lr=1e-3),
                                 StepBatch([], counts, next_targets=10), stop_requested=False)
    with metrics.paused() as pause:
        time.sleep(0.5)
        held = torch.ones(200_000_000, dtype=torch.uint8)  # 200 MB resident while paused, returned when freed
        during = rss_bytes()
        del held
    row = metrics.window(1, summary, lr=1e-3)
    assert row["step_time_s"] < 0.25 and row["tokens_per_second"] == pytest.approx(30 / row["step_time_s"])
    assert "skipped_steps" not in row  # only with a loss scaler
    assert 0 < row["peak_rss_gb"] * 1e9 < during - 150e6
    assert pause["peak_rss_gb"] * 1e9 > during - 10e6  # the pause's own, which a checkpoint save logs
    # MFU of LoRA: the frozen base's flops_per_token, over the window's mean sequence length (30 / 4 tokens)
    from shardtune.models.flops import flops_per_token

    shape = resolve_model("llama-3.1-8b")
    lora = TrainMetrics(accelerator, BatchSizes(1, 1, 1), 10, shape, 1e15, adapters=41_943_040)
    summary = lora.after_step(StepOutput(torch.tensor(1.5), torch.tensor(2.0), lr=1e-3),
                              StepBatch([], counts, next_targets=10), stop_requested=False)
    row = lora.window(1, summary, lr=1e-3)
    assert row["mfu"] == pytest.approx(row["tokens_per_second"] * flops_per_token(shape, 8, adapters=41_943_040)
                                       / 1e15)
    assert flops_per_token(shape, 8, adapters=41_943_040) < 0.7 * flops_per_token(shape, 8)


def test_overflows_without_end_stop_an_fp16_run(accelerator):
    """Each overflow under a loss scaler is a skipped step; MAX_SKIPPED_IN_A_ROW of them in a row are gradients no
    scale makes finite (torch's GradScaler would skip forever), and stop the run; a finite step starts the count
    again."""
    from shardtune.config import BatchSizes
    from shardtune.data.batches import StepBatch
    from shardtune.metrics import MAX_SKIPPED_IN_A_ROW, TrainMetrics
    from shardtune.step import StepOutput

    metrics = TrainMetrics(accelerator, BatchSizes(1, 1, 1), 10, resolve_model("llama-3.1-8b"), None,
                           loss_scaled=True)
    counts = {"targets": 10, "tokens": 30, "processed": 40, "sequences": 4}

    def step(norm: float):
        return metrics.after_step(StepOutput(torch.tensor(1.5), torch.tensor(norm), lr=1e-3),
                                  StepBatch([], counts, next_targets=10), stop_requested=False)

    assert [step(float("inf")).non_finite for _ in range(3)] == [False] * 3
    assert step(2.0).skipped_in_a_row == 0
    verdicts = [step(float("inf")).non_finite for _ in range(MAX_SKIPPED_IN_A_ROW)]
    assert verdicts == [False] * (MAX_SKIPPED_IN_A_ROW - 1) + [True]
    row = metrics.window(36, step(2.0), lr=1e-3)
    assert row["skipped_steps"] == 3 + MAX_SKIPPED_IN_A_ROW and row["grad_norm"] == 2.0
    assert "grad_norm" not in metrics.window(37, step(float("inf")), lr=1e-3)  # JSON has no inf
