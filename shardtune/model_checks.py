"""The recipe against the model's config.json, read without a weight: the model can be had, it has room for
--max_seq_length, --lora_target_modules name some of its layers, and --use_liger_kernel knows its family."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardtune.config import ConfigError, Problems, Recipe, padded_length, token_multiple
from shardtune.liger import check_liger_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_model(recipe: Recipe) -> None:
    """What the model's config.json (no weights) can tell: it exists and can be read, it has room for
    --max_seq_length, and --lora_target_modules name some of its layers."""
    config = read_model_config(recipe.model_name_or_path)
    problems = Problems()
    problems.check(check_context_length, recipe, config)
    problems.check(check_lora_targets, recipe, config)
    problems.check(check_liger_model, recipe, config)
    problems.raise_any()


def read_model_config(name: str) -> PretrainedConfig:
    """The model's config.json alone (shardtune.flops.read_config), a refusal when it cannot be had."""
    from shardtune.flops import ModelError, read_config

    try:
        return read_config(name)
    except ModelError as error:
        raise ConfigError(str(error)) from None


def check_context_length(recipe: Recipe, config: PretrainedConfig) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    padded, multiple = padded_length(recipe), token_multiple(recipe)  # a padded row's positions run to its end
    if limit and padded > limit:
        length = f"--max_seq_length {recipe.max_seq_length}" + (
            f" padded to a multiple of {multiple} ({padded})" if padded != recipe.max_seq_length else "")
        raise ConfigError(f"{length} is above the model's max_position_embeddings {limit}: give --max_seq_length "
                          f"{limit // multiple * multiple} or less.")


def check_lora_targets(recipe: Recipe, config: PretrainedConfig) -> None:
    """Each --lora_target_modules name must match a linear or embedding layer as peft matches it (the full name or
    its dotted suffix): peft refuses only when no name matches, and quietly drops a misspelt one otherwise."""
    if not recipe.use_peft or recipe.lora_target_modules.strip() == "all-linear":
        return
    import torch
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    layers = model_layers(config)
    unknown = []
    for target in recipe.lora_target_modules.split(","):
        wanted = LoraConfig(target_modules=[target.strip()])
        if not any(isinstance(module, torch.nn.Linear | torch.nn.Embedding)
                   and check_target_module_exists(wanted, name) for name, module in layers.items()):
            unknown.append(target.strip())
    if unknown:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in layers.items()
                         if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")})
        raise ConfigError(f"--lora_target_modules {', '.join(map(repr, unknown))} names no layer of the model: its "
                          f"linear modules are {', '.join(linear)} (or give all-linear).")


def model_layers(config: PretrainedConfig) -> dict:
    """The model's modules by name, built on the meta device from its config: structure only, no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    return dict(model.named_modules())
