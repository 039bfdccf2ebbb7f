"""What a rank really holds in weights, gradients and optimizer states, measured on the live objects.

This is the ground truth that the planner's `model_states` is tested against (tests/launch/test_memory_measured.py), and
what the trainer reports once per run. Tensors are counted by storage, each storage once, local shards only:
FSDP2 parameters are DTensors (their local shard counts), ZeRO-3 parameters keep their shard in `ds_tensor`.

The measurement is taken right after the innermost optimizer's first step, when everything coexists: the
weights, the gradients the step consumed, and the optimizer states it has just created. Under DeepSpeed the
inner optimizer steps on fp32 master partitions; the ZeRO optimizer's reduce buckets and the ZeRO-3 parameters
still gathered count as buffers, every other tensor it holds (16-bit and fp32 gradient partitions) as gradients.

Beside them, the process's own figures: its resident set size (host RAM, read from /proc) and, per logged row,
its peak memory."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# "host": the part of the other components that the offload settings placed in host memory, read from the
# strategy's own bookkeeping (on a CPU machine every tensor's device is the host, so devices tell nothing).
COMPONENTS = ("weights", "gradients", "optimizer", "buffers", "host")
# Counted apart: the model and the torch optimizer, and the gradient reduce buckets (communication buffers).
SKIPPED_ZERO_ATTRIBUTES = ("module", "parameter_offload", "optimizer", "ipg_buckets")


def innermost_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's wrapper -> (DeepSpeed's ZeRO optimizer ->) the torch optimizer that updates the states."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def stored_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold `tensor`'s data: itself, or a wrapper subclass's inner tensors (torchao's quantized
    optimizer states keep codes, scales and a lookup table behind a wrapper that has no storage of its own)."""
    tensor = local(tensor)
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return [inner for name in names for inner in stored_tensors(getattr(tensor, name))]
    return [tensor]


def reachable_tensors(obj: object, seen: set[int] | None = None, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor held by `obj` through attributes, lists and dicts (DeepSpeed's ZeRO optimizers)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from reachable_tensors(value, seen, depth + 1)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from reachable_tensors(value, seen, depth + 1)
    elif type(obj).__module__.startswith("deepspeed.runtime.zero") and hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            if name not in SKIPPED_ZERO_ATTRIBUTES:
                yield from reachable_tensors(value, seen, depth + 1)


class _Storages:
    """Adds up bytes of storages not counted before."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def bytes(self, tensors) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None or tensor.device.type == "meta":  # no memory behind it
                continue
            for stored in stored_tensors(tensor):
                storage = stored.untyped_storage()
                key = (str(stored.device), storage.data_ptr())
                if storage.nbytes() == 0 or key in self.seen:
                    continue
                self.seen.add(key)
                total += storage.nbytes()
        return total


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter data this rank holds (a ZeRO-3 partition, nothing for a model on the meta device)."""
    return _Storages().bytes(getattr(p, "ds_tensor", p) for p in model.parameters())


def fsdp_param_groups(unit: torch.nn.Module) -> list:
    """The FSDPParamGroups of one fully_shard unit: torch 2.13 keeps a list of them (`_fsdp_param_groups`), torch
    2.11, the GPU machine's, one or None (`_fsdp_param_group`)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def fsdp_params(model: torch.nn.Module) -> Iterator:
    """Every FSDPParam of an FSDP2 model: FSDP's own record of each parameter (nothing for other models)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module):
                yield from group.fsdp_params


def fsdp_unsharded_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """The full-size gradients FSDP2 keeps between micro-batches when gradient sync is off (no_sync): the
    unsharded parameter's gradient, or its copy upcast to the reduce dtype. Neither is a `.grad` of the model's
    (sharded) parameters, so a probe reading `p.grad` alone misses them."""
    grads = []
    for fsdp_param in fsdp_params(model):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        grads += [fsdp_param.unsharded_accumulated_grad, unsharded.grad if unsharded is not None else None]
    return grads


def zero_master_partitions(zero_optimizer: object) -> list[torch.Tensor]:
    """The fp32 master partitions of every parameter group (ZeRO-1/2) or sub-group (ZeRO-3). While DeepSpeed steps
    one of them, the torch optimizer's param_groups hold that one alone (stage_1_and_2.py `_optimizer_step`
    swaps in a single group, stage3.py puts one sub-group's partition in its group and empties it after), so
    reading param_groups misses the others. NVMe offload keeps empty placeholders here (no storage, not counted)."""
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        partitions = getattr(zero_optimizer, name, None)
        if partitions:
            return [tensor for tensor in partitions if isinstance(tensor, torch.Tensor)]
    return []


def held_model_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer states on this rank (host and device together)."""
    inner = innermost_optimizer(optimizer)
    params = list(model.parameters())
    counted = _Storages()
    # ZeRO++ hpZ's secondary 16-bit partitions (within a node) are weights too, beside the primary ones.
    weights = counted.bytes([getattr(p, "ds_tensor", p) for p in params]
                            + [getattr(p, "ds_secondary_tensor", None) for p in params])
    zero_optimizer = getattr(optimizer, "optimizer", None)
    is_zero = zero_optimizer is not None and zero_optimizer is not inner
    optimizer_states = counted.bytes(
        [value for state in inner.state.values() for value in state.values() if isinstance(value, torch.Tensor)]
        + [p for group in inner.param_groups for p in group["params"]]
        + (zero_master_partitions(zero_optimizer) if is_zero else [])
    )
    # Buffers: ZeRO-3 parameters still gathered (their full data beside the shard) and the reduce buckets.
    buckets = reachable_tensors(getattr(zero_optimizer, "ipg_buckets", None)) if is_zero else []
    buffers = counted.bytes([p for p in params if hasattr(p, "ds_tensor")] + list(buckets))
    grads = [p.grad for p in params] + [p.grad for group in inner.param_groups for p in group["params"]]
    grads += fsdp_unsharded_gradients(model)
    if is_zero:
        grads += list(reachable_tensors(zero_optimizer))
    offloaded = deepspeed_host_tensors(model, zero_optimizer) if is_zero else fsdp_host_tensors(model, inner)
    host = _Storages().bytes(offloaded)
    return {"weights": weights, "gradients": counted.bytes(grads), "optimizer": optimizer_states, "buffers": buffers,
            "host": host}


def fsdp_host_tensors(model: torch.nn.Module, inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What FSDP2's CPUOffloadPolicy keeps in host memory, by FSDP's own bookkeeping (each FSDPParam's
    `offload_to_cpu`): the sharded parameter, its gradient and the optimizer's states of it."""
    tensors: list[torch.Tensor] = []
    for fsdp_param in fsdp_params(model):
        if fsdp_param.offload_to_cpu:
            param = fsdp_param.sharded_param
            state = inner.state.get(param, {})
            tensors += [param, param.grad, *(v for v in state.values() if isinstance(v, torch.Tensor))]
    return tensors


def deepspeed_host_tensors(model: torch.nn.Module, zero_optimizer: object) -> list[torch.Tensor]:
    """What DeepSpeed's offload put in host memory, by its own attributes: with offload_optimizer (ZeRO-3
    `offload_optimizer`, ZeRO-1/2 `cpu_offload`) the fp32 master partitions of the sub-groups it assigned to the
    CPU (`subgroup_to_device`), their gradients and Adam states, and the gradient partition reduced into
    (`grad_partitions_flat_buffer`, allocated on the optimizer's device, the host); with offload_param the
    partitions of the parameters that are not persistent (persistent ones stay on the accelerator)."""
    if zero_optimizer is None:
        return []
    inner = innermost_optimizer(zero_optimizer)
    tensors: list[torch.Tensor] = []
    if getattr(zero_optimizer, "offload_optimizer", False) or getattr(zero_optimizer, "cpu_offload", False):
        devices = getattr(zero_optimizer, "subgroup_to_device", None) or {}
        for index, master in enumerate(zero_master_partitions(zero_optimizer)):
            if devices.get(index, "cpu") == "cpu":
                state = inner.state.get(master, {})
                tensors += [master, master.grad, *(v for v in state.values() if isinstance(v, torch.Tensor))]
        tensors.append(getattr(zero_optimizer, "grad_partitions_flat_buffer", None))
    if getattr(zero_optimizer, "offload_param", False):
        tensors += [p.ds_tensor for p in model.parameters()
                    if getattr(p, "ds_tensor", None) is not None and not getattr(p, "ds_persist", False)]
    return tensors


class ModelStateProbe:
    """Per component, the most this rank holds at two kinds of moment of the first optimizer step: after every
    micro-batch's backward, the non-final ones included (gradients still full-size where a strategy keeps them
    so between reductions: ZeRO-1, FSDP under no_sync), and right after each step of the inner optimizer. Under
    DeepSpeed one optimizer step is several inner steps, one per parameter group (ZeRO-1/2) or sub-group
    (ZeRO-3, `sub_group_size`): each has its own fp32 gradient while it steps (ZeRO-3 frees it after) and
    creates its own Adam states, so every one of them is observed, until the next step's first backward."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.held = dict.fromkeys(COMPONENTS, 0)
        self.inner_steps = 0  # of the first optimizer step: its parameter groups or sub-groups
        self.done = False
        self._handle = innermost_optimizer(optimizer).register_step_post_hook(self._after_step)

    def after_backward(self) -> None:
        self.done = self.done or self.inner_steps > 0  # the first optimizer step is over
        if not self.done:
            self._observe()
        elif self._handle is not None:  # removed here: a hook may not remove itself while hooks run
            self._handle.remove()
            self._handle = None

    def _after_step(self, *_) -> None:
        if not self.done:
            self._observe()
            self.inner_steps += 1

    def _observe(self) -> None:
        for key, value in held_model_states(self.model, self.optimizer).items():
            self.held[key] = max(self.held[key], value)


# ---------------------------------------------------------------------------------------------------------------
# The process: resident set size (host RAM) and peak memory.


def reset_peak_rss() -> None:
    """Start this process's peak resident set size (VmHWM) afresh from the current size (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:  # not Linux: the peak then counts from the start of the process
        pass


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS; 0 where /proc is missing)."""
    return _proc_status_bytes("VmRSS:") or 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size since the last `reset_peak_rss` (VmHWM; where /proc is missing, the
    peak since the process started)."""
    peak = _proc_status_bytes("VmHWM:")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as file:
            return next(int(line.split()[1]) * 1024 for line in file if line.startswith(field))
    except OSError:
        return None


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """Peak allocated GPU memory on CUDA, the process's peak resident set size on CPU, since reset_phase_peak, in
    GB (10^9 bytes, as the planner counts). On CUDA also what decides whether a plan fits beside the allocated
    peak: the caching allocator's reserved peak (its cache and fragmentation) and the device's memory in use now,
    as the driver reports it (the CUDA context, NCCL's buffers and other processes too)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9,
                "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9,
                "device_used_gb": (total - free) / 1e9}
    return {"peak_rss_gb": peak_rss_bytes() / 1e9}


def reset_phase_peak(device: torch.device) -> None:
    """Start a phase's peak (phase_peak_gb): the CUDA allocator's, else this process's resident set size's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def phase_peak_gb(device: torch.device, phase: str) -> dict[str, float]:
    """The peak since reset_phase_peak, named like peak_memory_gb's: <phase>_peak_memory_gb (allocated on the GPU)
    or <phase>_peak_rss_gb (resident on the CPU)."""
    return {f"{phase}_{name}": value for name, value in peak_memory_gb(device).items()}
