"""scripts/gpu_check.py's processes: each case launched in a session of its own and killed whole (the launcher's
group and every rank's) at its timeout or when SIGTERM or SIGINT arrives; the temporary model and data removed on
the way out."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KILL_GRACE_S = 10  # seconds: a kill takes up to two of these (SIGTERM, then SIGKILL)


@dataclass
class Finished:
    """How a launched command ended: its exit code (None: killed at its deadline) and its wall time."""

    returncode: int | None
    seconds: float


class Stopped(Exception):
    """SIGTERM or SIGINT arrived: the running case is ended whole and the temporary files removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stopping_on_signals():
    """SIGTERM and SIGINT raise Stopped in the main thread (once: a second signal is ignored while the first one's
    clean-up kills and removes); the previous handlers are restored on leaving."""
    signals = (signal.SIGTERM, signal.SIGINT)

    def stop(signum, frame) -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_killing_group(command: list[str], timeout: float, log_path: Path, env: dict[str, str],
                      cwd: Path | None = None) -> Finished:
    """Run `command` (in `cwd`) in a session (and process group) of its own, its output to `log_path`. At
    `timeout`, or when Stopped interrupts the wait, it is killed whole: SIGTERM, then after KILL_GRACE_S SIGKILL, to
    its group and to every descendant's group. torchrun starts each rank in a session of its own, which a signal to
    the launcher's group alone never reaches."""
    import psutil

    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True, cwd=cwd)
        returncode: int | None = None
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also after a normal exit: whatever is left in its group would hold the GPU for the next case
            kill_groups(process, psutil)
    return Finished(returncode, time.monotonic() - started)


def kill_groups(process: subprocess.Popen, psutil) -> None:
    descendants = []
    with contextlib.suppress(psutil.Error):
        descendants = psutil.Process(process.pid).children(recursive=True)
    groups = {process.pid}
    for child in descendants:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(child.pid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        if wait_until_dead(process, descendants, KILL_GRACE_S):
            break


def wait_until_dead(process: subprocess.Popen, descendants: list, timeout: float) -> bool:
    """Whether `process` (reaped here) and every one of `descendants` (psutil processes; a zombie counts as dead:
    its parent, or init, collects it) ended within `timeout`."""
    import psutil

    def dead(descendant) -> bool:
        try:
            return descendant.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None and all(dead(descendant) for descendant in descendants):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def failure(log_path: Path, finished: Finished, timeout: float) -> str:
    if finished.returncode is None:
        return f"killed after {timeout:.0f} s (process group and ranks); log {log_path}"
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return f"exit {finished.returncode}: {lines[-1][:160] if lines else 'no output'}; log {log_path}"


def in_scratch(work: Callable[[Path], None]) -> int | None:
    """work(a temporary directory) with SIGTERM and SIGINT ending it: the running case killed whole (in
    run_killing_group, on the way out), the directory removed. The signal's number if one ended it, else None."""
    with stopping_on_signals():
        try:
            with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
                work(Path(scratch))
        except Stopped as stop:
            return stop.signum
    return None
