"""Resuming a ZeRO-3 run whose optimizer lives on NVMe: what DeepSpeed's load_checkpoint leaves out.

With the optimizer swapped to NVMe, DeepSpeed 0.19's `load_checkpoint` (runtime/engine.py) skips
`_load_zero_checkpoint` and only copies the checkpoint's `offloaded_tensors/` back into the swap folder. That
restores the fp32 master weights of the swapped sub-groups and nothing else:

- sub-groups under the swapper's smallest I/O (1 MiB, the norms) are never swapped: their fp32 weights and Adam
  moments are in the ZeRO checkpoint's `optim_states.pt` alone, and would start over from the model's weights;
- the swap folder's Adam moment files are not read back: the fresh optimizer holds no state for the swapped
  sub-groups, so the swapper knows only their weights and Adam starts with zero moments;
- Adam's step count (its bias correction) is in the optimizer state, not in the swap files;
- the param groups' learning rates: the scheduler's state does not set them, the optimizer's state dict does, so
  the first step after the resume would run at the schedule's initial rate.

`restore_nvme_optimizer` puts these back from this rank's `optim_states.pt`, which DeepSpeed writes at every save
(the swapped sub-groups' tensors are empty there, their step counts are not). It uses DeepSpeed's ZeRO-3
optimizer internals (`fp32_partitioned_groups_flat`, the optimizer swapper's per-parameter swap info), like
DeepSpeed's own `_rigid_load_state_dict`, which the NVMe path does not call."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator

from shardtune.checkpoint.mmap_load import detach_from_files, load_mapped, mapped_deepspeed_loads
from shardtune.checkpoint.universal import loading_universal, repair_zero3_universal_load, restore_engines


def nvme_optimizers(accelerator: Accelerator) -> list:
    """The ZeRO-3 optimizers of this run whose states are swapped to NVMe."""
    engines = [model for model in accelerator._models if hasattr(model, "zero_nvme_offload_optimizer")]
    return [engine.optimizer for engine in engines if engine.zero_nvme_offload_optimizer()]


def load_state(accelerator: Accelerator, path: str, universal: bool = False) -> None:
    """accelerate's load_state, with DeepSpeed's files memory-mapped (shardtune.checkpoint.mmap_load), completed
    for NVMe-offloaded optimizers (see the module docstring). `universal`: `path` is DeepSpeed's universal form of
    a checkpoint (shardtune.checkpoint.universal), which DeepSpeed slices for this run's ranks."""
    engines = loading_universal(accelerator, universal)
    try:
        with mapped_deepspeed_loads(accelerator) as mapped:
            accelerator.load_state(path)
    finally:
        restore_engines(engines)
    # accelerate restores its micro-batch count (Accelerator.step), which decides at which micro-batch gradients
    # sync: counted under the saved accumulation, it is misaligned under another (3 steps of 2 micro-batches resumed
    # at 4 per step synced after 2, measured: half the step's gradient). A checkpoint is at a step's boundary: 0.
    accelerator.step = 0
    repair_zero3_universal_load(engines, path)
    detach_from_files(accelerator, mapped)
    optimizers = nvme_optimizers(accelerator)
    if not optimizers:
        return
    if len(optimizers) > 1:
        raise NotImplementedError("resuming more than one NVMe-offloaded DeepSpeed model")
    rank = torch.distributed.get_rank(group=optimizers[0].dp_process_group)
    # Mapped: what restore_nvme_optimizer keeps it copies, the rest stays page cache.
    saved = load_mapped(os.path.join(path, "pytorch_model", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
                        map_location="cpu")["optimizer_state_dict"]
    restore_nvme_optimizer(optimizers[0], saved)


def restore_nvme_optimizer(optimizer, saved: dict) -> None:
    """Put back from `saved` (a rank's ZeRO-3 optimizer state dict) what the NVMe load left out: the param
    groups' hyperparameters (the learning rate of the step being resumed); every sub-group's step count; the
    swapped sub-groups' Adam moments, registered with the swapper so that it reads them from the swap files
    load_checkpoint copied back; the unswapped sub-groups' fp32 weights and moments, and their 16-bit
    partitions."""
    base = saved["optimizer_state_dict"]
    sub_groups = sub_groups_in_state_order(optimizer, base["param_groups"])
    for group, saved_group in zip(optimizer.optimizer.param_groups, base["param_groups"], strict=True):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
    swapper = optimizer.optimizer_swapper
    for index, sub_group in sub_groups.items():
        master = optimizer.fp32_partitioned_groups_flat[sub_group]
        state = {}
        if optimizer._swappable_optimizer_subgroup(sub_group):
            moments = []
            for name, value in base["state"][index].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    value = torch.empty(0, dtype=master.dtype, device=master.device)  # data: swap file `name-<ds_id>`
                    value.ds_id = f"{name}-{master.ds_id}"
                    moments.append(value)
                state[name] = value
            swapper.swap_params_info[master.ds_id].add_state_tensors(moments)
        else:
            for name, value in base["state"][index].items():
                state[name] = value.to(master.device).clone() if torch.is_tensor(value) else value
            master.data.copy_(saved["fp32_flat_groups"][sub_group])
            optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)
        optimizer.optimizer.state[master] = state
    # Parameters below the persistence threshold (the norms) stay gathered: gather them again from the
    # partitions just restored, as DeepSpeed's own load does.
    persistent = optimizer.persistent_parameters
    if persistent:
        persistent[0].partition(persistent)
        persistent[0].all_gather(persistent)


def sub_groups_in_state_order(optimizer, saved_groups: list[dict]) -> dict[int, int]:
    """Saved state index -> sub-group: DeepSpeed's state dict lists each param group's sub-groups in order
    (stage3's _set_fp32_optimizer_param_groups)."""
    order = {}
    for group_id, group in enumerate(saved_groups):
        members = [sub_group for sub_group in range(len(optimizer.fp16_groups))
                   if optimizer.sub_group_to_group_id[sub_group] == group_id]
        if len(members) != len(group["params"]):
            raise RuntimeError(f"the checkpoint's optimizer group {group_id} has {len(group['params'])} sub-groups, "
                               f"this run's {len(members)}: resume with the DeepSpeed config it was saved with.")
        order.update(zip(group["params"], members, strict=True))
    return order
