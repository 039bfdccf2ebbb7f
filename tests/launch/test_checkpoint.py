"""Checkpoints survive anything: a rank killed or frozen at a fixed step (one inside an accumulation cycle) and
a resume give the uninterrupted run's losses, gradient norms and final weights bit for bit (DDP, FSDP, ZeRO-3,
ZeRO-3 with the sequence split); a crash during a save leaves the previous checkpoint in use; SIGTERM saves and
exits with the documented code; a non-finite loss stops without saving; exports equal the trained model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from accelerate.utils.other import TORCH_SAFE_GLOBALS
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardtune.checkpoint.output_dir import LOCK_FILE
from shardtune.checkpoint.preemption import FAULT_ENV, NON_FINITE_EXIT_CODE, PREEMPTED_EXIT_CODE
from shardtune.parallel.ranks import PEER_LOST_EXIT_CODE
from tests.conftest import (
    ENV,
    REFERENCE_ARGS,
    grad_norms,
    kill_tree,
    load_script,
    machine_log,
    read_metrics,
    run_recipe,
    start_machines,
    start_recipe,
    train_losses,
    wait_all,
    wait_for_ranks,
    wait_for_step,
)

ARGS = REFERENCE_ARGS


def weights(directory) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return {key: value.float() for key, value in model.state_dict().items()}


def deepspeed_globals(config: str) -> list:
    if not config.startswith("ds_"):
        return []
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [LossScaler, ZeroStageEnum]


def export(checkpoint, output) -> None:
    """scripts/export_hf.py's main, in this process (its command line is launched in
    tests/launch/test_checkpoint_durable.py)."""
    load_script("export_hf").main([str(checkpoint), str(output)])


# Faults land where the test says, through the trainer's fault hook (checkpoint.preemption.Fault): rank 1 signals
# itself right after the backward of a chosen micro-batch of a chosen step, the same place on every run. The
# reference runs accumulate 2 micro-batches per step: micro-batch 0 is inside an accumulation cycle, 1 ends it.
# DDP runs as one launcher of two processes: rank 1 dies mid-cycle, then the test kills every rank and the
# launcher, as a crashed machine ends them all. FSDP and ZeRO-3 run as two machines of one process each (two
# launchers on loopback): their losses, equal to the one-machine reference, show that multi-machine training is
# the same computation. Under ZeRO-3 rank 1 dies mid-cycle (SIGKILL): the survivor's next collective fails at
# once. Under FSDP rank 1 freezes (SIGSTOP, like a machine that hangs) at the end of a cycle: nothing fails, only
# the watchdog can stop the survivor. Either way machine 0 must name rank 1 and exit with code 4 within the rank
# timeout. Saves are synchronous every 2 steps, so the newest complete checkpoint is the last even step before
# the fault, and each run resumes from exactly there.
KILLS = {  # config: (machines, fault step, micro-batch, signal)
    "ddp": (1, 5, 0, "SIGKILL"),
    "fsdp_full_shard": (2, 3, 1, "SIGSTOP"),
    "ds_zero3": (2, 6, 0, "SIGKILL"),
    # Under the sequence split a step is 2 x 2 micro-batches of half-rows: the fault lands inside the cycle.
    "ds_zero3_ulysses": (1, 5, 2, "SIGKILL"),
}
RANK_TIMEOUT_S = 10


def launch(output_dir, tiny_assets, *args, config: str, machines: int, fault: str | None = None
           ) -> list[subprocess.Popen]:
    args = (*args, "--rank_timeout_s", str(RANK_TIMEOUT_S))
    env = {FAULT_ENV: fault} if fault else None
    if machines == 1:
        return [start_recipe(output_dir, tiny_assets, *args, config=config, processes=2, env=env)]
    return start_machines(output_dir, tiny_assets, *args, configs=[config] * machines,
                          machine_env=[env] * machines if env else None)


def wait_for_text(path, text: str, launchers: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if all(launcher.poll() is not None for launcher in launchers):
            break
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path.name}:\n{path.read_text(errors='replace')[-4000:]}")


@pytest.mark.parametrize("config", KILLS, ids=[f"{config}-{KILLS[config][0]}machines" for config in KILLS])
def test_kill_and_resume_equals_uninterrupted_run(config, reference_run, tiny_assets, tmp_path):
    machines, fault_step, micro_batch, sig = KILLS[config]
    resume_step = fault_step - 1 - (fault_step - 1) % 2  # the newest checkpoint before the fault (save_steps 2)
    reference = reference_run(config)

    killed = tmp_path / "killed"
    fault = f"rank=1,step={fault_step},micro_batch={micro_batch},signal={sig}"
    launchers = launch(killed, tiny_assets, *ARGS, config=config, machines=machines, fault=fault)
    ranks = wait_for_ranks(launchers[0], 2) if machines == 1 else []  # collected before the launcher dies
    rank_1_log = tmp_path / ("killed.log" if machines == 1 else "killed-machine1.log")
    wait_for_text(rank_1_log, f"rank 1 sends itself {sig} at step {fault_step}, micro-batch {micro_batch}",
                  launchers)
    if machines == 1:
        kill_tree(launchers[0], ranks)  # every rank, then the launcher
    else:
        (survivor_exit,) = wait_all(launchers[:1], timeout=120)
        survivor_log = machine_log(killed, 0)
        assert "rank 1 on machine 1 (" in survivor_log and "has not answered" in survivor_log, survivor_log[-4000:]
        assert f"exitcode: {PEER_LOST_EXIT_CODE}" in survivor_log, survivor_log[-4000:]
        print(f"{config}: rank 1 got {sig} at step {fault_step}; machine 0 exited {survivor_exit:.1f} s later "
              f"(rank timeout {RANK_TIMEOUT_S} s)")
        assert survivor_exit < RANK_TIMEOUT_S + 20
        kill_tree(launchers[1])  # a frozen machine is the scheduler's to end
    # The run stopped where the fault put it: nothing of the faulted step or after it was logged or saved.
    assert max(row["step"] for row in read_metrics(killed) if "loss" in row) == fault_step - 1
    assert not (killed / "model.safetensors").exists()
    assert not list(killed.glob(f"checkpoint-{fault_step + fault_step % 2}*"))

    resumed = launch(killed, tiny_assets, *ARGS, "--resume_from_checkpoint", "auto", config=config,
                     machines=machines)
    wait_all(resumed, timeout=600)
    log = machine_log(killed, 0) if machines > 1 else (tmp_path / "killed.log").read_text()
    assert [launcher.returncode for launcher in resumed] == [0] * machines, log[-4000:]
    if machines == 1:  # rank 0 was killed holding the directory's lock: the resume takes it over with a line
        assert "was held by a run that ended without closing" in log, log[-4000:]
    assert f"resumed from {killed}/checkpoint-{resume_step} at step {resume_step}" in log, log[-4000:]
    assert resume_step < 8

    assert [row["step"] for row in read_metrics(killed) if "loss" in row] == list(range(1, 9))
    assert train_losses(killed) == train_losses(reference), f"fault {fault}"  # bitwise
    assert grad_norms(killed) == grad_norms(reference), f"fault {fault}"
    ours, theirs = load_file(killed / "model.safetensors"), load_file(reference / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), f"{config}: {key} differs after the resume"

    # The export of the last checkpoint is the model the run saved, and loads with plain transformers.
    export(killed / "checkpoint-8", tmp_path / "exported")
    final = weights(killed)
    for key, tensor in weights(tmp_path / "exported").items():
        torch.testing.assert_close(tensor, final[key], rtol=0, atol=0, msg=key)
    if config == "ds_zero3":  # DeepSpeed's own converter on the same checkpoint gives the same weights
        subprocess.run([sys.executable, str(killed / "checkpoint-8" / "zero_to_fp32.py"), str(killed / "checkpoint-8"),
                        str(tmp_path / "zero_to_fp32"), "--safe_serialization", "--tag", "pytorch_model"],
                       check=True, env=ENV, capture_output=True)
        theirs = load_file(tmp_path / "zero_to_fp32" / "model.safetensors")
        for key, tensor in load_file(tmp_path / "exported" / "model.safetensors").items():
            assert torch.equal(theirs[key], tensor), key

    # Torch files in a checkpoint load without arbitrary unpickling. Allowed beyond tensors: numpy's array type
    # (accelerate's RNG states) and two plain DeepSpeed classes in its ZeRO files.
    torch_files = [path for path in (killed / "checkpoint-8").rglob("*") if path.suffix in (".bin", ".pt", ".pkl")]
    assert torch_files
    with torch.serialization.safe_globals([*TORCH_SAFE_GLOBALS, *deepspeed_globals(config)]):
        for path in torch_files:
            torch.load(path, weights_only=True)
    # A resume on another number of processes: tests/launch/test_resume_resized.py.


def test_crash_during_save_resumes_from_previous_checkpoint(reference_run, tiny_assets, tmp_path):
    reference = reference_run(None)
    crashed = tmp_path / "crashed"
    shutil.copytree(reference, crashed)
    # What a crash leaves: a save that never got renamed, and one renamed but never marked complete.
    os.rename(crashed / "checkpoint-8", crashed / ".checkpoint-8.tmp")
    os.remove(crashed / "checkpoint-6" / "checkpoint_complete.json")
    result = run_recipe(crashed, tiny_assets, *ARGS, "--resume_from_checkpoint", "auto")
    assert "resumed from" in result.stdout and "checkpoint-4 at step 4" in result.stdout
    assert train_losses(crashed) == train_losses(reference)
    assert grad_norms(crashed) == grad_norms(reference)
    assert (crashed / "checkpoint-8" / "checkpoint_complete.json").is_file()
    assert not (crashed / ".checkpoint-8.tmp").exists()


def test_sigterm_saves_and_exits_with_documented_code(tiny_assets, tmp_path):
    """Also: while the run is live, a second run into its directory is refused, --overwrite_output_dir too, and
    its files are untouched."""
    output_dir = tmp_path / "out"
    process = start_recipe(output_dir, tiny_assets, "--max_steps", "500", "--save_steps", "0")
    wait_for_step(process, output_dir, 2)
    second = run_recipe(output_dir, tiny_assets, "--max_steps", "2", "--overwrite_output_dir", "true", check=False)
    assert second.returncode == 2 and second.stderr.count("shardtune: error: ") == 1, second.stderr[-3000:]
    assert f"is in use by a live run (pid {process.pid} on " in second.stderr
    assert (output_dir / "metrics.jsonl").exists() and process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == PREEMPTED_EXIT_CODE
    checkpoints = [path for path in output_dir.glob("checkpoint-*") if (path / "checkpoint_complete.json").exists()]
    assert len(checkpoints) == 1
    step = json.loads((checkpoints[0] / "checkpoint_complete.json").read_text())["step"]
    assert step >= 2 and max(row["step"] for row in read_metrics(output_dir)) == step


# SIGTERM to every rank of a ZeRO-3 accelerate launch (as SLURM signals every task of a job step), a save in flight:
# tests/launch/test_checkpoint_durable.py::test_sigterm_during_async_save_ends_durable.


def test_non_finite_loss_stops_without_saving(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--max_steps", "6", "--save_steps", "2", "--warmup_ratio", "0",
                        "--learning_rate", "inf", check=False)
    assert result.returncode == NON_FINITE_EXIT_CODE
    assert "non-finite loss or gradient norm at step 2" in result.stdout
    assert not list(output_dir.glob("checkpoint-*")) and not (output_dir / "model.safetensors").exists()


def test_occupied_output_dir_overwritten_on_request(tiny_assets, tmp_path):
    """Refusing an occupied output_dir is in tests/unit/checks/test_bad_input.py; --overwrite_output_dir true replaces
    the earlier run."""
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (output_dir / LOCK_FILE).write_text("")  # every run takes the lock first: an earlier run's, ended cleanly
    run_recipe(output_dir, tiny_assets, "--max_steps", "2", "--overwrite_output_dir", "true")
    assert [row["step"] for row in read_metrics(output_dir) if "loss" in row] == [1, 2]
