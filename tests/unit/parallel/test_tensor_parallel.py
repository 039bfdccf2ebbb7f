"""Tensor parallelism without launching it: the launches accelerate or the trainer cannot run and the recipes and
models TP cannot split, each refused in one line before anything loads; the batch over the data ranks. Its training
runs are in tests/launch/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from shardtune.checks.startup import batch_sizes
from shardtune.config import BatchSizes, ConfigError, Recipe
from shardtune.flags import given_fields, parse_recipe
from shardtune.launch import LaunchDescription
from shardtune.parallel.tensor import check_tensor_parallel, check_tensor_parallel_heads
from tests.conftest import REPO
from tests.unit.checks.test_checks_shared import no_launch  # noqa: F401 (autouse fixture)

ZERO3_JSON = str(REPO / "accelerate_configs" / "deepspeed" / "zero3.json")
KINDS = {
    "fsdp": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
    "ddp": {},
    "deepspeed": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO3_JSON},
}


def tp_launch(monkeypatch, kind: str, world: int, **sizes: str) -> None:
    env = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", "ACCELERATE_USE_PARALLELISM_CONFIG": "true", **KINDS[kind]}
    env.update({f"PARALLELISM_CONFIG_{name.upper()}": value for name, value in sizes.items()})
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(("kind", "world", "sizes", "description"), [
    ("fsdp", 16, {"tp_size": "8", "dp_shard_size": "2"}, "FSDP2 FULL_SHARD, tensor parallel over 8 ranks"),
    ("ddp", 2, {"tp_size": "2"}, "tensor parallel over 2 ranks"),
])
def test_a_tensor_parallel_launch_is_described_with_its_data_ranks(kind, world, sizes, description, monkeypatch):
    tp_launch(monkeypatch, kind, world, **sizes)
    launch = LaunchDescription.from_env()
    assert launch.description == description
    assert launch.data_parallel_size == world // int(sizes["tp_size"])


LAUNCH_REFUSALS = {
    "under DeepSpeed": ("deepspeed", 8, {"tp_size": "2"}, "runs tensor parallelism under FSDP2 only"),
    "beside DDP replicas": ("ddp", 4, {"tp_size": "2"}, "accelerate runs tensor parallelism without FSDP2 only over "
                                                        "every process"),
    "FSDP2 without a dp_shard axis": ("fsdp", 2, {"tp_size": "2"}, "accelerate needs a dp_shard axis"),
    "a size that does not divide the ranks": ("fsdp", 6, {"tp_size": "4", "dp_shard_size": "2"},
                                              "parallelism_config_tp_size 4 does not divide the 6 processes"),
    "sizes that miss the ranks": ("fsdp", 8, {"tp_size": "2", "dp_shard_size": "2"},
                                  "dp_replicate_size 1 x dp_shard_size 2 x tp_size 2 is not the 8 processes"),
}


@pytest.mark.parametrize("case", LAUNCH_REFUSALS)
def test_a_tensor_parallel_launch_the_trainer_cannot_run_is_refused_in_one_line(case, monkeypatch):
    kind, world, sizes, message = LAUNCH_REFUSALS[case]
    tp_launch(monkeypatch, kind, world, **sizes)
    with pytest.raises(ConfigError) as error:
        LaunchDescription.from_env()
    (line,) = error.value.messages
    assert message in line and "\n" not in line


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "refused"), [
    (12, 4, 8, "The model has 12 attention heads, which tp_size 8 does not divide"),
    (32, 4, 8, "The model has 4 key/value heads, which tp_size 8 does not divide"),
    (128, 8, 8, None),  # Llama-3.1-405B on a node's 8 GPUs
])
def test_tp_must_divide_the_heads_and_the_key_value_heads(heads, kv_heads, tp, refused):
    config = LlamaConfig(hidden_size=heads * 8, num_attention_heads=heads, num_key_value_heads=kv_heads)
    if refused is None:
        check_tensor_parallel_heads(config, tp)
        return
    with pytest.raises(ConfigError, match=refused):
        check_tensor_parallel_heads(config, tp)


def test_a_model_without_a_tensor_parallel_plan_is_refused():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    config.base_model_tp_plan = None
    with pytest.raises(ConfigError, match="transformers has no tensor-parallel plan for llama models"):
        check_tensor_parallel_heads(config, 2)
    check_tensor_parallel_heads(config, 1)  # without TP no plan is needed


def test_a_transformers_without_the_plan_tp_splits_on_is_refused(monkeypatch):
    """transformers 5.17 (the device tool's own) resolves no plan and adds no embedding rule: refused in one line
    before anything loads."""
    from transformers import PreTrainedModel

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    check_tensor_parallel_heads(config, 2)
    owner = next(cls for cls in PreTrainedModel.__mro__ if "_resolve_parallel_plans" in vars(cls))
    monkeypatch.delattr(owner, "_resolve_parallel_plans")
    with pytest.raises(ConfigError) as error:
        check_tensor_parallel_heads(config, 2)
    (line,) = error.value.messages
    assert "transformers 5.24 resolves" in line and "pip install -r requirements.txt" in line and "\n" not in line
    check_tensor_parallel_heads(config, 1)  # without TP it is not needed


RECIPE_REFUSALS = {
    "dpo": (["--method", "dpo"], "--method dpo under tensor parallelism (tp_size 2) is not wired"),
    "the tiled loss asked for": (["--chunked_cross_entropy", "true"], "--chunked_cross_entropy true under tensor "
                                                                      "parallelism"),
    "LoRA": (["--use_peft", "true"], "--use_peft true under tensor parallelism"),
    "fp8": (["--mixed_precision", "fp8"], "--mixed_precision fp8 under tensor parallelism"),
    "compile": (["--torch_compile", "true"], "--torch_compile true under tensor parallelism (tp_size 2) is not "
                                            "supported yet"),
    "activation offloading": (["--activation_offloading", "true"], "--activation_offloading true under tensor "
                                                                  "parallelism"),
}


@pytest.mark.parametrize("case", RECIPE_REFUSALS)
def test_what_tp_cannot_run_with_is_refused(case):
    argv, message = RECIPE_REFUSALS[case]
    recipe = parse_recipe(Recipe(), argv)
    with pytest.raises(ConfigError) as error:
        check_tensor_parallel(recipe, 2, given_fields(Recipe(), argv))
    assert any(message in line for line in error.value.messages), error.value.messages
    check_tensor_parallel(recipe, 1, given_fields(Recipe(), argv))  # without TP: nothing to refuse


def test_the_tiled_loss_by_default_is_not_refused_under_tp():
    """On by default, it gives way to the plain loss under TP (the trainer's step): only asking for it is refused."""
    check_tensor_parallel(Recipe(), 2, frozenset())


def test_the_global_batch_counts_the_data_ranks():
    """The ranks of a tensor-parallel group run the same rows: 16 processes at tp 8 are 2 data ranks."""
    recipe = Recipe(per_device_train_batch_size=2, global_batch_size=64)
    batching = batch_sizes(recipe, 16, 8)
    assert batching == BatchSizes(2, 16, 16, 8) and batching.global_batch == 64
    with pytest.raises(ConfigError, match=r"data ranks \(processes / tp_size 8\) = 2 x 2 = 4"):
        batch_sizes(Recipe(per_device_train_batch_size=2, global_batch_size=66), 16, 8)
