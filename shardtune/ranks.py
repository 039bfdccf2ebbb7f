"""Keeping the ranks of a multi-machine job honest: they must agree on the launch, wait on each other for a
bounded time, and stop together when one of them dies, with a message that names it."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version

import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import gather_object

from shardtune.config import BatchPlan, ConfigError, Recipe

PEER_LOST_EXIT_CODE = 4
VERSIONED_PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "shardtune")
# What `accelerate launch` exports from the accelerate config: distributed type, ZeRO stage and offload, FSDP
# strategy, precision. Paths and ports may differ per machine and are left out.
LAUNCH_PREFIXES = ("ACCELERATE_", "FSDP_")
PER_MACHINE_KEYS = ("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_LOG_LEVEL")


def machine_of_rank() -> str:
    """'machine 1 (node7)': the launcher's node rank, which `--machine_rank` / SLURM sets, and the host name."""
    return f"machine {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})"


def launch_fingerprint(accelerator: Accelerator, recipe: Recipe, plan: BatchPlan) -> dict[str, str]:
    """Everything the ranks of one job must agree on, as strings, one key per value."""
    fingerprint = {
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "micro_batch": plan.micro_batch,
        "accumulation": plan.accumulation,
        "global_batch": plan.global_batch,
        **{key: value for key, value in os.environ.items()
           if key.startswith(LAUNCH_PREFIXES) and key not in PER_MACHINE_KEYS},
        **{f"recipe.{key}": value for key, value in dataclasses.asdict(recipe).items()},
    }
    for package in VERSIONED_PACKAGES:
        try:
            fingerprint[f"version.{package}"] = version(package)
        except PackageNotFoundError:
            fingerprint[f"version.{package}"] = "not installed"
    return {key: str(value) for key, value in fingerprint.items()}


def check_ranks_agree(accelerator: Accelerator, fingerprint: dict[str, str]) -> None:
    """Exchange every rank's fingerprint; on any difference every rank raises the same ConfigError, naming the
    keys and the machines. Machines started with different ZeRO stages or batch settings would otherwise hang
    in mismatched collectives or silently train different things."""
    everyone = gather_object([(machine_of_rank(), fingerprint)])
    differing = sorted({key for _, other in everyone for key in other.keys() | fingerprint.keys()
                        if other.get(key) != fingerprint.get(key)})
    if not differing:
        return
    details = []
    for key in differing[:5]:
        machines_by_value: dict[str, list[str]] = {}
        for machine, other in everyone:
            machines = machines_by_value.setdefault(other.get(key, "<unset>"), [])
            if machine not in machines:
                machines.append(machine)
        details.append(f"{key}: " + ", ".join(f"{value!r} on {', '.join(machines)}"
                                              for value, machines in machines_by_value.items()))
    more = f" (and {len(differing) - 5} more)" if len(differing) > 5 else ""
    raise ConfigError(
        f"the machines of this job were started differently: {'; '.join(details)}{more}. Launch every machine with "
        "the same accelerate config, recipe flags and package versions."
    )


def set_collective_timeout(minutes: float) -> None:
    """How long any collective of the default process group may wait before the job fails rather than hangs.
    The recipe's start-up timeout covers the slowest first collectives (rank 0 reading 140 GB of 70B weights
    while the others wait, DeepSpeed's CPU Adam build) and saves (every shard written to a slow filesystem);
    a training step of even 405B takes seconds, so its shorter timeout means a hang."""
    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(timedelta(minutes=minutes))


@contextmanager
def watch_ranks(accelerator: Accelerator, recipe: Recipe) -> Iterator[None]:
    """Run the body under a RankWatchdog (multi-process runs). An error from inside torch.distributed (a peer
    died) waits for the watchdog to name that peer before it propagates."""
    if accelerator.num_processes == 1:
        yield
        return
    watchdog = RankWatchdog(interval=min(5.0, recipe.rank_timeout_s / 4), timeout=recipe.rank_timeout_s)
    try:
        yield
    except SystemExit:  # a stop every rank takes together: non-finite loss, stop signal
        watchdog.stop(clean=True)
        raise
    except Exception as error:
        # A peer's death surfaces here as whatever the backend raises (gloo: a RuntimeError "Connection reset
        # by peer"), from inside torch.distributed.
        if any(f"torch{os.sep}distributed" in frame.filename for frame in traceback.extract_tb(error.__traceback__)):
            watchdog.wait_for_verdict()
        watchdog.stop(clean=False)  # this rank fails alone: let the others' watchdogs name it
        raise
    watchdog.stop(clean=True)


class RankWatchdog:
    """Each rank bumps a counter in the rendezvous store every `interval` seconds and watches the next rank's.
    A counter that stops moving for `timeout` seconds means that rank died (or its machine did): the watcher
    posts one message naming it, and every rank, seeing the message, prints it and exits. That bounds the
    job's life after a death by about `timeout + interval` seconds, whatever the collective timeouts; a NCCL
    survivor would otherwise block until its collective timeout. Counters, not clock times, because the
    machines' clocks need not agree. A hung but living rank still beats: collective timeouts catch hangs."""

    def __init__(self, interval: float, timeout: float) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.watched = (self.rank + 1) % self.world_size
        self.interval, self.timeout = interval, timeout
        # The store every rank already reached at rendezvous (under torchrun it lives in machine 0's launcher).
        self.store = dist.PrefixStore("shardtune/watchdog/", dist.distributed_c10d._get_default_store())
        self.stopped = threading.Event()
        self.verdict = threading.Event()
        self.beats = 0
        self.store.set(f"machine/{self.rank}", machine_of_rank())
        self.thread = threading.Thread(target=self._run, name="shardtune-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last_seen, last_change = None, time.monotonic()
        while not self.stopped.wait(self.interval):
            try:
                self.beats += 1
                self.store.set(f"beat/{self.rank}", str(self.beats))
                if self.store.check(["abort"]):
                    self._exit(self.store.get("abort").decode())
                seen = self.store.get(f"beat/{self.watched}") if self.store.check([f"beat/{self.watched}"]) else None
                if seen == b"done":
                    continue
                if seen != last_seen:
                    last_seen, last_change = seen, time.monotonic()
                elif time.monotonic() - last_change > self.timeout:
                    machine = self.store.get(f"machine/{self.watched}").decode()
                    message = (f"rank {self.watched} on {machine} has not answered for {self.timeout:.0f}s: it "
                               "died or lost its network; stopping every rank. Its own log says why; resume with "
                               "--resume_from_checkpoint auto.")
                    self.store.set("abort", message)
                    self._exit(message)
            except Exception as error:  # noqa: BLE001 (the store is gone: machine 0 or its launcher died)
                if self.stopped.is_set():
                    return
                self._exit(f"lost the rendezvous store on {os.environ.get('MASTER_ADDR')}:"
                           f"{os.environ.get('MASTER_PORT')} ({error}): machine 0 or its launcher died; stopping.")

    def _exit(self, message: str) -> None:
        print(f"shardtune: error: [rank {self.rank}] {message}", file=sys.stderr, flush=True)
        self.verdict.set()
        os._exit(PEER_LOST_EXIT_CODE)  # the main thread may be blocked inside a collective that never returns

    def wait_for_verdict(self) -> None:
        """After a collective failed here: give the watchdog time to name the rank that died, then return."""
        self.verdict.wait(self.timeout + 3 * self.interval)

    def stop(self, clean: bool) -> None:
        """Stop beating. `clean`: this rank leaves on purpose, with the others, so its watcher must not raise an
        alarm; otherwise the watcher names it after the timeout."""
        self.stopped.set()
        self.thread.join()
        if clean:
            try:
                self.store.set(f"beat/{self.rank}", "done")
            except Exception:  # noqa: BLE001 (the store's launcher may already be gone at the very end)
                pass
