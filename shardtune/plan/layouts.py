"""Multi-node layouts: what FSDP2's hybrid sharding and ZeRO++'s hierarchical partitioning (hpZ) change in the
bytes per GPU. Hybrid sharding shards the states over dp_shard_size GPUs (one node) instead of all of them, which
the planner counts by planning with that many GPUs (Strategy.sharded_over); hpZ keeps the partitions over all GPUs
and adds the secondary copy of the 16-bit weights counted here."""

from __future__ import annotations

from shardtune.models.flops import ModelShape
from shardtune.plan.states import Peft, parameter_sizes
from shardtune.plan.strategy import Strategy


def hpz_secondary_elements(shape: ModelShape, world: int, hpz_partition: int, peft: Peft | None = None) -> int:
    """Elements of one GPU's hpZ secondary partitions, as partition_parameters.py `_partition_param_sec` allocates
    them for every ZeRO-3 parameter (the frozen base's and LoRA's adapters' too): the parameter padded to a
    multiple of the world size (`_aligned_size`), divided by the hpZ group size (a rank holds one such slice)."""
    sizes = [numel for numel, _ in parameter_sizes(shape)] + (peft.adapter_sizes(shape) if peft else [])
    return sum(-(-numel // world) * world // hpz_partition for numel in sizes)


def hpz_secondary_bytes(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None = None) -> float:
    """Bytes per GPU of ZeRO++'s secondary weight partitions, in the module's dtype (`param.dtype`: 16-bit under
    bf16/fp16): 0 unless ZeRO-3 with zero_hpz_partition_size > 1 (at the world size too: the group is then every
    GPU, and the secondary copy as large as the primary partition). They are made when a parameter is first
    partitioned and refreshed after every step, never freed: held in every phase, beside the primary partitions."""
    hpz = min(strategy.hpz_partition, world)  # groups.py `_create_zero_param_parallel_group`: min(size, world)
    if strategy.kind != "deepspeed" or strategy.shard < 3 or hpz <= 1:
        return 0.0
    return float(strategy.compute_bytes * hpz_secondary_elements(shape, world, hpz, peft))
