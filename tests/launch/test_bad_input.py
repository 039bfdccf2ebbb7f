"""Bad configuration stops with one clear line and exit code 2, before any model is loaded or file written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_recipe

# Whatever the shell running the tests exported must not leak into a case.
LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


HEAVY_MODULES = ("torch", "transformers.modeling_utils", "peft", "deepspeed", "wandb", "accelerate")


@pytest.mark.parametrize("args", [("--no_such_flag", "1"), ("--learning_rate", "-1"), ("--packing", "maybe")])
def test_a_bad_command_line_is_refused_before_heavy_imports(args, tiny_assets, tmp_path):
    """A typo or an impossible value is refused from the command line alone: no torch, transformers model code,
    peft, DeepSpeed, W&B or accelerate imported (their imports are most of a launch's start-up)."""
    model_dir, data_file = tiny_assets
    recipe = str(REPO / "recipes" / "tiny.py")
    probe = ("import atexit, runpy, sys\n"
             f"atexit.register(lambda: print('heavy:', [m for m in {HEAVY_MODULES!r} if m in sys.modules]))\n"
             "sys.argv = ['tiny.py', *sys.argv[1:]]\n"
             f"runpy.run_path({recipe!r}, run_name='__main__')\n")
    env = {name: value for name, value in os.environ.items() if not name.startswith(("ACCELERATE_", "FSDP_"))
           and name not in LAUNCH_VARIABLES}
    result = subprocess.run([sys.executable, "-c", probe, "--model_name_or_path", model_dir, "--dataset", data_file,
                             "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", *args],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and "shardtune: error:" in result.stderr, result.stderr[-2000:]
    assert "heavy: []" in result.stdout, result.stdout[-2000:]


def test_batch_must_divide_over_ranks(tiny_assets, tmp_path):
    """A 2-process `accelerate launch` refused by both ranks: the refusal leads the output, the launcher's closing
    report names it as the root cause (from torchelastic's error file), and the launcher exits 1 whatever its
    ranks returned (each rank's 2 is in the report)."""
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--global_batch_size", "48", "--per_device_train_batch_size", "16",
                        config="ddp", processes=2, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*2\b", result.stderr), result.stderr[-3000:]  # each rank's own code
    refusal = ("shardtune: error: --global_batch_size 48 is not divisible by per_device_train_batch_size x "
               "processes = 16 x 2 = 32. Pick a global batch that is a multiple of 32")
    assert refusal in result.stderr.split("ChildFailedError")[0], result.stderr[-3000:]  # the ranks' own output
    ending = result.stderr.splitlines()[-15:]
    assert any(refusal in line for line in ending), "\n".join(ending)
    assert "To enable traceback see" not in "\n".join(ending)
    assert not output_dir.exists()
