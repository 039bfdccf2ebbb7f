"""Model and tokenizer loading through `from_pretrained`, gradient checkpointing (full or selective) and
activation offloading."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from accelerate import init_empty_weights
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_layers import GradientCheckpointingLayer

from shardtune.config import Recipe

if TYPE_CHECKING:
    from peft import LoraConfig


# How this process found the tokenizer's files (HF_HUB_OFFLINE=1 makes the first true), which transformers keeps
# among the arguments it writes to every saved tokenizer_config.json: not a property of the tokenizer.
LOADING_ONLY_ARGUMENTS = ("local_files_only", "is_local")


def load_tokenizer(recipe: Recipe) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(recipe.model_name_or_path)
    for name in LOADING_ONLY_ARGUMENTS:  # so that no export carries them
        tokenizer.init_kwargs.pop(name, None)
    if tokenizer.pad_token is None:  # Llama 3 ships none; padded positions are masked out of attention and loss
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(recipe: Recipe, main_process: bool = True) -> PreTrainedModel:
    """Full fine-tuning loads the weights in fp32: they are the master weights, and bf16 compute comes from
    autocast, FSDP's MixedPrecisionPolicy or DeepSpeed's bf16 mode. With --use_peft the frozen base loads in
    the compute dtype (bf16; 4-bit NF4 with --load_in_4bit) and only the LoRA adapters train, in fp32. With
    --bf16_stochastic_round the weights load in bf16: that optimizer keeps no fp32 master.
    Must run after the Accelerator exists, so that ZeRO-3 partitions weights while they load and FSDP loads
    them on rank 0 only (RAM-efficient loading: `main_process` False builds the model without weights)."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.mixed_precision)
    dtype = half if (recipe.use_peft or recipe.bf16_stochastic_round) and half else torch.float32
    if not main_process and fsdp_loads_on_rank0() and not recipe.load_in_4bit:
        model = empty_model(recipe, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            recipe.model_name_or_path, dtype=dtype, attn_implementation=recipe.attn_implementation,
            quantization_config=quantization(recipe, half),
        )
    model.config.use_cache = False  # no KV cache in training
    if recipe.gradient_checkpointing:
        enable_gradient_checkpointing(model, recipe.gradient_checkpointing_interval,
                                      recipe.gradient_checkpointing_mode)
    if recipe.use_peft:
        with bitsandbytes_kept_out(not recipe.load_in_4bit):
            from peft import get_peft_model  # --use_peft only: importing peft costs every rank about 3 s

            model = get_peft_model(model, lora_config(recipe), autocast_adapter_dtype=True)  # adapters in fp32
    return model


@contextlib.contextmanager
def bitsandbytes_kept_out(keep_out: bool) -> Iterator[None]:
    """Inside, bitsandbytes cannot be imported (`keep_out`; not when 4-bit loading needs it). peft imports it wherever
    it is installed (its LoRA dispatchers look for bitsandbytes layers), and TRL's activation offloader empties the
    CUDA caching allocator at every forward while "bitsandbytes" is in sys.modules (its QLoRA workaround): a LoRA
    model on a 16-bit base would pay that on every micro-batch. A None entry in sys.modules makes find_spec answer
    None and an import fail. peft caches its answer to "is bitsandbytes installed": dropped on entry, so that each
    model built asks again, and kept after, so that nothing in peft imports bitsandbytes later in the run. Where it
    is imported already (a bitsandbytes optimizer), nothing is kept out."""
    import_utils = sys.modules.get("peft.import_utils")
    for name in ("is_bnb_available", "is_bnb_4bit_available"):
        if hasattr(import_utils, name):
            getattr(import_utils, name).cache_clear()
    if not keep_out or "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None
    try:
        yield
    finally:
        if "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]


def fsdp_loads_on_rank0() -> bool:
    """FSDP's RAM-efficient loading, as `accelerate launch` exports it from fsdp_cpu_ram_efficient_loading.
    (QLoRA's 4-bit parameters cannot move to the meta device: accelerate loads those on every rank.)"""
    return (os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
            and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true")


def empty_model(recipe: Recipe, dtype: torch.dtype) -> PreTrainedModel:
    """The model's structure with parameters on the meta device, for the ranks that do not read the weights:
    accelerate's FSDP2 preparation shards the meta model and broadcasts rank 0's weights into the shards.
    Buffers stay real (include_buffers=False): the rotary frequencies are computed, not loaded, and accelerate
    re-registers each rank's own. transformers 5.24 would otherwise load the full model on every rank."""
    config = AutoConfig.from_pretrained(recipe.model_name_or_path)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=recipe.attn_implementation)


def lora_config(recipe: Recipe) -> LoraConfig:
    from peft import LoraConfig

    targets = recipe.lora_target_modules
    return LoraConfig(
        r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout, task_type="CAUSAL_LM",
        target_modules=targets if targets == "all-linear" else [name.strip() for name in targets.split(",")],
    )


def quantization(recipe: Recipe, compute_dtype: torch.dtype | None):
    """QLoRA's 4-bit NF4 base with double quantization. The 4-bit weights are stored in the compute dtype so
    that FSDP and ZeRO-3 can shard them like any other 16-bit tensor."""
    if not recipe.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    dtype = compute_dtype or torch.bfloat16
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)


# Op-level selective checkpointing (torchtitan's "op" mode): the outputs of these ops are kept from the forward and
# every other op is recomputed in backward. Matmuls (every other one, below) and the attention kernels: the SDPA
# backends' exact overloads, CPU's included, as TRL's selective checkpointing lists them.
SAVED_MATMUL = torch.ops.aten.mm.default
SAVED_ATTENTION = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)}


def selective_policy() -> Callable[..., CheckpointPolicy]:
    """One checkpointed call's policy: save the attention kernel's outputs and the 1st, 3rd, ... matmul of the
    layer (a Llama layer's q, v, gate and down projections), recompute the rest. The forward and the recompute
    count their matmuls apart, so both make the same choice for the same matmul."""
    matmuls = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func == SAVED_MATMUL:
            matmuls[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if matmuls[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        if func in SAVED_ATTENTION or "flash_attn" in str(func):  # flash-attn registers under hashed namespaces
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_contexts():
    """torch.utils.checkpoint's context_fn: called once per checkpointed call, so each call counts afresh."""
    return create_selective_checkpoint_contexts(selective_policy())


def enable_gradient_checkpointing(model: PreTrainedModel, interval: int, mode: str = "full") -> list[int]:
    """Recompute every `interval`-th decoder layer in backward (non-reentrant: ZeRO-3's and FSDP2's parameter hooks
    run inside the recompute, and selective checkpointing needs it). `mode` "full" recomputes the whole layer,
    "selective" only what selective_policy does not save. Returns the checkpointed layers' indices."""
    options = {"use_reentrant": False}
    if mode == "selective":
        options["context_fn"] = selective_contexts
    # transformers 5.17 (the GPU machine's) has only gradient_checkpointing_enable, a deprecated alias in 5.24
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable(options, every_n_layers=interval)
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    return [index for index, layer in enumerate(layers) if layer.gradient_checkpointing]


def enable_activation_offloading(model: torch.nn.Module) -> None:
    """Hold the tensors each training forward saves for backward in pinned host memory and bring them back in
    backward (TRL's OffloadActivations, on a side CUDA stream; parameters, tensors under 1 KiB and lm_head's input
    stay on the GPU). `model`: the prepared model, whose parameters TRL's manager must know. Its context is entered
    around the model's forward only: the loss, computed outside it, keeps its logits on the GPU."""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    offloading = get_act_offloading_ctx_manager(model)

    def enter(*_) -> None:
        offloading.__enter__()

    def leave(*_) -> None:  # returns None: the forward's output stays as it is
        offloading.__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
