"""Host RAM of a run: the checkpoint staging copy of --async_save, the weights while they load, the checkpoint's
page cache, NVMe offload's pinned swap buffers, what torch's pinned-memory allocator adds to pinned buffers, the
moment tensor a resumed DeepSpeed run copies off its mapped checkpoint, and the final export's shard."""

from __future__ import annotations

from shardtune.models.flops import ModelShape
from shardtune.plan.states import (
    CHECKPOINT_SHARD_BYTES,
    NF4_BYTES,
    Peft,
    decay_tensors,
    largest_sub_group,
    parameter_sizes,
    sub_group_sizes,
)
from shardtune.plan.strategy import Strategy

CHECKPOINT_BYTES = 2  # bytes per parameter of a Hugging Face Llama-class checkpoint (bf16)
# DeepSpeed runs set torch's pinned_max_cached_size_mb to this (parallel.pinned_memory.exact_pinned_host_memory):
# a pinned block above it is allocated at its size, not the next power of two, and freed back to the system.
PINNED_MAX_CACHED_MB = 1
MB = 1024 * 1024  # the allocator config's "mb"


def staging_host_bytes(strategy: Strategy, params: int, world: int, gpus_per_node: int,
                       model_only: bool = False) -> float:
    """Host RAM of --async_save's staging copy on the first node (shardtune.checkpoint), kept from the first
    asynchronous save on: each rank's share of the checkpoint. With Adam, full state: FSDP and ZeRO-3 12P/N per
    rank (fp32 weights or master 4, m and v 8); ZeRO-1/2 the same plus 4P on rank 0 while it saves the 16-bit
    module; DDP 12P on rank 0 alone. Model only: FSDP 4P/N per rank; DDP and DeepSpeed the weights on rank 0
    (twice under ZeRO-3, which gathers them first)."""
    p, n, local = float(params), world, min(gpus_per_node, world)
    if model_only:
        if strategy.kind == "fsdp":
            return 4 * p / n * local
        return (4 if strategy.kind == "ddp" else strategy.compute_bytes) * p * (2 if strategy.shard >= 3 else 1)
    if strategy.kind == "ddp":
        return 12 * p
    return 12 * p / n * local + (4 * p if strategy.kind == "deepspeed" and strategy.shard < 3 else 0)


def loading_host_bytes(strategy: Strategy, params: int, gpus_per_node: int, peft: Peft | None = None,
                       bf16_weights: bool = False) -> float:
    """Host RAM while the weights load, in the dtype they load in (shardtune.model.load_model): fp32 master
    weights for full fine-tuning (bf16 with --bf16_stochastic_round, `bf16_weights`), the 16-bit frozen base
    under LoRA; QLoRA quantizes each checkpoint shard as it
    reaches the GPU, so a process holds its NF4 copy on the way plus one 16-bit shard (5 GB). Every local
    process reads its own copy, unless RAM-efficient loading is on (FSDP: rank 0 reads, the others start on the
    meta device; DeepSpeed zero.Init streams checkpoint shards and keeps partitions: approximated as one copy
    per node)."""
    copies = 1 if strategy.ram_efficient_loading else gpus_per_node
    if peft is not None and peft.load_in_4bit:
        return (NF4_BYTES * params + CHECKPOINT_SHARD_BYTES) * copies
    per_param = strategy.compute_bytes if peft is not None or bf16_weights else 4
    return float(per_param * params * copies)


def checkpoint_page_cache_bytes(params: int) -> float:
    """The checkpoint's safetensors files, memory-mapped by every process that reads them: their pages count in
    each reader's resident set (measured: a rank that loads a bf16 checkpoint for fp32 training rises by 6 bytes
    per parameter, 4 of them the model's) but are one page cache per node, and clean: the kernel can drop them
    under pressure. Listed beside model_loading, not counted in "fits"."""
    return float(CHECKPOINT_BYTES * params)


def swap_buffer_bytes(strategy: Strategy, shape: ModelShape, trainable: int, world: int) -> float:
    """Pinned host RAM per rank of DeepSpeed's NVMe offload, allocated at start-up and held for the run:
    offload_param's buffer_count buffers of buffer_size elements in the module's dtype (partitioned_param_swapper.py)
    and offload_optimizer's buffer_count fp32 buffers of the largest sub-group each (optimizer_utils.py
    `SwapBufferManager`, largest_numel)."""
    if strategy.kind != "deepspeed":
        return 0.0
    total = 0.0
    if strategy.offload_params == "nvme":
        count, size = strategy.nvme_param_buffers
        total += count * size * strategy.compute_bytes
    if strategy.offload_optimizer == "nvme":
        total += strategy.nvme_optimizer_buffers * 4 * largest_sub_group(strategy, shape, trainable, world)
    return total


def pinned_block_bytes(nbytes: int, max_cached_bytes: float = float("inf"),
                       round_threshold_bytes: float = float("inf")) -> int:
    """Bytes torch's caching host allocator takes for a pinned request of `nbytes` (torch 2.13,
    ATen/core/CachingHostAllocator.h `allocate`): the next power of two (c10::llvm::PowerOf2Ceil) unless the
    request exceeds pinned_max_round_threshold_mb or pinned_max_cached_size_mb (both unlimited by default), then
    `nbytes`. A freed block stays cached unless it exceeds pinned_max_cached_size_mb (`maybe_cache_block`)."""
    if nbytes <= 0:
        return 0
    if nbytes <= round_threshold_bytes and nbytes <= max_cached_bytes:
        return 1 << (nbytes - 1).bit_length()
    return nbytes


def pinned_buffers(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None = None) -> list[int]:
    """Bytes of each pinned host buffer one rank holds from torch's caching host allocator (DeepSpeed's CUDA
    accelerator pins with `tensor.pin_memory()`, abstract_accelerator.py `_torch_pin_memory`; its NVMe swap
    buffers come from its own page-locked allocator and are not listed). Shipped JSON files pin (pin_memory true).
    - ZeRO-3 offload_optimizer (stage3.py): the fp32 gradient partition every micro-batch reduces into
      (`grad_partitions_flat_buffer`, one block of every trainable partition), and with device cpu one fp32
      gradient buffer per optimizer sub-group (`initialize_optimizer_states`; NVMe sub-groups swap instead).
    - ZeRO-3 offload_param: one 16-bit flat block per parameter group, up to max_in_cpu elements under NVMe
      (`_create_param_groups_fp16_flat_cpu_memory`). The per-parameter partitions zero.Init pins first are copied
      in and freed, back to the system under shardtune's setting (larger than PINNED_MAX_CACHED_MB).
    - FSDP2 CPUOffloadPolicy (pin_memory by default): every parameter's padded shard, ceil(rows / N) rows
      (_fsdp_param.py), and each step the fp32 gradient shard of every trainable parameter, copied to the host
      into a new pinned tensor (`.to("cpu", non_blocking=True)`, _fsdp_collectives.py) and cached by the
      allocator when freed."""
    trainable = [(n, d) for n, d in parameter_sizes(shape)] if peft is None else \
        [(n, True) for n in peft.adapter_sizes(shape)]
    if strategy.kind == "fsdp" and strategy.offload_params != "none":
        norms = [(shape.hidden, 1)] * (2 * shape.layers + 1)
        shards = [-(-rows // world) * columns for rows, columns in decay_tensors(shape) + norms]
        if peft is None:
            return [4 * numel for numel in shards] * 2  # fp32 weights, then fp32 gradients
        adapters = [4 * -(-numel // world) for numel, _ in trainable]  # small: taken as finely divisible
        return [strategy.compute_bytes * numel for numel in shards] + adapters * 2
    if strategy.kind != "deepspeed" or strategy.shard < 3:
        return []
    blocks: list[int] = []
    if strategy.offload_optimizer != "none":
        blocks.append(4 * sum(-(-n // world) for n, _ in trainable))
        if strategy.offload_optimizer == "cpu":
            blocks += [4 * size for size in sub_group_sizes(strategy, trainable, world)]
    if strategy.offload_params != "none" and peft is None:
        in_cpu = float("inf") if strategy.offload_params == "cpu" else strategy.nvme_max_in_cpu
        for decayed in (True, False):
            group = sum(-(-n // world) for n, d in trainable if d == decayed)
            kept = int(min(group, max(0, in_cpu)))
            in_cpu -= group
            if kept:
                blocks.append(strategy.compute_bytes * kept)
    return blocks


def pinned_rounding_bytes(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None = None) -> float:
    """What the caching host allocator takes per rank beyond the pinned buffers' own bytes (which the states
    count): DeepSpeed runs under shardtune's setting (PINNED_MAX_CACHED_MB), FSDP under torch's defaults."""
    limit = PINNED_MAX_CACHED_MB * MB if strategy.kind == "deepspeed" else float("inf")
    return float(sum(pinned_block_bytes(b, limit) - b for b in pinned_buffers(strategy, shape, world, peft)))


def resume_host_bytes(strategy: Strategy, shape: ModelShape, trainable: int, world: int) -> float:
    """Anonymous host RAM per rank that resuming a DeepSpeed run adds to what is resident when it loads.
    shardtune.checkpoint.mmap_load maps every file DeepSpeed loads (the rank's ZeRO shard: fp32 master and Adam's
    m and v, 12 bytes per trainable parameter / N; below ZeRO-3 the 16-bit module first): what is copied into
    existing buffers (the master partition, the module, states bound for the GPU or NVMe) is read through the
    page cache, clean and reclaimable, not counted. With the optimizer on the host (offload_optimizer cpu), the
    loaded m and v become the optimizer's states (it has none before its first step) and are copied off the file
    one tensor at a time (detach_from_files): the largest, one flat fp32 sub-group under ZeRO-3, the whole fp32
    partition (P / N) of the weight-decayed group under ZeRO-1/2. DDP and FSDP load on the device: nothing."""
    if strategy.kind != "deepspeed" or strategy.offload_optimizer != "cpu":
        return 0.0
    if strategy.shard >= 3:
        return 4.0 * largest_sub_group(strategy, shape, trainable, world)
    return 4.0 * -(-trainable // world)
