"""The run's output directory: the lock that makes it one live run's and the names of the files every run writes
there (shardtune.checkpoint.run_files lists all it writes, and clears them for --overwrite_output_dir).

Rank 0 holds an exclusive `flock` on `<output_dir>/.shardtune-lock` from before anything is written until the
process ends. The kernel releases a flock when its process dies, however it dies (on NFS, once the server's lease
of a crashed machine runs out, 90 s by default), so a run that is gone never blocks the next. The file says who
holds it (machine, process, start, command) and is emptied at a clean exit: a file that still names a holder when
its lock is free was left by a run that died, and the next run takes it over with a line saying so. The file
itself is never removed (a lock on a removed file would let a third run lock a new file of the same name).

Standard library only: the command line takes the lock before it imports torch."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time

from shardtune.config import ConfigError

LOCK_FILE = ".shardtune-lock"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # shardtune.tracking: generated samples at each eval
RUN_CONFIG_FILE = "run_config.json"  # shardtune.tracking: the resolved recipe and launch
ACQUIRE_PATIENCE_S = 2.0  # another launch's rank 0 may be probing the lock at this very moment
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a filesystem without flock


def is_rank_zero() -> bool:
    """The process that holds the lock: global rank 0 (a run without RANK is one process)."""
    return os.environ.get("RANK", "0").strip() == "0"


def describe_holder(path: str) -> str:
    """"pid 1234 on gpu-node-3, started 2026-12-06 03:50:12 UTC: recipes/tiny.py ...", or "" for an empty file."""
    try:
        with open(path) as file:
            holder = json.load(file)
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: {holder['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def in_use(output_dir: str) -> str | None:
    """Who holds `output_dir` now ("pid ... on ..."), or None when no live run does. Probes without taking the
    lock: a shared lock, let go at once."""
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return describe_holder(path) or "a run that has not yet said who it is"
    except OSError:
        return None  # a filesystem without locks: OutputDirLock.acquire says so
    finally:
        os.close(fd)  # releases the probe's lock
    return None


def in_use_message(output_dir: str, holder: str, overwrite: bool) -> str:
    why = " (--overwrite_output_dir never touches a live run's files)" if overwrite else ""
    return (f"--output_dir {output_dir!r} is in use by a live run ({holder}){why}: wait for it to end, stop it, or "
            "give another --output_dir.")


class OutputDirLock:
    """The lock of one output directory, held by this process until `release` (registered at exit)."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.fd: int | None = None

    def acquire(self, overwrite: bool) -> str | None:
        """Take the lock or raise ConfigError naming the live run that holds it. Returns a line to print when a
        dead run's lock was taken over, or when the filesystem takes no locks."""
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise ConfigError(f"--output_dir {os.path.dirname(self.path)!r} cannot be written ({error.strerror}): "
                              "give a directory this user can write.") from None
        deadline = time.monotonic() + ACQUIRE_PATIENCE_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                os.close(fd)
                holder = describe_holder(self.path) or "a run that has not yet said who it is"
                raise ConfigError(in_use_message(os.path.dirname(self.path), holder, overwrite)) from None
            except OSError as error:
                os.close(fd)
                if error.errno not in UNSUPPORTED:
                    raise
                return (f"the filesystem of {os.path.dirname(self.path)!r} takes no locks ({error.strerror}): "
                        "nothing stops a second run from writing into it at the same time.")
        self.fd = fd
        left = describe_holder(self.path)
        self.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "command": " ".join(sys.argv)}))
        atexit.register(self.release)
        if left:
            return (f"--output_dir {os.path.dirname(self.path)!r} was held by a run that ended without closing "
                    f"({left}); taking it over.")
        return None

    def write(self, text: str) -> None:
        assert self.fd is not None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Empty the file (a clean end) and let the lock go."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.write("")
        os.close(self.fd)  # releases the flock
        self.fd = None
