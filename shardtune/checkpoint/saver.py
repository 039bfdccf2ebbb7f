"""The Checkpointer: decides when the trainer's state is saved, and takes each save from its start to its
marker: staged at the step (shardtune.checkpoint.staging), written and fsynced by every rank, then renamed,
marked and pruned by rank 0 once every rank's files are durable (`publish`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from shardtune.checkpoint.durable import fsync_path
from shardtune.checkpoint.markers import checkpoint_step, complete_checkpoints, describe_files, warn, write_marker
from shardtune.checkpoint.pending import PendingSave
from shardtune.checkpoint.run_files import remove_checkpoint, remove_conversions
from shardtune.checkpoint.staging import (
    async_save_obstacle,
    dcp_save_count,
    new_stager,
    set_group_timeouts,
    stage_deepspeed,
    stage_fsdp,
    stage_model_only,
    stage_replicated,
    strategy_kind,
)
from shardtune.config import Recipe
from shardtune.parallel.ranks import set_collective_timeout


class Checkpointer:
    """Decides itself when the trainer's state is saved, and saves it. The trainer calls `after_step` after
    every optimizer step, `save` on a stop signal, and `wait` before it exits, so that nothing it reports as
    saved is still being written."""

    def __init__(self, accelerator: Accelerator, recipe: Recipe, extra_files: Callable[[str], None],
                 settings: dict | None = None) -> None:
        self.accelerator, self.recipe, self.extra_files = accelerator, recipe, extra_files
        self.settings = settings or {}  # what each marker records of the run (checkpoint.run_settings)
        self.pending: PendingSave | None = None
        self.kind = strategy_kind(accelerator)
        self.async_save = recipe.async_save and self.async_supported()
        self.dcp_groups: list = []
        self.poll_group = None
        self.stager = None
        if self.async_save:
            self.setup_background()

    # -- the trainer's interface

    def due(self, step: int, max_steps: int) -> bool:
        """Whether `step` saves: every --save_steps, and the last."""
        every = self.recipe.save_steps
        return bool(every) and (step % every == 0 or step == max_steps)

    def after_step(self, step: int, max_steps: int) -> None:
        if self.pending:
            self.poll(block=False)
        if self.due(step, max_steps):
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

    # -- starting

    def async_supported(self) -> bool:
        why = async_save_obstacle(self.accelerator, self.kind)
        if why:
            self.accelerator.print(f"shardtune: --async_save true ignored, saves are synchronous: {why}.")
        return why is None

    def setup_background(self) -> None:
        """The host copy of each save comes from torch.distributed.checkpoint's stager, which keeps its buffers
        (pinned on GPU machines) from one save to the next: the first save allocates them, later ones only copy,
        at memory speed. Under FSDP, torch.distributed.checkpoint also plans and finishes each save with
        collectives, which its background thread runs while training runs its own: each save in flight gets a
        gloo group of its own, so that neither stream of collectives can meet the other's."""
        self.stager = new_stager()
        if not dist.is_initialized():
            return
        timeout = timedelta(minutes=self.recipe.startup_timeout_minutes)
        # The per-step question "is every rank's write durable?" goes over gloo, on the host: on GPUs it would
        # cost a device sync at every step while a save is in flight.
        self.poll_group = dist.new_group(backend="gloo", timeout=timeout)
        count = dcp_save_count(self.accelerator, self.kind, self.recipe.save_only_model)
        self.dcp_groups = [dist.new_group(backend="gloo", timeout=timeout) for _ in range(count)]

    def stage(self, pending: PendingSave) -> None:
        """Everything of the save that must happen at this step: the small files written, the large ones
        copied to host memory (asynchronous saves) or written (synchronous ones)."""
        accelerator = self.accelerator
        kept = [None]
        if accelerator.is_main_process:
            # Left by a crash during an earlier save, or a later step's checkpoint of the run this one resumed:
            # deleted only where they hold nothing but a save's files.
            kept = [remove_checkpoint(pending.scratch) or remove_checkpoint(pending.final)]
        broadcast_object_list(kept)  # every rank waits for rank 0's cleaning, and hears why it could not
        if kept[0]:
            raise RuntimeError(f"checkpoint-{pending.step} cannot be saved: {kept[0]}")
        os.makedirs(pending.scratch, exist_ok=True)
        if self.recipe.save_only_model:
            stage_model_only(accelerator, pending, self.kind, self.stager, self.dcp_groups)
        elif not self.async_save:
            accelerator.save_state(pending.scratch)  # model, optimizer, scheduler, RNG states of every rank
        elif self.kind == "fsdp":
            stage_fsdp(accelerator, pending, self.stager, self.dcp_groups)
        elif self.kind == "deepspeed":
            stage_deepspeed(accelerator, pending, self.stager)
        else:
            stage_replicated(accelerator, pending, self.stager)
        if accelerator.is_main_process:
            self.extra_files(pending.scratch)  # config and tokenizer, so that the checkpoint exports on its own

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
                publish(pending, self.recipe, self.accelerator.num_processes, self.kind, self.settings)
            self.accelerator.wait_for_everyone()
        self.pending = None
        stall = f"; training waited {pending.staged_s:.2f}s of it" if self.async_save else ""
        self.accelerator.print(f"shardtune: saved {pending.final} in {time.perf_counter() - pending.started:.1f}s "
                               f"(durable){stall}")

    def count_over_ranks(self, local: list[float]) -> list[float]:
        if self.poll_group is not None:  # a gloo group of its own: host tensors, no device sync in the step
            flags = torch.tensor(local)
            dist.all_reduce(flags, group=self.poll_group)
            return flags.tolist()
        if self.accelerator.num_processes == 1:
            return local
        flags = torch.tensor(local, device=self.accelerator.device)  # a synchronous save, once per save
        return self.accelerator.reduce(flags, reduction="sum").tolist()

    @contextmanager
    def patient_collectives(self) -> Iterator[None]:
        """Within it, collectives wait as long as at start-up: a save waits for the slowest rank and disk. The
        groups of background saves keep that timeout after it, whatever training sets for its own
        collectives: they wait for the slowest rank's whole write."""
        set_collective_timeout(self.recipe.startup_timeout_minutes)
        try:
            yield
        finally:
            set_collective_timeout(self.recipe.collective_timeout_minutes)
            background = [*self.dcp_groups, *([self.poll_group] if self.poll_group is not None else [])]
            set_group_timeouts(background, self.recipe.startup_timeout_minutes)


def publish(pending: PendingSave, recipe: Recipe, world_size: int, kind: str, settings: dict) -> None:
    """On rank 0, once every rank's files are durable: rename, mark, and only then delete older checkpoints."""
    output_dir = recipe.resolved_output_dir
    os.rename(pending.scratch, pending.final)
    fsync_path(output_dir)  # the rename is durable before the marker says the checkpoint is complete
    write_marker(pending.final, {"step": pending.step, "world_size": world_size, "strategy": kind,
                                 "model_only": recipe.save_only_model, "run": settings,
                                 "files": describe_files(pending.final)})
    keep = recipe.save_total_limit
    # Checkpoints of later steps are from a run that was resumed from further back: they are reached again.
    earlier = [path for path in complete_checkpoints(output_dir) if checkpoint_step(path) <= pending.step]
    for old in earlier[:-keep] if keep > 0 else []:
        kept = remove_checkpoint(old)
        if kept:  # a stranger's file in it: the checkpoint stays, the run goes on
            warn(f"--save_total_limit {keep}: {kept}")
    for kept in remove_conversions(output_dir, pending.step) if keep > 0 else []:  # a resume's, now behind the run
        warn(f"--save_total_limit {keep}: {kept}")
    if keep > 0 and len(earlier) > keep:
        fsync_path(output_dir)
