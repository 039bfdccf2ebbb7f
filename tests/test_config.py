"""Recipe overrides and the batch arithmetic."""

from __future__ import annotations

import pytest

from shardtune.config import BatchPlan, ConfigError, Recipe, parse_recipe, plan_batches


def test_command_line_overrides_recipe_values():
    recipe = Recipe(name="x", learning_rate=1e-5, gradient_checkpointing=True, max_steps=10)
    overridden = parse_recipe(recipe, ["--learning_rate", "2e-4", "--gradient_checkpointing", "false"])
    assert overridden.learning_rate == 2e-4
    assert overridden.gradient_checkpointing is False
    assert overridden.max_steps == 10 and overridden.name == "x"  # untouched values keep the recipe's
    assert overridden.resolved_output_dir == "outputs/x"


@pytest.mark.parametrize(("micro", "gas", "total", "world", "expected"), [
    (4, None, 64, 8, 2), (1, 16, None, 8, 16), (2, 4, 64, 8, 4), (16, None, None, 2, 1),
])
def test_accumulation_derived_from_global_batch(micro, gas, total, world, expected):
    recipe = Recipe(per_device_train_batch_size=micro, gradient_accumulation_steps=gas, global_batch_size=total)
    plan = plan_batches(recipe, world)
    assert plan == BatchPlan(micro, expected, world)
    assert total is None or plan.global_batch == total


@pytest.mark.parametrize(("micro", "gas", "total", "world"), [(4, None, 60, 8), (2, 3, 64, 8), (0, None, 8, 1)])
def test_inconsistent_batches_refused(micro, gas, total, world):
    recipe = Recipe(per_device_train_batch_size=micro, gradient_accumulation_steps=gas, global_batch_size=total)
    with pytest.raises(ConfigError):
        plan_batches(recipe, world)
