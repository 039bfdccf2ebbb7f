"""Model and tokenizer loading through `from_pretrained`, and gradient checkpointing."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_layers import GradientCheckpointingLayer

from shardtune.config import Recipe


def load_tokenizer(recipe: Recipe) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(recipe.model_name_or_path)
    if tokenizer.pad_token is None:  # Llama 3 ships none; padded positions are masked out of attention and loss
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(recipe: Recipe) -> PreTrainedModel:
    """Weights load in fp32: they are the master weights. bf16 compute comes from autocast, FSDP's
    MixedPrecisionPolicy or DeepSpeed's bf16 mode. Must run after the Accelerator exists, so that ZeRO-3
    partitions weights while they load and FSDP loads them on rank 0 only (RAM-efficient loading)."""
    model = AutoModelForCausalLM.from_pretrained(
        recipe.model_name_or_path, dtype=torch.float32, attn_implementation=recipe.attn_implementation
    )
    model.config.use_cache = False  # no KV cache in training
    if recipe.gradient_checkpointing:
        enable_gradient_checkpointing(model, recipe.gradient_checkpointing_interval)
    return model


def enable_gradient_checkpointing(model: PreTrainedModel, interval: int) -> list[int]:
    """Recompute every `interval`-th decoder layer in backward (non-reentrant). Returns their indices."""
    model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=interval)
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    return [index for index, layer in enumerate(layers) if layer.gradient_checkpointing]
