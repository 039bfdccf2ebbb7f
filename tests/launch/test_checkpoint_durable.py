"""Checkpoints that survive a crashed machine, and saves that do not stall training.

Every file and directory of a checkpoint is fsynced by every rank before rank 0 renames it and writes its
marker (seen through an os.fsync hook in every process); a checkpoint that lost a shard is skipped by `auto`
and refused by path and by the exporter; asynchronous saves killed with -9 mid-write or stopped by SIGTERM
leave complete checkpoints that resume to the uninterrupted run's losses, bit for bit; --save_only_model
writes the model alone, which exports and cannot resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

import tests.conftest as harness
from shardtune.checkpoint.markers import MARKER, damage
from shardtune.checkpoint.pending import WRITE_DELAY_ENV
from shardtune.checkpoint.preemption import PREEMPTED_EXIT_CODE
from shardtune.cli import main
from shardtune.config import Recipe
from tests.conftest import REFERENCE_ARGS, REPO, run_recipe, start_recipe, train_losses
from tests.launch.test_checkpoint import export

# Imported by every Python process of a run (PYTHONPATH): logs each os.fsync (with the path of its file
# descriptor), os.rename and shutil.rmtree, with the system-wide monotonic clock, to <log>.<rank>.<pid>.
FSYNC_HOOK = '''
import functools, os, shutil, time

_LOG = os.environ.get("SHARDTUNE_FSYNC_LOG")


def _record(kind, *paths):
    with open(f"{_LOG}.{os.environ.get('RANK', 'launcher')}.{os.getpid()}", "a") as log:
        log.write(" ".join([str(time.monotonic_ns()), kind, *paths]) + "\\n")


def _hook(name, module, kind, paths):
    original = getattr(module, name)

    @functools.wraps(original)
    def hooked(*args, **kwargs):
        if kind == "rmtree":
            _record(kind, *paths(args))
        result = original(*args, **kwargs)
        if kind != "rmtree":
            _record(kind, *paths(args))
        return result

    setattr(module, name, hooked)


if _LOG:
    _hook("fsync", os, "fsync", lambda args: [os.readlink(f"/proc/self/fd/{args[0]}")])
    _hook("rename", os, "rename", lambda args: [os.path.abspath(args[0]), os.path.abspath(args[1])])
    _hook("rmtree", shutil, "rmtree", lambda args: [os.path.abspath(args[0])])
'''
DELAY_S = "2"  # the background write of each save waits this long: a kill or a signal lands inside it
ASYNC = ("--async_save", "true")


@pytest.fixture
def fsync_log(tmp_path, monkeypatch) -> Path:
    """Every process the test launches logs its fsyncs, renames and deletions under tmp_path/fsync-log."""
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(FSYNC_HOOK)
    log = tmp_path / "fsync-log"
    path = os.pathsep.join(filter(None, [str(hook_dir), harness.ENV.get("PYTHONPATH")]))
    monkeypatch.setitem(harness.ENV, "PYTHONPATH", path)
    monkeypatch.setitem(harness.ENV, "SHARDTUNE_FSYNC_LOG", str(log))
    return log


# Files that one rank writes, by its rank in their names (every other file is the main process's).
RANK_FILES = re.compile(r"random_states_(\d+)\.pkl$|/__(\d+)_\d+\.distcp$|/zero_pp_rank_(\d+)_")


def read_events(log: Path) -> list[tuple[int, str, str, list[str]]]:
    """(time ns, rank, kind, paths), in time order, from every process's log."""
    events = []
    for file in log.parent.glob(f"{log.name}.*"):
        rank = file.name.split(".")[-2]
        for line in file.read_text().splitlines():
            stamp, kind, *paths = line.split(" ")
            events.append((int(stamp), rank, kind, paths))
    return sorted(events)


def writer(name: str) -> str:
    match = RANK_FILES.search("/" + name)
    return next(group for group in match.groups() if group is not None) if match else "0"


def assert_durable_before_marked(output_dir: Path, log: Path, ranks: int = 2, steps: list[int] | None = None) -> int:
    """For each checkpoint now in output_dir (of `steps` only if given), in the save that produced it: every
    file its marker lists fsynced by the rank that wrote it, and every directory by every rank, before the
    rename that precedes the marker; the rename made durable (output_dir fsynced) before the marker appears;
    the marker fsynced; and no complete checkpoint deleted before a newer one was marked. Returns the number of
    checkpoints checked."""
    events = read_events(log)
    output_dir = output_dir.resolve()
    marked = {}  # checkpoint path -> times its marker appeared
    for stamp, _, kind, paths in events:
        if kind == "rename" and paths[1].endswith(f"/{MARKER}"):
            marked.setdefault(str(Path(paths[1]).parent), []).append(stamp)
    checkpoints = sorted(path for path in output_dir.glob("checkpoint-*") if (path / MARKER).exists()
                         and (steps is None or int(path.name.split("-")[1]) in steps))
    assert checkpoints, f"no complete checkpoint in {output_dir}"
    for checkpoint in checkpoints:
        scratch = str(output_dir / f".{checkpoint.name}.tmp")
        marker_at = marked[str(checkpoint)][-1]
        renamed_at = max(stamp for stamp, _, kind, paths in events if kind == "rename"
                         and paths == [scratch, str(checkpoint)] and stamp < marker_at)
        began_at = max(stamp for stamp, _, kind, paths in events if kind == "rmtree"
                       and paths == [scratch] and stamp < renamed_at)  # rank 0 clears the scratch at each start
        synced = defaultdict(set)  # path -> ranks that fsynced it during this save, before the rename
        for stamp, rank, kind, paths in events:
            if kind == "fsync" and began_at < stamp < renamed_at and paths[0].startswith(scratch):
                synced[paths[0]].add(rank)
        every_rank = {str(rank) for rank in range(ranks)}
        listed = json.loads((checkpoint / MARKER).read_text())["files"]
        on_disk = {str(path.relative_to(checkpoint)) for path in checkpoint.rglob("*") if path.is_file()} - {MARKER}
        assert set(listed) == on_disk, f"{checkpoint.name}: the marker lists {sorted(set(listed) ^ on_disk)} wrongly"
        assert len({writer(name) for name in listed}) == ranks  # each rank wrote files of its own
        for name in listed:
            assert writer(name) in synced[os.path.join(scratch, name)], f"{checkpoint.name}/{name} not fsynced by " \
                f"rank {writer(name)}, which wrote it, before its marker (by {synced[os.path.join(scratch, name)]})"
        for directory in [checkpoint, *(path for path in checkpoint.rglob("*") if path.is_dir())]:
            path = os.path.normpath(os.path.join(scratch, directory.relative_to(checkpoint)))
            assert synced[path] == every_rank, f"{directory} fsynced before its marker by ranks {synced[path]}"
        assert any(kind == "fsync" and paths == [str(output_dir)] and renamed_at < stamp < marker_at
                   for stamp, _, kind, paths in events), f"{checkpoint.name}: rename not made durable before marking"
        assert any(kind == "fsync" and paths == [str(checkpoint / MARKER) + ".tmp"] and stamp < marker_at
                   for stamp, _, kind, paths in events), f"{checkpoint.name}: marker not fsynced"
        assert damage(str(checkpoint)) is None
    for stamp, _, kind, paths in events:
        if kind == "rmtree" and any(at < stamp for at in marked.get(paths[0], [])):  # a complete one deleted
            step = int(paths[0].rsplit("-", 1)[1])
            newer = [at for path, times in marked.items() for at in times if int(path.rsplit("-", 1)[1]) > step]
            assert any(at < stamp for at in newer), f"{paths[0]} deleted before a newer checkpoint was marked"
    return len(checkpoints)


def wait_until(condition, process: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"run ended (exit {process.returncode}) before {what}"
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"no {what} within {timeout}s")


def crash(process: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank at once, as a machine that dies takes them (the launcher starts each
    rank in a session of its own: killing its process group alone leaves the ranks running)."""
    processes = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for each in processes:
        each.kill()
    psutil.wait_procs(processes, timeout=30)
    process.wait()


def complete(path: Path) -> bool:
    return (path / MARKER).is_file()


# The sharded writers; DDP's rank-0 writer goes through the same staging and marker (test_sigterm_... below is
# ZeRO-3; tests/launch/test_checkpoint.py kills DDP during a synchronous run).
@pytest.mark.parametrize("config", ["fsdp_full_shard", "ds_zero3"])
def test_kill_during_async_save_resumes_uninterrupted(config, reference_run, tiny_assets, tmp_path, fsync_log,
                                                      monkeypatch):
    """kill -9 while checkpoint-4 is being written in the background (training went on meanwhile): auto takes
    checkpoint-2, which had been written while steps 3 and 4 trained, and the losses are the uninterrupted
    run's, bit for bit. Every checkpoint left was durable before it was marked."""
    reference = reference_run(config)
    killed = tmp_path / "killed"
    args = (*REFERENCE_ARGS, "--save_total_limit", "2", *ASYNC)
    monkeypatch.setitem(harness.ENV, WRITE_DELAY_ENV, DELAY_S)
    process = start_recipe(killed, tiny_assets, *args, config=config, processes=2)
    wait_until(lambda: complete(killed / "checkpoint-2") and (killed / ".checkpoint-4.tmp").is_dir(), process,
               "checkpoint-2 complete with checkpoint-4 in flight")
    crash(process)
    assert not (killed / "checkpoint-4").exists() and (killed / ".checkpoint-4.tmp").is_dir()
    monkeypatch.delitem(harness.ENV, WRITE_DELAY_ENV)

    result = run_recipe(killed, tiny_assets, *args, "--resume_from_checkpoint", "auto", config=config, processes=2)
    assert f"resumed from {killed}/checkpoint-2 at step 2" in result.stdout, result.stdout[-3000:]
    assert train_losses(killed) == train_losses(reference)  # bitwise
    assert sorted(path.name for path in killed.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    assert assert_durable_before_marked(killed, fsync_log) == 2


def test_sigterm_during_async_save_ends_durable(tiny_assets, tmp_path, fsync_log, monkeypatch):
    """SIGTERM to every rank of a ZeRO-3 `accelerate launch` (as SLURM signals every task of a job step) while a
    save is in flight: the ranks finish it, save the stop step, wait until that one is durable and marked, and exit
    75 (one process's synchronous stop: tests/launch/test_checkpoint.py)."""
    output_dir = tmp_path / "out"
    monkeypatch.setitem(harness.ENV, WRITE_DELAY_ENV, DELAY_S)
    process = start_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, "--max_steps", "500", *ASYNC,
                           config="ds_zero3", processes=2)
    wait_until(lambda: (output_dir / ".checkpoint-2.tmp").is_dir() and not complete(output_dir / "checkpoint-2"),
               process, "checkpoint-2 in flight")
    for rank in [child for child in psutil.Process(process.pid).children(recursive=True)
                 if "tiny.py" in " ".join(child.cmdline())]:
        rank.send_signal(signal.SIGTERM)
    process.wait(timeout=180)
    log = (tmp_path / "out.log").read_text()
    assert f"exitcode: {PREEMPTED_EXIT_CODE}" in log or process.returncode == PREEMPTED_EXIT_CODE, log[-3000:]
    stop_step = max(row["step"] for row in harness.read_metrics(output_dir))
    assert json.loads((output_dir / f"checkpoint-{stop_step}" / MARKER).read_text())["step"] == stop_step
    assert complete(output_dir / "checkpoint-2") and stop_step > 2
    assert assert_durable_before_marked(output_dir, fsync_log) == 2


def test_damaged_checkpoints_are_skipped(reference_run, tiny_assets, tmp_path, fsync_log, capsys, monkeypatch):
    """A shard cut short in checkpoint-8 and one deleted from checkpoint-6: `auto` names each in one warning
    line and resumes from checkpoint-4 to the uninterrupted run's losses; the damaged one by path, and its
    export, are refused with one line. The synchronous saves of the resumed run are durable before marked."""
    reference = reference_run("fsdp_full_shard")
    damaged = tmp_path / "damaged"
    shutil.copytree(reference, damaged)
    shard = damaged / "checkpoint-8" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    (damaged / "checkpoint-6" / "optimizer_0" / "__0_0.distcp").unlink()

    refusal = refuse(tiny_assets, tmp_path, capsys, monkeypatch, "--output_dir", str(damaged),
                     "--resume_from_checkpoint", str(damaged / "checkpoint-8"))
    assert "checkpoint-8' is damaged: pytorch_model_fsdp_0/__1_0.distcp has" in refusal, refusal
    export = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(damaged / "checkpoint-6"),
                             str(tmp_path / "exported")], env=harness.ENV, capture_output=True, text=True)
    assert export.returncode != 0 and "optimizer_0/__0_0.distcp is missing" in export.stderr, export.stderr
    assert not (tmp_path / "exported").exists()

    result = run_recipe(damaged, tiny_assets, *REFERENCE_ARGS, "--resume_from_checkpoint", "auto",
                        config="fsdp_full_shard", processes=2)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("shardtune: warning:")]
    assert len(warnings) == 2, result.stderr[-3000:]
    assert "checkpoint-8 is damaged: pytorch_model_fsdp_0/__1_0.distcp has" in warnings[0]
    assert "checkpoint-6 is damaged: optimizer_0/__0_0.distcp is missing" in warnings[1]
    assert f"resumed from {damaged}/checkpoint-4 at step 4" in result.stdout
    assert train_losses(damaged) == train_losses(reference)  # bitwise
    assert assert_durable_before_marked(damaged, fsync_log, steps=[6, 8]) == 2  # saved again by this run


def test_export_is_durable_before_it_appears(reference_run, tmp_path, fsync_log):
    exported = tmp_path / "exported"
    subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"),
                    str(reference_run("fsdp_full_shard") / "checkpoint-8"), str(exported)],
                   check=True, env=harness.ENV, capture_output=True)
    events = read_events(fsync_log)
    scratch = str(exported.resolve().with_name(".exported.tmp"))
    (renamed_at,) = [stamp for stamp, _, kind, paths in events if kind == "rename" and paths[0] == scratch]
    synced = {paths[0] for stamp, _, kind, paths in events if kind == "fsync" and stamp < renamed_at}
    files = [path for path in exported.rglob("*") if path.is_file()]
    assert len(files) >= 3  # model, config, tokenizer
    for path in [exported, *files]:
        assert os.path.normpath(os.path.join(scratch, path.relative_to(exported))) in synced, path
    assert any(kind == "fsync" and paths == [str(tmp_path.resolve())] and stamp > renamed_at
               for stamp, _, kind, paths in events), "the rename of the export was not made durable"


@pytest.mark.parametrize("config", ["ds_zero3"])  # the gathered 16-bit model; FSDP's model shards export as above
def test_save_only_model(config, tiny_assets, tmp_path, capsys, monkeypatch):
    """Model-only checkpoints (gathered from ZeRO-3 partitions, or FSDP's model shards) hold no optimizer
    state, export to the trained model exactly, and are refused for resuming, as is `auto` with the flag."""
    output_dir = tmp_path / "out"
    run_recipe(output_dir, tiny_assets, *REFERENCE_ARGS, "--max_steps", "4", "--save_only_model", "true", *ASYNC,
               config=config, processes=2)
    checkpoint = output_dir / "checkpoint-4"
    marker = json.loads((checkpoint / MARKER).read_text())
    assert marker["model_only"] and not [name for name in marker["files"] if "optim" in name or "random" in name]
    export(checkpoint, tmp_path / "exp")
    final = AutoModelForCausalLM.from_pretrained(output_dir, dtype=torch.float32).state_dict()
    for key, tensor in AutoModelForCausalLM.from_pretrained(tmp_path / "exp", dtype=torch.float32).state_dict().items():
        assert torch.equal(tensor, final[key]), key

    refusal = refuse(tiny_assets, tmp_path, capsys, monkeypatch, "--output_dir", str(output_dir),
                     "--resume_from_checkpoint", str(checkpoint))
    assert "was saved with --save_only_model true: it holds no optimizer state" in refusal
    refusal = refuse(tiny_assets, tmp_path, capsys, monkeypatch, "--output_dir", str(output_dir),
                     "--resume_from_checkpoint", "auto", "--save_only_model", "true")
    assert "--save_only_model true writes checkpoints without optimizer states" in refusal


def refuse(tiny_assets, tmp_path, capsys, monkeypatch, *args: str) -> str:
    """Run the recipe entry point in this process (as one process, with no launch environment) and return the
    one error line it must stop with, exit code 2."""
    for name in [*os.environ]:
        if name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or name.startswith(
                ("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)
    model_dir, data_file = tiny_assets
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(Recipe(name="tiny", max_seq_length=64, per_device_train_batch_size=16, global_batch_size=32),
             ["--model_name_or_path", model_dir, "--dataset", data_file, "--report_to", "none", "--use_cpu", "true",
              *args])
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("shardtune: error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and "Traceback" not in stderr, stderr[-2000:]
    return errors[0]




