"""Checks of what a run writes and reads back: its output directory, checkpoints and resumption, the background
save, and the final export's dtype and samples. Standard library and shardtune's config only: they run before
anything heavy is imported."""

from __future__ import annotations

import json
import os

from shardtune.checkpoint.markers import MARKER, foreign_checkpoints, foreign_checkpoints_note
from shardtune.checkpoint.output_dir import in_use, in_use_message, is_rank_zero
from shardtune.checkpoint.run_files import clear_problem, described, strangers
from shardtune.config import SAVE_DTYPES, ConfigError, Recipe
from shardtune.data.sources import dataset_sources
from shardtune.launch import LaunchDescription


def check_checkpoints(recipe: Recipe) -> None:
    resume = recipe.resume_from_checkpoint
    if recipe.save_only_model and resume == "auto":
        raise ConfigError("--save_only_model true writes checkpoints without optimizer states, which cannot resume "
                          "training: drop --resume_from_checkpoint auto or --save_only_model true.")
    if recipe.save_only_model and recipe.use_peft:
        raise ConfigError("--save_only_model true is for full fine-tuning; a LoRA checkpoint's optimizer states are "
                          "small: drop --save_only_model true.")
    if resume == "auto" and recipe.overwrite_output_dir:
        raise ConfigError("--resume_from_checkpoint auto resumes the run in --output_dir and --overwrite_output_dir "
                          "true deletes it: drop one of them.")
    if resume and recipe.overwrite_output_dir:
        raise ConfigError(f"--overwrite_output_dir true would be ignored: a run resumed from {resume!r} keeps "
                          "--output_dir as it is. Drop one of them.")
    if resume and resume != "auto" and not os.path.isdir(resume):
        raise ConfigError(f"--resume_from_checkpoint {resume!r} is not a directory: give a checkpoint "
                          "(<output_dir>/checkpoint-<step>), or `auto` for the newest complete one in --output_dir.")


def check_output_dir(recipe: Recipe) -> None:
    output_dir = recipe.resolved_output_dir
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"--output_dir {output_dir!r} is a file; give a directory.")
    inputs = [("--model_name_or_path", recipe.model_name_or_path), ("--chat_template", recipe.chat_template),
              ("--eval_split", recipe.eval_split), *(("--dataset", part) for part in dataset_sources(recipe.dataset))]
    overlaps = overlap_problems(output_dir, [(flag, path) for flag, path in inputs if path and os.path.exists(path)])
    if overlaps:
        raise ConfigError(overlaps)
    holder = in_use(output_dir) if is_rank_zero() else None  # rank 0 holds the lock (shardtune.checkpoint.output_dir)
    if holder:
        raise ConfigError(in_use_message(output_dir, holder, recipe.overwrite_output_dir))
    check_not_occupied(recipe)


def check_not_occupied(recipe: Recipe) -> None:
    """A new run (neither resumed nor overwriting) starts in an empty --output_dir; --overwrite_output_dir true
    clears only a directory that holds nothing but a run's files (checkpoint.run_files.clear_problem). Checked with
    the flags, and again once the run holds the directory's lock: a run started beside it may have written there in
    between."""
    output_dir = recipe.resolved_output_dir
    if recipe.overwrite_output_dir and not recipe.resume_from_checkpoint:
        problem = clear_problem(output_dir)
        if problem:
            raise ConfigError(problem)
        return
    # Hidden ones too, and under a resume: once this run locks the directory they pass for its unfinished saves,
    # which a save of the same step replaces.
    foreign = foreign_checkpoints(output_dir)
    if recipe.resume_from_checkpoint and not foreign:
        return
    entries = sorted(name for name in os.listdir(output_dir) if not name.startswith(".")) \
        if os.path.isdir(output_dir) else []
    others = [name for name in strangers(output_dir) if name in entries and name not in foreign]
    if foreign:
        also = f"; it also holds {described(others)}, which no run wrote" \
            if others and not recipe.resume_from_checkpoint else ""
        fix = "Drop --resume_from_checkpoint and give --output_dir a new directory" \
            if recipe.resume_from_checkpoint == "auto" else "Give --output_dir a new or empty directory"
        raise ConfigError(f"{foreign_checkpoints_note(output_dir, foreign)}{also}. {fix}.")
    if entries:
        if others:  # --overwrite_output_dir would refuse them: not the fix to name
            raise ConfigError(f"--output_dir {output_dir!r} already holds {described(others)}, which no run wrote: "
                              "give a new or empty directory.")
        raise ConfigError(
            f"--output_dir {output_dir!r} already holds files of another run. Resume it with "
            "--resume_from_checkpoint auto, replace it with --overwrite_output_dir true, or pick another directory."
        )


def check_exports(recipe: Recipe) -> None:
    problems = []
    if recipe.generation_samples < 0:
        problems.append(f"--generation_samples must be 0 (off) or a positive count of held-out prompts to answer at "
                        f"each eval; got {recipe.generation_samples}.")
    if recipe.save_dtype not in SAVE_DTYPES:
        problems.append(f"--save_dtype {recipe.save_dtype!r} is not one of {', '.join(SAVE_DTYPES)} (auto: the dtype "
                        "the model's config.json states).")
    if problems:
        raise ConfigError(problems)


def check_async_save(recipe: Recipe, launch: LaunchDescription) -> None:
    """--async_save copies the state to host memory in a form it can write in the background: FSDP2's sharded
    state dict (checkpoint.staging.async_save_obstacle asks the same of the running strategy), and under DeepSpeed
    its torch writer, which a JSON's checkpoint writer or DataStates engine (deepspeed checkpoint_engine/utils.py
    `create_checkpoint_engine`) replaces."""
    if not recipe.async_save:
        return
    state_dict_type = os.environ.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT").strip().upper()
    if launch.uses_fsdp and state_dict_type not in ("SHARDED_STATE_DICT", "3"):
        raise ConfigError(f"--async_save true writes FSDP2's sharded state in the background, and the accelerate "
                          f"config sets fsdp_state_dict_type {state_dict_type}: set SHARDED_STATE_DICT (the shipped "
                          "configs'), or drop --async_save.")
    if launch.deepspeed_config_file:
        with open(launch.deepspeed_config_file) as file:
            settings = json.load(file)
        if (settings.get("checkpoint") or {}).get("writer") is not None or \
                settings.get("datastates_ckpt", False) is not False:
            raise ConfigError(f"--async_save true writes DeepSpeed's checkpoint with torch's writer in the background, "
                              f"and {launch.deepspeed_config_file} chooses a writer of its own (checkpoint.writer or "
                              "datastates_ckpt): drop one of the two.")


def overlap_problems(output_dir: str, inputs: list[tuple[str, str]]) -> list[str]:
    """What makes `output_dir` unsafe to write into beside this run's inputs (`inputs`: flag, local path): an
    output dir inside a checkpoint (the files would change the checkpoint, and its run's rotation or
    --overwrite_output_dir would delete them) and an input inside the output dir (--overwrite_output_dir would
    delete it; a model directory would be written over by the run's export). Paths compared resolved, so a relative
    path or a symlink is seen for what it is."""
    target = os.path.realpath(output_dir)
    problems = []
    ancestor = target
    while True:
        if os.path.isfile(os.path.join(ancestor, MARKER)):
            where = "is the checkpoint" if ancestor == target else f"lies inside the checkpoint {ancestor!r}"
            problems.append(f"--output_dir {output_dir!r} {where}: a new run's files would change it, and its own "
                            "run's rotation would delete them. Give --output_dir a directory outside it (to resume "
                            f"it: --output_dir {os.path.dirname(ancestor)} --resume_from_checkpoint {ancestor}).")
            break
        parent = os.path.dirname(ancestor)
        if parent == ancestor:
            break
        ancestor = parent
    for flag, path in inputs:
        real = os.path.realpath(path)
        if os.path.commonpath([target, real]) == target:
            where = "is" if real == target else "lies inside"
            problems.append(f"{flag} {path!r} {where} --output_dir {output_dir!r}, where the run writes its export and "
                            "checkpoints (and which --overwrite_output_dir empties): give --output_dir a directory "
                            "that holds none of the run's inputs.")
    return problems
