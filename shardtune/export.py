"""The trained model as a Hugging Face model directory: full weights gathered from the shards, cast to
--save_dtype, with a config.json that states the dtype written, and the model's generation_config.json.
scripts/export_hf.py casts a checkpoint's weights with the same helpers; each checkpoint holds the model files
it needs for that."""

from __future__ import annotations

import contextlib
import copy
import gc
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from shardtune.checkpoint.durable import durable
from shardtune.config import Recipe

# --save_dtype (shardtune.config.SAVE_DTYPES, less auto) as torch dtypes.
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_dtype(recipe: Recipe) -> torch.dtype | None:
    """--save_dtype: bf16 / fp16 / fp32, or auto: the dtype the model's own config.json states (bf16 for the
    Llama recipes). The loaded model's config says fp32 (full fine-tuning loads fp32 master weights), so auto
    reads the original. None (export as trained) where it states none."""
    if recipe.save_dtype != "auto":
        return EXPORT_DTYPES[recipe.save_dtype]
    from transformers import AutoConfig

    stated = AutoConfig.from_pretrained(recipe.model_name_or_path).dtype
    return getattr(torch, stated) if isinstance(stated, str) else stated


def cast_floating(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating-point tensors to `dtype`, in place, one at a time: a full state dict the gather made (FSDP's,
    on the host) frees each fp32 tensor as its cast replaces it, so the peak is one copy plus one tensor."""
    if dtype is not None:
        for key, tensor in state_dict.items():
            if tensor.is_floating_point() and tensor.dtype != dtype:
                state_dict[key] = tensor.to(dtype)
    return state_dict


def config_with_dtype(config: PretrainedConfig, dtype: torch.dtype | None) -> PretrainedConfig:
    """A copy of the model config that states `dtype` (config.json's "dtype"); the live config is untouched."""
    if dtype is None:
        return config
    config = copy.deepcopy(config)
    config.dtype = str(dtype).removeprefix("torch.")
    return config


def add_model_files(accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                    dtype: torch.dtype | None, path: str) -> None:
    """The config, generation config and tokenizer beside a checkpoint's state, so that it exports on its own as
    the final export is written (`save_hf_model`). The config states the export's dtype (scripts/export_hf.py
    writes that by default), not the fp32 of the master weights."""
    unwrapped = accelerator.unwrap_model(model)
    config_with_dtype(unwrapped.config, dtype).save_pretrained(path)
    if not is_peft_model(unwrapped) and unwrapped.can_generate():  # what the final export's save_pretrained writes
        unwrapped.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)


def save_hf_model(accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                  output_dir: str, dtype: torch.dtype | None = None) -> None:
    """Full weights gathered from FSDP / ZeRO-3 shards, cast to `dtype` (None: as trained), written as
    safetensors by the main process, with a config.json that states the dtype written. A PEFT model writes its
    adapter in peft's format, as trained (fp32 adapters: small, and peft upcasts them on load anyway), gathered
    alone (`adapter_state_dict`): the frozen base stays sharded."""
    unwrapped = accelerator.unwrap_model(model)
    if is_peft_model(unwrapped):
        state_dict = adapter_state_dict(accelerator, unwrapped)
    else:
        state_dict = accelerator.get_state_dict(model)  # ZeRO-3: on the main process only (None elsewhere)
    masters = {}
    if dtype == torch.float32 and deepspeed_half(accelerator):
        masters = deepspeed_master_weights(accelerator, model)  # a collective: every rank takes part
    if accelerator.is_main_process:
        state_dict.update(masters)
        if is_peft_model(unwrapped):
            unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        else:
            # save_pretrained drops a tied weight (Llama-3.2's lm_head.weight) only where its tensor shares storage
            # with the one it is tied to; FSDP2's gathered copies and the casts below share none: drop it here.
            for tied in unwrapped.all_tied_weights_keys:
                state_dict.pop(tied, None)
            # save_pretrained writes the dtype of the live parameters into config.json; the copy states the cast.
            unwrapped.save_pretrained(output_dir, state_dict=cast_floating(state_dict, dtype),
                                      safe_serialization=True, max_shard_size="5GB")
            config_with_dtype(unwrapped.config, dtype).save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        durable(output_dir, recursive=False)  # the export's files, then output_dir itself, survive a crash
    # The gathered copies sit in reference cycles that outlive this call until the collector runs: measured, a
    # bf16 ZeRO-3 run's fp32 masters (4 bytes x P on the host) were still alive through the final eval.
    del state_dict, masters
    gc.collect()
    accelerator.wait_for_everyone()


def adapter_state_dict(accelerator: Accelerator, unwrapped: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of a PEFT model (its adapters), whole, on the main process's host (empty
    elsewhere), under the names peft's save_pretrained selects from: gathered from FSDP2's shards or ZeRO-3's
    partitions, the frozen base never. accelerator.get_state_dict would gather the whole model to write an
    adapter (for a 70B base, 141 GB in bf16 for an adapter under 1 GB). A collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    adapters = [(name, param) for name, param in unwrapped.named_parameters() if param.requires_grad]
    gathered = contextlib.nullcontext()
    if any(hasattr(param, "ds_id") for _, param in adapters):  # ZeRO-3 partitions
        import deepspeed  # DeepSpeed runs only

        # All adapters in one gather (read only: modifier_rank None), released when the block ends.
        gathered = deepspeed.zero.GatheredParameters([param for _, param in adapters])
    state = {}
    with gathered:
        for name, param in adapters:  # FSDP2: one all-gather per adapter tensor, in the same order on every rank
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            if accelerator.is_main_process:
                state[name] = whole.detach().to("cpu", copy=True)
    return state


def is_peft_model(model: torch.nn.Module) -> bool:
    """A PeftModel exists only once peft was imported (by --use_peft's loading): a full fine-tune never
    imports it (about 3 s per rank)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def deepspeed_half(accelerator: Accelerator) -> bool:
    """DeepSpeed in bf16 / fp16: its module holds 16-bit weights, the fp32 master weights are the optimizer's."""
    return accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.mixed_precision in ("bf16", "fp16")


def deepspeed_master_weights(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 master weights of the trained parameters, assembled one parameter at a time from the ranks'
    partitions (a collective under every ZeRO stage: all ranks walk the parameters in the same order); on the
    main process, on the host. An fp32 export of a bf16 DeepSpeed run holds these, not upcast 16-bit weights."""
    from deepspeed.utils import safe_get_full_fp32_param  # DeepSpeed runs only: imported where it is used

    weights = {}
    for name, param in accelerator.unwrap_model(model).named_parameters():
        full = safe_get_full_fp32_param(param)  # None for frozen parameters: their 16-bit value stays
        if full is not None and accelerator.is_main_process:
            weights[name] = full.detach().cpu()
    return weights
