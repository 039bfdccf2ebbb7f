"""A --dry_run makes the checks a launch makes, under the launch it plans (checks.NOT_IN_DRY_RUN lists the few it
leaves out); accelerate config files are read for keys accelerate would ignore; the planner answers a name it
cannot plan at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub.constants
import pytest

from shardtune import hub
from shardtune.checks.launch_config import accelerate_config_problems
from shardtune.cli import checked_launch, main
from shardtune.config import ConfigError, Recipe
from shardtune.parallel.planned_launch import launch_environment, planned_launch_environment
from shardtune.plan import search
from shardtune.plan.__main__ import main as plan_main
from tests.conftest import REPO

CONFIGS = REPO / "accelerate_configs"
PLANNED = Recipe(name="x", model_name_or_path="llama-3.2-1b", max_seq_length=512, per_device_train_batch_size=1,
                 global_batch_size=16, report_to="none")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Whatever the shell running the tests exported must not leak into a case."""
    for name in [*os.environ]:
        if name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") or \
                name.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            monkeypatch.delenv(name)


def dry_run_errors(capsys, config: str, *args: str, hardware: str = "8xh100-80gb", recipe: Recipe = PLANNED
                   ) -> list[str]:
    """The error lines of a dry run of `recipe` planning `config` on `hardware` ([] when it plans)."""
    with pytest.raises(SystemExit) as exit_info:
        main(recipe, ["--dry_run", "--hardware", hardware, "--config_file", config, *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("shardtune: error:")]
    assert (exit_info.value.code == 2) == bool(errors), err[-2000:]
    return errors


# (accelerate config, flags, what the launch and the dry run both refuse). Each passed the dry run before: it
# checked the command line alone, not against the launch it planned.
LAUNCH_REFUSALS = {
    "compile under ZeRO-3": ("ds_zero3", ("--torch_compile", "true"), "--torch_compile under ZeRO-3"),
    "NVMe offload without a directory": ("ds_zero3_nvme_offload", (), "pass --offload_nvme_path"),
    "NVMe directory without NVMe offload": ("fsdp_full_shard", ("--offload_nvme_path", "/nvme"),
                                            "--offload_nvme_path is used only with NVMe offload"),
    "stochastic rounding over DDP replicas": ("ddp", ("--bf16_stochastic_round", "true"),
                                              "DDP's replicas draw independently"),
    "LoRA flag at its default without LoRA": ("fsdp_full_shard", ("--lora_alpha", "32"),
                                              "--lora_alpha shapes LoRA adapters, which train only with --use_peft"),
}


@pytest.mark.parametrize("case", LAUNCH_REFUSALS)
def test_the_dry_run_refuses_what_the_launch_refuses(case, capsys, tiny_assets, tmp_path):
    """The dry run of a config and the launch under that config (as accelerate's launcher exports it, here on
    this CPU machine) refuse the same command line with the same line."""
    config, args, refusal = LAUNCH_REFUSALS[case]
    config_file = str(CONFIGS / f"{config}.yaml")
    assert any(refusal in line for line in dry_run_errors(capsys, config_file, *args)), case
    model_dir, data_file = tiny_assets
    argv = ["--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir", str(tmp_path / "out"),
            "--use_cpu", "true", "--report_to", "none", *args]
    recipe = Recipe(name="tiny", max_seq_length=64, per_device_train_batch_size=1)
    with launch_environment(planned_launch_environment(config_file, 1, 2)), pytest.raises(ConfigError) as error:
        checked_launch(recipe, argv)
    assert any(refusal in message for message in error.value.messages), error.value.messages


def test_the_planned_gpu_is_judged(capsys):
    """fp8's float8 tensor cores are the planned GPUs': an A100 has none (the launch asks its own GPU)."""
    fsdp = str(CONFIGS / "fsdp_full_shard.yaml")
    errors = dry_run_errors(capsys, fsdp, "--mixed_precision", "fp8", hardware="8xa100-80gb")
    assert errors and "this GPU's is 8.0" in errors[0], errors
    assert dry_run_errors(capsys, fsdp, "--mixed_precision", "fp8", hardware="8xh100-80gb") == []


def test_shipped_configs_set_only_keys_accelerate_reads():
    for path in sorted(CONFIGS.glob("*.yaml")):
        assert accelerate_config_problems(str(path)) == [], path.name


TYPOS = {
    # (the key as written, its section, the key accelerate reads)
    "fsdp_ofload_params": ("fsdp_config", "fsdp_offload_params"),
    "fsdp_reshard_after_foward": ("fsdp_config", "fsdp_reshard_after_forward"),
    "zero3_init_flg": ("deepspeed_config", "zero3_init_flag"),
    "parallelism_config_dp_shard_sise": ("parallelism_config", "parallelism_config_dp_shard_size"),
}


@pytest.mark.parametrize("typo", TYPOS)
def test_a_misspelt_config_key_is_refused_with_the_nearest(typo, tmp_path, capsys):
    """accelerate copies a section's keys onto its launcher's arguments and ignores one it has no argument for:
    the run would go without the setting. The dry run names it and the key meant."""
    section, meant = TYPOS[typo]
    source = {"fsdp_config": "fsdp_hybrid_shard", "parallelism_config": "fsdp_hybrid_shard"}.get(section, "ds_zero3")
    text = (CONFIGS / f"{source}.yaml").read_text()
    assert f"  {meant}:" in text
    config = tmp_path / "typo.yaml"
    config.write_text(text.replace(f"  {meant}:", f"  {typo}:"))
    (line,) = dry_run_errors(capsys, str(config))
    assert f"sets {section}: {typo!r}, which accelerate does not read" in line and line.endswith(
        f"did you mean {meant}?"), line


def test_a_misspelt_top_level_key_is_refused_with_the_nearest(tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text((CONFIGS / "ddp.yaml").read_text().replace("mixed_precision:", "mixed_precison:"))
    assert accelerate_config_problems(str(config)) == [
        f"The accelerate config {config} sets 'mixed_precison', which accelerate does not know: did you mean "
        "mixed_precision?"]


def test_a_launched_rank_finds_its_launchers_config(tmp_path):
    """`accelerate launch` exports no variable naming its config file: a rank reads it from its launcher's
    command line (here a real parent process whose command line is accelerate's), relative to its directory."""
    (tmp_path / "typo.yaml").write_text((CONFIGS / "fsdp_full_shard.yaml").read_text().replace(
        "fsdp_offload_params:", "fsdp_ofload_params:"))
    rank = ("from shardtune.checks.launch_config import accelerate_config_problems\n"
            "from shardtune.parallel.launcher_args import this_launcher\n"
            "path = this_launcher().config_path\nprint(path)\nprint(accelerate_config_problems(path))\n")
    launcher = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {rank!r}], check=True)\n"
    result = subprocess.run([sys.executable, "-c", launcher, "accelerate", "launch", "--config_file", "typo.yaml",
                             "--num_processes", "1", "train.py", "--config_file", "other.yaml"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                                           "PYTHONPATH": str(REPO)})
    path, problems = result.stdout.splitlines()
    assert path == str(tmp_path / "typo.yaml"), result.stderr[-2000:]
    assert "did you mean fsdp_offload_params?" in problems


@pytest.mark.parametrize(("args", "refusal"), [
    (("--max_steps", "0"), "--max_steps must be > 0 (optimizer steps), or -1 to train --num_train_epochs epochs; "
                           "got 0."),
    (("--max_steps", "-5"), "--max_steps must be > 0"),
    (("--max_steps", "10", "--num_train_epochs", "2"), "--num_train_epochs would be ignored: --max_steps 10 sets"),
    (("--gradient_checkpointing", "false", "--gradient_checkpointing_mode", "full"),
     "--gradient_checkpointing_mode full chooses what checkpointed layers keep"),
    (("--torch_compile_backend", "inductor"), "--torch_compile_backend configures compilation"),
])
def test_nonsense_and_flags_that_would_not_act_are_refused(args, refusal, capsys):
    """Also a flag given at its default value: given, so it would act or is refused."""
    errors = dry_run_errors(capsys, str(CONFIGS / "fsdp_full_shard.yaml"), *args)
    assert len(errors) == 1 and refusal in errors[0], errors


def test_hardware_outside_a_dry_run_must_be_the_launchs(tiny_assets, tmp_path):
    """--hardware plans the launch against that hardware: on a one-process CPU run an 8-GPU plan is another run's."""
    model_dir, data_file = tiny_assets
    argv = ["--model_name_or_path", model_dir, "--dataset", data_file, "--output_dir", str(tmp_path / "out"),
            "--use_cpu", "true", "--report_to", "none", "--hardware", "8xh100-80gb"]
    with pytest.raises(ConfigError) as error:
        checked_launch(Recipe(name="tiny", max_seq_length=64), argv)
    assert error.value.messages == ["--hardware 8xh100-80gb plans GPUs, and this run trains on CPU (--use_cpu true): "
                                    "drop it, or plan that hardware with --dry_run --hardware 8xh100-80gb."]


def test_the_planner_answers_a_name_it_cannot_plan_at_once(capsys):
    """Neither a path, a built-in name nor a Hub id (owner/name): the nearest built-in, without asking the Hub."""
    start = time.monotonic()
    assert plan_main(["--model", "llama-3-8b"]) == 2
    assert time.monotonic() - start < 5
    (line,) = capsys.readouterr().err.splitlines()
    assert "--model 'llama-3-8b' is no built-in name, local directory or Hub model id (owner/name): did you mean " \
           "llama-3.1-8b?" in line


def test_a_hub_out_of_reach_fails_at_once(monkeypatch, capsys, tmp_path):
    """huggingface_hub retries a file it cannot fetch for about 25 s: one probe decides, and the lookup then
    fails from the cache in one line."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "_unreachable", [])
    start = time.monotonic()
    assert plan_main(["--model", "shardtune-tests/no-such-model"]) == 2
    assert time.monotonic() - start < 15
    (line,) = capsys.readouterr().err.splitlines()
    assert "Cannot reach the Hugging Face Hub (http://127.0.0.1:9" in line


def test_a_long_search_says_how_far_it_got(monkeypatch, capsys):
    """The search over node counts for a plan that fits prints its progress on stderr."""
    from shardtune.models.flops import resolve_model
    from shardtune.plan.hardware import parse_hardware

    monkeypatch.setattr(search, "PROGRESS_EVERY_S", 0.0)
    found = search.fewest_nodes(resolve_model("llama-3.1-70b"), parse_hardware("1x80gb"), search.Search(),
                                gpu_only=True)
    assert found is not None and found[0] > 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == found[0] - 1 and lines[-1] == (
        f"planning llama-3.1-70b: nothing GPU-only fits {found[0] - 1} nodes of 1x80gb; trying {found[0]} (up to "
        f"{search.MAX_NODES})..."), lines


def test_the_dry_run_leaves_out_only_what_it_says(capsys, tmp_path):
    """The output dir of an earlier run and a dataset that is not here are the training machine's."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    errors = dry_run_errors(capsys, str(CONFIGS / "fsdp_full_shard.yaml"), "--output_dir", str(tmp_path),
                            "--dataset", str(tmp_path / "missing.jsonl"))
    assert errors == []
    assert Path(tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
