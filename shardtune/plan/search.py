"""The fastest plan that fits: every shipped accelerate config, checkpointing and micro-batch in speed order, and
when nothing fits, what binds and the fewest nodes on which something does."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

from shardtune.flops import ModelShape
from shardtune.hardware import Hardware
from shardtune.plan.planner import MemoryPlan, gb, plan
from shardtune.plan.states import Peft
from shardtune.plan.strategy import CONFIGS_DIR, read_accelerate_config

# Fastest first: least sharding, then offload. Among offloads DeepSpeed's SIMD CPU Adam is faster than FSDP's
# CPU-side torch AdamW step, and NVMe is slowest.
SPEED_ORDER = (
    "ddp", "ds_zero1", "fsdp_shard_grad_op", "ds_zero2", "fsdp_full_shard", "ds_zero3",
    "ds_zero3_offload_optimizer", "ds_zero3_cpu_offload", "fsdp_full_shard_cpu_offload", "ds_zero3_nvme_offload",
)
MAX_NODES = 64  # how far "nothing fits" looks for a node count that does


def config_paths(configs_dir: str = CONFIGS_DIR) -> list[str]:
    """Every YAML in the directory, fastest first (SPEED_ORDER), unknown names last."""
    paths = glob.glob(os.path.join(configs_dir, "*.yaml"))
    rank = {name: index for index, name in enumerate(SPEED_ORDER)}
    return sorted(paths, key=lambda p: (rank.get(os.path.splitext(os.path.basename(p))[0], len(rank)), p))


@dataclass
class Recommendation:
    plan: MemoryPlan | None
    gpu_only: bool
    accumulation: int | None
    message: str


def micro_batches(global_batch: int | None, world: int, limit: int = 64) -> list[tuple[int, int]]:
    """(micro, accumulation) pairs, largest micro first, that keep global = micro x accumulation x world."""
    pairs = []
    micro = 1
    while micro <= limit:
        if global_batch is None:
            pairs.append((micro, 1))
        elif global_batch % (micro * world) == 0:
            pairs.append((micro, global_batch // (micro * world)))
        micro *= 2
    return pairs[::-1]


def candidates(shape: ModelShape, hardware: Hardware, global_batch: int | None = None, seq: int = 4096,
               mixed_precision: str = "bf16", configs_dir: str = CONFIGS_DIR, attn: str = "sdpa",
               peft: Peft | None = None, packing: bool = False) -> Iterator[tuple[MemoryPlan, int, bool]]:
    """(plan, accumulation, offloads) for every config, checkpointing and micro-batch, fastest first: GPU-only
    configs before offload; within each, no recomputation before recomputation, configs in SPEED_ORDER, then the
    largest micro-batch that keeps the global batch (accumulation derived; it must divide)."""
    pairs = micro_batches(global_batch, hardware.world_size)
    strategies = [read_accelerate_config(path, mixed_precision) for path in config_paths(configs_dir)]
    # Recomputation (~1/3 more compute) costs more than sharding on NVLink, offload more than both.
    for offload in (False, True):
        group = [s for s in strategies if s.offloads == offload]
        for checkpointing in (False, True):
            for strategy in group:
                for micro, accumulation in pairs:
                    yield (plan(shape, hardware, strategy, micro, seq, checkpointing, attn, peft, packing),
                           accumulation, offload)


def recommend(shape: ModelShape, hardware: Hardware, global_batch: int | None = None, seq: int = 4096,
              mixed_precision: str = "bf16", configs_dir: str = CONFIGS_DIR, attn: str = "sdpa",
              peft: Peft | None = None, packing: bool = False) -> Recommendation:
    """The fastest plan that fits the GPUs and the host RAM (see `candidates` for the order); when none does,
    what binds and the smallest number of such nodes on which one does."""
    if not micro_batches(global_batch, hardware.world_size):
        return Recommendation(None, False, None, f"Global batch {global_batch} is not divisible by the "
                              f"{hardware.world_size} GPUs of {hardware.name}: no micro-batch keeps it.")
    args = (shape, hardware, global_batch, seq, mixed_precision, configs_dir, attn, peft, packing)
    for candidate, accumulation, offload in candidates(*args):
        if candidate.fits:
            return Recommendation(candidate, not offload, accumulation,
                                  _fit_message(candidate, accumulation, offload, *args))
    return Recommendation(None, False, None, nothing_fits(*args))


def _describe(p: MemoryPlan, accumulation: int) -> str:
    return (f"{p.config}, micro-batch {p.micro_batch} x accumulation {accumulation}, gradient checkpointing "
            f"{'on' if p.gradient_checkpointing else 'off'}")


def _fit_message(chosen: MemoryPlan, accumulation: int, offload: bool, shape: ModelShape, hardware: Hardware,
                 *search) -> str:
    text = (f"{shape.name} on {hardware.name}: {_describe(chosen, accumulation)}: {gb(chosen.per_gpu['total'])} "
            f"of {gb(chosen.capacity)} usable per GPU, {gb(chosen.host_ram_per_node)} of "
            f"{gb(chosen.host_ram_capacity)} usable host RAM per node.")
    if offload:
        smallest = min((p for p, _, off in candidates(shape, hardware, *search) if not off),
                       key=lambda p: p.per_gpu["total"])
        text += (f" No GPU-only config fits: the smallest, {smallest.config} with micro-batch "
                 f"{smallest.micro_batch} and checkpointing, needs {gb(smallest.per_gpu['total'])} per GPU against "
                 f"{gb(smallest.capacity)} usable.")
    return text


def fewest_nodes(shape: ModelShape, hardware: Hardware, global_batch: int | None = None, seq: int = 4096,
                 *search, gpu_only: bool = False) -> tuple[int, Recommendation] | None:
    """The smallest number of `hardware`'s nodes, from `hardware.nodes` up to MAX_NODES, on which some config
    (GPU-only ones if `gpu_only`) fits while keeping the global batch, and the fastest plan there; None when no
    count does."""
    for nodes in range(hardware.nodes, MAX_NODES + 1):
        bigger = hardware.with_nodes(nodes)
        if not micro_batches(global_batch, bigger.world_size):
            continue  # the global batch does not divide over these GPUs
        for candidate, accumulation, offload in candidates(shape, bigger, global_batch, seq, *search):
            if candidate.fits and not (gpu_only and offload):
                return nodes, Recommendation(candidate, not offload, accumulation, "")
    return None


def nothing_fits(shape: ModelShape, hardware: Hardware, global_batch: int | None, seq: int, *search) -> str:
    """What binds on this hardware (the GPUs, or the host RAM of the plans the GPUs would hold), and the
    smallest number of such nodes on which some config fits, every strategy considered."""
    plans = [p for p, _, _ in candidates(shape, hardware, global_batch, seq, *search)]
    within_gpu = [p for p in plans if p.gpu_fits]
    if within_gpu:
        least = min(within_gpu, key=lambda p: p.host_ram_per_node)
        binding = (f"host RAM: the plans that fit the GPUs need {gb(least.host_ram_per_node)} per node at the "
                   f"least ({least.config}), {gb(least.host_ram_capacity)} is usable (give the node's RAM with "
                   "--host_ram_gb)")
    else:
        least = min(plans, key=lambda p: p.per_gpu["total"])
        binding = (f"GPU memory: the smallest plan, {least.config} with micro-batch {least.micro_batch} and "
                   f"checkpointing, needs {gb(least.per_gpu['total'])} per GPU, {gb(least.capacity)} is usable")
    text = f"Nothing fits {shape.name} on {hardware.name}; the binding limit is {binding}."
    found = fewest_nodes(shape, hardware.with_nodes(hardware.nodes + 1), global_batch, seq, *search)
    if found is None:
        text += f" It fits on no number of such nodes up to {MAX_NODES} with this global batch."
    else:
        nodes, fitting = found
        text += (f" It fits on {nodes} such nodes ({fitting.plan.hardware}): "
                 f"{_describe(fitting.plan, fitting.accumulation)}, {gb(fitting.plan.per_gpu['total'])} per GPU.")
        if not fitting.gpu_only:
            fast = fewest_nodes(shape, hardware.with_nodes(nodes + 1), global_batch, seq, *search, gpu_only=True)
            text += (f" Without offload it fits on {fast[0]} nodes: {_describe(fast[1].plan, fast[1].accumulation)}."
                     if fast else f" Without offload it fits on no number of nodes up to {MAX_NODES} with this "
                     "global batch.")
    peft = search[-1] if search else None
    return text + ("" if peft else " LoRA or QLoRA (--use_peft true) needs far less.")
