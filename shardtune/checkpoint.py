"""Atomic, sharded training checkpoints through accelerate's state saving, and finding one to resume from.

A checkpoint is written by every rank into `output_dir/.checkpoint-<step>.tmp`, renamed to
`output_dir/checkpoint-<step>` once all ranks have finished, and only then marked complete with
`checkpoint_complete.json`. A crash at any moment leaves the previous complete checkpoint as the newest one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shardtune.config import ConfigError

if TYPE_CHECKING:  # accelerate takes seconds to import; resolve_resume runs before any heavy import
    from accelerate import Accelerator

MARKER = "checkpoint_complete.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def complete_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints in `output_dir`, oldest first."""
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


def resolve_resume(resume_from: str, output_dir: str, world_size: int) -> tuple[str | None, int]:
    """(checkpoint path, step) to resume from; (None, 0) to start fresh. Raises ConfigError before any loading."""
    if not resume_from:
        return None, 0
    if resume_from == "auto":
        checkpoints = complete_checkpoints(output_dir)
        if not checkpoints:
            return None, 0
        checkpoint = checkpoints[-1]
    else:
        checkpoint = resume_from
        if not os.path.isfile(os.path.join(checkpoint, MARKER)):
            raise ConfigError(
                f"--resume_from_checkpoint {checkpoint!r} is not a complete checkpoint (no {MARKER}): "
                "its save did not finish. Give an earlier checkpoint, or `auto` for the newest complete one."
            )
    marker = read_marker(checkpoint)
    if marker["world_size"] != world_size:
        raise ConfigError(
            f"Checkpoint {checkpoint!r} was saved by {marker['world_size']} processes and this run has "
            f"{world_size}: sharded optimizer states and the data order depend on it. Resume with "
            f"--num_processes {marker['world_size']}, or export it with scripts/export_hf.py and start a new run."
        )
    return checkpoint, marker["step"]


def save_checkpoint(
    accelerator: Accelerator, output_dir: str, step: int, keep: int, extra_files: Callable[[str], None]
) -> str:
    """Save the full training state at `step`, sharded as the strategy holds it; keep the newest `keep`."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    scratch = os.path.join(output_dir, f".checkpoint-{step}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(scratch, ignore_errors=True)  # left by a crash during an earlier save
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one (renamed, never marked)
    accelerator.wait_for_everyone()
    accelerator.save_state(scratch)  # model, optimizer, scheduler, RNG states of every rank
    if accelerator.is_main_process:
        extra_files(scratch)  # config and tokenizer, so that the checkpoint exports on its own
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.rename(scratch, final)
        write_marker(final, {"step": step, "world_size": accelerator.num_processes})
        for old in complete_checkpoints(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


class Checkpointer:
    """Decides itself when the trainer's state is saved, and saves it. The trainer calls `after_step` after
    every optimizer step, `save` on a stop signal, and `wait` before it exits, so that nothing it reports as
    saved is still being written."""

    def __init__(self, accelerator: Accelerator, recipe, extra_files: Callable[[str], None]) -> None:
        self.accelerator, self.recipe, self.extra_files = accelerator, recipe, extra_files

    def after_step(self, step: int, max_steps: int) -> None:
        every = self.recipe.save_steps
        if every and (step % every == 0 or step == max_steps):
            self.save(step)

    def save(self, step: int) -> str:
        from shardtune.ranks import set_collective_timeout

        started = time.perf_counter()
        set_collective_timeout(self.recipe.startup_timeout_minutes)  # every shard written: as slow as the disk
        path = save_checkpoint(self.accelerator, self.recipe.resolved_output_dir, step, self.recipe.save_total_limit,
                               self.extra_files)
        set_collective_timeout(self.recipe.collective_timeout_minutes)
        self.accelerator.print(f"shardtune: saved {path} in {time.perf_counter() - started:.1f}s")
        return path

    def wait(self) -> None:
        """Block until every save started so far is complete and durable (saves are synchronous today)."""


def write_marker(checkpoint: str, content: dict) -> None:
    path = os.path.join(checkpoint, MARKER)
    with open(path + ".tmp", "w") as file:
        json.dump(content, file)
        file.flush()
        os.fsync(file.fileno())
    os.rename(path + ".tmp", path)
