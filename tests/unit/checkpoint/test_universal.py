"""A DeepSpeed checkpoint's universal form: converted into the resuming run's output directory (beside the checkpoint
only when it is the run's own), recognised there as the run's (a marker naming its source) and reused, and its
host RAM and time planned from the checkpoint's files. The conversion itself, its measured peak against this plan:
tests/launch/test_resume_resized.py."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from shardtune.checkpoint.conversion_plan import FP32, plan_conversion
from shardtune.checkpoint.markers import describe_files, write_marker
from shardtune.checkpoint.output_dir import LOCK_FILE
from shardtune.checkpoint.run_files import remove_conversions, run_entry
from shardtune.checkpoint.run_settings import resume_point
from shardtune.checkpoint.universal import (
    conversion_leftovers,
    conversion_target,
    converted_from,
    leftover_problem,
    remove_leftover,
)
from shardtune.checks.startup import batch_sizes
from shardtune.config import ConfigError, Recipe
from shardtune.launch import LaunchDescription


def marked_checkpoint(folder, step: int = 4):
    path = folder / f"checkpoint-{step}"
    (path / "pytorch_model").mkdir(parents=True)
    write_marker(str(path), {"step": step, "world_size": 2, "model_only": False, "files": describe_files(str(path))})
    return path


def test_the_run_s_own_checkpoint_converts_beside_itself_another_s_into_the_output_dir(tmp_path):
    own = marked_checkpoint(tmp_path / "run")
    assert conversion_target(str(own), str(tmp_path / "run")) == str(own / "universal")
    assert conversion_target(str(own) + "/", str(tmp_path / "run" / ".")) == str(own) + "/universal"
    foreign = marked_checkpoint(tmp_path / "other", step=6)
    assert conversion_target(str(foreign), str(tmp_path / "run")) == str(tmp_path / "run" / "universal-checkpoint-6")


def converted(output_dir, source, extra: str | None = None):
    target = output_dir / "universal-checkpoint-4"
    (target / "pytorch_model" / "zero").mkdir(parents=True)
    (target / "pytorch_model" / "zero" / "optimizer_state.pt").write_bytes(bytes(16))
    write_marker(str(target), {"step": 4, "world_size": 2, "model_only": False,
                               "converted_from": os.path.realpath(source), "files": describe_files(str(target))})
    if extra:
        (target / extra).write_text("mine")
    return target


def test_a_conversion_in_the_output_dir_is_the_run_s_and_reused_for_its_source_only(tmp_path):
    source = marked_checkpoint(tmp_path / "other")
    run = tmp_path / "run"
    target = converted(run, source)
    assert converted_from(str(target), str(source))
    assert not converted_from(str(target), str(marked_checkpoint(tmp_path / "third")))
    assert not run_entry(str(run), target.name)  # no lock: not known as a run's directory
    (run / LOCK_FILE).touch()
    assert run_entry(str(run), target.name)
    (run / ".universal-checkpoint-4.tmp").mkdir()  # an unfinished conversion: the run's, redone
    assert run_entry(str(run), ".universal-checkpoint-4.tmp")
    (target / "pytorch_model" / "zero" / "optimizer_state.pt").write_bytes(bytes(8))  # damaged: converted again
    assert not converted_from(str(target), str(source))


def test_a_file_added_to_a_conversion_makes_it_a_stranger_s(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).touch()
    target = converted(run, marked_checkpoint(tmp_path / "other"), extra="notes.txt")
    assert not run_entry(str(run), target.name)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_plan_holds_one_rank_s_optimizer_file_or_one_parameter_s_merge(tmp_path, stage):
    """Peak: the interpreter + the largest of one rank's optimizer file (and a fragment of it), one parameter's
    fragments and their concatenation, and under ZeRO-1/2 the model states file with the whole weights."""
    folder = tmp_path / "pytorch_model"
    folder.mkdir()
    shapes = {"embed.weight": torch.Size([1000, 10]), "norm.weight": torch.Size([10])}
    torch.save({"param_shapes": [shapes] if stage == 3 else shapes, "module": torch.zeros(2000 if stage < 3 else 1)},
               folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    for rank, size in enumerate((30_000, 50_000)):
        (folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(bytes(size))
    plan = plan_conversion(str(folder), stage, interpreter=(300_000_000, 2.0))
    model_bytes = (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").stat().st_size
    extract, merge = 50_000 + FP32 * (10_000 // 2 + 1), 2 * FP32 * 10_000
    assert plan.data_bytes == max(extract, merge, *((model_bytes,) if stage < 3 else ()))
    assert plan.peak_bytes == 300_000_000 + plan.data_bytes and plan.ranks == 2
    assert plan.source_bytes == 80_000 + model_bytes and plan.seconds > 2.0
    assert plan.line("ckpt").startswith("shardtune: planned conversion of ckpt (2 ranks' ZeRO files, ")
    assert plan.shortfall(plan.peak_bytes) is None
    assert plan.shortfall(plan.peak_bytes - 1).startswith("shardtune: warning: the conversion's planned peak host "
                                                          "RAM, 300.1 MB, exceeds the 300.1 MB available now")
    with pytest.raises(FileNotFoundError, match="holds no DeepSpeed ZeRO files"):
        plan_conversion(str(tmp_path), stage, interpreter=(1, 1.0))


def test_rotation_deletes_a_conversion_once_the_run_saved_past_it(tmp_path):
    run = tmp_path / "run"
    target = converted(run, marked_checkpoint(tmp_path / "other"))
    assert remove_conversions(str(run), before_step=4) == [] and target.is_dir()  # the run is not past it yet
    assert remove_conversions(str(run), before_step=6) == [] and not target.exists()
    target = converted(run, marked_checkpoint(tmp_path / "third"), extra="notes.txt")
    (line,) = remove_conversions(str(run), before_step=6)
    assert "notes.txt" in line and "kept" in line and target.is_dir()
    shutil.rmtree(target)
    target = converted(run, marked_checkpoint(tmp_path / "fourth"), extra=".hidden")  # a hidden stranger too
    (line,) = remove_conversions(str(run), before_step=6)
    assert ".hidden" in line and "kept" in line and (target / ".hidden").is_file()
    shutil.rmtree(target)
    (target / "pytorch_model").mkdir(parents=True)  # a directory of that name no conversion finished: not the run's
    (target / ".hidden").write_text("mine")
    (line,) = remove_conversions(str(run), before_step=6)
    assert "no checkpoint_complete.json" in line and (target / ".hidden").is_file()


def partial_conversion(folder, *extra: str):
    """What a conversion that did not finish leaves: ds_to_universal's output and its note, and `extra` files."""
    (folder / "pytorch_model" / "zero" / "embed.weight").mkdir(parents=True)
    (folder / "pytorch_model" / "zero" / "embed.weight" / "fp32.pt").write_bytes(bytes(8))
    (folder / "latest_universal").write_text("pytorch_model")
    (folder / "scheduler.bin").write_bytes(bytes(4))
    for name in extra:
        (folder / name).write_text("mine")
    return folder


def test_a_conversion_deletes_only_its_own_leftovers_and_the_start_up_says_what_it_keeps(tmp_path):
    """An unfinished conversion's scratch and a target it redoes are deleted before it starts, only when they hold
    nothing but a conversion's files (hidden names and links are someone's); else the resume is refused in one line
    per folder before anything loads, and nothing is deleted."""
    source, run = marked_checkpoint(tmp_path / "other"), tmp_path / "run"
    scratch = partial_conversion(run / ".universal-checkpoint-4.tmp")
    assert conversion_leftovers(str(source), str(run)) == [str(scratch)]
    assert leftover_problem(str(scratch)) is None
    remove_leftover(str(scratch))
    assert not scratch.exists() and run.is_dir()

    scratch = partial_conversion(run / ".universal-checkpoint-4.tmp", ".hidden")
    target = partial_conversion(run / "universal-checkpoint-4", "notes.txt")  # no marker: no conversion finished it
    (target / "pytorch_model" / "elsewhere").symlink_to(tmp_path)
    assert conversion_leftovers(str(source), str(run)) == [str(scratch), str(target)]
    assert ".hidden" in leftover_problem(str(scratch))
    with pytest.raises(ConfigError, match=r"\.hidden, which a conversion does not write: kept whole"):
        remove_leftover(str(scratch))
    assert (scratch / ".hidden").is_file() and (scratch / "pytorch_model").is_dir()
    assert "notes.txt" in leftover_problem(str(target)) and "pytorch_model/elsewhere" in leftover_problem(str(target))

    stage = 3
    run_settings_saved = {"world_size": 2, "strategy": "deepspeed"}
    recipe = Recipe(max_steps=10, global_batch_size=32, per_device_train_batch_size=8, output_dir=str(run),
                    resume_from_checkpoint=str(source))
    write_marker(str(source), {"step": 4, "model_only": False, **run_settings_saved,
                               "files": describe_files(str(source))})
    launch = LaunchDescription(world_size=4, uses_deepspeed=True, deepspeed_settings={"stage": stage})
    with pytest.raises(ConfigError) as error:
        resume_point(recipe, launch, batch_sizes(recipe, 4))
    assert len(error.value.messages) == 2 and all("\n" not in line for line in error.value.messages)
    assert (scratch / ".hidden").is_file() and (target / "notes.txt").is_file()

    # A finished conversion of the same source is reused, not a leftover; one of another source is redone.
    shutil.rmtree(scratch)
    shutil.rmtree(target)
    converted(run, source)
    assert conversion_leftovers(str(source), str(run)) == []
    assert resume_point(recipe, launch, batch_sizes(recipe, 4)).universal
    third = marked_checkpoint(tmp_path / "third")
    assert conversion_leftovers(str(third), str(run)) == [str(run / "universal-checkpoint-4")]
    assert leftover_problem(str(run / "universal-checkpoint-4")) is None


def test_the_run_s_own_checkpoint_keeps_what_is_not_its_conversion_s(tmp_path):
    own = marked_checkpoint(tmp_path / "run")
    scratch = partial_conversion(own / ".universal.tmp")
    (scratch / "pytorch_model" / "link").symlink_to(tmp_path)
    assert conversion_leftovers(str(own), str(tmp_path / "run")) == [str(scratch)]
    assert "pytorch_model/link" in leftover_problem(str(scratch))
    (scratch / "pytorch_model" / "link").unlink()
    unlisted = partial_conversion(own / "universal")  # renamed, the checkpoint's marker not yet rewritten: redone
    assert conversion_leftovers(str(own), str(tmp_path / "run")) == [str(scratch), str(unlisted)]
    assert leftover_problem(str(unlisted)) is None and leftover_problem(str(scratch)) is None
