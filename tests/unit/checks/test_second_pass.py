"""Mistakes of a second pass tried as a new user would, each once silent or a traceback: an output directory that
holds the run's own inputs or lies in a checkpoint, a resume through a symlink, a DeepSpeed JSON given as the
accelerate config, a config.json of another size than its weights, and `~` the shell left unexpanded."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shardtune.checkpoint.run_settings import check_resume_settings, run_settings
from shardtune.checks.launch_config import accelerate_config_problems
from shardtune.checks.model import check_model
from shardtune.checks.outputs import check_output_dir
from shardtune.checks.startup import batch_sizes
from shardtune.config import BatchSizes, ConfigError, Recipe
from shardtune.data.loading import load_splits
from shardtune.data.sources import check_dataset_path
from shardtune.flags import parse_flags
from shardtune.launch import LaunchDescription
from tests.conftest import CONFIGS


def output_dir_refusal(**fields) -> str:
    """The output-dir check's refusal (not main(): a run it let through would train and end the process)."""
    with pytest.raises(ConfigError) as refusal:
        check_output_dir(Recipe(**fields))
    assert len(refusal.value.messages) == 1, refusal.value.messages
    return refusal.value.messages[0]


def test_output_dir_in_a_checkpoint_is_refused(tiny_assets, tmp_path):
    """Inside one, a run trained and wrote into the checkpoint, which its own run's rotation would delete; the
    checkpoint itself was refused as "holds files of another run", with --overwrite_output_dir true as the fix."""
    checkpoint = tmp_path / "prev" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "checkpoint_complete.json").write_text('{"step": 2, "world_size": 1}')
    model, data = tiny_assets
    assert f"lies inside the checkpoint '{checkpoint}': a new run's files would change it" in output_dir_refusal(
        model_name_or_path=model, dataset=data, output_dir=str(checkpoint / "run"))
    message = output_dir_refusal(model_name_or_path=model, dataset=data, output_dir=str(checkpoint))
    assert "is the checkpoint: a new run's files would change it" in message
    assert f"--output_dir {tmp_path / 'prev'} --resume_from_checkpoint {checkpoint}" in message


def test_overwrite_output_dir_never_deletes_the_runs_inputs(tiny_assets, tmp_path):
    """--overwrite_output_dir true into the directory holding the data file deleted it (exit 0, after reading it);
    into the model directory it trained, then wrote its export over the model."""
    model, data = tmp_path / "model", tmp_path / "out" / "data.jsonl"
    shutil.copytree(tiny_assets[0], model)
    data.parent.mkdir()
    shutil.copy(tiny_assets[1], data)
    assert f"--dataset '{data}' lies inside --output_dir" in output_dir_refusal(
        model_name_or_path=tiny_assets[0], dataset=str(data), output_dir=str(data.parent), overwrite_output_dir=True)
    assert f"--model_name_or_path '{model}' is --output_dir" in output_dir_refusal(
        model_name_or_path=str(model), dataset=tiny_assets[1], output_dir=str(model), overwrite_output_dir=True)


def test_resume_through_a_symlink_is_the_same_run(tiny_assets, tmp_path, monkeypatch):
    """The model and data given through a symlink (or relative to another directory) are the files the checkpoint
    was trained on: the resume was refused as if they differed."""
    for name in [*os.environ]:
        if name in ("WORLD_SIZE", "RANK", "LOCAL_RANK") or name.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)
    model, data = tiny_assets
    launch = LaunchDescription.from_env()
    recipe = Recipe(model_name_or_path=model, dataset=data, per_device_train_batch_size=16, global_batch_size=32)
    saved = {**run_settings(recipe, launch, batch_sizes(recipe, 1)), "max_steps": recipe.max_steps}
    os.symlink(os.path.dirname(model), tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    linked = Recipe(model_name_or_path="link/model/", dataset="link/data.jsonl", per_device_train_batch_size=16,
                    global_batch_size=32)
    assert check_resume_settings("out/checkpoint-2", 2, saved, run_settings(linked, launch, batch_sizes(linked, 1))) \
        == []
    other = tmp_path / "data.jsonl"  # the same name in another directory is another file
    shutil.copy(data, other)
    moved = Recipe(model_name_or_path=model, dataset="data.jsonl", per_device_train_batch_size=16, global_batch_size=32)
    with pytest.raises(ConfigError, match="--dataset .* differs from the checkpoint's"):
        check_resume_settings("out/checkpoint-2", 2, saved, run_settings(moved, launch, batch_sizes(moved, 1)))


def test_a_resume_keeps_the_dpo_loss():
    """A DPO checkpoint resumed with another loss, beta or method would go on optimising another objective from the
    same optimizer state: refused, naming the checkpoint's values as flags to resume with."""
    launch, batching = LaunchDescription(), BatchSizes(4, 1, 1)
    dpo = Recipe(method="dpo", loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], beta=0.1)
    saved = run_settings(dpo, launch, batching)
    assert check_resume_settings("out/checkpoint-2", 2, saved, run_settings(dpo, launch, batching)) == []
    with pytest.raises(ConfigError) as refusal:
        check_resume_settings("out/checkpoint-2", 2, saved, run_settings(
            dataclasses.replace(dpo, loss_type=["ipo"], beta=0.5, method="sft"), launch, batching))
    assert len(refusal.value.messages) == 3, refusal.value.messages
    assert "resume with --loss_type sigmoid sft" in " ".join(refusal.value.messages)


def test_a_deepspeed_json_given_as_the_accelerate_config_says_so():
    """Each of its keys was refused on a line of its own, `bf16` with "did you mean fp16?"."""
    problems = accelerate_config_problems(str(CONFIGS / "deepspeed" / "zero3.json"))
    assert len(problems) == 1
    assert "zero3.json is a DeepSpeed config (it sets" in problems[0]
    assert "give the accelerate YAML that names it as deepspeed_config_file" in problems[0]


def test_a_config_json_of_another_size_than_its_weights_is_refused(tiny_assets, tmp_path):
    """transformers raised its RuntimeError (`ignore_mismatched_sizes`) after the data was tokenized."""
    model = tmp_path / "model"
    shutil.copytree(tiny_assets[0], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 10}))
    with pytest.raises(ConfigError, match=r"config.json does not describe the weights beside it: 2 tensor\(s\) "
                                          r"differ in shape, first lm_head.weight \(\[44, 64\] in "
                                          r"model.safetensors, \[10, 64\]"):
        check_model(Recipe(model_name_or_path=str(model), max_seq_length=64))
    check_model(Recipe(model_name_or_path=tiny_assets[0], max_seq_length=64))  # the weights' own config passes


def test_tilde_the_shell_left_is_the_home_directory(tmp_path, monkeypatch):
    """`--output_dir=~/runs/x` (no shell expands `~` after `=`) made a directory named `~` in the working directory;
    TrainingArguments expands it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    recipe, problems = parse_flags(Recipe(), ["--output_dir=~/runs/x", "--dataset", "~/a.jsonl,~/b.jsonl"])
    assert problems == []
    assert recipe.output_dir == str(tmp_path / "runs" / "x")
    assert recipe.dataset == f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"


def test_a_model_directory_given_as_the_dataset_says_so(tiny_assets):
    """It offered the model's config.json and tokenizer.json as the data files to give."""
    with pytest.raises(ConfigError, match="is a model directory .* give --dataset the data's file"):
        check_dataset_path(tiny_assets[0])


def test_resume_refusal_writes_a_flag_value_as_the_command_line_does():
    """"--use_peft false differs from the checkpoint's True": Python's spelling of the value it asks for."""
    saved = {"strategy": "ddp", "zero_stage": None, "use_peft": True, "global_batch": 32, "micro_batch": 16,
             "accumulation": 2, "max_steps": 4}
    current = {**saved, "use_peft": False, "explicit_max_steps": 4}
    with pytest.raises(ConfigError, match="--use_peft false differs from the checkpoint's true "):
        check_resume_settings("out/checkpoint-2", 2, saved, current)


def test_a_run_that_wrote_into_the_output_dir_after_the_checks_is_seen_under_the_lock(tiny_assets, tmp_path, capsys,
                                                                                      monkeypatch):
    """Two runs started together into one directory both passed the empty-directory check before either wrote; the
    second took the lock when the first had ended and trained over its files, both exit 0."""
    import shardtune.cli
    import shardtune.trainer

    for name in [*os.environ]:
        if name in ("WORLD_SIZE", "RANK", "LOCAL_RANK") or name.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)
    output_dir = tmp_path / "out"
    checked = shardtune.cli.resume_point

    def the_other_run_writes(*args):  # between this run's checks and its lock, as a run started beside it would
        output_dir.mkdir()
        (output_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
        return checked(*args)

    def train(*args):
        raise AssertionError("trained into another run's output directory")

    monkeypatch.setattr(shardtune.cli, "resume_point", the_other_run_writes)
    monkeypatch.setattr(shardtune.trainer, "train", train)
    model, data = tiny_assets
    with pytest.raises(SystemExit) as exit_info:
        shardtune.cli.main(Recipe(name="tiny", max_seq_length=64, per_device_train_batch_size=16, global_batch_size=32),
                           ["--model_name_or_path", model, "--dataset", data, "--output_dir", str(output_dir),
                            "--report_to", "none", "--use_cpu", "true"])
    assert exit_info.value.code == 2
    assert f"--output_dir '{output_dir}' already holds files of another run" in capsys.readouterr().err


def test_a_lora_adapter_or_checkpoint_given_as_the_model_says_what_to_do(tiny_assets, tmp_path):
    """A LoRA run's checkpoint (config.json beside adapter_config.json) ended in transformers' FileNotFoundError of
    adapter_model.safetensors after the data was tokenized; an adapter was "a directory without config.json"."""
    checkpoint, adapter = tmp_path / "checkpoint-2", tmp_path / "adapter"
    shutil.copytree(tiny_assets[0], checkpoint)
    adapter.mkdir()
    for directory in (checkpoint, adapter):
        (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16}))
    with pytest.raises(ConfigError, match=f"'{checkpoint}' is a LoRA run's checkpoint .* export it merged "
                                          rf"\(python scripts/export_hf.py {checkpoint} MERGED_DIR\)"):
        check_model(Recipe(model_name_or_path=str(checkpoint), max_seq_length=64))
    with pytest.raises(ConfigError, match=f"'{adapter}' is a LoRA adapter .* merge it into its base "
                                          rf"\(python scripts/merge_lora.py {adapter} MERGED_DIR\)"):
        check_model(Recipe(model_name_or_path=str(adapter), max_seq_length=64))


def test_a_chat_template_that_no_row_goes_through_is_said(tiny_assets, tmp_path, caplog):
    """--chat_template chatml on prompt/completion rows trained without it, silently, and saved it with the model
    as the template the model learnt."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(Path(tiny_assets[1]).read_text().splitlines(keepends=True)[:64]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets[0])
    recipe = Recipe(model_name_or_path=tiny_assets[0], dataset=str(data), max_seq_length=64, chat_template="chatml")
    with caplog.at_level(logging.WARNING, logger="shardtune.data.tokenize"):
        load_splits(recipe, tokenizer)
    assert f"--chat_template chatml is not applied to the `prompt_completion` rows of {data}" in caplog.text


def test_overwrite_output_dir_refuses_a_directory_that_holds_no_run(tiny_assets, tmp_path):
    """transformers 4's --overwrite_output_dir deleted nothing; here it emptied a project directory given as
    --output_dir (its sources and notes gone, exit 0). It is refused, a run's files beside them or not; a
    directory that holds only a run is still replaced."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "NOTES.txt").write_text("notes")
    for with_a_run in (False, True):
        if with_a_run:
            (project / ".shardtune-lock").write_text("")  # every run takes it before writing anything
            (project / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
        message = output_dir_refusal(model_name_or_path=tiny_assets[0], dataset=tiny_assets[1],
                                     output_dir=str(project), overwrite_output_dir=True)
        assert "also holds 2 entries no run wrote (NOTES.txt, src): move them out" in message
    shutil.rmtree(project / "src")
    (project / "NOTES.txt").unlink()
    check_output_dir(Recipe(model_name_or_path=tiny_assets[0], dataset=tiny_assets[1], output_dir=str(project),
                            overwrite_output_dir=True))
