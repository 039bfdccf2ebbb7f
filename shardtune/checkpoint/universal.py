"""A DeepSpeed ZeRO checkpoint resumed on another number of processes, through DeepSpeed's universal checkpoint.

Each of ZeRO's `zero_pp_rank_<i>_..._optim_states.pt` holds rank i's slice of the flat fp32 weights and Adam
moments, cut for the processes that saved them; DeepSpeed refuses to load them on another data-parallel size. Its
own converter, `deepspeed.checkpoint.ds_to_universal`, writes every parameter's fp32 weights and moments whole
(`zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`), which its `load_universal_checkpoint` slices for any size.

The conversion runs once, on rank 0, into `<checkpoint>/universal`: written under `.universal.tmp`, fsynced,
renamed, and then listed in the checkpoint's marker (rewritten atomically), so that `auto` checks its files, a
later resume of the same checkpoint reuses it, and rotation and --overwrite_output_dir delete it with the
checkpoint. `universal/` is a checkpoint accelerate's load_state reads: the converted `pytorch_model/` beside
copies of the checkpoint's own small states (scheduler, random streams). accelerate's DeepSpeed checkpoints carry
no `universal_checkpoint_info` (Megatron-DeepSpeed's client state): the converter injects the default
(--inject_missing_state)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

from accelerate import Accelerator

from shardtune.checkpoint.durable import fsync_path, fsync_tree
from shardtune.checkpoint.markers import describe_files, read_marker, write_marker

UNIVERSAL_DIR = "universal"
SCRATCH_DIR = ".universal.tmp"  # a conversion that did not finish: this module's own, redone
TAG = "pytorch_model"  # accelerate's DeepSpeed checkpoint tag (its load_state passes it to load_checkpoint)
# The checkpoint's own files that accelerate's load_state reads beside the model and optimizer.
SMALL_STATES = re.compile(r"^(scheduler(_\d+)?\.bin|random_states_\d+\.pkl|sampler(_\d+)?\.bin|"
                          r"dl_state_dict(_\d+)?\.bin|custom_checkpoint_\d+\.pkl)$")


def is_converted(checkpoint: str) -> bool:
    """The checkpoint holds a finished conversion: its marker lists the universal files (checked by `auto`)."""
    files = read_marker(checkpoint).get("files") or {}
    return any(name.startswith(f"{UNIVERSAL_DIR}/{TAG}/zero/") for name in files)


def universal_checkpoint(accelerator: Accelerator, checkpoint: str) -> str:
    """The universal form of `checkpoint`, converted by rank 0 if it is not yet; every rank returns its path."""
    if accelerator.is_main_process and not is_converted(checkpoint):
        started = time.perf_counter()
        accelerator.print(f"shardtune: converting {checkpoint} to DeepSpeed's universal checkpoint "
                          f"({os.path.join(checkpoint, UNIVERSAL_DIR)}) with deepspeed.checkpoint.ds_to_universal, "
                          "once", flush=True)
        convert(checkpoint)
        accelerator.print(f"shardtune: converted in {time.perf_counter() - started:.1f}s", flush=True)
    accelerator.wait_for_everyone()
    return os.path.join(checkpoint, UNIVERSAL_DIR)


def convert(checkpoint: str) -> None:
    """ds_to_universal into the scratch directory, the small states beside it, all durable, renamed into place,
    then the marker lists them."""
    scratch, target = os.path.join(checkpoint, SCRATCH_DIR), os.path.join(checkpoint, UNIVERSAL_DIR)
    shutil.rmtree(scratch, ignore_errors=True)  # an earlier conversion of this module's that did not finish
    if os.path.isdir(target):  # renamed, but the marker was not rewritten: redone as a whole
        shutil.rmtree(target)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               os.path.join(checkpoint, TAG), "--output_folder", os.path.join(scratch, TAG), "--inject_missing_state"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise RuntimeError(f"{' '.join(command)} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    for name in os.listdir(checkpoint):
        if SMALL_STATES.match(name):
            shutil.copy2(os.path.join(checkpoint, name), os.path.join(scratch, name))
    fsync_tree(scratch)
    os.rename(scratch, target)
    fsync_path(checkpoint)
    marker = read_marker(checkpoint)
    write_marker(checkpoint, {**marker, "files": describe_files(checkpoint)})


def loading_universal(accelerator: Accelerator, universal: bool) -> list:
    """The DeepSpeed engines whose next load reads a universal checkpoint (DeepSpeed's `checkpoint.load_universal`
    setting, set for this load only: `restore_engines` puts it back)."""
    engines = [model for model in accelerator._models if hasattr(model, "load_universal_checkpoint")] \
        if universal else []
    for engine in engines:
        engine._config.load_universal_checkpoint = True
    return engines


def restore_engines(engines: list) -> None:
    for engine in engines:
        engine._config.load_universal_checkpoint = False


def repair_zero3_universal_load(engines: list, path: str) -> None:
    """What DeepSpeed 0.19's ZeRO-3 universal load (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`) gets
    wrong, put right: it gives every optimizer sub-group the one `step` tensor it loaded, which each sub-group's
    AdamW step then increments in place (Adam's bias correction of the step after the resume runs ahead, sub-group
    by sub-group, and the losses drift from the next step on); and it gives every param group the first group's
    hyperparameters (weight decay on the norms, which the decay/no-decay split keeps at 0). ZeRO-1/2's universal
    load has neither fault."""
    import torch

    for engine in engines:
        if engine.zero_optimization_stage() != 3:
            continue
        zero = engine.optimizer
        for flat in zero.fp32_partitioned_groups_flat:
            state = zero.optimizer.state.get(flat, {})
            if "step" in state:
                state["step"] = state["step"].clone()
        # DeepSpeed's own file, written by ds_to_universal from this run's checkpoint; DeepSpeed loads it unpickled
        saved = torch.load(os.path.join(path, TAG, "zero", "optimizer_state.pt"), map_location="cpu",
                           weights_only=False)["optimizer_state_dict"]["param_groups"]
        for group, settings in zip(zero.optimizer.param_groups, saved, strict=True):
            group.update({key: value for key, value in settings.items() if key != "params"})
