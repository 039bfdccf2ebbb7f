"""Durable, sharded training checkpoints through accelerate's state saving, optionally written in the background,
and finding one to resume from.

A checkpoint is written by every rank into `output_dir/.checkpoint-<step>.tmp`. Every rank then fsyncs each file
and directory of it, so that what it wrote is on disk and not only in its machine's page cache; only after that
(a collective) does rank 0 rename it to `output_dir/checkpoint-<step>`, fsync `output_dir` so that the rename
survives a power cut, and write `checkpoint_complete.json`, which lists every file with its size (and a checksum
for the small ones). Older checkpoints are deleted after that. A crash at any moment therefore leaves the
previous complete checkpoint as the newest, and a checkpoint whose files were lost or cut short after all (a
disk that lied, a file deleted by hand) is detected against its marker and skipped by `auto`.

With `--async_save true` a save copies the state to host memory (rank by rank, each its own shard) and returns;
a background thread writes and fsyncs the files while training goes on, and the marker is written at the first
step boundary after every rank's write is durable. One save is in flight at a time: a new save, a stop signal and
the end of training first wait for it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from shardtune.config import ConfigError

if TYPE_CHECKING:  # accelerate and torch take seconds to import; resolve_resume runs before any heavy import
    import torch
    from accelerate import Accelerator

    from shardtune.config import Recipe

MARKER = "checkpoint_complete.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
# torch dtype -> safetensors dtype, in the order safetensors lays tensors out (widest first, so each is aligned).
SAFETENSORS_DTYPES = {"int64": "I64", "float64": "F64", "float32": "F32", "int32": "I32", "bfloat16": "BF16",
                      "float16": "F16", "int16": "I16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
                      "int8": "I8", "uint8": "U8", "bool": "BOOL"}
DTYPE_ORDER = {name: index for index, name in enumerate(SAFETENSORS_DTYPES)}
CHECKSUM_MAX_BYTES = 1 << 20  # small files (configs, RNG and scheduler states) are cheap to checksum
# For tests: seconds the background writer waits before it writes, so that a kill or a stop signal can be made
# to land while a save is in flight.
WRITE_DELAY_ENV = "SHARDTUNE_CHECKPOINT_WRITE_DELAY_S"


# ---------------------------------------------------------------------------------------------------- durability


def fsync_path(path: str) -> None:
    """fsync one file or directory (a directory's fsync makes the names created or renamed in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable(path: str, recursive: bool = True) -> None:
    """Make `path` survive a crash of this machine: fsync it (a directory: every file under it, or only its own
    files with `recursive=False`, and the directories), then the directory that holds it."""
    if os.path.isdir(path) and recursive:
        fsync_tree(path)
    elif os.path.isdir(path):
        for entry in os.scandir(path):
            if entry.is_file(follow_symlinks=False):
                fsync_path(entry.path)
        fsync_path(path)
    else:
        fsync_path(path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def fsync_tree(root: str) -> None:
    """fsync every file and directory under `root`, children before parents. An fsync writes back the file's
    dirty pages in this machine's page cache whoever wrote them, so a rank that syncs the whole tree after its
    own writes has made its own files durable, whatever the other ranks are doing."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            try:
                if not os.path.islink(path):
                    fsync_path(path)
            except FileNotFoundError:  # another rank's temporary file, renamed since: its writer syncs it
                pass
        fsync_path(directory)


def describe_files(checkpoint: str) -> dict[str, dict]:
    """Every file of a checkpoint but its marker: size, and sha256 where the file is small."""
    files = {}
    for directory, _, names in os.walk(checkpoint):
        for name in names:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, checkpoint)
            if relative in (MARKER, MARKER + ".tmp") or os.path.islink(path):
                continue
            size = os.path.getsize(path)
            files[relative] = {"bytes": size, **({"sha256": sha256(path)} if size <= CHECKSUM_MAX_BYTES else {})}
    return dict(sorted(files.items()))


def sha256(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def write_marker(checkpoint: str, content: dict) -> None:
    path = os.path.join(checkpoint, MARKER)
    with open(path + ".tmp", "w") as file:
        json.dump(content, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.rename(path + ".tmp", path)
    fsync_path(checkpoint)


# ------------------------------------------------------------------------------------------ finding and checking


def checkpoint_step(path: str) -> int:
    match = CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else -1


def complete_checkpoints(output_dir: str) -> list[str]:
    """Complete (marked) checkpoints in `output_dir`, oldest first. Marked is not yet checked: see `damage`."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_NAME.match(name)
        if match and os.path.isfile(os.path.join(output_dir, name, MARKER)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def read_marker(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, MARKER)) as file:
        return json.load(file)


def damage(checkpoint: str) -> str | None:
    """Why a marked checkpoint cannot be trusted (a file missing, of another size or checksum than its marker
    records), or None. Markers written before files were listed are trusted as they are."""
    try:
        files = read_marker(checkpoint).get("files")
    except (OSError, ValueError) as error:
        return f"its {MARKER} cannot be read ({error})"
    problems = []
    for name, expected in (files or {}).items():
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(path) != expected["bytes"]:
            problems.append(f"{name} has {os.path.getsize(path):,} bytes, {expected['bytes']:,} when saved")
        elif "sha256" in expected and sha256(path) != expected["sha256"]:
            problems.append(f"{name} differs from what was saved (sha256)")
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more file(s))" if len(problems) > 1 else "")


def warn(message: str) -> None:
    """One line on stderr from the first rank of each machine, so that each machine's log says it once."""
    if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
        print(f"shardtune: warning: {message}", file=sys.stderr, flush=True)


def newest_usable(output_dir: str) -> str | None:
    """The newest complete checkpoint that matches its marker and can resume training; each one skipped is
    named in one warning line."""
    skipped = False
    for checkpoint in reversed(complete_checkpoints(output_dir)):
        problem = damage(checkpoint)
        if problem:
            warn(f"{checkpoint} is damaged: {problem}; resuming from the checkpoint before it.")
        elif read_marker(checkpoint).get("model_only"):
            warn(f"{checkpoint} was saved with --save_only_model true and cannot resume training; skipped.")
        else:
            return checkpoint
        skipped = True
    if skipped:
        warn(f"no checkpoint in {output_dir} can resume training: starting from step 0.")
    return None


def resolve_resume(resume_from: str, output_dir: str, world_size: int) -> tuple[str | None, int]:
    """(checkpoint path, step) to resume from; (None, 0) to start fresh. Raises ConfigError before any loading."""
    if not resume_from:
        return None, 0
    if resume_from == "auto":
        checkpoint = newest_usable(output_dir)
        if checkpoint is None:
            return None, 0
    else:
        checkpoint = resume_from
        if not os.path.isfile(os.path.join(checkpoint, MARKER)):
            raise ConfigError(
                f"--resume_from_checkpoint {checkpoint!r} is not a complete checkpoint (no {MARKER}): "
                "its save did not finish. Give an earlier checkpoint, or `auto` for the newest complete one."
            )
        problem = damage(checkpoint)
        if problem:
            raise ConfigError(f"--resume_from_checkpoint {checkpoint!r} is damaged: {problem}. Give an earlier "
                              "checkpoint, or `auto` for the newest undamaged one.")
        if read_marker(checkpoint).get("model_only"):
            raise ConfigError(f"--resume_from_checkpoint {checkpoint!r} was saved with --save_only_model true: it "
                              "holds no optimizer state to resume from. Export it with scripts/export_hf.py and "
                              "start a new run from the export.")
    marker = read_marker(checkpoint)
    if marker["world_size"] != world_size:
        raise ConfigError(
            f"Checkpoint {checkpoint!r} was saved by {marker['world_size']} processes and this run has "
            f"{world_size}: sharded optimizer states and the data order depend on it. Resume with "
            f"--num_processes {marker['world_size']}, or export it with scripts/export_hf.py and start a new run."
        )
    return checkpoint, marker["step"]


# ------------------------------------------------------------------------------------------------------- saving


class PendingSave:
    """One save between its start and its marker: files still to write from host memory, torch.distributed
    .checkpoint writes in flight, and the fsync of the whole tree that ends it. `run` does all that, in the
    caller's thread (synchronous saves) or in a background thread (`start`)."""

    def __init__(self, step: int, scratch: str, final: str) -> None:
        self.step, self.scratch, self.final = step, scratch, final
        self.writes: list[tuple[str, Callable[[str], None]]] = []
        self.futures: list[Future] = []
        self.started = time.perf_counter()
        self.staged_s = 0.0
        self.finished: float | None = None  # when this rank's files were all durable
        self.error: BaseException | None = None
        self.done = threading.Event()

    def add(self, path: str, write: Callable[[str], None]) -> None:
        """`write(path)` writes one file of the checkpoint, from a copy of the state taken at this step."""
        self.writes.append((path, write))

    def start(self) -> None:
        threading.Thread(target=self.run, kwargs={"delay": float(os.environ.get(WRITE_DELAY_ENV) or 0)},
                         name=f"checkpoint-{self.step}-writer", daemon=True).start()

    def run(self, delay: float = 0.0) -> None:
        try:
            time.sleep(delay)
            while self.writes:
                path, write = self.writes.pop(0)
                write(path)
                fsync_path(path)
            for future in self.futures:
                future.result()
            fsync_tree(self.scratch)
        except BaseException as error:  # reported by every rank at the next step boundary
            self.error = error
        finally:
            self.finished = time.perf_counter()
            self.done.set()


class Checkpointer:
    """Decides itself when the trainer's state is saved, and saves it. The trainer calls `after_step` after
    every optimizer step, `save` on a stop signal, and `wait` before it exits, so that nothing it reports as
    saved is still being written."""

    def __init__(self, accelerator: Accelerator, recipe: Recipe, extra_files: Callable[[str], None]) -> None:
        self.accelerator, self.recipe, self.extra_files = accelerator, recipe, extra_files
        self.pending: PendingSave | None = None
        self.kind = strategy_kind(accelerator)
        self.async_save = recipe.async_save and self.async_supported()
        self.dcp_groups: list = []
        self.poll_group = None
        self.stager = None
        if self.async_save:
            self.setup_staging()

    # -- the trainer's interface

    def after_step(self, step: int, max_steps: int) -> None:
        if self.pending:
            self.poll(block=False)
        every = self.recipe.save_steps
        if every and (step % every == 0 or step == max_steps):
            self.save(step)

    def save(self, step: int) -> str:
        """Save the full training state at `step` (the model alone with --save_only_model), sharded as the
        strategy holds it. Synchronous saves return once it is durable and marked; asynchronous ones once it is
        in host memory."""
        waited = time.perf_counter()
        self.wait()  # one save in flight at a time: its host copy is the one this save would need
        waited = time.perf_counter() - waited
        output_dir = self.recipe.resolved_output_dir
        pending = PendingSave(step, os.path.join(output_dir, f".checkpoint-{step}.tmp"),
                              os.path.join(output_dir, f"checkpoint-{step}"))
        with self.patient_collectives():  # every rank serializes its shard, maybe to a slow disk
            self.stage(pending)
        pending.staged_s = time.perf_counter() - pending.started
        if self.async_save:
            self.pending = pending
            pending.start()
            self.accelerator.print(f"shardtune: checkpoint-{step} copied to host memory in {pending.staged_s:.2f}s"
                                   + (f" (after {waited:.1f}s waiting for the previous save)" if waited > 0.05
                                      else "") + "; writing it in the background")
        else:
            pending.run()
            self.pending = pending
            self.wait()
        return pending.final

    def wait(self) -> None:
        """Block until the save in flight, if any, is durable and marked complete (on every rank)."""
        if self.pending:
            self.poll(block=True)

    # -- saving

    def async_supported(self) -> bool:
        """Background writes need the strategy's state in a form this module can copy to host memory."""
        why = None
        if self.kind == "fsdp":
            from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

            plugin = self.accelerator.state.fsdp_plugin
            if plugin.fsdp_version != 2 or plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
                why = "it needs FSDP2 with fsdp_state_dict_type SHARDED_STATE_DICT"
        elif self.kind == "deepspeed":
            engines = [engine for engine in self.accelerator._models if hasattr(engine, "checkpoint_engine")]
            if any(getattr(engine.checkpoint_engine, "name", "") != "TorchCheckpointEngine" for engine in engines):
                why = "the DeepSpeed config chooses its own checkpoint writer"
        if why:
            self.accelerator.print(f"shardtune: --async_save true ignored, saves are synchronous: {why}.")
        return why is None

    def setup_staging(self) -> None:
        """The host copy of each save comes from torch.distributed.checkpoint's stager, which keeps its buffers
        (pinned on GPU machines) from one save to the next: the first save allocates them, later ones only copy,
        at memory speed. Under FSDP, torch.distributed.checkpoint also plans and finishes each save with
        collectives, which its background thread runs while training runs its own: each save in flight gets a
        gloo group of its own, so that neither stream of collectives can meet the other's."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                   use_shared_memory=False, use_async_staging=False,
                                                   use_non_blocking_copy=False))
        if not dist.is_initialized():
            return
        timeout = timedelta(minutes=self.recipe.startup_timeout_minutes)
        # The per-step question "is every rank's write durable?" goes over gloo, on the host: on GPUs it would
        # cost a device sync at every step while a save is in flight.
        self.poll_group = dist.new_group(backend="gloo", timeout=timeout)
        if self.kind == "fsdp":
            count = len(self.accelerator._models) + (0 if self.recipe.save_only_model else
                                                      len(self.accelerator._optimizers))
            self.dcp_groups = [dist.new_group(backend="gloo", timeout=timeout) for _ in range(count)]

    def host_copy(self, state: Any) -> Any:
        """A copy of `state` in host memory for a background write; the state itself for a synchronous one."""
        return self.stager.stage(state) if self.async_save else state

    def stage(self, pending: PendingSave) -> None:
        """Everything of the save that must happen at this step: the small files written, the large ones
        copied to host memory (asynchronous saves) or written (synchronous ones)."""
        accelerator = self.accelerator
        if accelerator.is_main_process:
            shutil.rmtree(pending.scratch, ignore_errors=True)  # left by a crash during an earlier save
            shutil.rmtree(pending.final, ignore_errors=True)  # an incomplete one (renamed, never marked)
        accelerator.wait_for_everyone()
        os.makedirs(pending.scratch, exist_ok=True)
        if self.recipe.save_only_model:
            self.stage_model_only(pending)
        elif not self.async_save:
            accelerator.save_state(pending.scratch)  # model, optimizer, scheduler, RNG states of every rank
        elif self.kind == "fsdp":
            self.stage_fsdp(pending)
        elif self.kind == "deepspeed":
            self.stage_deepspeed(pending)
        else:
            self.stage_replicated(pending)
        if accelerator.is_main_process:
            self.extra_files(pending.scratch)  # config and tokenizer, so that the checkpoint exports on its own

    def stage_replicated(self, pending: PendingSave) -> None:
        """DDP or one process: the files accelerate's save_state writes; the model and optimizer states (of the
        main process, which alone writes them) copied to host memory for the background writer."""
        from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME

        accelerator = self.accelerator
        if accelerator.is_main_process:
            for index, model in enumerate(accelerator._models):
                name = SAFE_WEIGHTS_NAME if index == 0 else SAFE_WEIGHTS_NAME.replace(".", f"_{index}.")
                state = self.host_copy(accelerator.get_state_dict(model, unwrap=False))
                pending.add(os.path.join(pending.scratch, name), functools.partial(write_safetensors, state))
            for index, optimizer in enumerate(accelerator._optimizers):
                name = f"{OPTIMIZER_NAME}.bin" if index == 0 else f"{OPTIMIZER_NAME}_{index}.bin"
                pending.add(os.path.join(pending.scratch, name),
                            functools.partial(write_torch, self.host_copy(optimizer.state_dict())))
        self.save_small_states(pending.scratch)

    def stage_fsdp(self, pending: PendingSave) -> None:
        """FSDP2: model and optimizer shards through torch.distributed.checkpoint's async_save, laid out as
        accelerate's save_state lays them out (so load_state and export_hf read them): async_save copies each
        rank's shards to host memory before it returns and writes them from its own thread."""
        from accelerate.utils import OPTIMIZER_NAME
        from accelerate.utils.constants import FSDP_MODEL_NAME
        from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        accelerator = self.accelerator
        options = _prepare_sd_options(accelerator.state.fsdp_plugin)  # the options load_state reads them with
        saves = [(f"{FSDP_MODEL_NAME}_{index}", {"model": _get_model_state_dict(model, sd_options=options)})
                 for index, model in enumerate(accelerator._models)]
        saves += [(f"{OPTIMIZER_NAME}_{index}",
                   {"optimizer": get_optimizer_state_dict(accelerator._models[index], optimizer, options=options)})
                  for index, optimizer in enumerate(accelerator._optimizers)]
        for index, (name, state) in enumerate(saves):
            self.dcp_async(pending, state, os.path.join(pending.scratch, name), index)
        self.save_small_states(pending.scratch)

    def dcp_async(self, pending: PendingSave, state: dict, path: str, index: int) -> None:
        """The `index`-th torch.distributed.checkpoint save of this checkpoint, on its own group."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        group = self.dcp_groups[index] if self.dcp_groups else None
        os.makedirs(path, exist_ok=True)
        pending.futures.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path),
                                              planner=DefaultSavePlanner(), process_group=group,
                                              async_stager=self.stager, no_dist=group is None))

    def stage_deepspeed(self, pending: PendingSave) -> None:
        """DeepSpeed: its own save_checkpoint, through a checkpoint engine that copies each state dict DeepSpeed
        asks it to write (each rank's ZeRO partitions, the module states) to host memory and leaves its
        torch.save to the background writer. DeepSpeed's own asynchronous engines do not fit: the decoupled one
        hands the live tensors to a writer process without a copy (the next optimizer step then waits for the
        whole write) and, like the fast one, needs pinned memory and O_DIRECT through DeepSpeed's async I/O op."""
        engines = [engine for engine in self.accelerator._models if hasattr(engine, "checkpoint_engine")]
        originals = [engine.checkpoint_engine for engine in engines]
        try:
            for engine, original in zip(engines, originals, strict=True):
                engine.checkpoint_engine = HostMemoryCheckpointEngine(original, pending, self.host_copy)
            self.accelerator.save_state(pending.scratch)
        finally:
            for engine, original in zip(engines, originals, strict=True):
                engine.checkpoint_engine = original

    def stage_model_only(self, pending: PendingSave) -> None:
        """--save_only_model: FSDP writes its model shards (torch.distributed.checkpoint, as save_state does);
        the other strategies write model.safetensors from the main process, gathered from ZeRO-3 partitions."""
        accelerator = self.accelerator
        if self.kind == "fsdp":
            from accelerate.utils.constants import FSDP_MODEL_NAME
            from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options

            options = _prepare_sd_options(accelerator.state.fsdp_plugin)
            state = {"model": _get_model_state_dict(accelerator._models[0], sd_options=options)}
            path = os.path.join(pending.scratch, f"{FSDP_MODEL_NAME}_0")
            if self.async_save:
                self.dcp_async(pending, state, path, 0)
            else:
                import torch.distributed as dist
                import torch.distributed.checkpoint as dcp

                dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=not dist.is_initialized())
            return
        state = accelerator.get_state_dict(accelerator._models[0])  # a collective under ZeRO-3
        if accelerator.is_main_process:
            pending.add(os.path.join(pending.scratch, "model.safetensors"),
                        functools.partial(write_safetensors, self.host_copy(state)))

    def save_small_states(self, scratch: str) -> None:
        """What save_state writes besides the model and optimizer: scheduler, sampler and RNG states, the
        gradient scaler and objects registered for checkpointing."""
        from accelerate.checkpointing import save_accelerator_state, save_custom_state

        accelerator = self.accelerator
        on_each_node = accelerator.project_configuration.save_on_each_node
        save_accelerator_state(scratch, [], [], accelerator._schedulers, accelerator._dataloaders,
                               accelerator.state.process_index, accelerator.step, accelerator.scaler,
                               save_on_each_node=on_each_node)
        for index, obj in enumerate(accelerator._custom_objects):
            save_custom_state(obj, scratch, index, save_on_each_node=on_each_node)

    # -- finishing

    def poll(self, block: bool) -> None:
        """Publish the save in flight once every rank's write is durable. A collective: every rank calls it at
        the same step (after_step, save and wait run in lockstep). Blocking, it waits for the slowest rank's
        disk, so its collectives have the start-up timeout."""
        pending = self.pending
        with self.patient_collectives():
            if block:
                pending.done.wait()
            local = [0.0 if pending.done.is_set() else 1.0, 1.0 if pending.error else 0.0]
            not_done, failed = self.count_over_ranks(local)
            if failed:
                self.pending = None
                where = "on this rank" if pending.error else "on another rank"
                raise RuntimeError(f"checkpoint-{pending.step}: writing it failed {where}; the previous complete "
                                   "checkpoint is still the newest.") from pending.error
            if not_done:
                return
            if self.accelerator.is_main_process:  # the others wait while rank 0 renames, marks and prunes
                publish(pending, self.recipe, self.accelerator.num_processes, self.kind)
            self.accelerator.wait_for_everyone()
        self.pending = None
        stall = f"; training waited {pending.staged_s:.2f}s of it" if self.async_save else ""
        self.accelerator.print(f"shardtune: saved {pending.final} in {time.perf_counter() - pending.started:.1f}s "
                               f"(durable){stall}")

    def count_over_ranks(self, local: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        if self.poll_group is not None:  # a gloo group of its own: host tensors, no device sync in the step
            flags = torch.tensor(local)
            dist.all_reduce(flags, group=self.poll_group)
            return flags.tolist()
        if self.accelerator.num_processes == 1:
            return local
        flags = torch.tensor(local, device=self.accelerator.device)  # a synchronous save, once per save
        return self.accelerator.reduce(flags, reduction="sum").tolist()

    def patient_collectives(self) -> _PatientCollectives:
        return _PatientCollectives(self)

    def keep_background_groups_patient(self) -> None:
        """The groups of background saves wait for the slowest rank's whole write: the start-up timeout,
        whatever timeout training sets for its own collectives."""
        from datetime import timedelta

        import torch.distributed as dist

        for group in [*self.dcp_groups, *([self.poll_group] if self.poll_group is not None else [])]:
            dist.distributed_c10d._set_pg_timeout(timedelta(minutes=self.recipe.startup_timeout_minutes), group)


class _PatientCollectives:
    """Within it, collectives wait as long as at start-up: a save waits for the slowest rank and disk."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer

    def __enter__(self) -> None:
        from shardtune.ranks import set_collective_timeout

        set_collective_timeout(self.checkpointer.recipe.startup_timeout_minutes)

    def __exit__(self, *exc_info) -> None:
        from shardtune.ranks import set_collective_timeout

        set_collective_timeout(self.checkpointer.recipe.collective_timeout_minutes)
        self.checkpointer.keep_background_groups_patient()


class HostMemoryCheckpointEngine:
    """Stands in for DeepSpeed's TorchCheckpointEngine during one save_checkpoint: `save` copies the state dict
    to host memory and queues its torch.save for the background writer; everything else is DeepSpeed's own
    engine."""

    def __init__(self, original: Any, pending: PendingSave, host_copy: Callable[[Any], Any]) -> None:
        self.original, self.pending, self.host_copy = original, pending, host_copy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)

    def save(self, state_dict: dict, path: str) -> None:
        zipfile = getattr(self.original, "zipfile_serialization", True)
        self.pending.add(path, functools.partial(write_torch, self.host_copy(state_dict), zipfile=zipfile))


def publish(pending: PendingSave, recipe: Recipe, world_size: int, kind: str) -> None:
    """On rank 0, once every rank's files are durable: rename, mark, and only then delete older checkpoints."""
    output_dir = recipe.resolved_output_dir
    os.rename(pending.scratch, pending.final)
    fsync_path(output_dir)  # the rename is durable before the marker says the checkpoint is complete
    write_marker(pending.final, {"step": pending.step, "world_size": world_size, "strategy": kind,
                                 "model_only": recipe.save_only_model, "files": describe_files(pending.final)})
    keep = recipe.save_total_limit
    # Checkpoints of later steps are from a run that was resumed from further back: they are reached again.
    earlier = [path for path in complete_checkpoints(output_dir) if checkpoint_step(path) <= pending.step]
    for old in earlier[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    if keep > 0 and len(earlier) > keep:
        fsync_path(output_dir)


def strategy_kind(accelerator: Accelerator) -> str:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return "fsdp"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "deepspeed"
    return "replicated"


def write_torch(obj: Any, path: str, zipfile: bool = True) -> None:
    import torch

    torch.save(obj, path, _use_new_zipfile_serialization=zipfile)


def write_safetensors(state_dict: dict[str, torch.Tensor], path: str) -> None:
    """The safetensors file accelerate's save writes (tied tensors such as shared embeddings stored once, the
    same metadata), streamed from the tensors' memory: safetensors' own writer builds the whole file in memory
    first, which halves its rate and doubles the host memory of a background save."""
    import torch
    from accelerate.utils.other import clean_state_dict_for_safetensors

    cleaned = clean_state_dict_for_safetensors(dict(state_dict))
    dtype = {name: str(tensor.dtype).removeprefix("torch.") for name, tensor in cleaned.items()}
    tensors = {name: cleaned[name] for name in sorted(cleaned, key=lambda name: (DTYPE_ORDER[dtype[name]], name))}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype[name]],
                        "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, len(encoded).to_bytes(8, "little") + encoded)
        for tensor in tensors.values():
            if tensor.numel():
                write_all(fd, tensor.reshape(-1).view(torch.uint8).cpu().numpy().data)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    view, written = memoryview(data).cast("B"), 0
    while written < len(view):
        written += os.write(fd, view[written:written + (1 << 30)])  # the GIL is released while it writes
