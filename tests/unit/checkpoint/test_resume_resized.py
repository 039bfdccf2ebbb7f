"""A resume on another number of processes: carried over under DDP and FSDP2 with the checkpoint's global batch
(said in the resumed line), refused in one line under DeepSpeed, where the global batch cannot be kept (naming the
sizes that keep it) or where the new launch makes another global batch. The launches:
tests/launch/test_resume_resized.py."""

from __future__ import annotations

import pytest

from shardtune.checkpoint.markers import describe_files, resolve_resume, write_marker
from shardtune.checkpoint.run_settings import (
    check_resume_settings,
    deepspeed_resize_problem,
    resume_point,
    run_settings,
)
from shardtune.checks.startup import batch_sizes
from shardtune.config import BatchSizes, ConfigError, Recipe
from shardtune.launch import LaunchDescription

RECIPE = Recipe(max_steps=10, global_batch_size=32, per_device_train_batch_size=8)


def saved_settings(launch: LaunchDescription, batching: BatchSizes) -> dict:
    return {**run_settings(RECIPE, launch, batching), "max_steps": 10}


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_another_world_size_keeps_the_global_batch_and_says_what_changed(fsdp):
    saved = saved_settings(LaunchDescription(world_size=2, uses_fsdp=fsdp), batch_sizes(RECIPE, 2))
    grown = LaunchDescription(world_size=4, uses_fsdp=fsdp)
    (note,) = check_resume_settings("ckpt", 4, saved, run_settings(RECIPE, grown, batch_sizes(RECIPE, 4)))
    assert note.startswith("4 processes where the checkpoint had 2: micro-batch 8 x 1 accumulation x 4 data ranks "
                           "where it had micro-batch 8 x 2 accumulation x 2 data ranks; kept: the global batch of "
                           "32, the data order after the 128 rows of its 4 steps, the schedule and the optimizer's "
                           "step count"), note
    assert ("torch.distributed.checkpoint" in note) == fsdp
    assert "ranks 2 to 3 start their random streams from --seed" in note

    (note,) = check_resume_settings("ckpt", 4, saved_settings(grown, batch_sizes(RECIPE, 4)),
                                    run_settings(RECIPE, LaunchDescription(world_size=1, uses_fsdp=fsdp),
                                                 batch_sizes(RECIPE, 1)))
    assert note.startswith("1 process where the checkpoint had 4: micro-batch 8 x 4 accumulation x 1 data ranks")
    assert "random streams" not in note


def test_another_global_batch_on_another_world_size_is_refused():
    """Without --global_batch_size the accumulation makes the global batch: on 4 processes it doubles."""
    unset = Recipe(max_steps=10, per_device_train_batch_size=8, gradient_accumulation_steps=2)
    saved = saved_settings(LaunchDescription(world_size=2), batch_sizes(unset, 2))
    with pytest.raises(ConfigError) as error:
        check_resume_settings("ckpt", 4, saved, run_settings(unset, LaunchDescription(world_size=4),
                                                             batch_sizes(unset, 4)))
    assert error.value.messages == [
        "this launch's global batch is 64 and ckpt was trained with 32 (the order of the rows it continues follows "
        "it): resume with --global_batch_size 32, or start a new run from its weights (scripts/export_hf.py ckpt)."]


def test_a_global_batch_the_new_ranks_cannot_make_names_the_sizes_that_can():
    with pytest.raises(ConfigError) as error:
        batch_sizes(RECIPE, 3)
    (line,) = error.value.messages
    assert line == ("--global_batch_size 32 is not divisible by per_device_train_batch_size x processes = 8 x 3 = 24. "
                    "Pick a global batch that is a multiple of 24, or to keep 32 (a resumed run's): 1, 2 or 4 "
                    "processes at --per_device_train_batch_size 8.")
    with pytest.raises(ConfigError) as error:
        batch_sizes(Recipe(global_batch_size=48, per_device_train_batch_size=16), 4)
    assert error.value.messages[0].endswith("to keep 48 (a resumed run's): --per_device_train_batch_size 1, 2, 3, 4, "
                                            "6 or 12 on these 4 data ranks, or 1 or 3 processes at "
                                            "--per_device_train_batch_size 16.")


def checkpoint(tmp_path, strategy: str | None, world_size: int = 2) -> str:
    path = tmp_path / f"checkpoint-{4}"
    (path / "shard").mkdir(parents=True)
    (path / "shard" / "states.bin").write_bytes(bytes(64))
    marker = {"step": 4, "world_size": world_size, "model_only": False, "files": describe_files(str(path))}
    write_marker(str(path), {**marker, **({"strategy": strategy} if strategy else {})})
    return str(path)


@pytest.mark.parametrize("strategy", ["replicated", "fsdp", "deepspeed"])
def test_a_checkpoint_of_another_world_size_is_found_and_judged_by_its_strategy(tmp_path, strategy):
    path = checkpoint(tmp_path, strategy)
    assert resolve_resume(path, str(tmp_path), 4) == (path, 4)
    assert resolve_resume("auto", str(tmp_path), 1) == (path, 4)


def test_a_marker_without_its_strategy_resumes_on_its_own_number_of_processes_only(tmp_path):
    path = checkpoint(tmp_path, None)
    assert resolve_resume(path, str(tmp_path), 2) == (path, 4)
    with pytest.raises(ConfigError) as error:
        resolve_resume(path, str(tmp_path), 3)
    (line,) = error.value.messages
    assert "saved by 2 processes and this run has 3" in line and "--num_processes 2" in line and "\n" not in line


def deepspeed(stage: int, world_size: int = 4, **settings) -> LaunchDescription:
    return LaunchDescription(world_size=world_size, uses_deepspeed=True,
                             deepspeed_settings={"stage": stage, **settings})


def test_deepspeed_resumes_on_another_world_size_with_cpu_offload_not_nvme_sequence_split_or_hpz():
    saved = saved_settings(deepspeed(2, world_size=2), batch_sizes(RECIPE, 2))
    (note,) = check_resume_settings("ckpt", 4, saved, run_settings(RECIPE, deepspeed(2), batch_sizes(RECIPE, 4)))
    assert "ZeRO states through DeepSpeed's universal checkpoint, converted once" in note
    for stage in (1, 2, 3):
        assert deepspeed_resize_problem("ckpt", 2, deepspeed(stage)) is None
    assert deepspeed_resize_problem("ckpt", 2, deepspeed(3, offload_optimizer="cpu", offload_param="cpu")) is None
    refused = {"with ZeRO++'s hpZ is not supported yet (not measured": deepspeed(3, hpz_partition=2),
               "with the sequence split is not supported yet (not measured": LaunchDescription(
                   world_size=4, uses_deepspeed=True, sp_size=2, deepspeed_settings={"stage": 2}),
               "with states offloaded to NVMe is not supported: DeepSpeed 0.19 restores NVMe-offloaded optimizer "
               "states from each rank's own swap files": deepspeed(3, offload_optimizer="nvme"),
               "with states offloaded to NVMe is not supported:": deepspeed(3, offload_param="nvme")}
    for what, launch in refused.items():
        line = deepspeed_resize_problem("ckpt", 2, launch)
        assert ("saved by 2 processes and this DeepSpeed launch has 4: a resume on another number of processes "
                f"{what}") in line and "--num_processes 2" in line and "\n" not in line, line


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_resume_point_on_another_world_size_loads_the_universal_form_or_is_refused(tmp_path, stage):
    """Refused with the optimizer on NVMe (ZeRO-3 here), loaded as the universal form without, or in CPU RAM."""
    path = tmp_path / "checkpoint-4"
    path.mkdir()
    run = saved_settings(deepspeed(stage, world_size=2), batch_sizes(RECIPE, 2))
    write_marker(str(path), {"step": 4, "world_size": 2, "strategy": "deepspeed", "model_only": False, "run": run,
                             "files": describe_files(str(path))})
    recipe = Recipe(max_steps=10, global_batch_size=32, per_device_train_batch_size=8, resume_from_checkpoint=str(path))
    assert not resume_point(recipe, deepspeed(stage, world_size=2), batch_sizes(recipe, 2)).universal
    if stage == 3:
        with pytest.raises(ConfigError, match="with states offloaded to NVMe is not supported"):
            resume_point(recipe, deepspeed(stage, offload_optimizer="nvme"), batch_sizes(recipe, 4))
        assert resume_point(recipe, deepspeed(stage, offload_optimizer="cpu"), batch_sizes(recipe, 4)).universal
    resumed = resume_point(recipe, deepspeed(stage), batch_sizes(recipe, 4))
    assert resumed.universal and resumed.step == 4 and "universal checkpoint" in resumed.notes[0]
