"""DeepSpeed's checkpoint loads, memory-mapped: a resumed rank's ZeRO shard (its fp32 master partition and Adam's
moments, 12 bytes per trainable parameter / N) is read through the page cache instead of into anonymous memory.

DeepSpeed's TorchCheckpointEngine.load (runtime/checkpoint_engine/torch_checkpoint_engine.py) calls torch.load
without mmap: the whole file lands in anonymous host memory while the offloaded states are resident.
`MmapCheckpointEngine` stands in for it during accelerate's load_state and loads with torch.load(mmap=True)
(MAP_PRIVATE): ZeRO's load copies the loaded master partition into its existing buffers (stage3.py
`_rigid_load_state_dict`: `curr_param.data.copy_`), and the pages it read are clean page cache, which the kernel
reclaims. torch's Optimizer.load_state_dict keeps a loaded tensor already of the parameter's dtype and device
(optimizer.py `_process_value_according_to_param_policy`): with the optimizer offloaded to the host, Adam's
moments would stay mapped from the checkpoint file, holding its disk space after the checkpoint is rotated away;
`detach_from_files` replaces each with an anonymous copy, one tensor at a time (they are resident optimizer
states, which the plan counts already). Files in torch's legacy format (a DeepSpeed config's
checkpoint_serialization false) cannot be mapped and load as DeepSpeed loads them."""

from __future__ import annotations

import contextlib
import zipfile
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator

from shardtune.checkpoint.staging import deepspeed_engines


def load_mapped(path: str, map_location: Any = None) -> Any:
    """torch.load of a DeepSpeed checkpoint file (pickled objects besides tensors: weights_only False), mapped
    where it is in torch's zipfile format (torch.save's default, storages aligned in the archive)."""
    return torch.load(path, map_location=map_location, weights_only=False, mmap=zipfile.is_zipfile(path))


class MmapCheckpointEngine:
    """DeepSpeed's TorchCheckpointEngine with `load` memory-mapped; it records the storages it mapped
    (their data pointers: the mapping itself is not kept alive) for `detach_from_files`."""

    def __init__(self, original: Any) -> None:
        self.original, self.mapped_storages = original, set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        loaded = load_mapped(path, map_location)
        self.mapped_storages.update(storage_pointers(loaded))
        return loaded


@contextlib.contextmanager
def mapped_deepspeed_loads(accelerator: Accelerator) -> Iterator[set[int]]:
    """Within the block, DeepSpeed's torch checkpoint engines load memory-mapped; yields the data pointers of the
    storages they mapped (filled as they load). Engines a DeepSpeed config chose itself keep their own loads."""
    engines = [engine for engine in deepspeed_engines(accelerator)
               if getattr(engine.checkpoint_engine, "name", "") == "TorchCheckpointEngine"]
    originals = [engine.checkpoint_engine for engine in engines]
    mapped: set[int] = set()
    try:
        for engine, original in zip(engines, originals, strict=True):
            engine.checkpoint_engine = wrapper = MmapCheckpointEngine(original)
            wrapper.mapped_storages = mapped
        yield mapped
    finally:
        for engine, original in zip(engines, originals, strict=True):
            engine.checkpoint_engine = original


def detach_from_files(accelerator: Accelerator, mapped: set[int]) -> int:
    """Every optimizer state tensor still backed by a mapped checkpoint file, replaced by an anonymous copy;
    returns how many. Each copy is made before its mapped tensor is dropped: one tensor beyond the states."""
    return sum(detach_optimizer(inner_torch_optimizer(engine.optimizer), mapped)
               for engine in deepspeed_engines(accelerator))


def detach_optimizer(optimizer: torch.optim.Optimizer | None, mapped: set[int]) -> int:
    """`detach_from_files` for one torch optimizer."""
    replaced = 0
    for state in optimizer.state.values() if optimizer is not None else ():
        for key, value in state.items():
            if torch.is_tensor(value) and value.untyped_storage().data_ptr() in mapped:
                state[key] = value.clone()
                replaced += 1
    return replaced


def inner_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer a DeepSpeed ZeRO / bf16 optimizer steps with (its `optimizer`, nested)."""
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def storage_pointers(obj: Any) -> set[int]:
    """The data pointers of the storages of every CPU tensor in a loaded object (dicts, lists, tuples)."""
    if torch.is_tensor(obj):
        return {obj.untyped_storage().data_ptr()} if obj.device.type == "cpu" and obj.numel() else set()
    if isinstance(obj, dict):
        return set().union(*(storage_pointers(value) for value in obj.values()))
    if isinstance(obj, list | tuple):
        return set().union(*(storage_pointers(value) for value in obj))
    return set()
