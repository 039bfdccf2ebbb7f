"""Host RAM of a run: the checkpoint staging copy of --async_save, the weights while they load, the checkpoint's
page cache, and NVMe offload's pinned swap buffers."""

from __future__ import annotations

from shardtune.flops import ModelShape
from shardtune.plan.states import CHECKPOINT_SHARD_BYTES, NF4_BYTES, Peft, largest_sub_group
from shardtune.plan.strategy import Strategy

CHECKPOINT_BYTES = 2  # bytes per parameter of a Hugging Face Llama-class checkpoint (bf16)


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


def loading_host_bytes(strategy: Strategy, params: int, gpus_per_node: int, peft: Peft | None = None) -> float:
    """Host RAM while the weights load, in the dtype they load in (shardtune.model.load_model): fp32 master
    weights for full fine-tuning, the 16-bit frozen base under LoRA; QLoRA quantizes each checkpoint shard as it
    reaches the GPU, so a process holds its NF4 copy on the way plus one 16-bit shard (5 GB). Every local
    process reads its own copy, unless RAM-efficient loading is on (FSDP: rank 0 reads, the others start on the
    meta device; DeepSpeed zero.Init streams checkpoint shards and keeps partitions: approximated as one copy
    per node)."""
    copies = 1 if strategy.ram_efficient_loading else gpus_per_node
    if peft is not None and peft.load_in_4bit:
        return (NF4_BYTES * params + CHECKPOINT_SHARD_BYTES) * copies
    per_param = 4 if peft is None else strategy.compute_bytes
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
