"""The trained model as a Hugging Face model directory: full weights gathered from the shards, cast to
--save_dtype, with a config.json that states the dtype written, and the model's generation_config.json.
scripts/export_hf.py casts a checkpoint's weights with the same helpers; each checkpoint holds the model files
it needs for that."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import re
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list
from huggingface_hub import StateDictSplit, split_torch_state_dict_into_shards
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from shardtune.checkpoint.durable import durable, fsync_path
from shardtune.checkpoint.tensor_files import write_safetensors
from shardtune.config import Recipe
from shardtune.tracking import absolute_if_local

# --save_dtype (shardtune.config.SAVE_DTYPES, less auto) as torch dtypes.
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The largest output shard (save_pretrained's and scripts/export_hf.py's): the export holds one on the host.
MAX_SHARD_SIZE = "5GB"
SHARD_PATTERN = SAFE_WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors")


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
    if is_peft_model(unwrapped):  # the LoRA settings (α, r, targets) the merge of the checkpoint's weights needs
        for config in unwrapped.peft_config.values():
            config = copy.deepcopy(config)
            config.base_model_name_or_path = absolute_if_local(config.base_model_name_or_path)
            config.inference_mode = True  # as peft saves it: the adapter loads for inference
            config.save_pretrained(path)
    tokenizer.save_pretrained(path)


def save_hf_model(accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                  output_dir: str, dtype: torch.dtype | None = None,
                  max_shard_size: int | str = MAX_SHARD_SIZE) -> None:
    """Full weights gathered from FSDP / ZeRO-3 shards, cast to `dtype` (None: as trained), written as
    safetensors by the main process one output shard at a time (`write_streamed_shards`), with a config.json
    that states the dtype written. A PEFT model writes its adapter in peft's format, as trained (fp32 adapters:
    small, and peft upcasts them on load anyway), gathered alone (`adapter_state_dict`): the frozen base stays
    sharded. A collective: every rank calls it."""
    unwrapped = accelerator.unwrap_model(model)
    if is_peft_model(unwrapped):
        state_dict = adapter_state_dict(accelerator, unwrapped)
        if accelerator.is_main_process:
            for config in unwrapped.peft_config.values():  # loads from any directory, not only the run's
                config.base_model_name_or_path = absolute_if_local(config.base_model_name_or_path)
            unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        del state_dict
    else:
        write_streamed_shards(accelerator, unwrapped, output_dir, dtype, max_shard_size)
    if accelerator.is_main_process:
        if not is_peft_model(unwrapped):
            # save_pretrained names the architecture and the dtype written in config.json; the copy does both.
            config = config_with_dtype(unwrapped.config, dtype or unwrapped.dtype)
            config.architectures = [unwrapped.__class__.__name__.removeprefix("FSDP")]
            config.save_pretrained(output_dir)
            if unwrapped.can_generate():
                unwrapped.generation_config.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        make_readable(output_dir)
        durable(output_dir, recursive=False)  # the export's files, then output_dir itself, survive a crash
    gc.collect()  # gathered copies can sit in reference cycles until the collector runs
    accelerator.wait_for_everyone()


def written_file_mode() -> int:
    """The mode a plain open(path, "w") gives a new file: 0o666 less the umask (0o644 under umask 022). Read from
    /proc, not set and restored with os.umask, which would race the files a background save creates meanwhile."""
    try:
        with open("/proc/self/status") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def make_readable(directory: str, recursive: bool = False) -> None:
    """The weights in `directory` get the mode any other written file gets: safetensors' save_file (which
    save_pretrained and peft call) creates its files 0o600, readable by their owner alone."""
    mode = written_file_mode()
    for root, _, names in os.walk(directory) if recursive else [(directory, None, os.listdir(directory))]:
        for name in names:
            path = os.path.join(root, name)
            if name.endswith(".safetensors") and os.path.isfile(path) and not os.path.islink(path):
                os.chmod(path, mode)


def export_entries(unwrapped: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as the export writes it, unmaterialized: each key's live parameter or buffer (a
    ZeRO-3 partition, an FSDP2 DTensor or a whole tensor), in state_dict order, without the tied weights.
    save_pretrained drops a tied weight (Llama-3.2's lm_head.weight) only where its tensor shares storage with the
    one it is tied to; FSDP2's gathered copies and the casts share none: it is dropped here."""
    entries = unwrapped.state_dict(keep_vars=True)
    for tied in unwrapped.all_tied_weights_keys:
        entries.pop(tied, None)
    return entries


def export_layout(unwrapped: torch.nn.Module, entries: dict[str, torch.Tensor], dtype: torch.dtype | None,
                  max_shard_size: int | str = MAX_SHARD_SIZE) -> StateDictSplit:
    """The output shards, planned by huggingface_hub as save_pretrained plans them, from each tensor's full shape
    and the dtype it is written in (meta tensors: no data), in the order save_pretrained gives them:
    transformers' revert_weight_conversion, which save_pretrained applies first, rebuilds the state dict in
    sorted key order (a mixture of experts' packed experts written per expert: written_sources)."""
    reverted = revert_weight_conversion(unwrapped, planned_tensors(entries, dtype))
    return split_torch_state_dict_into_shards(reverted, filename_pattern=SHARD_PATTERN, max_shard_size=max_shard_size)


def written_sources(unwrapped: torch.nn.Module, entries: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each written tensor's trained entry, every entry reverted on its own: the Llama-class models write each
    entry as it is named; a mixture of experts' packed experts (gate_up_proj, down_proj) are written per expert,
    as its checkpoints hold them. A model whose conversion merges several entries into one written tensor is
    refused."""
    planned = planned_tensors(entries, None)
    sources = {written: name for name, tensor in planned.items()
               for written in revert_weight_conversion(unwrapped, {name: tensor})}
    if sources.keys() != revert_weight_conversion(unwrapped, planned).keys():
        raise NotImplementedError(f"{type(unwrapped).__name__} saves its weights under other names than it trains "
                                  "them, several trained tensors into one (a transformers weight conversion): the "
                                  "streamed export writes each trained tensor on its own only.")
    return sources


def planned_tensors(entries: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Each entry as a meta tensor of its full shape (ZeRO-3: its ds_shape) in the dtype it is written in."""
    planned = {}
    for name, tensor in entries.items():
        shape = tensor.ds_shape if hasattr(tensor, "ds_id") else tensor.shape
        written = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        planned[name] = torch.empty(shape, dtype=written, device="meta")
    return planned


def write_streamed_shards(accelerator: Accelerator, unwrapped: torch.nn.Module, output_dir: str,
                          dtype: torch.dtype | None, max_shard_size: int | str = MAX_SHARD_SIZE) -> None:
    """The model's weights as save_pretrained writes them (same files, keys, dtypes and index), one output shard
    at a time: every rank gathers the shard's tensors one by one, the main process copies each to its host in
    the export dtype, writes the shard with safetensors, fsyncs it (its dirty pages written back, not held) and
    frees it before the next. The main process's host holds one shard, never the whole model. An fp32 export of
    a 16-bit DeepSpeed run writes the fp32 master weights of the trained parameters (safe_get_full_fp32_param).
    The main process plans the shards and every rank follows its plan: the order save_pretrained writes in
    depends on how the model was built (a model FSDP built on the meta device has no recorded conversion)."""
    entries = export_entries(unwrapped)
    main = accelerator.is_main_process
    layout = [(export_layout(unwrapped, entries, dtype, max_shard_size), written_sources(unwrapped, entries))
              if main else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(layout)
    layout, sources = layout[0]
    masters = dtype == torch.float32 and deepspeed_half(accelerator)
    if main:
        os.makedirs(output_dir, exist_ok=True)
        remove_stale_shards(output_dir, layout)
    for filename, names in layout.filename_to_tensors.items():
        shard, source, written = {}, None, {}
        for name in names:  # the same order on every rank: each gather is a collective
            if sources[name] != source:  # a packed entry gathered once for the tensors it is written as
                source = sources[name]
                whole = gathered_host_tensor(entries[source], dtype, masters, main)
                written = (revert_weight_conversion(unwrapped, {source: whole}) if name != source else
                           {name: whole}) if main else {}
            if main:  # a packed entry's pieces are views of its storage, which safetensors would write once
                shard[name] = written.pop(name) if name == source else written.pop(name).clone()
        if main:
            path = os.path.join(output_dir, filename)
            write_safetensors(shard, path)  # safetensors' own save_file would build a second copy in memory
            fsync_path(path)  # its dirty pages written back now, not held in the page cache
        del shard
    if main and layout.is_sharded:
        # save_pretrained's num_parameters() counts ZeRO-3's empty partitions as 0: the count here is the model's.
        names = {name for name, _ in unwrapped.named_parameters(remove_duplicate=False)}
        parameters = sum(tensor.numel() for name, tensor in planned_tensors(entries, dtype).items() if name in names)
        index = {"metadata": {"total_parameters": parameters, **layout.metadata},
                 "weight_map": layout.tensor_to_filename}
        with open(os.path.join(output_dir, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def gathered_host_tensor(tensor: torch.Tensor, dtype: torch.dtype | None, masters: bool,
                         main: bool) -> torch.Tensor | None:
    """One tensor whole, in the export dtype, on the main process's host (None elsewhere): a ZeRO-3 partition
    gathered alone and copied before the gather is released, an FSDP2 DTensor's full_tensor, the fp32 master
    weights of a trained parameter of a 16-bit DeepSpeed run where `masters`, a whole tensor as it is. Each is
    whole on the device for one tensor's time (as the gathers of accelerate's get_state_dict are). Every rank
    calls it, for the same tensors in the same order."""
    from torch.distributed.tensor import DTensor

    if masters:
        from deepspeed.utils import safe_get_full_fp32_param  # DeepSpeed runs only

        full = safe_get_full_fp32_param(tensor)  # None for frozen parameters: their 16-bit value is written
        if full is not None:
            return host_copy(full, dtype) if main else None
    if hasattr(tensor, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor]):  # read only: modifier_rank None
            return host_copy(tensor, dtype) if main else None
    if isinstance(tensor, DTensor):
        whole = tensor.full_tensor()
        return host_copy(whole, dtype) if main else None
    return host_copy(tensor, dtype) if main else None


def host_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A new host tensor: `tensor` cast on its device to the export dtype (floating point only), then copied,
    so that the host holds the written bytes alone and nothing aliases a live or gathered buffer."""
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype).to("cpu").contiguous()
    return tensor.to("cpu", copy=True).contiguous()


def remove_stale_shards(output_dir: str, layout: StateDictSplit) -> None:
    """Shard files of an earlier export to this directory that this one does not overwrite: those its index
    (model.safetensors.index.json, about to be replaced) names, as save_pretrained removes them. A shard-like name
    no earlier index lists is not an export's and stays."""
    try:
        with open(os.path.join(output_dir, SAFE_WEIGHTS_INDEX_NAME), encoding="utf-8") as file:
            earlier = set(json.load(file).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return
    for filename in sorted(earlier):
        path = os.path.join(output_dir, filename)
        if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", filename) and filename not in \
                layout.filename_to_tensors and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)


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
