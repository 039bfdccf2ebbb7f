"""Checkpoints survive anything: kill -9 at a random step and resume gives the uninterrupted run's losses
bit for bit (DDP, FSDP, ZeRO-3); a crash during a save leaves the previous checkpoint in use; SIGTERM saves
and exits with the documented code; a non-finite loss stops without saving; exports equal the trained model."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from accelerate.utils.other import TORCH_SAFE_GLOBALS
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardtune.preemption import NON_FINITE_EXIT_CODE, PREEMPTED_EXIT_CODE
from tests.conftest import (
    ENV,
    REFERENCE_ARGS,
    REPO,
    machine_log,
    read_metrics,
    run_recipe,
    start_machines,
    start_recipe,
    train_losses,
    wait_all,
    wait_for_step,
)

# The reference runs accumulate 2 micro-batches per step on 2 ranks: a kill can land inside a cycle.
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
    subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(checkpoint), str(output)],
                   check=True, env=ENV, capture_output=True)


# DDP runs as one launcher of two processes and dies whole. FSDP and ZeRO-3 run as two machines of one process
# each (two launchers on loopback): their losses, equal to the one-machine reference, show that multi-machine
# training is the same computation. Under ZeRO-3 rank 1 dies (SIGKILL): the survivor's collective fails at once.
# Under FSDP rank 1 freezes (SIGSTOP, like a machine that hangs): nothing fails, only the watchdog can stop the
# survivor. Either way machine 0 must name rank 1 and stop within the rank timeout. Each run resumes as launched.
KILLS = [("ddp", 1), ("fsdp_full_shard", 2), ("ds_zero3", 2)]
RANK_TIMEOUT_S = 10


def launch(output_dir, tiny_assets, *args, config: str, machines: int) -> list[subprocess.Popen]:
    args = (*args, "--rank_timeout_s", str(RANK_TIMEOUT_S))
    if machines == 1:
        return [start_recipe(output_dir, tiny_assets, *args, config=config, processes=2)]
    return start_machines(output_dir, tiny_assets, *args, configs=[config] * machines)


@pytest.mark.parametrize(("config", "machines"), KILLS, ids=[f"{config}-{n}machines" for config, n in KILLS])
def test_kill_and_resume_equals_uninterrupted_run(config, machines, reference_run, tiny_assets, tmp_path):
    reference = reference_run(config)

    kill_step = random.randint(3, 6)
    killed = tmp_path / "killed"
    launchers = launch(killed, tiny_assets, *ARGS, config=config, machines=machines)
    wait_for_step(launchers[0], killed, kill_step)
    if machines == 1:
        os.killpg(launchers[0].pid, signal.SIGKILL)
        launchers[0].wait()
    else:
        (rank_1,) = [child for child in psutil.Process(launchers[1].pid).children(recursive=True)
                     if "tiny.py" in " ".join(child.cmdline())]
        rank_1.send_signal(signal.SIGSTOP if config == "fsdp_full_shard" else signal.SIGKILL)
        (survivor_exit,) = wait_all(launchers[:1], timeout=120)
        survivor_log = machine_log(killed, 0)
        assert "rank 1 on machine 1 (" in survivor_log and "has not answered" in survivor_log, survivor_log[-4000:]
        print(f"{config}: rank 1 stopped at step {kill_step}; machine 0 exited {survivor_exit:.1f} s later "
              f"(rank timeout {RANK_TIMEOUT_S} s)")
        assert survivor_exit < RANK_TIMEOUT_S + 20
        os.killpg(launchers[1].pid, signal.SIGKILL)  # a frozen machine is the scheduler's to end
        launchers[1].wait()
    resumed = launch(killed, tiny_assets, *ARGS, "--resume_from_checkpoint", "auto", config=config,
                     machines=machines)
    wait_all(resumed, timeout=600)
    log = machine_log(killed, 0) if machines > 1 else (tmp_path / "killed.log").read_text()
    assert [launcher.returncode for launcher in resumed] == [0] * machines, log[-4000:]

    assert [row["step"] for row in read_metrics(killed) if "loss" in row] == list(range(1, 9))
    assert train_losses(killed) == train_losses(reference), f"killed at step {kill_step}"  # bitwise

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

    if config == "ddp":  # a different number of processes is refused before loading
        result = run_recipe(tmp_path / "one", tiny_assets, *ARGS, "--resume_from_checkpoint",
                            str(killed / "checkpoint-8"), check=False)
        assert result.returncode == 2 and "was saved by 2 processes and this run has 1" in result.stderr


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
    assert (crashed / "checkpoint-8" / "checkpoint_complete.json").is_file()
    assert not (crashed / ".checkpoint-8.tmp").exists()


def test_sigterm_saves_and_exits_with_documented_code(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    process = start_recipe(output_dir, tiny_assets, "--max_steps", "500", "--save_steps", "0")
    wait_for_step(process, output_dir, 2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == PREEMPTED_EXIT_CODE
    checkpoints = [path for path in output_dir.glob("checkpoint-*") if (path / "checkpoint_complete.json").exists()]
    assert len(checkpoints) == 1
    step = json.loads((checkpoints[0] / "checkpoint_complete.json").read_text())["step"]
    assert step >= 2 and max(row["step"] for row in read_metrics(output_dir)) == step


def test_sigterm_to_every_rank_under_accelerate_launch(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    process = start_recipe(output_dir, tiny_assets, "--max_steps", "500", "--save_steps", "0",
                           config="ds_zero3", processes=2)
    wait_for_step(process, output_dir, 2)
    ranks = [child for child in psutil.Process(process.pid).children(recursive=True)
             if "tiny.py" in " ".join(child.cmdline())]
    assert len(ranks) == 2
    for rank in ranks:  # as SLURM signals every task of a job step
        rank.send_signal(signal.SIGTERM)
    process.wait(timeout=180)
    log = (tmp_path / "out.log").read_text()
    assert f"exitcode: {PREEMPTED_EXIT_CODE}" in log or process.returncode == PREEMPTED_EXIT_CODE, log[-3000:]
    assert len(list(output_dir.glob("checkpoint-*/checkpoint_complete.json"))) == 1


def test_non_finite_loss_stops_without_saving(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--max_steps", "6", "--save_steps", "2", "--warmup_ratio", "0",
                        "--learning_rate", "inf", check=False)
    assert result.returncode == NON_FINITE_EXIT_CODE
    assert "non-finite loss or gradient norm at step 2" in result.stdout
    assert not list(output_dir.glob("checkpoint-*")) and not (output_dir / "model.safetensors").exists()


def test_occupied_output_dir_overwritten_on_request(tiny_assets, tmp_path):
    """Refusing an occupied output_dir is in test_bad_input; --overwrite_output_dir true replaces the earlier run."""
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    run_recipe(output_dir, tiny_assets, "--max_steps", "2", "--overwrite_output_dir", "true")
    assert [row["step"] for row in read_metrics(output_dir) if "loss" in row] == [1, 2]
