"""`make gpu-check` without a GPU: one line saying so and exit code 2, before anything is built. Its runner kills an
overrunning launch whole (the launcher's process group and the ranks torchrun starts in sessions of their own), and
the case becomes a FAILED row of the table. (On a GPU it trains a 1.2B model in six configurations; that run is
what its closing table reports.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import CONFIGS, ENV, REPO, free_port, load_script


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, its status not yet collected
    except psutil.NoSuchProcess:
        return True


def wait_for_pids(folder: Path, count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("*.pid"))) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return [int(path.read_text()) for path in folder.glob("*.pid")]


def test_gpu_check_refuses_without_cuda():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py")], capture_output=True,
                            text=True, env=ENV, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_check: error: no CUDA device is visible; run `make gpu-check` on a GPU machine."]


# A launcher stand-in: one child in its own group, one in a session of its own (as torchrun starts ranks), then it
# hangs. Each writes its pid.
HANGING = """
import os, subprocess, sys, time
folder = sys.argv[1]
sleeper = [sys.executable, "-c",
           "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"]
subprocess.Popen(sleeper + [f"{folder}/same-group.pid"])
subprocess.Popen(sleeper + [f"{folder}/own-session.pid"], start_new_session=True)
open(f"{folder}/launcher.pid", "w").write(str(os.getpid()))
time.sleep(600)
"""


def test_a_hanging_case_is_killed_whole_and_becomes_a_failed_row(tmp_path, capsys):
    script = load_script("gpu_check")
    (tmp_path / "pids").mkdir()
    log = tmp_path / "case.log"
    started = time.monotonic()
    finished = script.run_killing_group([sys.executable, "-c", HANGING, str(tmp_path / "pids")], 8, log, ENV)
    assert finished.returncode is None and 8 <= finished.seconds < 8 + 2 * script.KILL_GRACE_S
    assert time.monotonic() - started < 30
    pids = wait_for_pids(tmp_path / "pids", 3, 0)
    assert len(pids) == 3, "the stand-in did not start its children within the timeout"
    assert all(gone(pid) for pid in pids), [psutil.Process(pid).cmdline() for pid in pids if not gone(pid)]
    row = {"case": "ddp padded x1", "error": script.failure(log, finished, 8)}
    script.print_table([row])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (f"ddp padded x1                      FAILED: killed after 8 s (process group and ranks); "
                        f"log {log}")
    assert script.failed_cases([row]) == ["ddp padded x1"]


RANK = """
import os, sys, time
open(os.path.join(sys.argv[1], os.environ["RANK"] + ".pid"), "w").write(str(os.getpid()))
time.sleep(600)
"""


def test_a_hanging_accelerate_launch_loses_its_ranks_too(tmp_path):
    """torchrun starts each rank in a session of its own: the ranks of a launch killed at its timeout are gone."""
    script = load_script("gpu_check")
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "pids").mkdir()
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(CONFIGS / "ddp.yaml"),
               "--num_processes", "2", "--main_process_port", str(free_port()), str(tmp_path / "rank.py"),
               str(tmp_path / "pids")]
    finished = script.run_killing_group(command, 20, tmp_path / "launch.log", ENV)
    assert finished.returncode is None, (tmp_path / "launch.log").read_text()[-3000:]
    pids = wait_for_pids(tmp_path / "pids", 2, 0)
    assert len(pids) == 2, (tmp_path / "launch.log").read_text()[-3000:]
    assert all(gone(pid) for pid in pids)
