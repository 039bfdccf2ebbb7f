"""The plans users read are the planner's: the generated plan table (docs/plan-table.md) and the README's
recipes table agree with what the planner says of each recipe. Launched refusals are in
tests/launch/test_plan_launch.py."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest

from shardtune.cli import main
from shardtune.models.flops import recipe_fields
from tests.conftest import REPO, load_script


def test_plan_table_doc_is_current():
    plan_table = load_script("plan_table")
    doc = plan_table.TABLE_DOC.read_text()
    assert plan_table.doc_with_table(doc) == doc, "run: python scripts/plan_table.py --write"
    assert ("| llama-3.1-70b | 8xh100-80gb | fsdp_full_shard | on | adamw_torch_8bit with bf16 stochastic rounding "
            "(no fp32 master) |") in doc


def test_every_recipe_follows_its_plan():
    """Each recipe header's plan is the planner's, and the recipe launches what it plans: the config in its
    launch line, its micro-batch, checkpointing and checkpointing mode, and the node count it needs."""
    plan_table = load_script("plan_table")
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
        if found.plan.gradient_checkpointing:
            assert fields.get("gradient_checkpointing_mode", "full") == found.plan.gradient_checkpointing_mode, (
                path.name)
        assert (f"--num_machines {nodes} " in text) == (nodes > 1), path.name
        assert f"| `recipes/{path.name}` | " in readme and f"| `{found.plan.config}`" in readme.split(
            f"| `recipes/{path.name}` | ")[1].split("\n")[0], f"README's recipe table: {path.name}"


def test_a_qlora_dry_run_plans_without_bitsandbytes(monkeypatch, capsys):
    """Planning loads nothing: QLoRA's --dry_run needs no bitsandbytes (a run that loads the model still does)."""
    for name in [*os.environ]:
        if name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or name.startswith(
                ("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # importlib.util.find_spec then answers None
    spec = importlib.util.spec_from_file_location("qlora_recipe", REPO / "recipes" / "llama70b_qlora.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with pytest.raises(SystemExit) as exit_info:
        main(recipe.RECIPE, ["--dry_run", "--hardware", "1xh100-80gb", "--config_file",
                             str(REPO / "accelerate_configs" / "ddp.yaml")])
    assert exit_info.value.code == 0, capsys.readouterr().err[-2000:]
    assert "-> fits" in capsys.readouterr().out
