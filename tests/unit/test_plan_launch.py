"""The plans users read are the planner's: the generated plan table (docs/plan-table.md) and the README's
recipes table agree with what the planner says of each recipe. Launched refusals are in
tests/launch/test_plan_launch.py."""

from __future__ import annotations

import importlib.util
import re

from shardtune.flops import recipe_fields
from tests.conftest import REPO


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
