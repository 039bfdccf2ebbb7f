"""`make demo` builds only what the demo runs: the DeepSpeed op its config loads (the shared-memory collectives on
DeepSpeed's CPU accelerator), chosen from that config by scripts/build_deepspeed_ops.py --config; CPU Adam and async
I/O (with libaio) stay with `make test`. That a launch of the demo's config compiles nothing beyond that op is
tests/launch/test_demo_ops.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, REPO, load_script

DEMO_CONFIG = "accelerate_configs/ds_zero3.yaml"


def build_script(*args: str, extensions: Path) -> subprocess.CompletedProcess:
    """The build script on DeepSpeed's CPU accelerator (the demo's), compiling into `extensions` if anything."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(extensions)}
    return subprocess.run([sys.executable, "scripts/build_deepspeed_ops.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def make_commands(target: str, venv: Path) -> list[list[str]]:
    """The commands `make <target>` runs in a virtualenv that has nothing yet (make -n: printed, none run)."""
    result = subprocess.run(["make", "-n", "-C", str(REPO), target, f"VENV={venv}"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.replace("\\\n", " ").splitlines()  # a recipe's continued lines as the shell joins them
    return [shlex.split(line) for line in lines if line.strip() and not line.startswith("make")]


def ops_built_by(commands: list[list[str]]) -> list[list[str]]:
    """Each build_deepspeed_ops.py run's arguments."""
    return [words[words.index("scripts/build_deepspeed_ops.py") + 1:] for words in commands
            if "scripts/build_deepspeed_ops.py" in words]


def test_demo_config_loads_only_the_shared_memory_op():
    script = load_script("build_deepspeed_ops")
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    ops = script.needed_ops([CONFIGS / "ds_zero3.yaml"])
    assert ops == [script.NeededOp("ShareMemCommBuilder", ("ds_zero3",))]
    present, absent = script.split_by_accelerator(ops, CPU_Accelerator())
    assert absent == [] and [builder.NAME for _, builder in present] == ["deepspeed_shm_comm"]


def test_build_script_with_the_demo_config_names_the_shared_memory_op_alone(tmp_path):
    extensions = tmp_path / "torch_extensions"
    result = build_script("--config", DEMO_CONFIG, "--dry_run", extensions=extensions)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("deepspeed op")] == [
        "deepspeed op deepspeed_shm_comm: would be built (for ds_zero3)"]
    assert not extensions.exists()  # --dry_run compiled nothing


def test_build_script_refuses_every_bad_config_before_building(tmp_path):
    (tmp_path / "broken.yaml").write_text("distributed_type: [DEEPSPEED\n")
    extensions = tmp_path / "torch_extensions"
    result = build_script("--config", str(tmp_path / "missing.yaml"), "--config", str(tmp_path / "broken.yaml"),
                          "--config", DEMO_CONFIG, extensions=extensions)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and all(line.startswith("build_deepspeed_ops.py: error: --config ") for line in lines)
    assert "missing.yaml' does not exist: give an accelerate config file" in lines[0]
    assert "broken.yaml': Cannot read accelerate config" in lines[1] and lines[1].endswith("config file.")
    assert "deepspeed op" not in result.stdout and not extensions.exists()


def test_build_script_has_nothing_to_build_for_a_config_without_deepspeed(tmp_path):
    extensions = tmp_path / "torch_extensions"
    result = build_script("--config", "accelerate_configs/ddp.yaml", extensions=extensions)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "no deepspeed op to build: ddp uses no DeepSpeed"
    assert not extensions.exists()


@pytest.mark.parametrize("target", ["demo", "demo-dpo"])
def test_make_demo_builds_only_the_op_of_the_config_it_launches(target, tmp_path):
    commands = make_commands(target, tmp_path / "venv")
    launch = next(words for words in commands if "launch" in words)
    config = launch[launch.index("--config_file") + 1]
    assert ops_built_by(commands) == [["--config", config]]
    assert not [words for words in commands if "apt-get" in " ".join(words)]  # libaio is NVMe offload's


def test_make_test_builds_every_op(tmp_path):
    assert ops_built_by(make_commands("test", tmp_path / "venv")) == [[]]  # the default: every shipped config's ops
