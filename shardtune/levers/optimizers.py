"""The optimizer of `--optim` and the learning-rate schedule: transformers' TrainingArguments names, built as
transformers' Trainer builds them (trainer_optimizer.py `_get_adamw_torch`, `_get_torchao_optimizer`,
`_get_bitsandbytes_optimizer`), over `param_groups`.

- adamw_torch: torch AdamW, the fused kernel where the parameters are on CUDA (TrainingArguments' default
  adamw_torch_fused), the per-tensor loop elsewhere.
- adamw_torch_8bit / adamw_torch_4bit: torchao's AdamW8bit / AdamW4bit, Adam's two states quantized per block of
  TORCHAO_BLOCK_SIZE elements (the Trainer's block size for both). They step DTensor shards (FSDP2) and run on CPU.
- adamw_8bit / paged_adamw_8bit: bitsandbytes' 8-bit AdamW (CUDA only), paged: states in CUDA unified memory.
- --bf16_stochastic_round (torchao's bf16_stochastic_round, TrainingArguments' optim_args key for its torchao
  names): no fp32 master copy. The weights are bf16 (shardtune.model loads them so, shardtune.parallel.distributed keeps
  them so), each update is computed in fp32 and rounded to bf16 stochastically, so that updates smaller than bf16's
  spacing survive on average. With adamw_torch the optimizer is torchao's AdamW (the same update; its states take
  the parameters' dtype, bf16); with the torchao names, their own optimizer.
"""

from __future__ import annotations

import torch

from shardtune.config import BITSANDBYTES_OPTIMIZERS, TORCHAO_BLOCK_SIZE, TORCHAO_OPTIMIZERS, Recipe
from shardtune.schedule import make_scheduler


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, not on norms and biases (by name: ZeRO-3 params have no real shape)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:  # a frozen PEFT base
            continue
        (no_decay if "norm" in name or name.endswith("bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]  # DeepSpeed drops empty groups (LoRA has no norms)


def build_optimizer(model: torch.nn.Module, recipe: Recipe, fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer `recipe.optim` names over `param_groups` (shardtune.checks.startup refused what cannot run here).
    `fused`: adamw_torch's fused kernel, for a run on CUDA (the parameters may still be on the host here)."""
    groups = param_groups(model, recipe.weight_decay)
    adam = {"lr": recipe.learning_rate, "betas": (recipe.adam_beta1, recipe.adam_beta2), "eps": recipe.adam_epsilon}
    stochastic = recipe.bf16_stochastic_round
    if recipe.optim in TORCHAO_OPTIMIZERS:
        return torchao_low_bit(recipe.optim)(groups, **adam, block_size=TORCHAO_BLOCK_SIZE,
                                             bf16_stochastic_round=stochastic)
    if stochastic:
        # torchao's full-precision AdamW (its states take the parameters' dtype), exported for this use: "train a
        # BF16 model" with bf16_stochastic_round (torchao/optim/README.md).
        from torchao.optim import _AdamW

        return _AdamW(groups, **adam, bf16_stochastic_round=True)
    if recipe.optim in BITSANDBYTES_OPTIMIZERS:
        from bitsandbytes.optim import AdamW

        return AdamW(groups, **adam, optim_bits=8, is_paged=recipe.optim.startswith("paged"))
    return torch.optim.AdamW(groups, **adam, fused=fused or None)


def torchao_low_bit(optim: str) -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit or AdamW4bit, its quantized states made to appear fp32 rather than in the parameter's
    dtype: the same stored bytes and the same update (the states are dequantized to fp32 either way), but over
    FSDP2's bf16 DTensor shards torchao 0.18 fails otherwise, eager and compiled alike (DTensor's sharding
    propagation takes the state's appearance, bf16, for the fp32 lerp in adam.py `single_param_adam`)."""
    from torchao.optim import AdamW4bit, AdamW8bit
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    base, state = (AdamW8bit, OptimState8bit) if optim == "adamw_torch_8bit" else (AdamW4bit, OptimState4bit)

    class Fp32AppearingStates(base):
        @staticmethod
        def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
            return state.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

    Fp32AppearingStates.__name__ = base.__name__
    return Fp32AppearingStates


def make_optimizer(model: torch.nn.Module, recipe: Recipe, max_steps: int, fused: bool = False
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The recipe's optimizer, and its learning-rate schedule over `max_steps`."""
    optimizer = build_optimizer(model, recipe, fused)
    return optimizer, make_scheduler(optimizer, recipe, max_steps)
