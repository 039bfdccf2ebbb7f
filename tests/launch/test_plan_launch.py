"""A launched recipe plans its memory on every rank before loading anything, and refuses a plan that does not
fit with the numbers and the nearest plan that does."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ENV, REPO, run_recipe


def test_70b_zero3_on_one_h100_node_refused_before_loading(tiny_assets, tmp_path):
    """Under accelerate launch, on every rank, the plan of the launched config (ZeRO-3). A CPU run cannot stand for
    the GPUs of --hardware (refused: tests/unit/checks/test_checks_shared.py), so the launch plans them as a dry run."""
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--model_name_or_path", "meta-llama/Llama-3.1-70B",
                        "--hardware", "8xh100-80gb", "--dry_run", "true", config="ds_zero3", processes=2,
                        recipe=REPO / "recipes" / "llama70b.py", check=False)
    assert result.returncode != 0
    assert "with DeepSpeed ZeRO-3" in result.stdout and "DOES NOT FIT" in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("shardtune: error:")]
    error = next(line for line in errors if "does not fit" in line)  # beside the model offline here, if it is
    assert "does not fit 8xh100-80gb with DeepSpeed ZeRO-3: its limit is GPU memory" in error
    fastest = error.split("The fastest plan that fits: ")[1]
    assert "_offload" in fastest.split(",")[0] and "host RAM per node" in fastest
    assert "Loading weights" not in result.stderr and not output_dir.exists()


def test_dry_run_prints_the_plan_and_exits(tmp_path):
    def dry_run(recipe: str, hardware: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "recipes" / recipe), "--dry-run", "--hardware", hardware,
                               *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)

    fits = dry_run("llama1b.py", "8xh100-80gb")
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "llama-3.2-1b (1,235,814,400 params) on 8xh100-80gb" in fits.stdout and "-> fits" in fits.stdout
    assert "with ddp," in fits.stdout  # outside accelerate launch: the config of the recipe's launch line
    too_big = dry_run("llama405b.py", "8xh100-80gb", "--offload_nvme_path", "/local_nvme")  # its launch line's
    assert too_big.returncode == 2 and "DOES NOT FIT" in too_big.stdout
    refused = dry_run("llama8b.py", "3x8xh100-80gb", "--mixed_precision", "fp4", "--lora_r", "0", "--use_peft",
                      "true")
    errors = [line for line in refused.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and len(errors) == 3, refused.stderr
    assert "--mixed_precision must be one of" in errors[0] and "LoRA needs --lora_r >= 1" in refused.stderr
    assert "not divisible by per_device_train_batch_size x processes" in refused.stderr  # 64 over 24 GPUs
    assert not list(tmp_path.iterdir())  # nothing written






