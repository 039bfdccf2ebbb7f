"""The scripts behave like the CLI: --help prints their options and exits before any work starts, and a bad input
is one line naming the problem, exit code 2, before anything is launched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from shardtune.config import Recipe
from shardtune.flags import parse_recipe
from shardtune.levers.catalogue import LEVERS, PLAIN_FLAGS
from tests.conftest import CONFIGS, REPO, load_script
from tests.unit.test_help import help_entries

SCRIPTS = sorted(path.name for path in (REPO / "scripts").glob("*.py"))


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_every_option_and_exits(script):
    result = run(f"scripts/{script}", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {script}"), result.stdout[:500]
    entries = help_entries(result.stdout)
    assert not [option for option, text in entries.items() if not text], f"{script}: options without help"
    # Nothing ran: no op compiled, no plan table printed.
    assert "deepspeed op" not in result.stdout and "|---" not in result.stdout


def test_every_script_refuses_a_bad_flag_in_one_line():
    """argparse's own refusal (shardtune.checks.command_line) as a recipe's: one line on stderr naming the flag
    (or the argument the script needs first), no usage block, exit code 2. All scripts at once: 2 cores."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000"}
    started = {script: subprocess.Popen([sys.executable, f"scripts/{script}", "--no_such_flag"], cwd=REPO, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for script in SCRIPTS}
    wrong = {}
    for script, process in started.items():
        out, err = process.communicate(timeout=120)
        named = "--no_such_flag" in err or "arguments are required" in err
        one_line = len(err.splitlines()) == 1 and "error: Bad command line: " in err and "usage:" not in err
        if process.returncode != 2 or out or not (one_line and named):
            wrong[script] = (process.returncode, err[-300:])
    assert not wrong, wrong


def test_bench_refuses_a_missing_recipe_before_launching():
    result = run("scripts/bench.py", "--config_file", "accelerate_configs/ddp.yaml", "--recipe", "recipes/nothere.py")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["bench.py: error: --recipe 'recipes/nothere.py' does not exist: give a "
                                          "recipe file, e.g. recipes/tiny.py."]


def test_bench_refuses_impossible_numbers_before_launching():
    result = run("scripts/bench.py", "--config_file", "nothere.yaml", "--recipe", "recipes/tiny.py",
                 "--num_processes", "0", "--steps", "5", "--warmup", "5")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 3 and all(line.startswith("bench.py: error: ") for line in lines), lines
    assert "--config_file 'nothere.yaml' does not exist" in lines[0]
    assert lines[1] == "bench.py: error: --num_processes must be > 0, got 0."
    assert "--warmup must be >= 0 and below --steps (5), got 5" in lines[2]


def test_flops_unknown_gpu_is_one_clean_line():
    result = run("-m", "shardtune.models.flops", "--model", "llama-3.1-8b", "--tokens_per_second", "1000",
                 "--gpus", "8", "--gpu", "h1000")
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "shardtune.models.flops: warning: Unknown GPU 'h1000': no BF16 peak known, so no MFU is reported."]
    assert "MFU: unknown GPU peak, not reported" in result.stdout


def test_build_deepspeed_ops_builds_what_the_shipped_configs_need():
    ops = {op.builder: set(op.configs) for op in load_script("build_deepspeed_ops").needed_ops(
        sorted(CONFIGS.glob("*.yaml")))}
    deepspeed = {path.stem for path in CONFIGS.glob("ds_*.yaml")}
    assert ops == {"ShareMemCommBuilder": deepspeed,
                   "CPUAdamBuilder": {"ds_zero3_cpu_offload", "ds_zero3_nvme_offload", "ds_zero3_offload_optimizer",
                                      "ds_zero3_offload_optimizer_ulysses"},
                   "AsyncIOBuilder": {"ds_zero3_nvme_offload"}}


@pytest.mark.parametrize("accelerator", ["cuda", "cpu"])
def test_build_deepspeed_ops_asks_each_accelerator_only_for_the_ops_it_has(accelerator):
    """DeepSpeed's CUDA accelerator (constructible without a GPU) lists no shared-memory collectives op: the
    script names it and builds the others; the CPU accelerator has all three."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    script = load_script("build_deepspeed_ops")
    ops = script.needed_ops(sorted(CONFIGS.glob("*.yaml")))
    present, absent = script.split_by_accelerator(ops, {"cuda": CUDA_Accelerator, "cpu": CPU_Accelerator}[
        accelerator]())
    built = {builder.NAME for _, builder in present}
    if accelerator == "cuda":
        assert [op.builder for op in absent] == ["ShareMemCommBuilder"]
        assert built == {"cpu_adam", "async_io"}
    else:
        assert absent == [] and built == {"cpu_adam", "async_io", "deepspeed_shm_comm"}


def test_bench_levers_rows_run_each_lever_where_it_runs():
    """scripts/bench.py --levers: the plain path turns every lever off; each lever's row is the plain flags and its
    own (the last value of a flag is the one parsed); the combination adds the precision-free levers that run here;
    a lever that cannot run under the launch says why instead of failing mid-table."""
    bench = load_script("bench")
    plain = dict(zip(PLAIN_FLAGS[::2], PLAIN_FLAGS[1::2], strict=True))
    assert plain["--chunked_cross_entropy"] == plain["--torch_compile"] == "false"
    rows = {name: (flags, why) for name, flags, why in bench.lever_rows("deepspeed", 3, 2, "no", False, cuda=False)}
    assert rows["plain"] == (PLAIN_FLAGS, "")
    assert rows["8-bit AdamW states"][1] == "not under DeepSpeed"
    assert rows["activation offloading, layers recomputed"][1] == rows["Liger kernels"][1] == "needs CUDA"
    assert rows["packing to full rows"][1] == "needs --packing true"
    assert rows["4-bit states, no fp32 master"][1] == "not under DeepSpeed"
    (combined,) = [name for name in rows if name.startswith("recommended")]
    assert combined == "recommended: loss in tiles"
    assert rows["compiled layers"][1] == "not under ZeRO-3"
    fsdp = [(name, flags) for name, flags, _ in bench.lever_rows("fsdp", 3, 2, "no", False, cuda=False)]
    assert fsdp[-1][0] == "recommended: loss in tiles + compiled layers"
    recipe = parse_recipe(Recipe(), list(fsdp[-1][1]))
    assert recipe.chunked_cross_entropy and recipe.torch_compile and recipe.optim == "adamw_torch"
    for lever in LEVERS:  # each lever's row parses as a recipe: the flags exist and their values are valid
        recipe = parse_recipe(Recipe(packing=True, mixed_precision="bf16"), list(rows[lever.name][0]))
        assert recipe.chunked_cross_entropy is (lever.name in ("loss in tiles", "Liger kernels"))
        assert recipe.use_liger_kernel is (lever.name == "Liger kernels")
    on_gpus = {name: why for name, _, why in bench.lever_rows("fsdp", 3, 8, "bf16", True, cuda=True)}
    assert not any(on_gpus.values()), on_gpus
    assert "packing to full rows" in [name for name in on_gpus if name.startswith("recommended")][0]


def test_merge_lora_other_base_merges_into_the_base_named(tiny_assets, tmp_path):
    """--other_base acts: an adapter whose recorded base is found merges into the --base named (here a copy of that
    base, as a user keeps one on a faster disk), and the merge is the adapter's: the merged weights differ from the
    base's by B·A·α/r."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    merge_lora = load_script("merge_lora")
    model_dir = tiny_assets[0]
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    model.save_pretrained(tmp_path / "adapter")
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    assert merge_lora.main([str(tmp_path / "adapter"), str(tmp_path / "refused"), "--base", str(copy)]) == 2
    assert merge_lora.main([str(tmp_path / "adapter"), str(tmp_path / "merged"), "--base", str(copy),
                            "--other_base"]) == 0
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).state_dict()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * 8 / 4
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(merged[name], base[name] + delta)
    assert not (tmp_path / "refused").exists()
