"""Each strategy's state at a save, one function per strategy: written now (synchronous saves), or copied to
host memory and queued for the background writer (asynchronous ones), laid out as accelerate's save_state lays
it out, so that load_state and scripts/export_hf.py read it.

`stager` is torch.distributed.checkpoint's stager of an asynchronous save, whose buffers (pinned on GPU machines)
last from one save to the next; None for a synchronous save, which writes from the live state. Every use of
accelerate's and torch's private APIs by checkpointing is in this module: the accelerator's prepared objects
(`_models`, `_optimizers` …), FSDP's state-dict options, and process groups' timeouts."""

from __future__ import annotations

import dataclasses
import functools
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.checkpointing import save_accelerator_state, save_custom_state
from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, DistributedType
from accelerate.utils.constants import FSDP_MODEL_NAME
from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

from shardtune.checkpoint.pending import PendingSave
from shardtune.checkpoint.tensor_files import write_safetensors, write_torch


def strategy_kind(accelerator: Accelerator) -> str:
    """"fsdp", "deepspeed", or "replicated" (DDP or one process), the `strategy` each marker records."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return "fsdp"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "deepspeed"
    return "replicated"


def async_save_obstacle(accelerator: Accelerator, kind: str) -> str | None:
    """Why background writes cannot take this strategy's state (they need it in a form this package can copy
    to host memory), or None."""
    if kind == "fsdp":
        plugin = accelerator.state.fsdp_plugin
        if plugin.fsdp_version != 2 or plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
            return "it needs FSDP2 with fsdp_state_dict_type SHARDED_STATE_DICT"
    elif kind == "deepspeed":
        if any(getattr(engine.checkpoint_engine, "name", "") != "TorchCheckpointEngine"
               for engine in deepspeed_engines(accelerator)):
            return "the DeepSpeed config chooses its own checkpoint writer"
    return None


def new_stager() -> DefaultStager:
    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def dcp_save_count(accelerator: Accelerator, kind: str, model_only: bool) -> int:
    """How many torch.distributed.checkpoint saves one checkpoint makes in the background: one per FSDP model
    and (unless `model_only`) per optimizer, none under the other strategies."""
    if kind != "fsdp":
        return 0
    return len(accelerator._models) + (0 if model_only else len(accelerator._optimizers))


def set_group_timeouts(groups: list, minutes: float) -> None:
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timedelta(minutes=minutes), group)


def host_copy(stager: DefaultStager | None, state: Any) -> Any:
    """A copy of `state` in host memory for a background write; the state itself for a synchronous one."""
    return stager.stage(state) if stager is not None else state


# ----------------------------------------------------------------------------------- one function per strategy


def stage_replicated(accelerator: Accelerator, pending: PendingSave, stager: DefaultStager) -> None:
    """DDP or one process: the files accelerate's save_state writes; the model and optimizer states (of the
    main process, which alone writes them) copied to host memory for the background writer."""
    if accelerator.is_main_process:
        for index, model in enumerate(accelerator._models):
            name = SAFE_WEIGHTS_NAME if index == 0 else SAFE_WEIGHTS_NAME.replace(".", f"_{index}.")
            state = host_copy(stager, accelerator.get_state_dict(model, unwrap=False))
            pending.add(os.path.join(pending.scratch, name), functools.partial(write_safetensors, state))
        for index, optimizer in enumerate(accelerator._optimizers):
            name = f"{OPTIMIZER_NAME}.bin" if index == 0 else f"{OPTIMIZER_NAME}_{index}.bin"
            pending.add(os.path.join(pending.scratch, name),
                        functools.partial(write_torch, host_copy(stager, optimizer.state_dict())))
    save_small_states(accelerator, pending.scratch)


def stage_fsdp(accelerator: Accelerator, pending: PendingSave, stager: DefaultStager, dcp_groups: list) -> None:
    """FSDP2: model and optimizer shards through torch.distributed.checkpoint's async_save: async_save copies
    each rank's shards to host memory before it returns and writes them from its own thread."""
    options = fsdp_save_options(accelerator.state.fsdp_plugin)
    saves = [(f"{FSDP_MODEL_NAME}_{index}", {"model": _get_model_state_dict(model, sd_options=options)})
             for index, model in enumerate(accelerator._models)]
    saves += [(f"{OPTIMIZER_NAME}_{index}",
               {"optimizer": get_optimizer_state_dict(accelerator._models[index], optimizer, options=options)})
              for index, optimizer in enumerate(accelerator._optimizers)]
    for index, (name, state) in enumerate(saves):
        dcp_async_save(pending, state, os.path.join(pending.scratch, name), stager, dcp_groups, index)
    save_small_states(accelerator, pending.scratch)


def stage_deepspeed(accelerator: Accelerator, pending: PendingSave, stager: DefaultStager) -> None:
    """DeepSpeed: its own save_checkpoint, through a checkpoint engine that copies each state dict DeepSpeed
    asks it to write (each rank's ZeRO partitions, the module states) to host memory and leaves its
    torch.save to the background writer. DeepSpeed's own asynchronous engines do not fit: the decoupled one
    hands the live tensors to a writer process without a copy (the next optimizer step then waits for the
    whole write) and, like the fast one, needs pinned memory and O_DIRECT through DeepSpeed's async I/O op."""
    engines = deepspeed_engines(accelerator)
    originals = [engine.checkpoint_engine for engine in engines]
    try:
        for engine, original in zip(engines, originals, strict=True):
            engine.checkpoint_engine = HostMemoryCheckpointEngine(original, pending, stager)
        accelerator.save_state(pending.scratch)
    finally:
        for engine, original in zip(engines, originals, strict=True):
            engine.checkpoint_engine = original


def stage_model_only(accelerator: Accelerator, pending: PendingSave, kind: str, stager: DefaultStager | None,
                     dcp_groups: list) -> None:
    """--save_only_model: FSDP writes its model shards (torch.distributed.checkpoint, as save_state does);
    the other strategies write model.safetensors from the main process, gathered from ZeRO-3 partitions."""
    if kind == "fsdp":
        options = fsdp_save_options(accelerator.state.fsdp_plugin)
        state = {"model": _get_model_state_dict(accelerator._models[0], sd_options=options)}
        path = os.path.join(pending.scratch, f"{FSDP_MODEL_NAME}_0")
        if stager is not None:
            dcp_async_save(pending, state, path, stager, dcp_groups, 0)
        else:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=not dist.is_initialized())
        return
    state = accelerator.get_state_dict(accelerator._models[0])  # a collective under ZeRO-3
    if accelerator.is_main_process:
        pending.add(os.path.join(pending.scratch, "model.safetensors"),
                    functools.partial(write_safetensors, host_copy(stager, state)))


# ---------------------------------------------------------------------------------------------------- helpers


def fsdp_save_options(plugin) -> StateDictOptions:
    """The state-dict options load_state reads FSDP2 shards with (accelerate's), but with the shards left where
    they live. accelerate's SHARDED_STATE_DICT config asks for offload_to_cpu, and get_*_state_dict's cpu_offload
    then copies every shard into new pageable host memory (torch.distributed._state_dict_utils.
    _offload_state_dict_to_cpu): a second host copy beside the stager's, and a miss in the stager's buffer cache
    on every save, since that cache is keyed by the source tensors' storages (torch.distributed.checkpoint.
    _state_dict_stager): new pinned buffers, pinned anew, each time. The live shards last from one save to the
    next, so the stager copies them once into the buffers it keeps; dcp.save writes device shards as they are.
    The files are the same either way. A full state dict keeps the offload: it gathers whole tensors, which it
    must not hold on every GPU."""
    options = _prepare_sd_options(plugin)
    return options if options.full_state_dict else dataclasses.replace(options, cpu_offload=False)


def dcp_async_save(pending: PendingSave, state: dict, path: str, stager: DefaultStager, dcp_groups: list,
                   index: int) -> None:
    """The `index`-th torch.distributed.checkpoint save of this checkpoint, on its own group."""
    group = dcp_groups[index] if dcp_groups else None
    os.makedirs(path, exist_ok=True)
    pending.futures.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path),
                                          planner=DefaultSavePlanner(), process_group=group,
                                          async_stager=stager, no_dist=group is None))


def save_small_states(accelerator: Accelerator, scratch: str) -> None:
    """What save_state writes besides the model and optimizer: scheduler, sampler and RNG states, the
    gradient scaler and objects registered for checkpointing."""
    on_each_node = accelerator.project_configuration.save_on_each_node
    save_accelerator_state(scratch, [], [], accelerator._schedulers, accelerator._dataloaders,
                           accelerator.state.process_index, accelerator.step, accelerator.scaler,
                           save_on_each_node=on_each_node)
    for index, obj in enumerate(accelerator._custom_objects):
        save_custom_state(obj, scratch, index, save_on_each_node=on_each_node)


def deepspeed_engines(accelerator: Accelerator) -> list:
    return [engine for engine in accelerator._models if hasattr(engine, "checkpoint_engine")]


class HostMemoryCheckpointEngine:
    """Stands in for DeepSpeed's TorchCheckpointEngine during one save_checkpoint: `save` copies the state dict
    to host memory and queues its torch.save for the background writer; everything else is DeepSpeed's own
    engine."""

    def __init__(self, original: Any, pending: PendingSave, stager: DefaultStager) -> None:
        self.original, self.pending, self.stager = original, pending, stager

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)

    def save(self, state_dict: dict, path: str) -> None:
        zipfile = getattr(self.original, "zipfile_serialization", True)
        self.pending.add(path, functools.partial(write_torch, host_copy(self.stager, state_dict), zipfile=zipfile))
