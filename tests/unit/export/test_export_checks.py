"""Every artifact the export scripts write loads as what it claims, without a launch: a LoRA run's checkpoint (the
peft model as a one-process run saves it, with the model files the trainer adds) exports as the merged model or,
with --adapter, as the adapter; what an export wrote is loaded back and a mismatch refused; written files get the
mode a new file gets; adapter base paths are absolute, and merge_lora resolves or refuses a relative one from
another directory; bad input is one line with the fix. The launched LoRA runs' checkpoints (DDP, FSDP, ZeRO-3)
are exported in tests/launch/test_peft.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from shardtune.checkpoint.markers import describe_files, write_marker
from shardtune.config import Recipe
from shardtune.export.model import add_model_files, save_hf_model
from shardtune.model import load_tokenizer
from tests.conftest import load_script

export_hf = load_script("export_hf")
merge_lora = load_script("merge_lora")
LORA = {"r": 4, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
LOGITS_TOLERANCE = 1e-5


def new_file_mode() -> int:
    """What a plain open(path, "w") gives a new file under the current umask."""
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"mode-probe-{os.getpid()}"
    probe.unlink(missing_ok=True)
    with open(probe, "w"):
        pass
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    return mode


def modes(directory: Path) -> dict[str, int]:
    return {path.name: path.stat().st_mode & 0o777 for path in directory.iterdir() if path.is_file()}


@pytest.fixture(scope="module")
def accelerator():
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def lora_run(tiny_assets, accelerator, tmp_path_factory):
    """A LoRA run as the trainer leaves it: the base loaded from a path relative to the run's working directory,
    adapters trained (here: set at random), the run's own adapter export (save_hf_model) and a checkpoint-4
    holding the peft model's state (as one process saves it) and the model files the trainer adds."""
    root = tmp_path_factory.mktemp("lora")
    assets = Path(tiny_assets[0]).parent
    output_dir = root / "out"
    checkpoint = output_dir / "checkpoint-4"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(assets)  # the run's working directory
        tokenizer = load_tokenizer(Recipe(model_name_or_path="model"))
        base = AutoModelForCausalLM.from_pretrained("model", dtype=torch.float32)
        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.05)  # trained adapters: B is no longer zero
        save_hf_model(accelerator, model, tokenizer, str(output_dir))
        checkpoint.mkdir()
        save_file(model.state_dict(), str(checkpoint / "model.safetensors"))  # as accelerate's save_state writes it
        add_model_files(accelerator, model, tokenizer, None, str(checkpoint))
        mark(checkpoint)
    recorded = {"use_peft": True, "lora_r": 4, "lora_alpha": 32, "lora_dropout": 0.0,
                "lora_target_modules": "all-linear", "model_name_or_path": str(assets / "model")}
    (output_dir / "run_config.json").write_text(json.dumps({"recipe": recorded}))
    input_ids = torch.randint(4, base.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.eval()(input_ids).logits
    return {"output_dir": output_dir, "checkpoint": checkpoint, "input_ids": input_ids, "logits": logits,
            "base": str(assets / "model")}


def mark(checkpoint: Path) -> None:
    write_marker(str(checkpoint), {"step": 4, "world_size": 1, "strategy": "ddp", "model_only": False,
                                   "files": describe_files(str(checkpoint))})


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids).logits


def refusal(capsys, main, *argv: str) -> str:
    """The one line a refused command prints; it exits with code 2."""
    capsys.readouterr()  # what earlier commands printed
    with pytest.raises(SystemExit) as exited:
        code = main(list(argv))
        raise SystemExit(code)
    assert exited.value.code == 2, exited.value.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


# ------------------------------------------------------------------------------------ the run's own export


def test_the_runs_adapter_records_its_base_absolute_and_is_readable(lora_run):
    """The base was loaded from a path relative to the run's directory: the adapter (and each checkpoint's LoRA
    settings) record it absolute; the adapter's weights have the mode of any file the run writes."""
    for directory in (lora_run["output_dir"], lora_run["checkpoint"]):
        recorded = json.loads((directory / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert recorded == lora_run["base"], directory
    assert modes(lora_run["output_dir"])["adapter_model.safetensors"] == new_file_mode()


# ---------------------------------------------------------------------------------------- export_hf, LoRA


def test_lora_checkpoint_exports_as_the_merged_model(lora_run, tmp_path):
    exported = tmp_path / "merged"
    export_hf.main([str(lora_run["checkpoint"]), str(exported)])
    model, info = LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(logits_of(model, lora_run["input_ids"]), lora_run["logits"],
                               rtol=0, atol=LOGITS_TOLERANCE)
    assert set(modes(exported).values()) == {new_file_mode()}, modes(exported)


def test_lora_checkpoint_exports_its_adapter_with_the_flag(lora_run, tmp_path):
    exported = tmp_path / "adapter"
    export_hf.main([str(lora_run["checkpoint"]), str(exported), "--adapter"])
    assert json.loads((exported / "adapter_config.json").read_text())["base_model_name_or_path"] == lora_run["base"]
    base = AutoModelForCausalLM.from_pretrained(lora_run["base"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, exported)
    torch.testing.assert_close(logits_of(adapted, lora_run["input_ids"]), lora_run["logits"],
                               rtol=0, atol=LOGITS_TOLERANCE)
    assert set(modes(exported).values()) == {new_file_mode()}, modes(exported)


def old_checkpoint(lora_run, root: Path, run_config: bool) -> Path:
    """The checkpoint as runs saved it before checkpoints held their LoRA settings."""
    checkpoint = root / "out" / "checkpoint-4"
    shutil.copytree(lora_run["checkpoint"], checkpoint)
    (checkpoint / "adapter_config.json").unlink()
    mark(checkpoint)
    if run_config:
        shutil.copy(lora_run["output_dir"] / "run_config.json", root / "out")
    return checkpoint


def test_an_older_lora_checkpoint_merges_with_its_runs_settings_or_is_refused(lora_run, tmp_path, capsys):
    checkpoint = old_checkpoint(lora_run, tmp_path / "with", run_config=True)
    export_hf.main([str(checkpoint), str(tmp_path / "merged")])
    model = LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(logits_of(model, lora_run["input_ids"]), lora_run["logits"],
                               rtol=0, atol=LOGITS_TOLERANCE)
    alone = old_checkpoint(lora_run, tmp_path / "alone", run_config=False)
    line = refusal(capsys, export_hf.main, str(alone), str(tmp_path / "refused"))
    assert "without its LoRA settings" in line and "copy the run's adapter_config.json" in line, line
    assert not (tmp_path / "refused").exists()


# -------------------------------------------------------------------------------- export_hf, any checkpoint


def plain_checkpoint(tiny_assets, root: Path, rename=None) -> Path:
    """A full fine-tune's one-process checkpoint of the tiny model, saved 0600 as safetensors' writer saves it;
    `rename` changes the names of its tensors."""
    checkpoint = root / "checkpoint-2"
    shutil.copytree(tiny_assets[0], checkpoint)
    state = load_file(str(checkpoint / "model.safetensors"))
    save_file({rename(key) if rename else key: value for key, value in state.items()},
              str(checkpoint / "model.safetensors"))
    mark(checkpoint)
    return checkpoint


def test_an_export_that_would_not_load_is_refused(tiny_assets, tmp_path, capsys):
    """Closing the class: names the model class does not have (here torch.compile's prefix) are refused in one
    line, and nothing is written, where the export used to exit 0 with a model that loads random."""
    checkpoint = plain_checkpoint(tiny_assets, tmp_path, rename=lambda key: f"_orig_mod.{key}")
    line = refusal(capsys, export_hf.main, str(checkpoint), str(tmp_path / "exported"))
    assert "would not load as what it claims" in line and "weights are missing" in line, line
    assert not (tmp_path / "exported").exists() and not (tmp_path / ".exported.tmp").exists()


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o027], ids=["022", "002", "027"])
def test_exported_files_get_the_mode_a_new_file_gets(umask, tiny_assets, tmp_path):
    checkpoint = plain_checkpoint(tiny_assets, tmp_path)
    assert modes(checkpoint)["model.safetensors"] == 0o600  # as safetensors writes it
    previous = os.umask(umask)
    try:
        export_hf.main([str(checkpoint), str(tmp_path / "exported")])
        expected = new_file_mode()
    finally:
        os.umask(previous)
    assert expected == 0o666 & ~umask
    assert modes(tmp_path / "exported") == dict.fromkeys(modes(tmp_path / "exported"), expected)


def test_export_hf_bad_input_is_one_line_with_the_fix(lora_run, tiny_assets, tmp_path, capsys, monkeypatch):
    run = lora_run["output_dir"]
    full = plain_checkpoint(tiny_assets, tmp_path / "full")
    unfinished = tmp_path / "run" / "checkpoint-8"
    shutil.copytree(full, unfinished)
    (unfinished / "checkpoint_complete.json").unlink()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "a").write_text("")
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    cases = {
        ("nowhere", "out"): "nowhere not found: give a checkpoint-<step> directory",
        (str(run), "out"): f"run's output_dir, not a checkpoint: give one of its checkpoints, e.g. {run}/checkpoint-4",
        ("run/checkpoint-8", "out"): "not a complete checkpoint (no checkpoint_complete.json): its save did not finish",
        (str(full), "taken"): "taken exists and is not empty: give a new directory",
        (str(full), f"{full}/export"): "inside the checkpoint",
        (str(full), "out", "--adapter"): "is not a LoRA run's checkpoint: it has no adapter to export; leave out",
        (tiny_assets[0], "out"): "already a Hugging Face model directory",
    }
    for argv, expected in cases.items():
        line = refusal(capsys, export_hf.main, *argv)
        assert line.startswith("export_hf: error: ") and expected in line, (argv, line)
    assert not (tmp_path / "out").exists()
    # A LoRA run's output_dir holding no checkpoint is its adapter: merge_lora.py takes it.
    adapter = tmp_path / "adapter"
    shutil.copytree(run, adapter, ignore=shutil.ignore_patterns("checkpoint-*"))
    assert "merge it into its base with `python scripts/merge_lora.py" in refusal(capsys, export_hf.main,
                                                                                    "adapter", "out")


# ------------------------------------------------------------------------------------------------ merge_lora


def relative_adapter(lora_run, root: Path, run_config: bool) -> Path:
    """The run's adapter as runs wrote it before they recorded the base absolute: relative to the run's directory
    (the assets' parent, where the run started)."""
    adapter = root / "adapter"
    shutil.copytree(lora_run["output_dir"], adapter, ignore=shutil.ignore_patterns("checkpoint-*", "run_config.json"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = os.path.join(".", os.path.basename(lora_run["base"]))
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    if run_config:
        shutil.copy(lora_run["output_dir"] / "run_config.json", adapter)
    return adapter


def test_merge_lora_resolves_a_relative_base_from_another_directory(lora_run, tmp_path, monkeypatch):
    adapter = relative_adapter(lora_run, tmp_path, run_config=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert merge_lora.main([os.path.relpath(adapter), "merged"]) == 0
    model, info = LlamaForCausalLM.from_pretrained(elsewhere / "merged", dtype=torch.float32,
                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    torch.testing.assert_close(logits_of(model, lora_run["input_ids"]), lora_run["logits"],
                               rtol=0, atol=LOGITS_TOLERANCE)
    assert set(modes(elsewhere / "merged").values()) == {new_file_mode()}, modes(elsewhere / "merged")


def test_merge_lora_bad_input_is_one_line_with_the_fix(lora_run, tmp_path, capsys, monkeypatch):
    adapter = relative_adapter(lora_run, tmp_path, run_config=False)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "a").write_text("")
    broken = tmp_path / "broken"  # a base whose config.json does not describe its weights
    shutil.copytree(lora_run["base"], broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cases = {
        (str(adapter), "merged", "--base", str(broken)): f"cannot load the base model {broken} (",
        (str(adapter), "merged"): "records its base as ./model, a path relative to the directory its run was started "
                                  "in, not found from",
        (str(adapter), "merged", "--base", "./nowhere"): "--base ./nowhere not found",
        (str(adapter), str(taken)): "exists and is not empty: give a new directory",
        (str(lora_run["checkpoint"]), "merged"): "is a checkpoint: export it merged with `python scripts/export_hf.py",
        ("nowhere", "merged"): "nowhere not found: give the output_dir of a --use_peft run",
    }
    for argv, expected in cases.items():
        line = refusal(capsys, merge_lora.main, *argv)
        assert line.startswith("merge_lora: error: ") and expected in line, (argv, line)
        if expected.startswith("records"):
            assert "--base" in line, line
    assert not (elsewhere / "merged").exists() and not (elsewhere / ".merged.tmp").exists()
    # Given the base, the old adapter merges from anywhere.
    assert merge_lora.main([str(adapter), "merged", "--base", lora_run["base"]]) == 0
    model = LlamaForCausalLM.from_pretrained(elsewhere / "merged", dtype=torch.float32)
    torch.testing.assert_close(logits_of(model, lora_run["input_ids"]), lora_run["logits"],
                               rtol=0, atol=LOGITS_TOLERANCE)
