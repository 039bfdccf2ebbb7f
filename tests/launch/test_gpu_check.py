"""`make gpu-check` without a GPU: one line saying so and exit code 2, before anything is built. Its runner kills an
overrunning launch whole (the launcher's process group and the ranks torchrun starts in sessions of their own), and
the case becomes a FAILED row of the table; SIGTERM or SIGINT to the check does the same to the running case and
removes the temporary files. (On a GPU it trains a 1.2B model in ten cases; that run is what its closing table
reports.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import CONFIGS, ENV, REPO, free_port, load_script, popen


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


def test_gpu_check_refuses_without_cuda(tmp_path):
    """As `make gpu-check` runs it, a subset of cases and a results file included: one line, nothing written."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--cases",
                             "ddp-padded-x1,ds_zero3-packed-x1", "--out", str(tmp_path / "results.jsonl")],
                            capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_check: error: no CUDA device is visible; run `make gpu-check` on a GPU machine."]
    assert not (tmp_path / "results.jsonl").exists()


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


# gpu_check's own way out of a signal: a scratch directory with a file in it (the model, in a real run), a hanging
# case in it; exits 128 + the signal, as gpu_check does.
STOPPED = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[3])
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)
pids = sys.argv[1]

def work(root):
    (root / "model.safetensors").write_text("weights")
    gpu_check.run_killing_group([sys.executable, "-c", sys.argv[2], pids], 600, root / "case.log", dict(os.environ))

stopped = gpu_check.in_scratch(work)
sys.exit(128 + stopped if stopped else 0)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_running_case_whole_and_removes_the_temporary_files(sig, tmp_path):
    (tmp_path / "pids").mkdir()
    (tmp_path / "tmp").mkdir()
    check = popen([sys.executable, "-c", STOPPED, str(tmp_path / "pids"), HANGING,
                   str(REPO / "scripts" / "gpu_check.py")], cwd=REPO,
                  env={**ENV, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(REPO)},
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = wait_for_pids(tmp_path / "pids", 3, 60)
    assert len(pids) == 3 and list((tmp_path / "tmp").iterdir()), "the case did not start"
    check.send_signal(sig)
    _, stderr = check.communicate(timeout=2 * 10 + 20)
    assert check.returncode == 128 + sig, stderr[-3000:]
    assert all(gone(pid) for pid in pids), [psutil.Process(pid).cmdline() for pid in pids if not gone(pid)]
    assert list((tmp_path / "tmp").iterdir()) == []


# What the check's processes import that the GPU machine lacks: the trainer (datasets through shardtune.data.loading),
# DeepSpeed (ZeRO-3 cases), torchao (the levers, fp8) and Liger's kernels; accelerate's launcher as gpu_check runs it.
CHECK_IMPORTS = ("import shardtune.trainer, shardtune.gpu_check.figures, deepspeed, datasets, torchao.float8, "
                 "torchao.optim, liger_kernel.transformers, accelerate.commands.launch; "
                 "from deepspeed.runtime.engine import DeepSpeedEngine; print('imported')")


def device_site(root: Path) -> Path:
    """A folder holding what the GPU machine has installed, taken from this virtualenv: the distributions of
    scripts/device_packages.txt installed here and what they require here (this virtualenv's versions may need
    more than the device's: huggingface-hub 2.5 its httpx2), never a carried one, linked file by top-level entry.
    (`make device-rehearsal` installs the device's own versions instead.)"""
    import importlib.metadata
    import json

    from packaging.requirements import Requirement

    wheels = load_script("gpu_wheels")
    carried = set(json.loads(wheels.SET_RECORD.read_text())["wheels"])
    site = root / "device-site"
    site.mkdir()
    todo, seen = [name for name in wheels.read_device_packages() if name not in carried], set()
    while todo:
        name = wheels.normalized(todo.pop())
        if name in seen or name in carried:
            continue
        seen.add(name)
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [Requirement(line).name for line in distribution.requires or []
                 if Requirement(line).marker is None or Requirement(line).marker.evaluate({"extra": ""})]
        base = Path(distribution.locate_file(""))
        for entry in {Path(str(file)).parts[0] for file in distribution.files or []}:
            if (base / entry).exists() and not (site / entry).exists() and entry not in ("..", "__pycache__"):
                (site / entry).symlink_to(base / entry)
    return site


def test_the_wheel_set_installs_alone_and_imports_what_the_check_imports(tmp_path):
    """`make gpu-wheels`'s .whl/ (or the folder SHARDTUNE_GPU_WHEELS names) for this Python: a clean virtualenv
    that has only the GPU machine's packages installs it with --no-index --no-deps, as the device command does, and
    imports what the check imports; the set is under its size limit. Skips where no set for this Python was built
    (it is downloaded: `python scripts/gpu_wheels.py --dest DIR --python_version 3.11` here)."""
    import json
    import os

    wheels_dir = Path(os.environ.get("SHARDTUNE_GPU_WHEELS", REPO / ".whl"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    manifest = wheels_dir / "manifest.json"
    if not manifest.is_file() or json.loads(manifest.read_text())["python_version"] != version:
        pytest.skip(f"no wheel set for Python {version} in {wheels_dir} (scripts/gpu_wheels.py builds one)")
    gpu_wheels = load_script("gpu_wheels")
    files = sorted(wheels_dir.glob("*.whl"))
    assert sum(path.stat().st_size for path in files) <= gpu_wheels.WHEELS_LIMIT_MIB * 2**20
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "clean")], check=True)
    target = tmp_path / "target"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                              str(target), *map(str, files)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(target), str(device_site(tmp_path)), str(REPO)])}
    result = subprocess.run([str(tmp_path / "clean" / "bin" / "python"), "-c", CHECK_IMPORTS], capture_output=True,
                            text=True, env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "imported", result.stderr[-3000:]


# gpu_check's reporting as run_cases and main drive it: a case that ended (its row appended, the table and the
# archive rewritten), then a hanging case writing its log; `timeout` sends SIGTERM, as the device command's does.
REPORTED = """
import argparse, importlib.util, os, sys
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[3])
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)
out, logs, pids = sys.argv[1], sys.argv[4], sys.argv[5]
args = argparse.Namespace(out=f"{out}/results.jsonl", table=f"{out}/table.txt", archive=f"{out}/logs.tar.gz",
                          log_dir=logs)
reporter, rows = gpu_check.Reporter(args), []

def work(root):
    open(f"{logs}/ddp-padded-x1.log", "w").write("trained\\n")
    rows.append({"case": "ddp padded x1", "error": "exit 1: boom"})
    reporter.append(rows[-1])
    reporter.write(rows, [])
    open(f"{logs}/hanging.log", "w").write("step 1\\n")
    gpu_check.run_killing_group([sys.executable, "-c", sys.argv[2], pids], 600, root / "x.log", dict(os.environ))

stopped = gpu_check.in_scratch(work)
reporter.write(rows, [])
sys.exit(128 + stopped if stopped else 0)
"""


def test_a_killed_check_leaves_its_three_files(tmp_path):
    """Under `timeout`, as on the device: the rows of the cases that ended, the table and the logs' archive (the
    killed case's partial log in it) are in the output folder, and nothing else; the case's processes are gone."""
    import json
    import tarfile

    out, logs, pids = tmp_path / "out", tmp_path / "logs", tmp_path / "pids"
    for folder in (out, logs, pids):
        folder.mkdir()
    started = time.monotonic()
    result = subprocess.run(["timeout", "-k", "30", "8", sys.executable, "-c", REPORTED, str(out), HANGING,
                             str(REPO / "scripts" / "gpu_check.py"), str(logs), str(pids)], cwd=REPO,
                            env={**ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 124, result.stderr[-3000:]  # timeout's own code once it sent SIGTERM
    assert time.monotonic() - started < 8 + 2 * 10 + 10  # ended on SIGTERM, not on the SIGKILL 30 s later
    pid_values = [int(path.read_text()) for path in pids.glob("*.pid")]
    assert len(pid_values) == 3 and all(gone(pid) for pid in pid_values)
    assert sorted(path.name for path in out.iterdir()) == ["logs.tar.gz", "results.jsonl", "table.txt"]
    assert [json.loads(line)["case"] for line in (out / "results.jsonl").read_text().splitlines()] == [
        "ddp padded x1"]
    assert "ddp padded x1                      FAILED: exit 1: boom" in (out / "table.txt").read_text()
    with tarfile.open(out / "logs.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["gpu-check/ddp-padded-x1.log", "gpu-check/hanging.log"]
        assert archive.extractfile("gpu-check/hanging.log").read() == b"step 1\n"
