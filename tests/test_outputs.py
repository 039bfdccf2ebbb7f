"""What a run leaves behind: a Hugging Face model that plain transformers loads and generates with, in the
model's own dtype; a metrics.jsonl with the global-batch loss; samples.jsonl with the answers to held-out
prompts at each eval; run_config.json; and a real offline W&B run holding the same values, the samples table
and the run's config. Exports of checkpoints in any dtype, and the metrics plot."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from datasets import Dataset
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from scripts import export_hf, plot_metrics
from shardtune.config import Recipe
from shardtune.data import IGNORE_INDEX
from shardtune.flops import resolve_model
from shardtune.generation import generate_samples, held_out_prompts
from shardtune.launch import LaunchDescription
from shardtune.plan.launched import launch_hardware, plan_launch
from shardtune.tiny import build_tokenizer, write_tiny_assets
from shardtune.tracking import json_values, memory_plan
from tests.conftest import read_metrics, run_recipe

SAMPLES = 3  # not the default (4): the flag is what sets the count


def test_zero3_output_loads_generates_and_is_tracked(tiny_assets, tmp_path):
    # The tiny model as the Llama checkpoints ship: weights and config.json in bf16. Training loads fp32 master
    # weights; the export is bf16 again by default (--save_dtype auto).
    write_tiny_assets(str(tmp_path / "bf16"), num_examples=2, save_dtype=torch.bfloat16)
    assets = (str(tmp_path / "bf16" / "model"), tiny_assets[1])
    output_dir = tmp_path / "out"
    run_recipe(output_dir, assets, "--max_steps", "8", "--report_to", "wandb", "--eval_steps", "4",
               "--save_steps", "4", "--generation_samples", str(SAMPLES), config="ds_zero3", processes=2)

    model = AutoModelForCausalLM.from_pretrained(output_dir)  # vanilla transformers, no shardtune
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    initial = AutoModelForCausalLM.from_pretrained(assets[0])
    assert not torch.equal(model.lm_head.weight, initial.lm_head.weight), "saved weights are untrained"
    prompt = tokenizer("rev abcd=", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert prompt["input_ids"].shape[1] < generated.shape[1] <= prompt["input_ids"].shape[1] + 5
    assert export_dtypes(output_dir) == {torch.bfloat16}
    assert json.loads((output_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((output_dir / "checkpoint-8" / "config.json").read_text())["dtype"] == "bfloat16"
    check_checkpoint_exports(output_dir / "checkpoint-8", output_dir / "model.safetensors", tmp_path / "exports")

    metrics = read_metrics(output_dir)
    losses = [row for row in metrics if "loss" in row]
    assert [row["step"] for row in losses] == list(range(1, 9))
    assert [row["step"] for row in metrics if "eval_loss" in row] == [4, 8]
    assert all(row["tokens_per_second_per_device"] > 0 for row in losses)
    samples = read_samples(output_dir)
    assert [row["step"] for row in samples] == [4] * SAMPLES + [8] * SAMPLES
    for row in samples:  # each prompt is an eval row cut before its completion; the reference, that completion
        word = re.fullmatch(r"rev ([a-j]+)=", row["prompt"]).group(1)
        assert row["reference"] == word[::-1] and isinstance(row["completion"], str)

    run_config = json.loads((output_dir / "run_config.json").read_text())
    run_dirs = list((output_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, "expected one offline W&B run under output_dir/wandb"
    records = wandb_records(next(run_dirs[0].glob("run-*.wandb")))
    raw = next(run_dirs[0].glob("run-*.wandb")).read_bytes()
    for row in losses:  # every logged loss is in the run's records, as W&B's JSON encoding of the float
        assert repr(row["loss"]).encode() in raw
    check_config(wandb_config(records), run_config)
    assert wandb_tables(records, run_dirs[0], "samples") == {
        step: [[row["step"], row["prompt"], row["completion"], row["reference"]]
               for row in samples if row["step"] == step] for step in (4, 8)}

    # A resumed run continues the same W&B run: same run id, a second offline segment to sync. The samples
    # logged after the checkpoint are dropped and logged again, as the metrics are.
    run_recipe(output_dir, assets, "--max_steps", "8", "--report_to", "wandb", "--save_steps", "4",
               "--generation_samples", str(SAMPLES), "--resume_from_checkpoint", str(output_dir / "checkpoint-4"),
               config="ds_zero3", processes=2)
    runs = sorted((output_dir / "wandb").glob("offline-run-*"))
    run_id = (output_dir / "wandb_run_id").read_text().strip()
    assert len(runs) == 2 and all(run.name.endswith(f"-{run_id}") for run in runs)
    assert [row["step"] for row in read_samples(output_dir)] == [4] * SAMPLES + [8] * SAMPLES


def check_config(config: dict, run_config: dict) -> None:
    """The W&B config is run_config.json: the resolved recipe, the launch's accelerate config, no plan on CPU."""
    assert config == run_config
    assert config["recipe"]["generation_samples"] == SAMPLES and config["recipe"]["max_steps"] == 8
    accelerate = config["accelerate"]
    assert accelerate["distributed_type"] == "DEEPSPEED" and accelerate["num_processes"] == 2
    environment = accelerate["environment"]  # what the launch exported from accelerate_configs/ds_zero3.yaml
    assert environment["ACCELERATE_USE_DEEPSPEED"] == environment["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    deepspeed = accelerate["deepspeed_config"]  # the JSON the launch named, as DeepSpeed runs it
    assert deepspeed["zero_optimization"]["stage"] == 3
    assert isinstance(deepspeed["train_micro_batch_size_per_gpu"], int)  # "auto" in files, resolved by prepare
    assert config["memory_plan"] is None and "no GPU" in config["memory_plan_absent"]


def check_checkpoint_exports(checkpoint: Path, final_export: Path, root: Path) -> None:
    """export_hf.py writes the dtype the checkpoint's config states by default and any other on request; the
    bf16 export of the last checkpoint is the trainer's final export, bit for bit (both cast the fp32 weights)."""
    export_hf.main([str(checkpoint), str(root / "auto")])
    export_hf.main([str(checkpoint), str(root / "fp32"), "--dtype", "fp32"])
    assert export_dtypes(root / "auto") == {torch.bfloat16}
    assert export_dtypes(root / "fp32") == {torch.float32}
    assert json.loads((root / "fp32" / "config.json").read_text())["dtype"] == "float32"
    final, bf16, fp32 = load_file(final_export), load_weights(root / "auto"), load_weights(root / "fp32")
    assert final.keys() == bf16.keys() <= fp32.keys()
    for key, tensor in final.items():
        assert torch.equal(bf16[key], tensor) and torch.equal(fp32[key].to(torch.bfloat16), tensor), key


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


@pytest.mark.parametrize("config", ["ddp", "fsdp_full_shard"])
def test_exports_are_in_the_model_dtype(config, reference_run, tmp_path):
    """The reference runs' final exports are in the tiny model's own dtype (fp32, as its config.json says), as
    their checkpoints' default export is; --dtype bf16 casts the same weights."""
    output_dir = reference_run(config)
    assert export_dtypes(output_dir) == {torch.float32}
    assert json.loads((output_dir / "config.json").read_text())["dtype"] == "float32"
    export_hf.main([str(output_dir / "checkpoint-8"), str(tmp_path / "auto")])
    export_hf.main([str(output_dir / "checkpoint-8"), str(tmp_path / "bf16"), "--dtype", "bf16"])
    final, auto, bf16 = (load_weights(output_dir), load_weights(tmp_path / "auto"), load_weights(tmp_path / "bf16"))
    assert export_dtypes(tmp_path / "bf16") == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert final.keys() == auto.keys() == bf16.keys()
    for key, tensor in final.items():
        assert torch.equal(auto[key], tensor) and torch.equal(bf16[key], tensor.to(torch.bfloat16)), key


@pytest.fixture
def accelerator():
    """A real one-process Accelerator on CPU; its process-wide state is reset afterwards for other tests."""
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


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


def read_samples(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for path in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(path))
    return weights


def export_dtypes(directory: Path) -> set[torch.dtype]:
    """The dtypes of the floating-point tensors of a directory's safetensors files, read from the files."""
    dtypes = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as file:
            dtypes |= {file.get_tensor(key).dtype for key in file.keys()}  # noqa: SIM118
    assert dtypes, f"no safetensors in {directory}"
    return {dtype for dtype in dtypes if dtype.is_floating_point}


# The offline .wandb file: a 7-byte header (":W&B", magic, version), then W&B's protobuf Records in the LevelDB
# log format: 32 KiB blocks of chunks, each with a 7-byte header (CRC, length, type); a record may span blocks.
BLOCK, CHUNK_HEADER, FULL, LAST = 32768, 7, 1, 4


def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data, records, pending, offset = path.read_bytes(), [], b"", 7
    assert data.startswith(b":W&B")
    while offset + CHUNK_HEADER <= len(data):
        if BLOCK - offset % BLOCK < CHUNK_HEADER:  # a block's tail too short for a header is padding
            offset += BLOCK - offset % BLOCK
            continue
        length, kind = int.from_bytes(data[offset + 4:offset + 6], "little"), data[offset + 6]
        pending += data[offset + CHUNK_HEADER:offset + CHUNK_HEADER + length]
        offset += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_config(records: list) -> dict:
    config = {}
    for record in records:
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
    config.pop("_wandb", None)  # W&B's own entry
    return config


def wandb_tables(records: list, run_dir: Path, key: str) -> dict[int, list]:
    """step -> rows of the table logged under `key` at that step, read from the table file the history names.
    History items carry their name as a path (`nested_key`): a table's fields are (key, "path"), (key, "_type")."""
    tables = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        items = {tuple(item.nested_key) or (item.key,): json.loads(item.value_json) for item in record.history.item}
        if (key, "path") in items:
            assert items[key, "_type"] == "table-file"
            tables[items["_step",]] = json.loads((run_dir / "files" / items[key, "path"]).read_text())["data"]
    return tables
