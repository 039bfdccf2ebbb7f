"""Every deletion in the package deletes only what its run wrote, each tested beside a stranger's file: checkpoint
rotation past --save_total_limit and a save redone over an unfinished one (shardtune.checkpoint.saver), the final
export's stale shards (shardtune.export.model), the scratch directories of scripts/export_hf.py and merge_lora.py, the
tiny task's assets (models.tiny_assets) and bench_checkpoint's disk probe. --overwrite_output_dir's clearing is in
tests/unit/checkpoint/test_output_dir.py; here, that its list of names covers what a run's export really writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from huggingface_hub import split_torch_state_dict_into_shards
from transformers import AutoModelForCausalLM

from shardtune.checkpoint.markers import MARKER, complete_checkpoints, describe_files, write_marker
from shardtune.checkpoint.run_files import RUN_DIRECTORIES, RUN_FILES, remove_checkpoint, strangers
from shardtune.checkpoint.saver import Checkpointer
from shardtune.config import Recipe
from shardtune.export.model import remove_stale_shards, save_hf_model
from shardtune.models.tiny_assets import build_tokenizer, ensure_tiny_assets
from tests.conftest import load_script


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(path.relative_to(root)): None if path.is_dir() else path.read_bytes()
            for path in sorted(root.rglob("*"))}


@pytest.fixture
def accelerator():
    """A real one-process Accelerator on CPU; its process-wide state is reset afterwards for other tests."""
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def checkpointer(accelerator: Accelerator, output_dir: Path, keep: int) -> Checkpointer:
    """The trainer's Checkpointer over a small prepared model and optimizer: its saves are accelerate's own."""
    model = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    recipe = Recipe(output_dir=str(output_dir), save_steps=1, save_total_limit=keep, report_to="none")
    return Checkpointer(accelerator, recipe, extra_files=lambda path: None)


def test_rotation_keeps_a_checkpoint_that_holds_a_strangers_file(accelerator, tmp_path, capsys, monkeypatch):
    """Past --save_total_limit, a checkpoint holding only its save's files goes; one a file was added to stays
    whole, said in one line at each save that would have deleted it, and training goes on."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    output_dir = tmp_path / "out"
    saver = checkpointer(accelerator, output_dir, keep=1)
    saver.save(1)
    (output_dir / "checkpoint-1" / "notes.txt").write_text("mine")
    (output_dir / "notes.txt").write_text("mine too")
    for step in (2, 3):
        saver.save(step)
    assert [os.path.basename(path) for path in complete_checkpoints(str(output_dir))] == ["checkpoint-1",
                                                                                          "checkpoint-3"]
    assert (output_dir / "checkpoint-1" / "notes.txt").read_text() == "mine"
    assert (output_dir / "notes.txt").read_text() == "mine too"
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtune: warning:")]
    assert len(warnings) == 2 and all(f"--save_total_limit 1: {output_dir}/checkpoint-1 holds notes.txt, which its "
                                      "save did not write: kept whole" in line for line in warnings), warnings


def test_a_save_is_not_redone_over_a_checkpoint_holding_a_strangers_file(accelerator, tmp_path):
    """A resumed run saves again at a step whose checkpoint its earlier run left (or a crash left unfinished):
    replaced when it holds only a save's files, refused in one line when a file was added to it."""
    output_dir = tmp_path / "out"
    saver = checkpointer(accelerator, output_dir, keep=0)
    saver.save(5)
    marker = output_dir / "checkpoint-5" / MARKER
    os.utime(marker, (0, 0))  # a mark a new save cannot carry (an inode number can be reused for the new marker)
    (output_dir / ".checkpoint-6.tmp").mkdir()
    (output_dir / ".checkpoint-6.tmp" / "model.safetensors").write_bytes(b"left by a crash")
    saver.save(6)  # the crash's leftover is this run's: replaced
    assert not (output_dir / ".checkpoint-6.tmp").exists() and (output_dir / "checkpoint-6" / MARKER).is_file()
    (output_dir / "checkpoint-5" / "notes.txt").write_text("mine")
    before = tree(output_dir / "checkpoint-5")
    with pytest.raises(RuntimeError, match=r"checkpoint-5 cannot be saved: .*/checkpoint-5 holds notes.txt, which "
                                           r"its save did not write: kept whole"):
        saver.save(5)
    assert tree(output_dir / "checkpoint-5") == before and marker.stat().st_mtime == 0
    (output_dir / "checkpoint-5" / "notes.txt").unlink()
    saver.save(5)
    assert marker.stat().st_mtime != 0  # saved again: a new marker


def test_remove_checkpoint_deletes_only_a_saves_directory(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / "sub").mkdir(parents=True)
    (checkpoint / "sub" / "shard.bin").write_bytes(b"x")
    write_marker(str(checkpoint), {"step": 2, "world_size": 1, "files": describe_files(str(checkpoint))})
    (checkpoint / "sub" / "extra.bin").write_bytes(b"mine")
    assert "holds sub/extra.bin, which its save did not write" in remove_checkpoint(str(checkpoint))
    assert (checkpoint / "sub" / "extra.bin").is_file() and (checkpoint / MARKER).is_file()
    (checkpoint / "sub" / "extra.bin").unlink()
    assert remove_checkpoint(str(checkpoint)) is None and not checkpoint.exists()
    other = tmp_path / "results"
    other.mkdir()
    assert "is not a checkpoint directory a save wrote: kept" in remove_checkpoint(str(other))
    assert other.is_dir()


def test_stale_export_shards_go_and_a_strangers_shard_named_file_stays(tmp_path):
    """An earlier export's shards that the new one does not write are removed, those its index names only."""
    for index in (1, 2, 3):
        (tmp_path / f"model-0000{index}-of-00003.safetensors").write_bytes(b"earlier export")
    (tmp_path / "model-00001-of-00009.safetensors").write_bytes(b"not an export's")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        f"w{index}": f"model-0000{index}-of-00003.safetensors" for index in (1, 2, 3)}}))
    state = {f"w{index}": torch.zeros(64) for index in range(4)}
    layout = split_torch_state_dict_into_shards(state, max_shard_size=600)
    assert len(layout.filename_to_tensors) == 2  # model-00001-of-00002 and model-00002-of-00002
    remove_stale_shards(str(tmp_path), layout)
    assert sorted(os.listdir(tmp_path)) == ["model-00001-of-00009.safetensors", "model.safetensors.index.json"]


def test_a_runs_export_is_all_names_the_clearing_knows(tiny_assets, accelerator, tmp_path):
    """What save_hf_model writes into output_dir, a full model's and a LoRA adapter's (peft adds its model card),
    is on --overwrite_output_dir's list: a replaced run leaves nothing behind and refuses nothing of its own."""
    from peft import LoraConfig, get_peft_model

    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_assets[0], dtype=torch.float32)
    save_hf_model(accelerator, model, tokenizer, str(tmp_path / "full"), max_shard_size=20_000)
    assert any(name.startswith("model-00001-of-") for name in os.listdir(tmp_path / "full"))  # sharded
    lora = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, target_modules="all-linear"))
    save_hf_model(accelerator, lora, tokenizer, str(tmp_path / "lora"))
    assert {"README.md", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "lora"))
    for directory in ("full", "lora"):
        assert strangers(str(tmp_path / directory)) == [], os.listdir(tmp_path / directory)


def test_the_names_other_modules_write_are_on_the_list():
    """tracking.py and the DPO reference cache name their files themselves: a rename there must reach the list."""
    from shardtune import tracking
    from shardtune.methods.reference import REFERENCE_CACHE

    assert {tracking.RUN_CONFIG_FILE, tracking.SAMPLES_FILE, tracking.METRICS_FILE} <= RUN_FILES
    assert REFERENCE_CACHE in RUN_DIRECTORIES


def test_what_wandb_and_the_reference_cache_write_is_all_names_the_clearing_knows(tmp_path, monkeypatch):
    """wandb's own layout under the output directory (an offline run, then the same run resumed, as tracking.py
    starts it) and the DPO reference cache as write_cache leaves it: nothing in their folders is a stranger's."""
    import wandb

    from shardtune.checkpoint.output_dir import LOCK_FILE
    from shardtune.methods.reference import write_cache
    from shardtune.tracking import wandb_init_kwargs

    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / LOCK_FILE).write_text("")
    recipe = Recipe(name="tiny", output_dir=str(tmp_path))
    try:
        for step in (1, 2):
            run = wandb.init(project="p", mode="offline", **wandb_init_kwargs(recipe, run_id="abcd1234"))
            run.log({"loss": 1.0 / step})
            run.finish()
    finally:
        wandb.teardown()  # W&B's service process, which would otherwise outlive the test
    for split in ("train", "eval"):
        write_cache(str(tmp_path), split, {"pairs": 2}, torch.zeros(2, 2))
    (tmp_path / "reference_log_probs" / "eval.pt.tmp").write_bytes(b"a save cut short")
    wandb_names = os.listdir(tmp_path / "wandb")
    assert {"latest-run", "debug.log", "debug-internal.log"} <= set(wandb_names), wandb_names
    assert strangers(str(tmp_path)) == [], (wandb_names, os.listdir(tmp_path / "reference_log_probs"))


# ------------------------------------------------------------------------------------------------ the scripts


def refusal(capsys, main, *argv: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(list(argv)))
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_export_hf_never_deletes_a_scratch_name_it_did_not_make(tmp_path, capsys):
    """The export is written under .<output>.tmp: one already there (a stranger's, or an export that did not
    finish) was deleted first; it is refused in one line and stays."""
    checkpoint = tmp_path / "run" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    write_marker(str(checkpoint), {"step": 4, "world_size": 1, "files": describe_files(str(checkpoint))})
    scratch = tmp_path / ".exported.tmp"
    scratch.mkdir()
    (scratch / "mine.txt").write_text("mine")
    line = refusal(capsys, load_script("export_hf").main, str(checkpoint), str(tmp_path / "exported"))
    assert f"{scratch} already exists (an export that did not finish, or not an export's): remove it" in line
    assert (scratch / "mine.txt").read_text() == "mine" and not (tmp_path / "exported").exists()


def test_merge_lora_never_deletes_a_scratch_name_it_did_not_make(tiny_assets, tmp_path, capsys):
    """A refused merge (here: the output directory is not empty) deleted .<output>.tmp on its way out, whoever
    made it; a merge into a name whose scratch exists deleted it first. Both leave it as it is."""
    merge_lora = load_script("merge_lora")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny_assets[0]}))
    scratch, output = tmp_path / ".merged.tmp", tmp_path / "merged"
    scratch.mkdir()
    (scratch / "mine.txt").write_text("mine")
    output.mkdir()
    (output / "a").write_text("")
    assert "exists and is not empty" in refusal(capsys, merge_lora.main, str(adapter), str(output))
    assert (scratch / "mine.txt").read_text() == "mine"
    (output / "a").unlink()
    line = refusal(capsys, merge_lora.main, str(adapter), str(output))
    assert f"{scratch} already exists (a merge that did not finish, or not a merge's): remove it" in line
    assert (scratch / "mine.txt").read_text() == "mine" and os.listdir(output) == []


def test_bench_checkpoint_rates_the_disk_without_touching_a_file_of_the_same_name(tmp_path):
    """The disk probe wrote dd.bin in --dir and deleted it, whoever's it was."""
    (tmp_path / "dd.bin").write_text("mine")
    rate = load_script("bench_checkpoint").disk_rate(tmp_path, 16)
    assert rate > 0 and os.listdir(tmp_path) == ["dd.bin"] and (tmp_path / "dd.bin").read_text() == "mine"


def test_tiny_assets_leave_their_neighbours_alone(tmp_path):
    """Written in a scratch directory of their own (mkdtemp) beside the assets, renamed into place, and only that
    scratch removed."""
    (tmp_path / ".tiny-mine").mkdir()
    (tmp_path / ".tiny-mine" / "notes.txt").write_text("mine")
    (tmp_path / "other.txt").write_text("mine")
    before = tree(tmp_path)
    ensure_tiny_assets(str(tmp_path / "tiny"))
    after = tree(tmp_path)
    assert {name: content for name, content in after.items() if not name.startswith("tiny")} == before


def test_prepare_data_deletes_only_its_own_scratch(tiny_assets, tmp_path, capsys):
    """Tokenized into a scratch directory of its own (mkdtemp) beside --output_dir, renamed into place (an empty
    --output_dir is replaced); a scratch-like name of someone else's and the other neighbours stay."""
    from tests.conftest import REPO

    (tmp_path / ".prepare-mine").mkdir()
    (tmp_path / ".prepare-mine" / "notes.txt").write_text("mine")
    (tmp_path / "other.txt").write_text("mine")
    (tmp_path / "out").mkdir()
    before = tree(tmp_path)
    assert load_script("prepare_data").main([str(REPO / "recipes" / "tiny.py"), "--output_dir", str(tmp_path / "out"),
                                             "--model_name_or_path", tiny_assets[0], "--dataset", tiny_assets[1]]) == 0
    after = tree(tmp_path)
    assert {name: content for name, content in after.items() if not name.startswith("out")} == \
        {name: content for name, content in before.items() if name != "out"}
    assert any(name.startswith("out/") for name in after)  # the prepared data took the empty directory's place
