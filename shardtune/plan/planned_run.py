"""The run the planner CLI plans: a recipe's fields as the recipe runs them (Recipe's defaults for what it leaves
out), or a bare model's planner defaults, with the command line's flags over them; the recipe's own refusals that
concern a plan; and the plan and the search of that run."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection

from shardtune.checks.model import check_context_length, expert_refusals
from shardtune.checks.startup import batch_sizes
from shardtune.checks.values import (
    check_activation_offloading,
    check_checkpointing_mode,
    check_packed_attention,
    check_pad_to_multiple_of,
)
from shardtune.config import PLANNED_ATTENTION, ConfigError, Problems, Recipe, padded_length, reference_mode
from shardtune.levers.liger import check_liger_kernel
from shardtune.models.flops import ModelError, ModelShape, recipe_fields, resolve_config, shape_from_config
from shardtune.plan.hardware import Hardware
from shardtune.plan.planner import MemoryPlan, plan
from shardtune.plan.search import Search
from shardtune.plan.states import Peft
from shardtune.plan.strategy import CONFIGS_DIR, PlanError, Strategy

# The optimizer is a choice of numerics, not of layout: the alternatives offered for a recipe's run keep it.
HELD_OPTIMIZER = ("optim", "bf16_stochastic_round")
# A bare model's run, where Recipe's defaults are not what the planner assumes: 4096 tokens, recomputation on.
MODEL_DEFAULTS = {"max_seq_length": 4096, "gradient_checkpointing": True}


def is_recipe(model: str) -> bool:
    return model.endswith(".py")


def planned_recipe(model: str, flags: dict[str, object]) -> Recipe:
    """The run of `--model`: the recipe file's literal fields, or MODEL_DEFAULTS, with `flags` (Recipe field ->
    the value given on the command line, None where not given) over them."""
    base = ({name: value for name, value in recipe_fields(model).items() if value is not None}
            if is_recipe(model) else dict(MODEL_DEFAULTS))
    return dataclasses.replace(Recipe(**base), **{name: value for name, value in flags.items() if value is not None})


def check_planned(recipe: Recipe, model_config: object) -> None:
    """The recipe's own refusals that concern the plan, by the recipe's rules (a plan is for GPUs): the model has
    room for --max_seq_length, a packed row gets a kernel without a dense mask, Liger's kernels run with the
    rest, the padding multiple suits the precision, offloaded activations come from recomputed layers, the
    checkpointing mode and interval have checkpointing to act on, and a mixture of experts takes the levers asked.
    Raises one ConfigError with every failure."""
    problems = Problems()
    problems.check(check_context_length, recipe, model_config)
    problems.check(check_packed_attention, recipe)
    problems.check(check_liger_kernel, recipe)
    problems.check(check_pad_to_multiple_of, recipe)
    problems.check(check_activation_offloading, recipe, True)
    problems.check(check_checkpointing_mode, recipe)
    problems.messages += expert_refusals(recipe, model_config)  # a mixture of experts' (shardtune.models.experts)
    problems.raise_any()


def recipe_reference(recipe: Recipe) -> str | None:
    """The reference mode a DPO recipe holds, None for SFT (the fields read here, each a planner flag)."""
    return reference_mode(recipe.method, recipe.use_peft, recipe.precompute_ref_log_probs,
                          recipe.ref_model_name_or_path)


def recipe_reference_shape(recipe: Recipe) -> ModelShape | None:
    """The shape of the model --ref_model_name_or_path names where a DPO run loads it (live, or for the precomputing
    pass), read from its config.json as the policy's is; None where the reference is the policy's own model."""
    if recipe_reference(recipe) not in ("live", "precomputed") or not recipe.ref_model_name_or_path:
        return None
    return reference_model_shape(recipe.ref_model_name_or_path)


@functools.lru_cache(maxsize=8)  # a --compare plans it under every config
def reference_model_shape(model: str) -> ModelShape:
    """A reference model's shape: a built-in name, a local model directory or config.json, or a Hub id; its problems
    name --ref_model_name_or_path, as a PlanError (a launch's plan, a dry run's included, refuses it in one line)."""
    try:
        name, config = resolve_config(model)
        return shape_from_config(config, name)
    except ModelError as error:
        raise PlanError(str(error).replace("--model_name_or_path", "--ref_model_name_or_path")) from None


def recipe_peft(recipe: Recipe) -> Peft | None:
    return Peft(recipe.lora_r, recipe.lora_target_modules, recipe.load_in_4bit) if recipe.use_peft else None


def recipe_accumulation(recipe: Recipe, world: int) -> int | None:
    """The recipe's micro-batches per step on `world` ranks; None where its global batch does not divide there
    (the recipe's own check refuses that run; the plan then counts the gradients as accumulating)."""
    try:
        return batch_sizes(recipe, world).accumulation
    except ConfigError:
        return None


def planned_length(recipe: Recipe, mixed_precision: str) -> int:
    """The longest row the run pads to, in the precision it is planned in (a bare model takes the accelerate
    config's, which may be fp8: config.token_multiple)."""
    return padded_length(dataclasses.replace(recipe, mixed_precision=mixed_precision))


def plan_recipe(shape: ModelShape, hardware: Hardware, strategy: Strategy, recipe: Recipe) -> MemoryPlan:
    """The plan of `recipe` under `strategy`: every field of the recipe that memory depends on."""
    return plan(shape, hardware, strategy, recipe.per_device_train_batch_size,
                planned_length(recipe, "fp8" if strategy.float8 else recipe.mixed_precision),
                recipe.gradient_checkpointing, PLANNED_ATTENTION[recipe.attn_implementation], recipe_peft(recipe),
                recipe.packing, async_save=recipe.async_save, save_only_model=recipe.save_only_model,
                eval_batch=recipe.per_device_eval_batch_size, checkpointing_mode=recipe.gradient_checkpointing_mode,
                activation_offloading=recipe.activation_offloading, chunked_cross_entropy=recipe.chunked_cross_entropy,
                optim=recipe.optim, bf16_stochastic_round=recipe.bf16_stochastic_round,
                gradient_accumulation_steps=recipe_accumulation(
                    recipe, hardware.world_size // strategy.tensor_parallel),  # the data-parallel ranks
                torch_compile=recipe.torch_compile, use_liger_kernel=recipe.use_liger_kernel,
                checkpointing_interval=recipe.gradient_checkpointing_interval, reference=recipe_reference(recipe),
                reference_shape=recipe_reference_shape(recipe))


def recipe_search(recipe: Recipe, hardware: Hardware, mixed_precision: str, held: Collection[str] = (),
                  configs_dir: str = CONFIGS_DIR) -> Search:
    """The search for the fastest config for `recipe`, holding the recipe's values of the SEARCHED fields named in
    `held` and searching the others. A held micro-batch must keep the global batch on `hardware` (ConfigError, by
    the recipe's rule, when it cannot); a recipe's accumulation without a global batch keeps the global batch it
    makes there."""
    global_batch = recipe.global_batch_size
    fix_micro_batch = "per_device_train_batch_size" in held
    if fix_micro_batch and (global_batch is not None or recipe.gradient_accumulation_steps is not None):
        global_batch = kept_global_batch(recipe, hardware)
    return Search(global_batch, planned_length(recipe, mixed_precision), mixed_precision, configs_dir,
                  PLANNED_ATTENTION[recipe.attn_implementation], recipe_peft(recipe), recipe.packing,
                  recipe.per_device_train_batch_size if fix_micro_batch else None,
                  recipe.gradient_checkpointing if "gradient_checkpointing" in held else None,
                  recipe.per_device_eval_batch_size, recipe.async_save, recipe.save_only_model,
                  recipe.chunked_cross_entropy,
                  recipe.gradient_checkpointing_mode if "gradient_checkpointing_mode" in held else None,
                  recipe.activation_offloading,
                  recipe.optim if "optim" in held else None,
                  recipe.bf16_stochastic_round if "bf16_stochastic_round" in held else None,
                  use_liger_kernel=recipe.use_liger_kernel,
                  checkpointing_interval=recipe.gradient_checkpointing_interval, reference=recipe_reference(recipe),
                  reference_shape=recipe_reference_shape(recipe))


def kept_global_batch(recipe: Recipe, hardware: Hardware) -> int:
    """The global batch the recipe's micro-batch makes over every GPU of `hardware`, or over its nodes where only
    tensor parallelism within each node keeps it (its data-parallel ranks); the first refusal where neither."""
    try:
        return batch_sizes(recipe, hardware.world_size).global_batch
    except ConfigError as error:
        try:
            return batch_sizes(recipe, hardware.world_size, hardware.gpus_per_node).global_batch
        except ConfigError:
            raise error from None
