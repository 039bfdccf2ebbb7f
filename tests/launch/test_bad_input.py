"""Bad configuration stops with one clear line and exit code 2, before any model is loaded or file written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, kill_tree, launch_env, popen, run_recipe
from tests.unit.parallel.test_bad_launch import CPU_FLAG, FSDP_TP_ON_TWO, ONE_PROCESS, TP_TWO

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


# The launcher settings a rank can judge only under the real `accelerate launch` (its command line read from the
# rank's parent): (the launcher's options, the one line every refusing machine prints after "shardtune: error: ").
# tests/unit/parallel/test_bad_launch.py runs the same cases in-process, with the variables accelerate's code builds.
SCRIPT = "recipes/tiny.py"
LAUNCHER_CASES = {
    "TP size beside ddp.yaml": (("--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
                                 "--parallelism_config_tp_size", "2"), TP_TWO.format(config="ddp", strategy="DDP")),
    "two processes without a config": (("--num_processes", "2"), ONE_PROCESS.replace("{script}", SCRIPT)),
    "--cpu with two processes": (("--cpu", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2"),
                                 CPU_FLAG.replace("{script}", SCRIPT)),
    # Waited forever for a second machine while the file said num_machines: 2.
    "fsdp_tp.yaml on one machine": (("--config_file", "accelerate_configs/fsdp_tp.yaml", "--num_processes", "2"),
                                    FSDP_TP_ON_TWO),
    "the launcher's precision against the recipe's": (
        ("--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "1", "--mixed_precision", "fp16"),
        "accelerate launch --mixed_precision fp16 and the recipe's --mixed_precision no disagree, and the recipe's "
        "would be applied: give the recipe --mixed_precision fp16 (after the script) and drop the launcher's flag."),
}
# Another spelling of the launcher (its ranks must recognise it as theirs, or every check above is skipped).
ACCELERATE_CLI = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
LAUNCHED_AS = {"the launcher's precision, under python -m accelerate.commands.accelerate_cli launch": ACCELERATE_CLI}
LAUNCHER_CASES.update({case: LAUNCHER_CASES["the launcher's precision against the recipe's"] for case in LAUNCHED_AS})


@pytest.mark.parametrize("case", LAUNCHER_CASES)
def test_a_launcher_setting_that_would_not_act_is_refused_at_start_up(case, tiny_assets, tmp_path):
    """The real launcher, started from the repository as users start it: exit non-zero with the one line, before
    any model loads or file is written, within a start-up's time (no rendezvous left waiting)."""
    options, line = LAUNCHER_CASES[case]
    model_dir, data_file = tiny_assets
    output_dir = tmp_path / "out"
    launcher = LAUNCHED_AS.get(case, [str(Path(sys.executable).parent / "accelerate"), "launch"])
    command = [*launcher, *options, "--main_process_port",
               str(free_port()), SCRIPT, "--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir",
               str(output_dir), "--report_to", "none", "--use_cpu", "true"]
    # HF_HOME of its own: no default accelerate config of this machine's is read where the case names none.
    process = popen(command, cwd=REPO, env=launch_env({"HF_HOME": str(tmp_path / "hf")}), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_tree(process)
        raise AssertionError(f"{' '.join(command)}\nstill running after 300 s: a hang") from None
    assert process.returncode != 0, stderr[-3000:]
    assert {text for text in stderr.splitlines() if text.startswith("shardtune: error:")} == {
        f"shardtune: error: {line}"}, stderr[-3000:]
    assert "Loading weights" not in stderr and not output_dir.exists()
