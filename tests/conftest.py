"""Helpers that run the tiny recipe for real: one process, or `accelerate launch` with real ranks on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardtune.tiny import ensure_tiny_assets

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "accelerate_configs"
TINY_RECIPE = REPO / "recipes" / "tiny.py"
# Two ranks share the two cores: one thread each, and no W&B unless a test asks for it.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> tuple[str, str]:
    return ensure_tiny_assets(str(tmp_path_factory.mktemp("assets") / "tiny"))


def run_recipe(
    output_dir: Path, assets: tuple[str, str], *args: str, config: str | None = None, processes: int = 1,
    launch_args: tuple[str, ...] = (), recipe: Path = TINY_RECIPE, check: bool = True,
) -> subprocess.CompletedProcess:
    """Run the tiny recipe on the given model and data; with `config`, through `accelerate launch`."""
    model_dir, data_file = assets
    recipe_args = ["--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir", str(output_dir),
                   "--report_to", "none", "--logging_steps", "1", "--eval_steps", "0", *args]
    if config is None:
        command = [sys.executable, str(recipe), *recipe_args]
    else:
        accelerate = str(Path(sys.executable).parent / "accelerate")
        command = [accelerate, "launch", "--config_file", str(CONFIGS / f"{config}.yaml"),
                   "--num_processes", str(processes), "--main_process_port", str(free_port()), *launch_args,
                   str(recipe), *recipe_args]
    result = subprocess.run(command, cwd=output_dir.parent, env=ENV, capture_output=True, text=True, timeout=900)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)}\nexit {result.returncode}\n{result.stderr[-6000:]}")
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(output_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(output_dir) if "loss" in row]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
