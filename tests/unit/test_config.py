"""Recipe overrides and the batch arithmetic."""

from __future__ import annotations

import os

import pytest

from shardtune.checks.startup import batch_sizes, validate
from shardtune.config import LR_SCHEDULERS, BatchSizes, ConfigError, Recipe
from shardtune.flags import parse_recipe
from shardtune.launch import LaunchDescription
from shardtune.schedule import check_schedule


def test_command_line_overrides_recipe_values():
    recipe = Recipe(name="x", learning_rate=1e-5, gradient_checkpointing=True, max_steps=10)
    overridden = parse_recipe(recipe, ["--learning_rate", "2e-4", "--gradient_checkpointing", "false"])
    assert overridden.learning_rate == 2e-4
    assert overridden.gradient_checkpointing is False
    assert overridden.max_steps == 10 and overridden.name == "x"  # untouched values keep the recipe's
    assert overridden.resolved_output_dir == "outputs/x"


def test_a_constant_schedule_given_alone_drops_the_recipes_warm_up():
    recipe = Recipe(warmup_ratio=0.03)
    constant = parse_recipe(recipe, ["--lr_scheduler_type", "constant"])
    assert (constant.warmup_ratio, constant.warmup_steps) == (0.0, 0)
    assert parse_recipe(recipe, ["--lr_scheduler_type", "constant", "--warmup_ratio", "0.1"]).warmup_ratio == 0.1
    no_warmup = parse_recipe(recipe, ["--lr_scheduler_type", "constant", "--warmup_steps", "0"])
    assert (no_warmup.warmup_ratio, no_warmup.warmup_steps) == (0.0, 0)
    check_schedule(no_warmup)


def test_accumulation_given_alone_replaces_the_recipes_global_batch():
    """As --warmup_steps replaces a recipe's warm-up ratio: --gradient_accumulation_steps alone sets the global
    batch; given with --global_batch_size, the two must agree."""
    recipe = Recipe(per_device_train_batch_size=2, global_batch_size=64)
    alone = parse_recipe(recipe, ["--gradient_accumulation_steps", "4"])
    assert alone.global_batch_size is None and batch_sizes(alone, 8) == BatchSizes(2, 4, 8)
    both = parse_recipe(recipe, ["--gradient_accumulation_steps", "4", "--global_batch_size", "32"])
    assert batch_sizes(both, 4) == BatchSizes(2, 4, 4)
    with pytest.raises(ConfigError, match="disagrees with --global_batch_size"):
        batch_sizes(parse_recipe(recipe, ["--gradient_accumulation_steps", "4", "--global_batch_size", "64"]), 4)


@pytest.mark.parametrize(("micro", "gas", "total", "world", "expected"), [
    (4, None, 64, 8, 2), (1, 16, None, 8, 16), (2, 4, 64, 8, 4), (16, None, None, 2, 1),
])
def test_accumulation_derived_from_global_batch(micro, gas, total, world, expected):
    recipe = Recipe(per_device_train_batch_size=micro, gradient_accumulation_steps=gas, global_batch_size=total)
    batching = batch_sizes(recipe, world)
    assert batching == BatchSizes(micro, expected, world)
    assert total is None or batching.global_batch == total


@pytest.mark.parametrize(("micro", "gas", "total", "world"), [(4, None, 60, 8), (2, 3, 64, 8), (0, None, 8, 1)])
def test_inconsistent_batches_refused(micro, gas, total, world):
    recipe = Recipe(per_device_train_batch_size=micro, gradient_accumulation_steps=gas, global_batch_size=total)
    with pytest.raises(ConfigError):
        batch_sizes(recipe, world)


@pytest.mark.parametrize(("env", "words"), [
    ({}, "one process"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "DDP"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
      "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"},
     "DeepSpeed ZeRO-3, optimizer offloaded to cpu, parameters offloaded to nvme"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "DeepSpeed ZeRO-2"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"},
     "FSDP2 SHARD_GRAD_OP"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"},
     "FSDP2 FULL_SHARD, parameters offloaded to cpu"),
])
def test_the_start_up_line_names_the_strategy_in_words(env, words, monkeypatch):
    """Not accelerate's enum value ("NO", "MULTI_CPU"): what runs, as the configs' names say it."""
    for name in [*os.environ]:
        if name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT") or name.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert LaunchDescription.from_env().description == words


@pytest.mark.parametrize("env", [
    {},  # one process, no launcher
    {"WORLD_SIZE": "16", "RANK": "15", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},  # 2 nodes, DDP
    {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
     "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
     "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"},
    {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
     "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none"},
    {"ACCELERATE_USE_DEEPSPEED": "true"},  # stage from a DeepSpeed JSON file
    {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false",
     "FSDP_SHARDING_STRATEGY": "FULL_SHARD"},  # what `accelerate launch` exports for fsdp_shard_grad_op.yaml
])
def test_good_launch_environments_pass(env, monkeypatch):
    for name in [*os.environ]:
        if name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT") or name.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launch = LaunchDescription.from_env()
    assert launch.world_size == int(env.get("WORLD_SIZE", 1))
    assert (launch.uses_deepspeed, launch.uses_fsdp) == ("ACCELERATE_USE_DEEPSPEED" in env,
                                                         "ACCELERATE_USE_FSDP" in env)


def test_good_recipe_passes_validation(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "rev ab=", "completion": "ba"}\n')
    recipe = Recipe(model_name_or_path="some/model", dataset=str(data), output_dir=str(tmp_path / "out"),
                    per_device_train_batch_size=4, global_batch_size=32, resume_from_checkpoint="auto",
                    use_cpu=True)
    assert validate(recipe, LaunchDescription(world_size=8), has_gpu=False) == BatchSizes(4, 1, 8)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", LR_SCHEDULERS)
def test_accepted_schedulers_step_without_arguments(name):
    """The names --lr_scheduler_type accepts build and step as the trainer calls them: no kwargs, no metric."""
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=1, num_training_steps=4)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
