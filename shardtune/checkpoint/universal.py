"""A DeepSpeed ZeRO checkpoint resumed on another number of processes, through DeepSpeed's universal checkpoint.

Each of ZeRO's `zero_pp_rank_<i>_..._optim_states.pt` holds rank i's slice of the flat fp32 weights and Adam
moments, cut for the processes that saved them; DeepSpeed refuses to load them on another data-parallel size. Its
own converter, `deepspeed.checkpoint.ds_to_universal`, writes every parameter's fp32 weights and moments whole
(`zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`), which its `load_universal_checkpoint` slices for any size.

The conversion runs once, on rank 0, into the resuming run's output directory, never into another run's (a
checkpoint given by path may be read-only, or still another run's): a checkpoint of this run's own directory is
converted into `<checkpoint>/universal` and listed in its marker, so that rotation and --overwrite_output_dir delete
it with the checkpoint; one from elsewhere into `<output_dir>/universal-checkpoint-<step>`, a folder with a marker
of its own naming its source. Either is written under a scratch name, fsynced, renamed and marked, so that `auto`
checks its files and a later resume of the same checkpoint reuses it. It is a checkpoint accelerate's load_state
reads: the converted `pytorch_model/` beside copies of the checkpoint's own small states (scheduler, random
streams). accelerate's DeepSpeed checkpoints carry no `universal_checkpoint_info` (Megatron-DeepSpeed's client
state): the converter injects the default (--inject_missing_state). Its host RAM and time are planned and printed
before it starts, its peak measured after (shardtune.checkpoint.conversion_plan)."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time

import psutil
from accelerate import Accelerator

from shardtune.checkpoint.conversion_plan import plan_conversion, run_measured, size
from shardtune.checkpoint.durable import fsync_path, fsync_tree
from shardtune.checkpoint.markers import MARKER, damage, describe_files, read_marker, write_marker
from shardtune.checkpoint.run_files import checkpoint_strangers, described
from shardtune.config import ConfigError

UNIVERSAL_DIR = "universal"
SCRATCH_DIR = ".universal.tmp"  # a conversion that did not finish: this module's own, redone
LATEST = "latest_universal"  # ds_to_universal's note beside its output folder
TAG = "pytorch_model"  # accelerate's DeepSpeed checkpoint tag (its load_state passes it to load_checkpoint)
# The checkpoint's own files that accelerate's load_state reads beside the model and optimizer.
SMALL_STATES = re.compile(r"^(scheduler(_\d+)?\.bin|random_states_\d+\.pkl|sampler(_\d+)?\.bin|"
                          r"dl_state_dict(_\d+)?\.bin|custom_checkpoint_\d+\.pkl)$")


def is_converted(checkpoint: str) -> bool:
    """The checkpoint holds a finished conversion: its marker lists the universal files (checked by `auto`)."""
    files = read_marker(checkpoint).get("files") or {}
    return any(name.startswith(f"{UNIVERSAL_DIR}/{TAG}/zero/") for name in files)


def conversion_target(checkpoint: str, output_dir: str) -> str:
    """Where `checkpoint`'s universal form goes: inside it when it is this run's own, else into the output dir."""
    if os.path.realpath(os.path.dirname(os.path.normpath(checkpoint))) == os.path.realpath(output_dir):
        return os.path.join(checkpoint, UNIVERSAL_DIR)
    step = read_marker(checkpoint)["step"]
    return os.path.join(output_dir, f"universal-checkpoint-{step}")


def converted_from(target: str, checkpoint: str) -> bool:
    """`target` (a folder of this run's) holds a finished, undamaged conversion of `checkpoint`."""
    if not os.path.isfile(os.path.join(target, "checkpoint_complete.json")) or damage(target):
        return False
    return read_marker(target).get("converted_from") == os.path.realpath(checkpoint)


def universal_checkpoint(accelerator: Accelerator, checkpoint: str, output_dir: str) -> str:
    """The universal form of `checkpoint`, converted by rank 0 if it is not yet; every rank returns its path."""
    target = conversion_target(checkpoint, output_dir)
    inside = os.path.basename(target) == UNIVERSAL_DIR  # the run's own checkpoint: converted inside it
    if accelerator.is_main_process and not (is_converted(checkpoint) if inside else converted_from(target, checkpoint)):
        marker = read_marker(checkpoint)
        zero_stage = (marker.get("run") or {}).get("zero_stage") or 3
        plan = plan_conversion(os.path.join(checkpoint, TAG), zero_stage)
        accelerator.print(plan.line(checkpoint), flush=True)
        if warning := plan.shortfall(psutil.virtual_memory().available):
            print(warning, file=sys.stderr, flush=True)
        accelerator.print(f"shardtune: converting {checkpoint} to DeepSpeed's universal checkpoint ({target}) with "
                          "deepspeed.checkpoint.ds_to_universal, once", flush=True)
        started = time.perf_counter()
        peak = convert(checkpoint, target, inside)
        accelerator.print(f"shardtune: converted in {time.perf_counter() - started:.1f}s (planned "
                          f"{plan.seconds:.0f}s), peak host RAM {size(peak)} (planned {size(plan.peak_bytes)})",
                          flush=True)
    accelerator.wait_for_everyone()
    return target


def scratch_path(target: str, inside: bool) -> str:
    return os.path.join(os.path.dirname(target), SCRATCH_DIR if inside else f".{os.path.basename(target)}.tmp")


def conversion_leftovers(checkpoint: str, output_dir: str) -> list[str]:
    """What a conversion of `checkpoint` for a run in `output_dir` deletes before it starts: its scratch folder (an
    earlier conversion that did not finish) and a target it redoes (renamed but not marked, damaged, or another
    source's). The start-up checks them (leftover_problem) before anything loads; `convert` deletes them."""
    target = conversion_target(checkpoint, output_dir)
    inside = os.path.basename(target) == UNIVERSAL_DIR
    finished = is_converted(checkpoint) if inside else converted_from(target, checkpoint)
    redone = os.path.lexists(target) and not finished
    return [path for path in (scratch_path(target, inside), *([target] if redone else [])) if os.path.lexists(path)]


def leftover_problem(path: str) -> str | None:
    """Why `path` is not a conversion's to delete, or None: a link or a file, or a folder holding anything a
    conversion does not write there (ds_to_universal's pytorch_model/ and latest_universal, the checkpoint's small
    states, the marker; with a marker, only what it lists), hidden names included."""
    if os.path.islink(path) or not os.path.isdir(path):
        return f"{path} is not a folder a conversion wrote: kept; move it out of the way and resume again."
    found = set(checkpoint_strangers(path)) if os.path.isfile(os.path.join(path, MARKER)) else set()
    for directory, folders, names in os.walk(path):
        for name in names + [folder for folder in folders if os.path.islink(os.path.join(directory, folder))]:
            relative = os.path.relpath(os.path.join(directory, name), path)
            top = directory == path
            if os.path.islink(os.path.join(directory, name)) or not (
                    relative.startswith(TAG + os.sep) or (top and (name in (LATEST, MARKER, MARKER + ".tmp")
                                                                   or SMALL_STATES.match(name)))):
                found.add(relative)
    if found:
        return (f"{path} holds {described(sorted(found))}, which a conversion does not write: kept whole; move "
                f"{'it' if len(found) == 1 else 'them'} out (or the folder away) and resume again.")
    return None


def remove_leftover(path: str) -> None:
    """Delete a conversion's leftover, checked again here (the start-up checked it before loading)."""
    if problem := leftover_problem(path):
        raise ConfigError(problem)
    shutil.rmtree(path)


def convert(checkpoint: str, target: str, inside: bool) -> int:
    """ds_to_universal into a scratch directory, the small states beside it, all durable, renamed into place,
    then marked (the checkpoint's marker lists them, or the target's own names its source). Returns the
    converter's peak host RAM (bytes, measured by the kernel)."""
    parent = os.path.dirname(target)
    scratch = scratch_path(target, inside)
    for leftover in (scratch, target):  # an earlier conversion that did not finish; a target redone as a whole
        if os.path.lexists(leftover):
            remove_leftover(leftover)
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               os.path.join(checkpoint, TAG), "--output_folder", os.path.join(scratch, TAG), "--inject_missing_state",
               "--num_extract_workers", "1", "--num_merge_workers", "1"]  # one rank's file at a time (planned so)
    returncode, stderr, peak = run_measured(command)
    if returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise RuntimeError(f"{' '.join(command)} failed (exit {returncode}):\n{stderr[-4000:]}")
    for name in os.listdir(checkpoint):
        if SMALL_STATES.match(name):
            shutil.copy2(os.path.join(checkpoint, name), os.path.join(scratch, name))
    if not inside:  # its own marker, as a checkpoint's: what it holds, at which step, converted from what
        marker = read_marker(checkpoint)
        write_marker(scratch, {"step": marker["step"], "world_size": marker["world_size"], "model_only": False,
                               "converted_from": os.path.realpath(checkpoint), "files": describe_files(scratch)})
    fsync_tree(scratch)
    os.rename(scratch, target)
    fsync_path(parent)
    if inside:
        marker = read_marker(checkpoint)
        write_marker(checkpoint, {**marker, "files": describe_files(checkpoint)})
    return peak


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
            if torch.is_tensor(state.get("step")):  # DeepSpeed's CPU Adam counts in a Python int: not shared
                state["step"] = state["step"].clone()
        # DeepSpeed's own file, written by ds_to_universal from this run's checkpoint; DeepSpeed loads it unpickled
        saved = torch.load(os.path.join(path, TAG, "zero", "optimizer_state.pt"), map_location="cpu",
                           weights_only=False)["optimizer_state_dict"]["param_groups"]
        for group, settings in zip(zero.optimizer.param_groups, saved, strict=True):
            group.update({key: value for key, value in settings.items() if key != "params"})
