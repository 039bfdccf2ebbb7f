"""Every setting given to `accelerate launch` acts or is refused in one line, and so is a recipe flag that belongs to
the launcher or is given twice. In this process: the launch variables are those accelerate's own launcher code builds
for the command line (commands/launch.py, utils/launch.py), and the launcher's command line is the one a rank reads
from its parent (parallel.launcher_args.LauncherRequest). tests/launch/test_bad_input.py launches the cases that
need the real launcher."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from shardtune.cli import checked_launch, main
from shardtune.config import Recipe
from shardtune.parallel.launcher_args import LauncherRequest, launch_options, launcher_problems, script_shown
from tests.conftest import REPO

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TP_TWO = ("accelerate launch --parallelism_config_tp_size 2 reaches no process: accelerate passes parallelism sizes "
          "on only from a config file with a parallelism_config section, and accelerate_configs/{config}.yaml has "
          "none, so the run would train {strategy} without them. Launch a config that applies them (tp_size: "
          "accelerate_configs/fsdp_tp.yaml (TP with FSDP2), or for TP alone a copy of ddp.yaml with the section "
          "parallelism_config: {{parallelism_config_tp_size: N}}).")
ONE_PROCESS = ("accelerate launch --num_processes 2 started one process: without a config file accelerate starts "
               "several processes only on a machine with several GPUs. Give it a config: accelerate launch "
               "--config_file accelerate_configs/ddp.yaml --num_processes 2 {script} (on CPU with the recipe's "
               "--use_cpu true).")
CPU_FLAG = ("accelerate launch --cpu starts the script as one process, whatever --num_processes 2 asks: drop --cpu and "
            "give the recipe --use_cpu true instead (accelerate launch --config_file accelerate_configs/ddp.yaml "
            "--num_processes 2 {script} --use_cpu true).")
PRECISION_FLAG = ("accelerate launch --mixed_precision fp16 and the recipe's --mixed_precision no disagree, and the "
                  "recipe's would be applied: give the recipe --mixed_precision fp16 (after the script) and drop the "
                  "launcher's flag.")
FSDP_TP_ON_TWO = ("parallelism_config_tp_size 8 does not divide the 2 processes launched into groups: launch "
                  "accelerate_configs/fsdp_tp.yaml with --parallelism_config_tp_size <GPUs per node> "
                  "--parallelism_config_dp_shard_size <processes / tp_size>.")
DEEPSPEED_ALONE = ("ACCELERATE_USE_DEEPSPEED=true is set but no launcher started this process (WORLD_SIZE is unset): "
                   "start DeepSpeed runs with accelerate launch --config_file accelerate_configs/ds_zero3.yaml (or "
                   "another ds_*.yaml) recipes/<recipe>.py ..., or unset ACCELERATE_USE_DEEPSPEED to train one "
                   "process without it.")

# (the launcher's options, the recipe's flags, the one line printed after "shardtune: error: ")
LAUNCH_CASES = {
    "TP size beside ddp.yaml": (
        ("--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2", "--parallelism_config_tp_size", "2"),
        (), TP_TWO.format(config="ddp", strategy="DDP")),
    "TP size beside ds_zero3.yaml": (
        ("--config_file", "accelerate_configs/ds_zero3.yaml", "--num_processes", "2",
         "--parallelism_config_tp_size", "2"), (), TP_TWO.format(config="ds_zero3", strategy="DeepSpeed ZeRO-3")),
    "CP size beside ds_zero3.yaml": (
        ("--config_file", "accelerate_configs/ds_zero3.yaml", "--num_processes", "2",
         "--parallelism_config_cp_size", "2"), (),
        "accelerate launch --parallelism_config_cp_size 2 reaches no process: accelerate passes parallelism sizes on "
        "only from a config file with a parallelism_config section, and accelerate_configs/ds_zero3.yaml has none, "
        "so the run would train DeepSpeed ZeRO-3 without them. Launch a config that applies them (cp_size: "
        "accelerate_configs/fsdp_cp.yaml)."),
    "two processes without a config": (("--num_processes", "2"), (), ONE_PROCESS),
    "--cpu with a config of two processes": (
        ("--cpu", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2"), (), CPU_FLAG),
    "--cpu with a DeepSpeed config": (
        ("--cpu", "--config_file", "accelerate_configs/ds_zero3.yaml", "--num_processes", "1"), (),
        "accelerate launch --cpu starts the script as one process without accelerate_configs/ds_zero3.yaml's "
        "DeepSpeed: drop --cpu and give the recipe --use_cpu true instead (accelerate launch --config_file "
        "accelerate_configs/ds_zero3.yaml --num_processes 1 {script} --use_cpu true)."),
    "the launcher's precision against the recipe's": (
        ("--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "1", "--mixed_precision", "fp16"),
        ("--mixed_precision", "no"), PRECISION_FLAG),
    "fsdp_tp.yaml on one machine of two processes": (
        ("--config_file", "accelerate_configs/fsdp_tp.yaml", "--num_processes", "2"), (), FSDP_TP_ON_TWO),
    "Ulysses with a kernel it cannot run": (
        ("--config_file", "accelerate_configs/ds_zero3_ulysses.yaml", "--num_processes", "2",
         "--parallelism_config_sp_size", "2"), ("--attn_implementation", "eager"),
        "--attn_implementation eager cannot run under the sequence split (sp_size 2): Ulysses takes sdpa, "
        "flash_attention_2, flash_attention_3; use sdpa, or flash_attention_2 on GPUs."),
}

# (the recipe's flags, the one line), with no launcher
FLAG_CASES = {
    "--dataset twice": (("--dataset", "{data}", "--dataset", "{tmp}/other.jsonl"),
                        "--dataset {data}, --dataset {tmp}/other.jsonl: the same setting given 2 times, and only the "
                        "last would apply: give it once (several sources go in one: --dataset A,B)."),
    "a number twice": (("--learning_rate", "1e-4", "--learning_rate=2e-4"),
                       "--learning_rate 1e-4, --learning_rate 2e-4: the same setting given 2 times, and only the last "
                       "would apply: give it once."),
    "a launcher flag given to the recipe": (
        ("--num_processes", "2"),
        "Unknown argument --num_processes: a flag of accelerate launch, not of the recipe: give it to the launcher, "
        "before the script: accelerate launch --config_file accelerate_configs/<config>.yaml --num_processes 2 "
        "{script} ..."),
    "the deepspeed launcher's --local_rank": (
        ("--local_rank=0",),
        "Unknown argument --local_rank: the deepspeed launcher's flag for its script, and shardtune's runs start "
        "under accelerate launch, which gives each rank its LOCAL_RANK itself: accelerate launch --config_file "
        "accelerate_configs/ds_zero3.yaml (or another ds_*.yaml) recipes/<recipe>.py ..."),
}


def launched_env(options: tuple[str, ...]) -> dict[str, str]:
    """The variables a rank of `accelerate launch <options> recipe.py` sees: accelerate's launch_command dispatch
    and prepare_*_env, with torchrun's own variables (rank 0) where it starts torchrun, none where its simple
    launcher runs the script once."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    args, defaults, from_config = _validate_launch_command(launch_command_parser().parse_args([*options, "r.py"]))
    torchrun = not args.cpu and (args.use_deepspeed or args.use_fsdp or args.multi_gpu)
    if args.use_deepspeed and not args.cpu:
        fields = [*(defaults.deepspeed_config if defaults else ())] + ["mixed_precision"] * from_config
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    elif torchrun:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    env = {name: value for name, value in env.items() if os.environ.get(name) != value}
    if torchrun:
        env.update(WORLD_SIZE=str(args.num_processes), LOCAL_WORLD_SIZE=str(args.num_processes), RANK="0",
                   LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    return env


def reached_the_trainer(*args, **kwargs):
    raise AssertionError("the launch was not refused: it reached the trainer")


def scrubbed_launch(monkeypatch, env: dict[str, str], options: tuple[str, ...] | None) -> None:
    """This process as a rank of `accelerate launch <options>` (None: started by no launcher) with `env`."""
    for name in [*os.environ]:
        if name in LAUNCH_VARIABLES or name.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    request = LauncherRequest.of_options([*options, "recipes/tiny.py"], str(REPO)) if options is not None else None
    monkeypatch.setattr("shardtune.cli.this_launcher", lambda: request)
    monkeypatch.setattr("shardtune.trainer.train", reached_the_trainer)


def error_lines(recipe_args: tuple[str, ...], tiny_assets, tmp_path: Path, capsys) -> list[str]:
    """The recipe entry point refused with exit code 2, nothing written: its error lines."""
    model_dir, data_file = tiny_assets
    base = ["--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir", str(tmp_path / "out"),
            "--report_to", "none", "--use_cpu", "true"]
    given = {arg.partition("=")[0] for arg in recipe_args}
    kept = [token for flag, value in zip(base[::2], base[1::2], strict=True) if flag not in given
            for token in (flag, value)]
    argv = [*kept, *recipe_args]  # the case's own flags as given, repeats included
    with pytest.raises(SystemExit) as exit_info:
        main(Recipe(name="tiny", max_seq_length=64, per_device_train_batch_size=2, global_batch_size=4), argv)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr and not (tmp_path / "out").exists(), stderr[-2000:]  # nothing written
    return [line for line in stderr.splitlines() if line.startswith("shardtune: error:")]


@pytest.mark.parametrize("case", LAUNCH_CASES)
def test_a_launcher_setting_that_would_not_act_is_refused(case, tiny_assets, tmp_path, capsys, monkeypatch):
    options, recipe_args, line = LAUNCH_CASES[case]
    monkeypatch.chdir(REPO)  # the launcher's relative --config_file, as users launch from the repository
    scrubbed_launch(monkeypatch, launched_env(options), options)
    script = script_shown()
    assert error_lines(recipe_args, tiny_assets, tmp_path, capsys) == [
        f"shardtune: error: {line.replace('{script}', script)}"]


@pytest.mark.parametrize("case", FLAG_CASES)
def test_a_recipe_flag_that_would_not_act_is_refused(case, tiny_assets, tmp_path, capsys, monkeypatch):
    args, line = FLAG_CASES[case]
    scrubbed_launch(monkeypatch, {}, None)
    values = {"data": tiny_assets[1], "tmp": str(tmp_path), "script": script_shown()}
    (tmp_path / "other.jsonl").write_text(Path(tiny_assets[1]).read_text())  # a second source that exists
    assert error_lines(tuple(arg.format(**values) for arg in args), tiny_assets, tmp_path, capsys) == [
        f"shardtune: error: {line.format(**values)}"]


def test_deepspeed_without_a_launcher_is_refused(tiny_assets, tmp_path, capsys, monkeypatch):
    """ACCELERATE_USE_DEEPSPEED=true python recipes/x.py: one line, not accelerate's "Default process group has
    not been initialized" traceback from inside the Accelerator."""
    scrubbed_launch(monkeypatch, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE":
                                  str(REPO / "accelerate_configs" / "deepspeed" / "zero3.json")}, None)
    assert error_lines(("--mixed_precision", "no"), tiny_assets, tmp_path, capsys) == [
        f"shardtune: error: {DEEPSPEED_ALONE}"]


@pytest.mark.parametrize(("options", "recipe_args", "note"), [
    (("--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "1"), ("--mixed_precision", "no"),
     "shardtune: note: training without mixed precision (no, the recipe's --mixed_precision), not the accelerate "
     "config's mixed_precision "
     "bf16: the recipe's precision wins, as a TrainingArguments script's bf16/fp16 do (give --mixed_precision bf16 to "
     "train in it)."),
    (("--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "1"), ("--mixed_precision", "bf16"), None),
    (("--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "1", "--mixed_precision", "bf16"),
     ("--mixed_precision", "bf16"), None),
], ids=["the config's precision loses, with a note", "the same precision", "the launcher's flag agrees"])
def test_the_recipes_precision_is_applied_and_a_config_that_differs_is_noted(options, recipe_args, note, tiny_assets,
                                                                             tmp_path, capsys, monkeypatch):
    """A config file's mixed_precision, written for every recipe launched with it, loses to the recipe's, which the
    start-up says; the launch goes on at the recipe's precision, and with no note where they agree."""
    monkeypatch.chdir(REPO)
    scrubbed_launch(monkeypatch, launched_env(options), options)
    model_dir, data_file = tiny_assets
    recipe, launch, _ = checked_launch(Recipe(name="tiny", max_seq_length=64), [
        "--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir", str(tmp_path / "out"),
        "--report_to", "none", "--use_cpu", "true", *recipe_args])
    assert launch.launcher_precision == "bf16" and recipe.mixed_precision == recipe_args[1]
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtune: note:")]
    assert notes == ([note] if note else [])


def test_the_applied_parallelism_is_recorded(monkeypatch):
    """run_config.json's `parallelism`: the sizes a launch applies, read where the checks read them."""
    from shardtune.launch import LaunchDescription

    monkeypatch.chdir(REPO)
    options = ("--config_file", "accelerate_configs/ds_zero3_ulysses.yaml", "--num_processes", "2",
               "--parallelism_config_sp_size", "2")
    scrubbed_launch(monkeypatch, launched_env(options), options)
    launch = LaunchDescription.from_env(LauncherRequest.of_options([*options, "r.py"], str(REPO)))
    assert launch.parallelism_sizes == {"tp_size": 1, "cp_size": 1, "sp_size": 2, "dp_shard_size": 0,
                                        "dp_replicate_size": 0}


@pytest.mark.parametrize(("local_processes", "gpus", "refused"), [(16, 8, True), (8, 8, False), (2, 8, False)])
def test_more_processes_than_gpus_on_a_machine_refused(local_processes: int, gpus: int, refused: bool) -> None:
    """A 2-node config (num_processes: 16) launched on one 8-GPU machine without --num_machines starts 16 processes
    there: refused in one line before the ranks ask for devices 8 to 15 (a CUDA 'invalid device ordinal')."""
    from shardtune.checks.values import check_device
    from shardtune.config import ConfigError

    recipe = Recipe(model_name_or_path="m")
    if not refused:
        check_device(recipe, True, local_processes, gpus)
        return
    with pytest.raises(ConfigError) as caught:
        check_device(recipe, True, local_processes, gpus)
    assert str(caught.value) == (
        "16 processes were started on this machine, which has 8 GPUs: one process per GPU. A config's num_processes "
        "counts every node's: launch each node with accelerate launch --num_machines N --machine_rank R, or "
        "--num_processes 8 on one.")
    check_device(dataclasses.replace(recipe, use_cpu=True), False, local_processes, 0)  # CPU ranks share the cores


@pytest.mark.parametrize("argv", [
    ["/venv/bin/accelerate", "launch"],
    ["/usr/bin/python3", "/venv/bin/accelerate", "launch"],
    ["/venv/bin/accelerate-launch"],
    ["python", "-m", "accelerate.commands.launch"],
    ["/venv/bin/python", "-m", "accelerate.commands.accelerate_cli", "launch"],
], ids=["accelerate launch", "python accelerate launch", "accelerate-launch", "python -m accelerate.commands.launch",
        "python -m accelerate.commands.accelerate_cli launch"])
def test_every_spelling_of_the_launcher_is_recognised(argv):
    """A rank finds its launcher by its command line: each way to run accelerate's launcher gives the options after
    it, the script's own arguments (a `launch` among them) included."""
    options = ["--config_file", "accelerate_configs/ddp.yaml", "recipes/tiny.py", "accelerate", "launch", "--x"]
    assert launch_options([*argv, *options]) == options


@pytest.mark.parametrize("argv", [
    ["python", "recipes/tiny.py", "--use_cpu", "true"],
    ["/venv/bin/accelerate", "config"],
    ["python", "-m", "accelerate.commands.accelerate_cli", "env"],
    ["torchrun", "--nproc_per_node", "2", "launch"],
])
def test_other_command_lines_are_no_launcher(argv):
    assert launch_options(argv) is None


def test_cpu_without_a_config_asks_one_process_on_a_gpu_machine(monkeypatch):
    """`accelerate launch --cpu recipes/tiny.py` on an 8-GPU node: accelerate's own defaulting fills in
    --num_processes 8 (the GPU count) that no one asked for, and its simple launcher starts one process, as asked."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    request = LauncherRequest.of_options(["--cpu", "recipes/tiny.py", "--use_cpu", "true"], str(REPO))
    assert request is not None and request.num_processes == 1
    assert launcher_problems(request, 1, "on one CPU process") == []
    asked = LauncherRequest.of_options(["--cpu", "--num_processes", "8", "recipes/tiny.py"], str(REPO))
    assert asked is not None and asked.num_processes == 8  # given, it is what the refusal names
    (line,) = launcher_problems(asked, 1, "on one CPU process")
    assert "whatever --num_processes 8 asks" in line


@pytest.mark.parametrize("kind", ["MULTI_CPU", "NO"])
def test_a_config_of_one_process_is_named_by_its_type(kind, tmp_path):
    config = tmp_path / "one.yaml"
    config.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: '{kind}'\nmixed_precision: 'no'\n"
                      "num_machines: 1\nnum_processes: 1\nuse_cpu: true\n")
    request = LauncherRequest.of_options(["--config_file", "one.yaml", "--num_processes", "2", "r.py"],
                                         str(tmp_path))
    assert request is not None and request.config_path == str(config) and request.distributed_type == kind
    assert launcher_problems(request, 1, "DDP") == [
        f"accelerate launch --num_processes 2 started one process: one.yaml runs one process (distributed_type "
        f"{kind}). Give it a config: accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 "
        f"{script_shown()} (on CPU with the recipe's --use_cpu true)."]


def test_the_default_config_is_found_as_accelerate_finds_it(tmp_path, monkeypatch):
    """Without --config_file the launcher reads accelerate's default config, unless its own --cpu is given; a --cpu
    after the script is the script's argument and changes nothing."""
    default = tmp_path / "default_config.yaml"
    default.write_text((REPO / "accelerate_configs" / "ddp.yaml").read_text())
    monkeypatch.setattr("accelerate.commands.config.config_args.default_config_file", str(default))
    monkeypatch.setattr("accelerate.commands.launch.default_config_file", str(default))
    after_the_script = LauncherRequest.of_options(["recipes/tiny.py", "--cpu"], str(REPO))
    assert after_the_script is not None and not after_the_script.cpu
    assert after_the_script.config_path == str(default) and after_the_script.distributed_type == "MULTI_GPU"
    launchers_own = LauncherRequest.of_options(["--cpu", "recipes/tiny.py"], str(REPO))
    assert launchers_own is not None and launchers_own.cpu and launchers_own.config_path == ""
