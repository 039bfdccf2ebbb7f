"""scripts/slurm/train.sbatch under a real SLURM started here: munged, slurmctld and two slurmd on this machine
(`slurmd -N`), so one job spans two nodes. The job (`--nodes 1-2`: 2 nodes x 1 rank while both are free) is signalled
as `#SBATCH --signal=TERM@600` signals it before its time limit: it saves a checkpoint and requeues itself; one node is
lost meanwhile (drained), so the requeued attempt gets 1 node, is planned on it, resumes there on 1 process and
finishes with the per-step losses of the 1 machine x 2 processes reference run (bit for bit up to the stop, within
1e-5 after it: the same global batches, reduced over 1 rank)."""

from __future__ import annotations

import os
import pwd
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    CONFIGS,
    ENV,
    REFERENCE_ARGS,
    REPO,
    TINY_RECIPE,
    free_port,
    read_metrics,
    recipe_command,
    skip_unless_required,
    train_losses,
)

SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
CONFIG = "fsdp_full_shard"
SEARCH_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
BINARIES = {name: shutil.which(name, path=SEARCH_PATH)
            for name in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue", "sinfo")}
MISSING = [name for name, path in BINARIES.items() if path is None]
RESIZED_TOLERANCE = 1e-5  # the same global batches on 1 rank instead of 2: rounding only
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE"}



@pytest.fixture(scope="module", autouse=True)
def slurm_installed() -> None:
    """Skips without SLURM; fails instead under `make test` and CI (SHARDTUNE_REQUIRE=slurm)."""
    if MISSING:
        skip_unless_required("slurm", f"SLURM is not installed (no {', '.join(MISSING)}): apt-get install slurm-wlm "
                                      "munge, which `make test` does")


class Slurm:
    """A one-machine cluster: its config file, the environment that points the SLURM commands at it, its logs."""

    def __init__(self, root: Path, head: str) -> None:
        self.root, self.head = root, head
        self.env = {key: value for key, value in ENV.items()
                    if not key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}  # not a job's own settings
        self.env["SLURM_CONF"] = str(root / "slurm.conf")

    def run(self, *args: str, **options) -> str:
        result = subprocess.run([BINARIES.get(args[0]) or args[0], *args[1:]], env=options.pop("env", self.env),
                                capture_output=True, text=True, timeout=60, **options)
        assert result.returncode == 0, f"{' '.join(args)}: exit {result.returncode}\n{result.stderr}"
        return result.stdout

    def job(self, job_id: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "-o", "show", "job", job_id)))

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
                         for path in sorted(self.root.glob("*.log")))


def slurm_conf(root: Path, head: str, nodes: dict[str, int], controller_port: int) -> str:
    user = pwd.getpwuid(os.getuid()).pw_name
    lines = [
        "ClusterName=shardtune-test",
        f"SlurmctldHost={head}(127.0.0.1)",
        f"SlurmctldPort={controller_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # A requeued job may start again once its credential has expired: 5 s instead of 120 s.
        f"AuthInfo=socket={root}/munge.socket,cred_expire=5",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool-%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",  # no cgroups needed
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/linear",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",  # start the requeued job as soon as it is eligible, not within 60 s
        "SlurmdParameters=config_overrides",  # two nodes share this machine's CPUs
        "ReturnToService=2",
        "KillWait=5",
        "MinJobAge=600",  # finished jobs stay visible to scontrol (there is no accounting database)
        f"FirstJobId={random.randint(1000, 900000)}",  # the script derives its rendezvous port from the job id
    ]
    for name, port in nodes.items():
        lines.append(f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={port} CPUs={os.cpu_count()} "
                     "RealMemory=1000 State=UNKNOWN")
    lines.append("PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    # The first node is this machine by name, so that the script's rendezvous host (the job's first node)
    # resolves; the second runs on it too, under another name.
    head = socket.gethostname().split(".")[0]
    nodes = {head: free_port(), f"{head}-b": free_port()}
    (root / "state").mkdir()
    for name in nodes:
        (root / f"spool-{name}").mkdir()
    (root / "slurm.conf").write_text(slurm_conf(root, head, nodes, free_port()))
    key = root / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    cluster = Slurm(root, head)
    daemons: list[subprocess.Popen] = []

    def start(*command: str) -> None:
        with open(root / "daemons.log", "a") as log:
            daemons.append(subprocess.Popen([BINARIES[command[0]], *command[1:]], env=cluster.env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    try:
        # --force: munged otherwise refuses a socket in a directory that others cannot enter (pytest's 0700).
        start("munged", "--foreground", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
              f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed")
        deadline = time.monotonic() + 10
        while not (root / "munge.socket").exists():
            assert time.monotonic() < deadline and daemons[0].poll() is None, cluster.logs()
            time.sleep(0.1)
        start("slurmctld", "-D", "-i")
        for name in nodes:
            start("slurmd", "-D", "-N", name)
        deadline = time.monotonic() + 60
        while subprocess.run([BINARIES["sinfo"], "-h", "-N", "-o", "%T"], env=cluster.env, capture_output=True,
                             text=True).stdout.split() != ["idle"] * len(nodes):  # fails until slurmctld listens
            assert time.monotonic() < deadline, "nodes not idle within 60 s\n" + cluster.logs()
            time.sleep(0.5)
        yield cluster
    finally:
        try:
            jobs = cluster.run("squeue", "-h", "-o", "%i").split() if len(daemons) > 1 else []
            if jobs:
                cluster.run("scancel", *jobs)
                deadline = time.monotonic() + 30
                while cluster.run("squeue", "-h", "-o", "%i").split() and time.monotonic() < deadline:
                    time.sleep(0.5)
        finally:
            for daemon in reversed(daemons):
                daemon.terminate()
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()


def wait_for(condition, timeout: float, message) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message()
        time.sleep(0.3)


def logged_step(output_dir: Path) -> int:
    try:
        return max((row["step"] for row in read_metrics(output_dir)), default=0)
    except (OSError, ValueError):  # not written yet, or a line half-written
        return 0


def test_two_node_job_checkpoints_requeues_and_resumes(slurm, reference_run, tiny_assets, tmp_path):
    reference = reference_run(CONFIG)
    (tmp_path / "logs").mkdir()  # the submit directory, laid out like the repository root
    output_dir = tmp_path / "out"
    recipe_flags = recipe_command(output_dir, tiny_assets, *REFERENCE_ARGS)[2:]  # REFERENCE_ARGS and the tiny data
    started = time.monotonic()
    env = {**slurm.env, "PATH": f"{Path(sys.executable).parent}:{slurm.env['PATH']}",
           "SHARDTUNE_PROCS_PER_NODE": "1", "SHARDTUNE_GPU": "80gb"}  # planned for GPUs of 80 GB
    job_id = slurm.run("sbatch", "--parsable", "--nodes", "1-2", "--partition", "batch", "--account", "shardtune",
                       "--time", "30:00", "--gpus-per-node", "0",  # this cluster has no GPUs: ranks use gloo on CPU
                       str(SCRIPT), str(TINY_RECIPE), str(CONFIGS / f"{CONFIG}.yaml"), *recipe_flags,
                       cwd=tmp_path, env=env).strip()
    batch_log = tmp_path / "logs" / f"shardtune-{job_id}.out"

    def node_log(attempt: int, node: int) -> Path:
        return tmp_path / "logs" / f"shardtune-{job_id}-attempt{attempt}-node{node}.log"

    def report() -> str:
        texts = [f"job: {slurm.job(job_id)}"] + [f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
                                                 for path in sorted((tmp_path / "logs").glob("*"))]
        return "\n".join(texts) + "\n" + slurm.logs()

    # What `#SBATCH --signal=TERM@600` does before the time limit: SIGTERM to every process of the job's steps
    # (every launcher and rank), not to the batch shell.
    wait_for(lambda: logged_step(output_dir) >= 2 or slurm.job(job_id)["JobState"] in FINAL_STATES, 240, report)
    assert slurm.job(job_id)["JobState"] == "RUNNING", report()
    slurm.run("scancel", "--signal=TERM", job_id)
    # The second node is lost meanwhile: its job ends, and the requeued attempt can get the first alone.
    slurm.run("scontrol", "update", f"NodeName={slurm.head}-b", "State=DRAIN", "Reason=lost")
    signalled = time.monotonic() - started
    wait_for(lambda: slurm.job(job_id)["JobState"] in FINAL_STATES, 300, report)
    print(f"slurm job: signalled {signalled:.0f} s after submission, done after {time.monotonic() - started:.0f} s")

    job = slurm.job(job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"], job["NumNodes"]) == ("COMPLETED", "0:0", "1", "1"), \
        report()
    port = 10000 + int(job_id) % 20000
    batch = batch_log.read_text()
    # fsdp_full_shard steps the optimizer on the GPU: one OpenMP thread per rank.
    assert f"job {job_id} attempt 0: 2 nodes x 1, rendezvous {slurm.head}:{port}, OMP_NUM_THREADS=1 per rank" \
        in batch, batch
    assert f"requeueing job {job_id}" in batch and f"job {job_id} attempt 1: 1 nodes x 1," in batch, batch
    # Each attempt planned on the nodes it got before it launched.
    for attempt, nodes in ((0, 2), (1, 1)):
        planning = batch.index(f"job {job_id} attempt {attempt}: planning {TINY_RECIPE} on {nodes}x1x80gb")
        assert f"on {nodes}x1x80gb ({nodes} GPUs) with fsdp_full_shard" in batch[planning:], batch
        assert "-> fits" in batch[planning:], batch

    # Attempt 0: both nodes' ranks stopped at the same step boundary, after saving a complete checkpoint there.
    stops = {re.search(r"checkpoint at step (\d+) saved, exiting with code 75", node_log(0, node).read_text())
             for node in (0, 1)}
    assert None not in stops, report()
    (stop_step,) = {int(match.group(1)) for match in stops}
    assert 2 <= stop_step < 8
    assert (output_dir / f"checkpoint-{stop_step}" / "checkpoint_complete.json").is_file()
    # Attempt 1: the one node resumed from it on its one process, the global batch kept, and trained to the end.
    log = node_log(1, 0).read_text()
    assert f"resumed from {output_dir}/checkpoint-{stop_step} at step {stop_step}" in log, log[-4000:]
    assert ("1 process where the checkpoint had 2: micro-batch 8 x 4 accumulation x 1 data ranks where it had "
            "micro-batch 8 x 2 accumulation x 2 data ranks") in log, log[-4000:]
    assert "FSDP2 FULL_SHARD |" in log and "= 8 x 4 accumulation x 1 ranks" in log and "first loss" in log, \
        log[-4000:]
    assert not node_log(1, 1).exists()

    assert [row["step"] for row in read_metrics(output_dir) if "loss" in row] == list(range(1, 9))
    losses, reference_losses = train_losses(output_dir), train_losses(reference)
    assert losses[:stop_step] == reference_losses[:stop_step]  # bitwise: 2 nodes x 1 rank, as 1 node x 2
    assert losses[stop_step:] == pytest.approx(reference_losses[stop_step:], rel=RESIZED_TOLERANCE,
                                               abs=RESIZED_TOLERANCE)
    assert (output_dir / "model.safetensors").is_file()
