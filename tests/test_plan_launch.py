"""A launched recipe plans its memory on every rank before loading anything, and refuses a plan that does not
fit with the numbers and the nearest plan that does."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

from shardtune.flops import recipe_fields
from tests.conftest import ENV, REPO, run_recipe


def test_70b_zero3_on_one_h100_node_refused_before_loading(tiny_assets, tmp_path):
    output_dir = tmp_path / "out"
    result = run_recipe(output_dir, tiny_assets, "--model_name_or_path", "meta-llama/Llama-3.1-70B",
                        "--hardware", "8xh100-80gb", config="ds_zero3", processes=2,
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
    too_big = dry_run("llama405b.py", "8xh100-80gb")
    assert too_big.returncode == 2 and "DOES NOT FIT" in too_big.stdout
    refused = dry_run("llama8b.py", "3x8xh100-80gb", "--mixed_precision", "fp8", "--lora_r", "0", "--use_peft",
                      "true")
    errors = [line for line in refused.stderr.splitlines() if line.startswith("shardtune: error:")]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and len(errors) == 3, refused.stderr
    assert "--mixed_precision must be one of" in errors[0] and "LoRA needs --lora_r >= 1" in refused.stderr
    assert "not divisible by per_device_train_batch_size x processes" in refused.stderr  # 64 over 24 GPUs
    assert not list(tmp_path.iterdir())  # nothing written


def load_plan_table():
    spec = importlib.util.spec_from_file_location("plan_table", REPO / "scripts" / "plan_table.py")
    plan_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_table)
    return plan_table


def test_plan_table_doc_is_current():
    plan_table = load_plan_table()
    doc = plan_table.TABLE_DOC.read_text()
    assert plan_table.doc_with_table(doc) == doc, "run: python scripts/plan_table.py --write"
    assert "| llama-3.1-70b | 8xh100-80gb | ds_zero3_offload_optimizer |" in doc


def test_every_recipe_follows_its_plan():
    """Each recipe header's plan is the planner's, and the recipe launches what it plans: the config in its
    launch line, its micro-batch and checkpointing, and the node count it needs."""
    plan_table = load_plan_table()
    readme = (REPO / "README.md").read_text()
    for path in plan_table.model_recipes():
        text = path.read_text()
        assert plan_table.recipe_with_plan(path) == text, f"{path.name}: run python scripts/plan_table.py --write"
        nodes, found = plan_table.recipe_plan(path)
        fields = recipe_fields(str(path))
        launch = re.search(r"accelerate launch --config_file accelerate_configs/(\S+)\.yaml", text)
        assert launch and launch.group(1) == found.plan.config, path.name
        assert fields["per_device_train_batch_size"] == found.plan.micro_batch, path.name
        assert fields["gradient_checkpointing"] == found.plan.gradient_checkpointing, path.name
        assert (f"--num_machines {nodes} " in text) == (nodes > 1), path.name
        assert f"| `recipes/{path.name}` | " in readme and f"| `{found.plan.config}`" in readme.split(
            f"| `recipes/{path.name}` | ")[1].split("\n")[0], f"README's recipe table: {path.name}"
