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
from shardtune.checkpoint.universal import conversion_target, converted_from


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
