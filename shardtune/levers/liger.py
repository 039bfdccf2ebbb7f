"""--use_liger_kernel: Liger's Triton kernels (liger-kernel) in a model of a family Liger patches
(shardtune.models.families.LIGER_MODEL_TYPES), and what they cannot run with.

The layers: each RMSNorm and SwiGLU MLP instance gets Liger's forward (apply_liger_kernel_to_<model_type> with
`model=`, applied to the loaded model before accelerate's prepare, as --torch_compile is), so the
hooks ZeRO-3 and FSDP2 put on those modules still gather their weights around them. RoPE is a module-level
function that the attention's forward looks up at every call: it stays replaced in the model's modeling module
for the process. The classes Liger also swaps in that module (for models built later) are put back: only this
model is patched. The loss: Liger's fused linear cross-entropy, run as the LM head's forward
(shardtune.levers.tiled_loss.fused_linear_cross_entropy), where ZeRO-3 and FSDP2 have gathered the head's weight.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

from shardtune.config import LIGER_VERSION, ConfigError, Recipe
from shardtune.models.families import FAMILIES, LIGER_MODEL_TYPES

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


def check_liger_kernel(recipe: Recipe) -> None:
    """What --use_liger_kernel cannot run with (the machine is check_liger_device's). Its loss is Liger's fused
    linear cross-entropy run as the LM head's forward, where the tiled loss runs (shardtune.levers.tiled_loss), so that
    ZeRO-3 and FSDP2 gather the head's weight for it: it replaces the tiles and needs their path."""
    if not recipe.use_liger_kernel:
        return
    problems = []
    # DPO takes no loss of Liger's: its log-probs run in shardtune's tiles or over the full logits, as asked.
    if not recipe.chunked_cross_entropy and recipe.method != "dpo":
        problems.append("--use_liger_kernel computes the loss with Liger's fused linear cross-entropy in place of "
                        "the tiled loss, and --chunked_cross_entropy false asks for the full logits: drop one of "
                        "them.")
    if recipe.torch_compile:
        problems.append("--use_liger_kernel with --torch_compile: compile would trace Liger's Triton kernels inside "
                        "the layers, a combination not measured here (both fuse the norms and the MLP): drop one "
                        "of them.")
    if recipe.gradient_checkpointing and recipe.gradient_checkpointing_mode == "selective":
        problems.append("--use_liger_kernel with --gradient_checkpointing_mode selective: Liger's RoPE rotates "
                        "q_proj's output in place, and the selective policy keeps that output, so the recomputation "
                        "would rotate it twice: use --gradient_checkpointing_mode full.")
    if problems:
        raise ConfigError(problems)


def check_liger_device(recipe: Recipe, on_gpu: bool, loads: bool = True) -> None:
    """Liger's kernels are Triton GPU kernels: none runs on CPU. `loads`: the run will import Liger."""
    if not recipe.use_liger_kernel:
        return
    if not on_gpu:
        raise ConfigError("--use_liger_kernel runs Liger's Triton kernels, which need a CUDA GPU: drop it on this "
                          "machine (the plain layers and the tiled loss train the same model).")
    if loads and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(f"--use_liger_kernel needs liger-kernel, which is not installed: pip install "
                          f"liger-kernel=={LIGER_VERSION}")


def check_liger_model(recipe: Recipe, config: PretrainedConfig) -> None:
    """Liger patches the layers of the families it knows by their model type: another family would train with
    its plain layers and a fused loss, not what the flag says."""
    model_type = getattr(config, "model_type", "")
    refusal = FAMILIES[model_type].liger_refusal if model_type in FAMILIES else ""
    if recipe.use_liger_kernel and refusal:
        raise ConfigError(f"--use_liger_kernel: {refusal}")
    if recipe.use_liger_kernel and model_type not in LIGER_MODEL_TYPES:
        raise ConfigError(f"--use_liger_kernel patches the layers of {', '.join(LIGER_MODEL_TYPES)} models; this "
                          f"model's type is {model_type!r}: drop --use_liger_kernel.")


def apply_liger_kernels(model: torch.nn.Module) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE in `model` (a peft wrapper's base model too), in place. Liger's own loss
    paths stay off (cross_entropy, fused_linear_cross_entropy): the trainer's loss runs Liger's fused loss inside
    the LM head's forward instead (shardtune.levers.tiled_loss)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modeling = sys.modules[type(base).__module__]
    before = dict(vars(modeling))
    model_type = base.config.model_type
    MODEL_TYPE_TO_APPLY_LIGER_FN[model_type](rope=True, rms_norm=True, cross_entropy=False, model=base,
                                             fused_linear_cross_entropy=False, **FAMILIES[model_type].liger_options)
    for name, value in before.items():  # the classes: later models of the family build their own modules
        if isinstance(value, type) and vars(modeling)[name] is not value:
            setattr(modeling, name, value)
