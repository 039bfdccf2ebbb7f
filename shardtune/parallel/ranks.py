"""Keeping the ranks of a multi-machine job honest: they must agree on the launch, wait on each other for a
bounded time, and stop together when one of them dies, with a message that names it."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version

import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object

from shardtune.config import BatchSizes, ConfigError, Recipe
from shardtune.launch import LaunchDescription
from shardtune.parallel.local_rank import first_on_machine

PEER_LOST_EXIT_CODE = 4
# What `accelerate launch` exports from the accelerate config (distributed type, ZeRO stage and offload, FSDP
# strategy, precision), less the paths that may differ per machine.
LAUNCH_PREFIXES = ("ACCELERATE_USE_", "ACCELERATE_DEEPSPEED_", "ACCELERATE_MIXED_PRECISION", "FSDP_",
                   "PARALLELISM_CONFIG_")
PER_MACHINE_KEYS = ("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
                    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH")
MACHINES_NAMED = 3  # per differing value: enough to find them, short at 128 machines
# How long a rank looks for the file rank 0 wrote in --output_dir: longer than NFS's default attribute-cache time for
# a directory (acdirmax, 60 s), which may remember that the directory did not exist.
SHARED_DIR_PATIENCE_S = 90.0


def machine_of_rank() -> str:
    """'machine 1 (node7)': the launcher's node rank, which `--machine_rank` / SLURM sets, and the host name."""
    return f"machine {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})"


def launch_fingerprint(accelerator: Accelerator, recipe: Recipe, batching: BatchSizes, launch: LaunchDescription,
                       start_step: int) -> dict[str, str]:
    """Everything the ranks of one job must agree on, as strings, one key per value."""
    fingerprint = {
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "micro_batch": batching.micro_batch,
        "accumulation": batching.accumulation,
        "global_batch": batching.global_batch,
        "resume_step": start_step,  # a per-machine output_dir or a stale network filesystem would differ here
        **{key: value for key, value in os.environ.items()
           if key.startswith(LAUNCH_PREFIXES) and key not in PER_MACHINE_KEYS},
        **{f"recipe.{key}": value for key, value in dataclasses.asdict(recipe).items()},
    }
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        fingerprint.update(deepspeed_fingerprint(launch))
    packages = ["torch", "transformers", "accelerate", "datasets", "shardtune"]
    packages += ["deepspeed"] if accelerator.distributed_type == DistributedType.DEEPSPEED else []
    packages += ["peft"] if recipe.use_peft else []
    for package in packages:
        try:
            fingerprint[f"version.{package}"] = version(package)
        except PackageNotFoundError:
            fingerprint[f"version.{package}"] = "not installed"
    return {key: str(value) for key, value in fingerprint.items()}


def deepspeed_fingerprint(launch: LaunchDescription) -> dict[str, str]:
    """The DeepSpeed settings every machine must share, as the start-up checks and the planner read them (the
    launch's): from the JSON file `accelerate launch` names, which it exports no stage or offload variables for.
    Stage, offload devices and precision by name (for the message); every other value through a digest of the
    file (its path and NVMe swap directories may differ per machine, its contents may not)."""
    settings = launch.deepspeed_settings
    fingerprint = {f"deepspeed.{key}": str(settings.get(key)) for key in
                   ("stage", "offload_optimizer", "offload_param", "mixed_precision")}
    path = launch.deepspeed_config_file
    if path:  # read when the launch was: readable, with a zero_optimization section
        with open(path) as file:
            config = json.load(file)
        for kind in ("offload_optimizer", "offload_param"):
            (config.get("zero_optimization", {}).get(kind) or {}).pop("nvme_path", None)
        fingerprint["deepspeed.config_sha256"] = hashlib.sha256(
            json.dumps(config, sort_keys=True).encode()).hexdigest()
    return fingerprint


def check_ranks_agree(accelerator: Accelerator, fingerprint: dict[str, str]) -> list[str]:
    """Exchange every rank's fingerprint; on any difference every rank raises the same ConfigError, naming the
    keys and the machines. Machines started with different ZeRO stages or batch settings would otherwise hang
    in mismatched collectives or silently train different things. Returns each rank's machine name."""
    everyone = gather_object([(machine_of_rank(), fingerprint)])
    differing = sorted({key for _, other in everyone for key in other.keys() | fingerprint.keys()
                        if other.get(key) != fingerprint.get(key)})
    if not differing:
        return [machine for machine, _ in everyone]
    details = []
    for key in differing[:5]:
        machines_by_value: dict[str, list[str]] = {}
        for machine, other in everyone:
            machines = machines_by_value.setdefault(other.get(key, "<unset>"), [])
            if machine not in machines:
                machines.append(machine)
        details.append(f"{key}: " + ", ".join(
            f"{value!r} on {', '.join(machines[:MACHINES_NAMED])}"
            + (f" and {len(machines) - MACHINES_NAMED} more" if len(machines) > MACHINES_NAMED else "")
            for value, machines in machines_by_value.items()))
    more = f" (and {len(differing) - 5} more)" if len(differing) > 5 else ""
    raise ConfigError(
        f"the machines of this job were started differently: {'; '.join(details)}{more}. Launch every machine with "
        "the same accelerate config, recipe flags and package versions."
    )


def check_output_dir_shared(output_dir: str, machines: list[str], patience_s: float = SHARED_DIR_PATIENCE_S) -> None:
    """On several machines, --output_dir must be one directory that every machine sees: each rank writes its shard
    of a checkpoint there and rank 0 marks the checkpoint complete after checking every file, and `auto` resumes
    from what it finds there. Rank 0 writes a file of a name never looked up before, fsynced, before the broadcast
    of its name; every rank must then read it, and looks again for `patience_s` (an NFS client may remember, for
    its attribute-cache time, that the directory did not exist when the start-up checks looked). Every rank raises
    the same ConfigError, naming the machines that cannot."""
    if not dist.is_initialized() or len(set(machines)) < 2:
        return
    message = [None]
    if dist.get_rank() == 0:
        message = [f".shardtune-shared-{uuid.uuid4().hex}"]
        try:
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, message[0]), "w") as file:
                file.write(message[0])
                file.flush()
                os.fsync(file.fileno())
        except OSError as error:  # every rank must hear of it, not wait in the broadcast
            message = [f"error: rank 0 cannot write to --output_dir {output_dir!r}: {error}"]
    dist.broadcast_object_list(message, src=0)
    if message[0].startswith("error: "):
        raise ConfigError(message[0][len("error: "):])
    path = os.path.join(output_dir, message[0])
    deadline = time.monotonic() + patience_s
    while not (seen := read_text(path) == message[0]) and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            os.listdir(os.path.dirname(os.path.abspath(output_dir)))  # asks the server again
        time.sleep(1.0)
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, seen)
    if dist.get_rank() == 0:
        with contextlib.suppress(OSError):
            os.remove(path)  # every rank has read it: the verdicts are in
    blind = sorted({machines[rank] for rank, ok in enumerate(verdicts) if not ok})
    if blind:
        raise ConfigError(f"--output_dir {output_dir!r} is not one directory on every machine: "
                          f"{', '.join(blind[:MACHINES_NAMED])} cannot read what rank 0 wrote there. Checkpoints "
                          "and resuming need a filesystem every machine shares (NFS, Lustre, ...): give such a "
                          "--output_dir.")


def read_text(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None


def set_collective_timeout(minutes: float) -> None:
    """How long any collective may wait before the job fails rather than hangs, in every process group of this
    rank (DeepSpeed and FSDP make their own). The recipe's start-up timeout covers the slowest first collectives
    (rank 0 reading 140 GB of 70B weights while the others wait, DeepSpeed's CPU Adam build) and saves (every
    shard written to a slow filesystem); a training step of even 405B takes seconds, so its shorter timeout
    means a hang."""
    if not dist.is_initialized():
        return
    for group in list(dist.distributed_c10d._world.pg_map):
        if not dist.distributed_c10d._rank_not_in_group(group):
            dist.distributed_c10d._set_pg_timeout(timedelta(minutes=minutes), group)


@contextmanager
def watch_ranks(accelerator: Accelerator, recipe: Recipe, machines: list[str]) -> Iterator[None]:
    """Run the body under a RankWatchdog (multi-process runs). An error from inside torch.distributed (a peer
    died) waits for the watchdog to name that peer before it propagates; any other error is posted at once, so
    that the other ranks stop with its cause instead of waiting for it in a collective."""
    if accelerator.num_processes == 1:
        yield
        return
    watchdog = RankWatchdog(machines, interval=min(5.0, recipe.rank_timeout_s / 4), timeout=recipe.rank_timeout_s)
    try:
        yield
    except BaseException as error:
        if from_a_collective(error):
            watchdog.wait_for_verdict()
        watchdog.stop(failure=f"{type(error).__name__}: {error}".strip().splitlines()[0][:300])
        raise
    watchdog.stop()


def from_a_collective(error: BaseException) -> bool:
    """A peer's loss surfaces as the backend's error: torch's DistError (NCCL), or gloo's RuntimeError, raised
    from a wait inside torch.distributed or in DeepSpeed's own collectives."""
    frames = traceback.extract_tb(error.__traceback__)
    return (isinstance(error, dist.DistError) or "gloo" in str(error)
            or any(f"torch{os.sep}distributed" in frame.filename for frame in frames))


class RankWatchdog:
    """Each rank bumps a counter in the rendezvous store every `interval` seconds and watches the next rank's.
    A counter that stops moving for `timeout` seconds means that rank died, froze, or lost its machine: the
    watcher posts one message naming it, and every rank, seeing the message, prints it and exits. That bounds
    the job's life after a death by about `timeout + interval` seconds, whatever the collective timeouts; a NCCL
    survivor would otherwise block until its collective timeout. A rank that fails posts its error, and stops
    everyone at once. Counters, not clock times, because the machines' clocks need not agree. A hung but living
    rank still beats: the collective timeouts catch that."""

    def __init__(self, machines: list[str], interval: float, timeout: float) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.watched = (self.rank + 1) % self.world_size
        self.machines, self.interval, self.timeout = machines, interval, timeout
        # Its own client of the store every rank reached at rendezvous (under torchrun, served by machine 0's
        # launcher), with the watchdog's timeout: the main thread's client may block in a long `wait`.
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timedelta(seconds=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted launch keeps its store
        self.store = dist.PrefixStore(f"shardtune/watchdog/{attempt}/", client)
        self.stopped = threading.Event()
        self.verdict = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shardtune-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last_seen, last_change, store_ok = -1, time.monotonic(), time.monotonic()
        while not self.stopped.wait(self.interval):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                if self.store.check(["abort"]):
                    self._exit(self.store.get("abort").decode())
                seen = self.store.add(f"beat/{self.watched}", 0)
                store_ok = time.monotonic()
            except Exception as error:  # noqa: BLE001 (a blip, or machine 0's launcher is gone)
                if self.stopped.is_set():
                    return
                if time.monotonic() - store_ok > self.timeout:
                    self._exit(f"lost the rendezvous store on {os.environ.get('MASTER_ADDR')}:"
                               f"{os.environ.get('MASTER_PORT')} for {self.timeout:.0f}s ({error}): machine 0 or "
                               "its launcher died; stopping.")
                continue
            if seen != last_seen:
                last_seen, last_change = seen, time.monotonic()
                continue
            state = self._state(self.watched)
            if state == "done":
                continue
            watched = f"rank {self.watched} on {self.machines[self.watched]}"
            if state:  # it failed and said why
                self._abort(f"{watched} failed ({state}); stopping every rank.")
            elif time.monotonic() - last_change > self.timeout:
                self._abort(f"{watched} has not answered for {self.timeout:.0f}s: it died, froze or lost its "
                            "network; stopping every rank. Its own log says why; resume with "
                            "--resume_from_checkpoint auto.")

    def _state(self, rank: int) -> str:
        key = f"state/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def _abort(self, message: str) -> None:
        self.store.set("abort", message)
        self._exit(message, detected=True)

    def _exit(self, message: str, detected: bool = False) -> None:
        if detected or first_on_machine():  # once per machine, and by the rank that saw it
            print(f"shardtune: error: [rank {self.rank}] {message}", file=sys.stderr, flush=True)
        self.verdict.set()
        os._exit(PEER_LOST_EXIT_CODE)  # the main thread may be blocked inside a collective that never returns

    def wait_for_verdict(self) -> None:
        """After a collective failed here: give the watchdog time to name the rank that died, then return."""
        self.verdict.wait(self.timeout + 3 * self.interval)

    def stop(self, failure: str = "") -> None:
        """Stop beating and say why: done (the watcher must not raise an alarm) or this rank's failure (the
        watcher stops everyone with it)."""
        self.stopped.set()
        self.thread.join()
        try:
            self.store.set(f"state/{self.rank}", f"{failure}" if failure else "done")
        except Exception:  # noqa: BLE001 (the store's launcher may already be gone)
            pass
