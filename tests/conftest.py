"""Helpers that run the tiny recipe for real: one process, or `accelerate launch` with real ranks on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtune.tiny import ensure_tiny_assets

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
TINY_RECIPE = REPO / "recipes" / "tiny.py"
# Two ranks share the two cores: one thread each, and no W&B unless a test asks for it.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}


# The reference run of each strategy, shared by the equivalence and the resume tests: fp32, 8 steps of
# 32 sequences (2 ranks x 8 x 2 accumulation steps, or 1 x 8 x 4 alone), a checkpoint every 2 steps.
REFERENCE_ARGS = ("--max_steps", "8", "--save_steps", "2", "--save_total_limit", "0", "--mixed_precision", "no",
                  "--per_device_train_batch_size", "8", "--global_batch_size", "32")


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> tuple[str, str]:
    return ensure_tiny_assets(str(tmp_path_factory.mktemp("assets") / "tiny"))


@pytest.fixture(scope="session")
def reference_run(tiny_assets, tmp_path_factory):
    """reference_run(config) -> output dir of that strategy's reference run (None: one process), run once."""
    done: dict[str | None, Path] = {}

    def run(config: str | None) -> Path:
        if config not in done:
            root = tmp_path_factory.mktemp(f"reference-{config or 'single'}")
            run_recipe(root / "out", tiny_assets, *REFERENCE_ARGS, *nvme_args(config, root), config=config,
                       processes=2)
            done[config] = root / "out"
        return done[config]

    return run


def nvme_args(config: str | None, root: Path) -> tuple[str, ...]:
    if "nvme" not in (config or ""):
        return ()
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("NVMe offload needs libaio for DeepSpeed's async_io op: apt-get install libaio-dev")
    (root / "nvme").mkdir()
    return ("--offload_nvme_path", str(root / "nvme"))


def recipe_command(
    output_dir: Path, assets: tuple[str, str], *args: str, config: str | None = None, processes: int = 1,
    launch_args: tuple[str, ...] = (), recipe: Path = TINY_RECIPE, port: int | None = None,
) -> list[str]:
    """The command that runs the tiny recipe on the given model and data; with `config`, `accelerate launch`."""
    model_dir, data_file = assets
    recipe_args = ["--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir", str(output_dir),
                   "--report_to", "none", "--logging_steps", "1", "--eval_steps", "0", "--use_cpu", "true", *args]
    if config is None:
        command = [sys.executable, str(recipe), *recipe_args]
    else:
        accelerate = str(Path(sys.executable).parent / "accelerate")
        command = [accelerate, "launch", "--config_file", str(CONFIGS / f"{config}.yaml"),
                   "--num_processes", str(processes), "--main_process_port", str(port or free_port()), *launch_args,
                   str(recipe), *recipe_args]
    return command


def run_recipe(output_dir: Path, assets: tuple[str, str], *args: str, check: bool = True, **options
               ) -> subprocess.CompletedProcess:
    command = recipe_command(output_dir, assets, *args, **options)
    result = subprocess.run(command, cwd=output_dir.parent, env=ENV, capture_output=True, text=True, timeout=900)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)}\nexit {result.returncode}\n{result.stderr[-6000:]}")
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(output_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(output_dir) if "loss" in row]


def start_recipe(output_dir: Path, assets: tuple[str, str], *args: str, log_name: str | None = None, **options
                 ) -> subprocess.Popen:
    """Start a run in its own process group, so that a test can signal or kill all of its processes."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(output_dir.parent / f"{log_name or output_dir.name}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(recipe_command(output_dir, assets, *args, **options), cwd=output_dir.parent, env=ENV,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_machines(output_dir: Path, assets: tuple[str, str], *args: str, configs: list[str],
                   machine_args: list[tuple[str, ...]] | None = None) -> list[subprocess.Popen]:
    """One `accelerate launch` per machine, all on loopback, one process each: machine i runs configs[i] with
    `args` and machine_args[i]. Logs go to <output_dir>-machine<i>.log."""
    port, machines = free_port(), len(configs)
    processes = []
    for rank, config in enumerate(configs):
        launch_args = ("--num_machines", str(machines), "--machine_rank", str(rank),
                       "--main_process_ip", "127.0.0.1")
        extra = machine_args[rank] if machine_args else ()
        processes.append(start_recipe(output_dir, assets, *args, *extra, config=config, processes=machines,
                                      launch_args=launch_args, port=port, log_name=f"{output_dir.name}-machine{rank}"))
    return processes


def wait_for_step(process: subprocess.Popen, output_dir: Path, step: int, timeout: float = 300) -> None:
    """Block until the run has logged `step` (or fail if it ends or takes too long)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"run ended (exit {process.returncode}) before step {step}"
        try:
            if any(row.get("step", 0) >= step for row in read_metrics(output_dir)):
                return
        except (OSError, ValueError):  # not written yet, or a line half-written
            pass
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout}s")


def wait_all(processes: list[subprocess.Popen], timeout: float, started: float | None = None) -> list[float]:
    """Seconds from `started` (default: now) until each launcher exited; kills them all and fails if any
    outlives `timeout`."""
    started, ended = started or time.monotonic(), {}
    while len(ended) < len(processes):
        for index, process in enumerate(processes):
            if index not in ended and process.poll() is not None:
                ended[index] = time.monotonic() - started
        if time.monotonic() - started > timeout:
            for process in processes:
                os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"launchers still running after {timeout}s: a hang")
        time.sleep(0.1)
    return [ended[index] for index in range(len(processes))]


def machine_log(output_dir: Path, machine: int) -> str:
    return (output_dir.parent / f"{output_dir.name}-machine{machine}.log").read_text()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
