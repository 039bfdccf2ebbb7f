"""Every recipe is declarative, named after its file, launchable with a shipped config, and overridable."""

from __future__ import annotations

import importlib.util
import re

import pytest

from shardtune.config import Recipe
from shardtune.flags import parse_recipe
from tests.conftest import CONFIGS, REPO

RECIPES = sorted(path for path in (REPO / "recipes").glob("*.py") if path.stem != "tiny")
EXPECTED = {"llama1b", "llama3b", "llama8b", "llama70b", "llama405b", "mistral7b", "qwen2_5_7b", "llama8b_lora",
            "llama70b_lora", "llama70b_qlora"}


def load(path) -> Recipe:
    spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RECIPE


def test_all_model_recipes_exist():
    assert {path.stem for path in RECIPES} == EXPECTED


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_recipe_declares_and_names_its_launch(path):
    recipe = load(path)
    assert recipe.name == path.stem and recipe.model_name_or_path
    assert recipe.mixed_precision == "bf16"  # checkpointing and micro-batch: test_every_recipe_follows_its_plan
    header = path.read_text().split('"""')[1]
    config = re.search(r"--config_file accelerate_configs/(\w+)\.yaml", header).group(1)
    assert (CONFIGS / f"{config}.yaml").is_file()
    assert f"recipes/{path.name}" in header
    assert parse_recipe(recipe, ["--max_steps", "5"]).max_steps == 5
