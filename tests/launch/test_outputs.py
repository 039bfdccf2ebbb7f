"""What a run leaves behind: a Hugging Face model that plain transformers loads and generates with, in the
model's own dtype; a metrics.jsonl with the global-batch loss and the learning rate each step used;
samples.jsonl with the answers to held-out prompts at each eval; run_config.json; and a real offline W&B run
holding the same values, the samples table and the run's config. Exports of checkpoints in any dtype, with the
final export's model files."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

from scripts import export_hf
from shardtune.models.tiny_assets import write_tiny_assets
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
    check_model_files(root / "auto", final_export.parent)
    final, bf16, fp32 = load_file(final_export), load_weights(root / "auto"), load_weights(root / "fp32")
    assert final.keys() == bf16.keys() <= fp32.keys()
    for key, tensor in final.items():
        assert torch.equal(bf16[key], tensor) and torch.equal(fp32[key].to(torch.bfloat16), tensor), key


@pytest.mark.parametrize("config", ["ddp", "fsdp_full_shard"])
def test_exports_are_in_the_model_dtype(config, reference_run, tmp_path):
    """The reference runs' final exports are in the tiny model's own dtype (fp32, as its config.json says), as
    their checkpoints' default export is, with the same model files; --dtype bf16 casts the same weights. Their
    metrics log the learning rate each step used."""
    output_dir = reference_run(config)
    assert export_dtypes(output_dir) == {torch.float32}
    assert json.loads((output_dir / "config.json").read_text())["dtype"] == "float32"
    export_hf.main([str(output_dir / "checkpoint-8"), str(tmp_path / "auto")])
    export_hf.main([str(output_dir / "checkpoint-8"), str(tmp_path / "bf16"), "--dtype", "bf16"])
    check_logged_rates(output_dir)
    check_model_files(tmp_path / "auto", output_dir)
    final, auto, bf16 = (load_weights(output_dir), load_weights(tmp_path / "auto"), load_weights(tmp_path / "bf16"))
    assert export_dtypes(tmp_path / "bf16") == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert final.keys() == auto.keys() == bf16.keys()
    for key, tensor in final.items():
        assert torch.equal(auto[key], tensor) and torch.equal(bf16[key], tensor.to(torch.bfloat16)), key


def check_logged_rates(output_dir: Path) -> None:
    """The lr logged at step s is the rate step s's update used: transformers' schedule of the run's recipe
    after s - 1 scheduler steps, read before the scheduler moves on (not the next step's rate)."""
    recipe = json.loads((output_dir / "run_config.json").read_text())["recipe"]
    max_steps = recipe["max_steps"]
    warmup = recipe["warmup_steps"] or math.ceil(recipe["warmup_ratio"] * max_steps)
    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=recipe["learning_rate"])
    scheduler = get_scheduler(recipe["lr_scheduler_type"], optimizer, num_warmup_steps=warmup,
                              num_training_steps=max_steps)
    expected = []
    for _ in range(max_steps):
        expected.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    logged = {row["step"]: row["lr"] for row in read_metrics(output_dir) if "lr" in row}
    assert list(logged) == list(range(1, max_steps + 1))
    assert list(logged.values()) == expected


def check_model_files(export: Path, final_export: Path) -> None:
    """A checkpoint's export holds the final export's generation_config.json, and neither tokenizer config says
    how the run loaded the tokenizer (the launches run with HF_HUB_OFFLINE=1)."""
    generation = json.loads((final_export / "generation_config.json").read_text())
    assert json.loads((export / "generation_config.json").read_text()) == generation
    for directory in (export, final_export):
        tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
        assert "local_files_only" not in tokenizer_config and "is_local" not in tokenizer_config, directory


# --- reading what was written ------------------------------------------------------------------------------


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
