"""Memory plan per GPU, before a single weight is loaded: model states, activations and buffers for any model x
hardware x accelerate config, and the fastest config, checkpointing and micro-batch that fit.

    python -m shardtune.plan --model llama-3.1-70b --hardware 8xh100-80gb                  # recommendation
    python -m shardtune.plan --model recipes/llama8b.py --config_file accelerate_configs/fsdp_full_shard.yaml
    python -m shardtune.plan --model llama-3.1-8b --compare --chart plan.png

All sizes are bytes. GB in output is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import yaml

from shardtune.flops import ModelError, ModelShape, recipe_fields, resolve_model
from shardtune.hardware import Hardware, HardwareError, nominal_gpu_memory, parse_hardware

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS_DIR = os.path.join(REPO, "accelerate_configs")
GiB = 1024**3

# Headroom kept free on every GPU: the CUDA context and NCCL's communicator buffers (about 0.5-1 GiB each on an
# 8-GPU node), and the caching allocator's fragmentation (reserved minus allocated: typically 5-10% of a training
# step's peak). A plan fits when its peak of live tensor bytes stays below what is left.
GPU_FIXED_RESERVE = 2 * GiB
GPU_HEADROOM_FRACTION = 0.10
# Host RAM kept free on every node: the OS, the page cache that loading reads through, dataloader workers.
HOST_HEADROOM_FRACTION = 0.10

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), for a DeepSpeed config without a JSON file. The shipped
# configs set their own in accelerate_configs/deepspeed/*.json, read into the Strategy (deepspeed_settings).
DS_REDUCE_BUCKET = int(5e8)  # elements; gradients are reduced through a flat bucket of this size
DS_PREFETCH_BUCKET = int(5e7)  # elements; ZeRO-3 prefetches up to this many parameters ahead
DS_SUB_GROUP = int(1e9)  # elements of a rank's ZeRO-3 partition that the optimizer steps at once
DS_PERSISTENCE_THRESHOLD = int(1e5)  # ZeRO-3 keeps parameters of at most this many elements whole on every rank
DS_MAX_LIVE_PARAMETERS = int(1e9)  # elements of gathered ZeRO-3 parameters alive at once
DS_NVME_PARAM_BUFFERS = (5, int(1e8))  # offload_param buffer_count, buffer_size: pinned host staging for NVMe
DS_NVME_OPTIMIZER_BUFFERS = 4  # offload_optimizer buffer_count: pinned buffers of one sub-group each
DS_NVME_MAX_IN_CPU = int(1e9)  # offload_param max_in_cpu: elements of a rank's partitions kept in host RAM

# How the planner models each transformers attention implementation (shardtune.config.ATTENTION_PACKAGES): SDPA
# and eager take a dense mask; the flash kernels (flash-attn's varlen kernels, flex attention's block mask) none.
PLANNED_ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash", "flash_attention_3": "flash",
                     "flex_attention": "flash"}

# Fastest first: least sharding, then offload. Among offloads DeepSpeed's SIMD CPU Adam is faster than FSDP's
# CPU-side torch AdamW step, and NVMe is slowest.
SPEED_ORDER = (
    "ddp", "ds_zero1", "fsdp_shard_grad_op", "ds_zero2", "fsdp_full_shard", "ds_zero3",
    "ds_zero3_offload_optimizer", "ds_zero3_cpu_offload", "fsdp_full_shard_cpu_offload", "ds_zero3_nvme_offload",
)


class PlanError(ValueError):
    """A config file or option the planner cannot use."""


# ---------------------------------------------------------------------------------------------------------------
# Strategy: what an accelerate config file means for memory.


@dataclass(frozen=True)
class Strategy:
    name: str
    kind: str  # "ddp" (also single GPU), "fsdp" or "deepspeed"
    shard: int  # ZeRO stage equivalent: 0 none, 1 optimizer, 2 + gradients, 3 + parameters
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_params: str = "none"
    ram_efficient_loading: bool = False
    mixed_precision: str = "bf16"
    # DeepSpeed's buffers and chunks in elements: the JSON's zero_optimization, DeepSpeed's defaults without one;
    # None where the JSON says "auto" (accelerate derives it from hidden_size: see deepspeed_sizes).
    reduce_bucket: int | None = DS_REDUCE_BUCKET
    overlap_comm: bool = False  # ZeRO-1/2 then allocate a second reduce bucket (ZeRO-3 overlaps by default)
    prefetch_bucket: int | None = DS_PREFETCH_BUCKET
    sub_group: int | None = DS_SUB_GROUP
    persistence_threshold: int | None = DS_PERSISTENCE_THRESHOLD
    max_live_parameters: int | None = DS_MAX_LIVE_PARAMETERS
    # NVMe offload's pinned host buffers (only where the device is nvme): parameter buffers (count, elements
    # each) and the optimizer swapper's buffer count.
    nvme_param_buffers: tuple[int, int] = DS_NVME_PARAM_BUFFERS
    nvme_optimizer_buffers: int = DS_NVME_OPTIMIZER_BUFFERS
    nvme_max_in_cpu: int = DS_NVME_MAX_IN_CPU


def read_accelerate_config(path: str, mixed_precision: str | None = None,
                           deepspeed_config_file: str | None = None) -> Strategy:
    """Any accelerate config YAML: distributed_type, fsdp_config, deepspeed_config (and the DeepSpeed JSON file it
    names, or `deepspeed_config_file` in its place, as `accelerate launch --deepspeed_config_file` overrides it),
    mixed_precision. The GPU count comes from --hardware, not from num_processes."""
    try:
        with open(path) as file:
            config = yaml.safe_load(file) or {}
    except (OSError, yaml.YAMLError) as error:
        raise PlanError(f"Cannot read accelerate config {path!r}: {error}") from error
    name = os.path.splitext(os.path.basename(path))[0]
    kind = str(config.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        json_file = deepspeed_config_file or ds.get("deepspeed_config_file")
        if json_file:
            settings = deepspeed_settings(resolve_deepspeed_json(str(json_file), path))
        else:
            settings = _deepspeed_yaml(ds)
        # A JSON's bf16/fp16 "auto" takes the run's precision: the recipe's, bf16 unless it says otherwise.
        precision = settings.pop("mixed_precision") or mixed_precision or config.get("mixed_precision") or "bf16"
        return _deepspeed_strategy(name, settings, bool(ds.get("zero3_init_flag", False)), _precision(path, precision))
    precision = _precision(path, mixed_precision or config.get("mixed_precision") or "no")
    if kind == "FSDP":
        fsdp = config.get("fsdp_config") or {}
        reshard = fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", True))
        if isinstance(reshard, str):  # FSDP1 names, also accepted by accelerate for FSDP2
            reshard = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}.get(reshard.upper(), True)
        offload = "cpu" if fsdp.get("fsdp_offload_params") else "none"
        return Strategy(name, "fsdp", 3 if reshard else 2, offload, offload,
                        bool(fsdp.get("fsdp_cpu_ram_efficient_loading", False)), precision)
    if kind in ("MULTI_GPU", "NO", "MULTI_CPU"):
        return Strategy(name, "ddp", 0, mixed_precision=precision)
    raise PlanError(f"{path}: distributed_type {kind!r} is not planned (use NO, MULTI_GPU, FSDP or DEEPSPEED).")


def _precision(path: str, precision: str) -> str:
    if precision not in ("bf16", "fp16", "no"):
        raise PlanError(f"{path}: mixed_precision {precision!r} is not bf16, fp16 or no.")
    return precision


def resolve_deepspeed_json(path: str, accelerate_config: str | None = None) -> str:
    """A YAML's deepspeed_config_file as accelerate opens it (relative to the working directory), else relative to
    the repository or to the YAML's folder's parent: the shipped YAMLs name accelerate_configs/deepspeed/*.json,
    which resolves from the repository root and from anywhere else as well."""
    if os.path.isabs(path):
        return path
    bases = [os.getcwd(), REPO] + ([os.path.dirname(os.path.dirname(os.path.abspath(accelerate_config)))]
                                   if accelerate_config else [])
    for base in bases:
        candidate = os.path.join(base, path)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return path


def _size(zero: dict, key: str, default: int) -> int | None:
    """An element count of zero_optimization; None where it is "auto" (accelerate derives it from hidden_size)."""
    value = zero.get(key, default)
    if value == "auto":
        return None
    try:
        return int(float(value))
    except (TypeError, ValueError) as error:
        raise PlanError(f"zero_optimization.{key} {value!r} is not a number of elements or \"auto\".") from error


def deepspeed_settings(path: str) -> dict:
    """What a DeepSpeed JSON file sets for memory, with DeepSpeed's defaults for what it leaves out: the one source
    of the stage, offload devices, precision and buffer sizes for the start-up checks, the cross-rank fingerprint
    and the planner. mixed_precision is None where bf16/fp16 are "auto" (accelerate fills them from the run)."""
    try:
        with open(path) as file:
            config = json.load(file)
    except (OSError, ValueError) as error:
        raise PlanError(f"Cannot read the DeepSpeed config file {path!r}: {error}") from error
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        raise PlanError(f"The DeepSpeed config file {path!r} has no zero_optimization section.")
    stage = zero.get("stage", 0)
    precision = None
    enabled = {dtype: str((config.get(dtype) or {}).get("enabled", "auto")).lower() for dtype in ("bf16", "fp16")}
    if "true" in enabled.values():
        precision = "bf16" if enabled["bf16"] == "true" else "fp16"
    elif set(enabled.values()) == {"false"}:
        precision = "no"
    return {
        "stage": stage,
        "offload_optimizer": str((zero.get("offload_optimizer") or {}).get("device", "none")).lower(),
        "offload_param": str((zero.get("offload_param") or {}).get("device", "none")).lower(),
        "nvme_path": {kind: (zero.get(f"offload_{kind}") or {}).get("nvme_path") for kind in ("optimizer", "param")},
        "mixed_precision": precision,
        "reduce_bucket": _size(zero, "reduce_bucket_size", DS_REDUCE_BUCKET),
        "overlap_comm": bool(zero.get("overlap_comm", str(stage) == "3")),
        "prefetch_bucket": _size(zero, "stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET),
        "sub_group": _size(zero, "sub_group_size", DS_SUB_GROUP),
        "persistence_threshold": _size(zero, "stage3_param_persistence_threshold", DS_PERSISTENCE_THRESHOLD),
        "max_live_parameters": _size(zero, "stage3_max_live_parameters", DS_MAX_LIVE_PARAMETERS),
        "nvme_param_buffers": (int((zero.get("offload_param") or {}).get("buffer_count", DS_NVME_PARAM_BUFFERS[0])),
                               int(float((zero.get("offload_param") or {}).get("buffer_size",
                                                                               DS_NVME_PARAM_BUFFERS[1])))),
        "nvme_optimizer_buffers": int((zero.get("offload_optimizer") or {}).get("buffer_count",
                                                                                 DS_NVME_OPTIMIZER_BUFFERS)),
        "nvme_max_in_cpu": int(float((zero.get("offload_param") or {}).get("max_in_cpu", DS_NVME_MAX_IN_CPU))),
    }


def _deepspeed_yaml(ds: dict) -> dict:
    """A YAML's deepspeed_config without a JSON file: accelerate builds the config from these keys alone, so every
    buffer size is DeepSpeed's default."""
    stage = ds.get("zero_stage", 2)  # accelerate's default stage
    return {"stage": stage, "offload_optimizer": str(ds.get("offload_optimizer_device") or "none").lower(),
            "offload_param": str(ds.get("offload_param_device") or "none").lower(), "mixed_precision": None,
            "overlap_comm": str(stage) == "3"}


def launch_deepspeed_settings() -> dict:
    """deepspeed_settings of this launch: the JSON file `accelerate launch` names in ACCELERATE_DEEPSPEED_CONFIG_FILE
    (resolved as accelerate_configs' YAMLs name it), else the ACCELERATE_DEEPSPEED_* variables it exports for a
    YAML-only deepspeed_config."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path:
        return deepspeed_settings(resolve_deepspeed_json(path))
    env = os.environ.get
    return _deepspeed_yaml({"zero_stage": env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"),
                            "offload_optimizer_device": env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
                            "offload_param_device": env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")})


def _deepspeed_strategy(name: str, settings: dict, zero3_init: bool, precision: str) -> Strategy:
    try:
        stage = int(settings["stage"])
    except (TypeError, ValueError) as error:
        raise PlanError(f"{name}: ZeRO stage {settings['stage']!r} is not 1, 2 or 3.") from error
    sizes = {key: settings[key] for key in ("reduce_bucket", "overlap_comm", "prefetch_bucket", "sub_group",
                                            "persistence_threshold", "max_live_parameters", "nvme_param_buffers",
                                            "nvme_optimizer_buffers", "nvme_max_in_cpu") if key in settings}
    return Strategy(name, "deepspeed", stage, settings["offload_optimizer"], settings["offload_param"],
                    zero3_init and stage == 3, precision, **sizes)


# ---------------------------------------------------------------------------------------------------------------
# Model states.

CHECKPOINT_SHARD_BYTES = 5e9  # Hugging Face checkpoints of large models come in shards of up to 5 GB
# QLoRA's NF4: 4 bits per weight plus double-quantized block constants (0.127 bits per weight, QLoRA paper).
NF4_BYTES = (4 + 0.127) / 8
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Peft:
    """LoRA adapters of rank `rank` on the named linear layers of every decoder layer ("all-linear": all seven),
    on a frozen base held in 16 bits, or in 4-bit NF4 with `load_in_4bit` (QLoRA)."""

    rank: int = 16
    targets: str = "all-linear"
    load_in_4bit: bool = False

    def target_names(self) -> list[str]:
        return list(LORA_TARGETS) if self.targets == "all-linear" else [t.strip() for t in self.targets.split(",")]

    def trainable_params(self, shape: ModelShape) -> int:
        return sum(self.adapter_sizes(shape))

    def adapter_sizes(self, shape: ModelShape) -> list[int]:
        """Elements of every adapter matrix (A: rank x in, B: out x rank), layer by layer."""
        q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        h, inter = shape.hidden, shape.intermediate
        shapes = {"q_proj": (h, q_dim), "k_proj": (h, kv_dim), "v_proj": (h, kv_dim), "o_proj": (q_dim, h),
                  "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
        names = self.target_names()
        unknown = [name for name in names if name not in shapes]
        if unknown:
            raise PlanError(f"LoRA target(s) {unknown} are not linear layers of {shape.name}; use {LORA_TARGETS}.")
        layer = [size for name in names for size in (self.rank * shapes[name][0], self.rank * shapes[name][1])]
        return layer * shape.layers


def peft_states(strategy: Strategy, shape: ModelShape, world: int, peft: Peft) -> States:
    """The adapters train like a small full model (model_states of the trainable parameters: fp32 weights and
    Adam, DeepSpeed's 16-bit copy and master); the frozen base adds weights only, no gradient and no optimizer
    state, in 16 bits (4 in fp32 runs) or NF4, sharded where the strategy shards weights."""
    states = model_states(strategy, peft.trainable_params(shape), world)
    per_param = NF4_BYTES if peft.load_in_4bit else (4 if strategy.mixed_precision == "no" else 2)
    sharded = strategy.kind == "fsdp" or (strategy.kind == "deepspeed" and strategy.shard >= 3)
    base = per_param * shape.params / (world if sharded else 1)
    if strategy.offload_params != "none" and sharded:
        states.host += base
    else:
        states.weights += base
    return states


@dataclass
class States:
    """Per GPU (weights, gradients, optimizer) and per rank on host RAM or NVMe."""

    weights: float
    gradients: float
    optimizer: float
    host: float = 0.0
    nvme: float = 0.0


def parameter_sizes(shape: ModelShape) -> list[tuple[int, bool]]:
    """(elements, weight-decayed) of every parameter of a Llama-class model, in `model.parameters()` order: the
    order in which DeepSpeed fills each parameter group's sub-groups. Decayed as the trainer splits them
    (shardtune.trainer.param_groups: matrices decay, norms and biases do not)."""
    h, inter = shape.hidden, shape.intermediate
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    sizes = [(shape.vocab * h, True)]
    layer = [(h * q_dim, True), *([(q_dim, False)] if shape.qkv_bias else []),
             (h * kv_dim, True), *([(kv_dim, False)] if shape.qkv_bias else []),
             (h * kv_dim, True), *([(kv_dim, False)] if shape.qkv_bias else []),
             (q_dim * h, True), *([(h, False)] if shape.o_bias else [])]
    for matrix in ((h, inter), (h, inter), (inter, h)):
        layer += [(matrix[0] * matrix[1], True)] + ([(matrix[1], False)] if shape.mlp_bias else [])
    sizes += (layer + [(h, False), (h, False)]) * shape.layers + [(h, False)]
    return sizes + ([] if shape.tied else [(shape.vocab * h, True)])


def largest_sub_group(strategy: Strategy, shape: ModelShape | None, params: int, world: int) -> float:
    """Elements of the largest ZeRO-3 optimizer sub-group of one rank, as stage3.py `_create_fp16_sub_groups`
    cuts them: within each parameter group, partitions (ceil(numel / N) each) are added in order until the sum
    reaches sub_group_size. Without a shape (LoRA's adapters: many small matrices) the partition is taken as
    finely divisible: min(sub_group_size, P/N)."""
    sub_group = strategy.sub_group if strategy.sub_group is not None else DS_SUB_GROUP
    if shape is None or params != shape.params:
        return float(min(sub_group, -(-params // world)))
    largest = 0
    for decayed in (True, False):
        current = 0
        for numel, decay in parameter_sizes(shape):
            if decay != decayed:
                continue
            current += -(-numel // world)
            if current >= sub_group:
                largest, current = max(largest, current), 0
        largest = max(largest, current)
    return float(largest)


def persistent_elements(strategy: Strategy, shape: ModelShape, peft: Peft | None = None) -> int:
    """Elements of the parameters ZeRO-3 keeps whole on every rank between steps (numel at most
    stage3_param_persistence_threshold, parameter_offload.py `mark_persistent_parameters`), LoRA's adapters
    included: it releases them before the optimizer steps and gathers them again after (stage3.py `_post_step`)."""
    threshold = deepspeed_sizes(strategy, shape)["persistence_threshold"]
    sizes = [numel for numel, _ in parameter_sizes(shape)] + (peft.adapter_sizes(shape) if peft else [])
    return sum(numel for numel in sizes if numel <= threshold)


def deepspeed_sizes(strategy: Strategy, shape: ModelShape) -> dict[str, int]:
    """The Strategy's DeepSpeed sizes with "auto" resolved as accelerate resolves it from the model's hidden size
    (accelerator.py `_prepare_deepspeed`): reduce bucket h², prefetch bucket 0.9·h², persistence 10·h."""
    h = shape.hidden
    auto = {"reduce_bucket": h * h, "prefetch_bucket": int(0.9 * h * h), "persistence_threshold": 10 * h,
            "max_live_parameters": DS_MAX_LIVE_PARAMETERS}
    return {key: getattr(strategy, key) if getattr(strategy, key) is not None else value
            for key, value in auto.items()}


def model_states(strategy: Strategy, params: int, world: int, shape: ModelShape | None = None) -> States:
    """Bytes of weights, gradients and Adam states per GPU, as the code stores them. `shape` gives DeepSpeed's
    parameter groups and sub-groups and ZeRO-3's persistent parameters their real sizes (without it: P/N each).

    - DDP (accelerate's autocast): fp32 weights 4P + fp32 grads 4P + Adam m, v 8P = 16P. Autocast computes in
      16-bit but keeps the fp32 parameters, so their gradients are fp32 too.
    - DeepSpeed with bf16/fp16 converts the module to 16-bit; the ZeRO optimizer keeps fp32 master weights, m
      and v (12P/N). Gradients, as measured at the first step (tests/test_memory_measured.py): ZeRO-1 holds the
      full 16-bit gradients until the reduction at the accumulation boundary (2P), at the step one group's fp32
      partition beside the whole gradients of the parameters its partition overlaps. With 16-bit weights the
      trainer accumulates ZeRO-2/3 gradients in fp32 (shardtune.distributed.configure_deepspeed): ZeRO-2 reduces
      them into the fp32 partition the optimizer reads (4P/N); ZeRO-3 into an fp32 partition, and builds one
      optimizer sub-group's fp32 gradient at a time on top (_zero3_states). So ZeRO-1: 2 + 2 + 12/N, ZeRO-2:
      2 + 16/N, ZeRO-3: 18/N bytes per parameter and 4 bytes per element of the largest sub-group.
    - DeepSpeed fp32 (mixed_precision no): the same with 4-byte weights and gradients; the fp32 "master" is still a
      separate clone (stage_1_and_2.py: `.clone().to(master dtype)`).
    - FSDP2 (FULL_SHARD and SHARD_GRAD_OP): the sharded parameters stay fp32 and serve as master weights
      (MixedPrecisionPolicy only casts the all-gathered copies), so 4P/N + 4P/N + 8P/N. SHARD_GRAD_OP keeps the
      16-bit unsharded weights between forward and backward: counted in buffers().
    - Offload: DeepSpeed offload_optimizer moves the fp32 master, m and v (12P/N) to host RAM or NVMe; ZeRO-3
      keeps its fp32 gradient partitions in host RAM in both cases (8P/N, see _zero3_states). offload_param moves
      the 16-bit weight partitions too (2P/N).
      FSDP fsdp_offload_params (CPUOffloadPolicy) keeps sharded weights, grads and Adam
      states on the host."""
    p, n = float(params), world
    half = strategy.mixed_precision in ("bf16", "fp16")
    if strategy.kind == "ddp":
        return States(4 * p, 4 * p, 8 * p)
    if strategy.kind == "fsdp":
        states = States(4 * p / n, 4 * p / n, 8 * p / n)
        if strategy.offload_params != "none":
            return States(0.0, 0.0, 0.0, host=states.weights + states.gradients + states.optimizer)
        return states
    low = 2 if half else 4  # bytes of the module's weights and gradients
    weights = low * p / n if strategy.shard >= 3 else low * p
    if strategy.shard >= 3:
        return _zero3_states(strategy, p, n, weights, largest_sub_group(strategy, shape, params, world), low)
    if strategy.shard == 2:  # fp32 accumulation: the reduced partition is the optimizer's gradient
        grads = 4 * p / n if half else 4 * p / n + 4 * largest_group(shape, params, world)
    else:  # ZeRO-1: the full gradients after backward, or at the step one group's fp32 partition (built as in
        # ZeRO-2) beside the reduced partitions (`averaged_gradients`), views that keep the whole gradient of every
        # parameter overlapping the rank's partition alive: measured 3P at N = 2 and 2.27P at N = 3 in bf16
        grads = max(low * p, 4 * largest_group(shape, params, world) + low * overlapping_elements(shape, params, world))
    states = States(weights, grads, 12 * p / n)
    where = {"cpu": "host", "nvme": "nvme"}
    if strategy.offload_optimizer in where:
        states.host += states.gradients + 4 * p / n  # the gradient partitions stay in host RAM, even with NVMe
        setattr(states, where[strategy.offload_optimizer], getattr(states, where[strategy.offload_optimizer])
                + states.optimizer)
        states.optimizer = states.gradients = 0.0
    if strategy.offload_params in where and strategy.shard >= 3:
        setattr(states, where[strategy.offload_params], getattr(states, where[strategy.offload_params]) + weights)
        states.weights = 0.0
    return states


def largest_group(shape: ModelShape | None, params: int, world: int) -> float:
    """Elements of one rank's partition of the larger parameter group (the trainer's decayed matrices): ZeRO-1/2
    flatten a group's gradients into a new fp32 partition at the step (stage_1_and_2.py `step`), one group at a
    time. Without a shape: P/N."""
    if shape is None or params != shape.params:
        return params / world
    decayed = sum(numel for numel, decay in parameter_sizes(shape) if decay)
    return max(decayed, shape.params - decayed) / world


def overlapping_elements(shape: ModelShape | None, params: int, world: int) -> float:
    """ZeRO-1/2: the most elements, over ranks, of the parameters that overlap a rank's partition. Each parameter
    group is flattened in parameter order, padded to a multiple of 2 x N elements (stage_1_and_2.py
    nccl_start_alignment_factor) and cut into N equal partitions; a parameter that straddles a boundary overlaps
    two. Without a shape: P/N."""
    if shape is None or params != shape.params:
        return params / world
    per_rank = [0] * world
    for decayed in (True, False):
        group = [numel for numel, decay in parameter_sizes(shape) if decay == decayed]
        alignment = 2 * world
        size = -(-sum(group) // alignment) * alignment // world
        start = 0
        for numel in group:
            for rank in range(start // size, min(world, -(-(start + numel) // size))):
                per_rank[rank] += numel
            start += numel
    return float(max(per_rank))


def _zero3_states(strategy: Strategy, p: float, n: int, weights: float, sub_group: float, low: int) -> States:
    """ZeRO-3 as stage3.py allocates it. The gradient partition every micro-batch reduces into
    (`grad_partitions_flat_buffer`) is in the accumulation dtype: fp32, by the trainer's grad_accum_dtype under
    bf16/fp16 and natively in fp32 runs (4P/N). The optimizer then steps one sub-group at a time: it flattens that
    sub-group's gradients into a new fp32 tensor, steps, and frees it (`_prepare_sub_group` /
    `_release_sub_group`), so one sub-group's fp32 gradient (4 x its elements) is alive on top. With
    offload_optimizer both live in host RAM instead, and each sub-group keeps its own fp32 gradient buffer for
    CPU Adam (4P/N in all) beside the accumulation partition. offload_param keeps every 16-bit partition in one flat
    host buffer per parameter group, the persistent parameters' too (`_create_param_groups_fp16_flat_cpu_memory`;
    their whole copies on the GPU are buffers); to NVMe, only what exceeds max_in_cpu elements per rank goes to
    the swap files."""
    states = States(weights, 4 * p / n + 4 * sub_group, 12 * p / n)
    where = {"cpu": "host", "nvme": "nvme"}
    if strategy.offload_optimizer in where:
        states.host += 8 * p / n
        setattr(states, where[strategy.offload_optimizer], getattr(states, where[strategy.offload_optimizer])
                + states.optimizer)
        states.optimizer = states.gradients = 0.0
    if strategy.offload_params in ("cpu", "nvme"):
        in_host = weights if strategy.offload_params == "cpu" else min(weights, low * strategy.nvme_max_in_cpu)
        states.host += in_host
        states.nvme += weights - in_host
        states.weights = 0.0
    return states


def buffers(strategy: Strategy, shape: ModelShape, params: int, world: int, activation_mode: str,
            peft: Peft | None = None) -> float:
    """Transient 16-bit copies and communication buffers alive during forward/backward (assumptions documented
    per case; DeepSpeed values are its defaults, see DS_REDUCE_BUCKET).

    - DDP: the trainer sets gradient_as_bucket_view, so the gradients are the all-reduce buckets (counted as
      gradients). Autocast caches one 16-bit copy of every matmul weight for the whole forward.
    - DeepSpeed ZeRO-1/2: one reduce bucket of DS_REDUCE_BUCKET gradient elements (overlap_comm is off below
      stage 3). ZeRO-3: the module being computed plus the one prefetched (2 x the largest module, which for
      Llama 3 is the embedding or lm_head), the prefetch bucket and the reduce bucket.
    - FSDP FULL_SHARD: the root unit (embedding, final norm, lm_head) stays gathered from forward to backward;
      one layer computing and one prefetched; the unsharded gradients of one layer and of the root before
      reduce-scatter, in fp32 (the trainer's reduce_dtype; with LoRA one layer's adapters). SHARD_GRAD_OP keeps
      every unsharded 16-bit weight from forward to backward instead of re-gathering."""
    low = 2 if strategy.mixed_precision in ("bf16", "fp16") else 4
    layer = shape.layer_params
    root = shape.params - shape.layers * layer
    if strategy.kind == "ddp":  # with LoRA only the adapters have gradients, and a 16-bit base needs no cast
        cached = peft.trainable_params(shape) if peft else shape.non_embedding_matmul_params
        return 2 * cached if activation_mode == "autocast" else 0
    if strategy.kind == "deepspeed":
        return deepspeed_buffers(strategy, shape, params, low, peft)
    reducing = 4 * layer_gradient_elements(shape, peft) + (0 if peft else 4 * root)
    if strategy.shard >= 3:
        return (root + 2 * layer) * low + reducing
    return params * low + reducing


def layer_gradient_elements(shape: ModelShape, peft: Peft | None = None) -> float:
    """Elements of one decoder layer's gradients: all its parameters, or under LoRA its adapters' (all adapters
    are in the layers)."""
    return peft.trainable_params(shape) / shape.layers if peft else shape.layer_params


def freed_under_layer_gradients(strategy: Strategy, shape: ModelShape, batch: int, seq: int, mode: str,
                                attn: str = "sdpa", masked: bool = True, peft: Peft | None = None) -> float:
    """FSDP: a layer's unsharded fp32 gradients (in buffers()) grow while that layer's backward frees the
    activations it saved or recomputed, so they sit on top of the peak activations only by what exceeds one
    layer's activations (measured on CPU: counting both overshoots the forward/backward peak by 5-9%)."""
    if strategy.kind != "fsdp":
        return 0.0
    activations = layer_activation_bytes(shape, batch, seq, mode, attn, masked, frozen=peft is not None)
    return float(min(4 * layer_gradient_elements(shape, peft), activations))


def deepspeed_buffers(strategy: Strategy, shape: ModelShape, params: int, low: int, peft: Peft | None = None
                      ) -> float:
    """DeepSpeed's communication buffers and gathered parameters, at the sizes the JSON sets (allocated at full
    size, however small the model: measured).

    - ZeRO-1/2 (stage_1_and_2.py `setup_buckets`): a reduce bucket of reduce_bucket_size elements, and a second
      one with overlap_comm (one fills while the other is reduced), in the dtype gradients are reduced in: the
      module's, or fp32 where the trainer accumulates ZeRO-2 gradients in fp32.
    - ZeRO-3 (stage3.py): one reduce bucket in the module's dtype (contiguous_gradients). Gathered 16-bit
      parameters: the module computing, at most the largest leaf module (the embedding or lm_head for Llama),
      and what is prefetched ahead of it (stage3_prefetch_bucket_size), capped by stage3_max_live_parameters;
      plus the persistent parameters (at most stage3_param_persistence_threshold elements each), gathered on
      every rank from the end of the first step on."""
    sizes = deepspeed_sizes(strategy, shape)
    if strategy.shard < 3:
        bucket_bytes = 4 if strategy.shard == 2 else low
        return (2 if strategy.overlap_comm else 1) * sizes["reduce_bucket"] * bucket_bytes
    largest = max(numel for numel, _ in parameter_sizes(shape))
    gathered = min(max(sizes["max_live_parameters"], largest), largest + min(sizes["prefetch_bucket"], params))
    return (gathered + persistent_elements(strategy, shape, peft) + sizes["reduce_bucket"]) * low


# ---------------------------------------------------------------------------------------------------------------
# Activations, calibrated against torch.autograd.graph.saved_tensors_hooks in tests/test_plan.py.


def activation_mode(strategy: Strategy) -> str:
    """"fp32" (mixed_precision no); "half": 16-bit weights and compute (DeepSpeed converts the module, FSDP2's
    MixedPrecisionPolicy gathers 16-bit parameters); "autocast": fp32 weights and residual stream, 16-bit matmuls
    (accelerate's native AMP under DDP)."""
    if strategy.mixed_precision == "no":
        return "fp32"
    return "autocast" if strategy.kind == "ddp" else "half"


def _dtypes(mode: str) -> tuple[int, int]:
    """(compute bytes, residual-stream bytes)."""
    return {"fp32": (4, 4), "half": (2, 2), "autocast": (2, 4)}[mode]


def layer_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, attn: str = "sdpa",
                           masked: bool = True, frozen: bool = False) -> int:
    """Bytes one Llama decoder layer saves for backward without recomputation (n = batch x seq tokens,
    c = compute bytes, r = residual bytes; the layer input itself is saved by the first norm).

    - Each RMSNorm: its input upcast to fp32 (4nh; the input itself when already fp32), the fp32 rstd (4n), the
      normalised x in the residual dtype (r·nh, for the weight gradient: not with a `frozen` base, LoRA's) and
      its output as the next matmuls' input in the compute dtype (c·nh; under autocast one 16-bit copy per
      consuming matmul: 3 for q, k, v and 2 for gate, up, as autocast caches only casts of leaf weights).
    - Attention: RoPE saves only cos/sin (shared). SDPA saves q, k, v, its output (c·n·d each, where k and v are
      repeated to all heads when GQA meets a mask, since transformers then calls repeat_kv) and the fp32
      logsumexp (4·n·heads); o_proj reads the output in place. `masked` (a dense mask reaches the kernel: a
      padded batch, or a packed row's block-diagonal mask under SDPA or eager): each layer also saves its own copy
      of the mask in the compute dtype (c·b·s², measured on CPU SDPA). The flash kernels ("flash":
      flash_attention_2/3, flex_attention) take no dense mask and save what unmasked SDPA saves. Eager saves q,
      repeated k and v, the fp32 softmax (4·b·heads·s²) and its 16-bit copy, and the contiguous o_proj input.
    - SwiGLU MLP: gate output, SiLU output, up output and their product (4·c·n·intermediate).
    Residual adds save nothing."""
    compute, residual = _dtypes(mode)
    n, h, inter = batch * seq, shape.hidden, shape.intermediate
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # Autocast casts a matmul input once per matmul (only leaf weights are cached): q, k, v and gate, up.
    attn_inputs, mlp_inputs = (3, 2) if mode == "autocast" else (1, 1)
    norm = 4 * n * h + 4 * n + (0 if frozen else residual * n * h)
    norms = 2 * norm + (attn_inputs + mlp_inputs) * compute * n * h
    if attn == "eager":
        scores = batch * shape.heads * seq * seq
        attention = 4 * compute * n * q_dim + 4 * scores + (compute * scores if compute != 4 else 0)
    else:
        key = value = kv_dim
        if masked and shape.kv_heads != shape.heads:  # repeat_kv copies, except one kv head: a reshape view
            key = value = q_dim if shape.kv_heads > 1 else kv_dim
            key = q_dim if mode == "autocast" else key  # autocast's cast to 16-bit materialises the view
        attention = compute * n * (2 * q_dim + key + value) + 4 * n * shape.heads
        if masked:  # each layer's SDPA call saves its own converted copy of the additive mask
            attention += batch * seq * seq * compute
    return norms + attention + 4 * compute * n * inter


def shared_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, attn: str = "sdpa",
                            masked: bool = True) -> int:
    """Saved once for all layers: RoPE cos and sin (1 x s x head_dim each, residual dtype)."""
    _, residual = _dtypes(mode)
    return 2 * seq * shape.head_dim * residual


def head_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, frozen: bool = False) -> int:
    """Outside the layers: input ids (int64, for the embedding's weight gradient), the final RMSNorm (as in a
    layer), the fp32 log-probabilities saved by cross-entropy (4·n·vocab: the upcast logits' log_softmax) and the
    int64 targets. A `frozen` base saves neither the ids nor lm_head's input, nor the norm's normalised x."""
    compute, residual = _dtypes(mode)
    n, h = batch * seq, shape.hidden
    norm = 4 * n * h + 4 * n + (0 if frozen else residual * n * h + compute * n * h)
    return (0 if frozen else 8 * n) + norm + 4 * n * shape.vocab + 8 * n


def saved_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, checkpointing: bool,
                           attn: str = "sdpa", masked: bool = True, frozen: bool = False) -> int:
    """Everything saved for backward at the end of the forward (what saved_tensors_hooks see). With full
    recomputation (non-reentrant) a layer saves only its input (r·n·h); masks and RoPE tables are then held by
    the recompute closure, not the graph, and are counted in the transient peak instead."""
    _, residual = _dtypes(mode)
    head = head_activation_bytes(shape, batch, seq, mode, frozen)
    if checkpointing:
        return shape.layers * residual * batch * seq * shape.hidden + head
    per_layer = layer_activation_bytes(shape, batch, seq, mode, attn, masked, frozen)
    return shape.layers * per_layer + shared_activation_bytes(shape, batch, seq, mode, attn, masked) + head


def activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, checkpointing: bool,
                     attn: str = "sdpa", masked: bool = True, frozen: bool = False) -> dict[str, int]:
    """Peak activation memory = saved + the largest transient on top of it:
    - the loss: the forward holds the logits (c·n·vocab) and their fp32 upcast (4·n·vocab); its backward holds
      two fp32 n x vocab gradients (d log-probs, d logits) - the larger, 8·n·vocab, is taken;
    - with recomputation, one layer's full activations while it is recomputed in backward;
    - the MLP backward's two intermediate-size gradients (2·c·n·intermediate)."""
    compute, _ = _dtypes(mode)
    n = batch * seq
    saved = saved_activation_bytes(shape, batch, seq, mode, checkpointing, attn, masked, frozen)
    logits = max(compute * n * shape.vocab + (4 * n * shape.vocab if compute != 4 else 0), 8 * n * shape.vocab)
    recompute = 0
    if checkpointing:
        recompute = layer_activation_bytes(shape, batch, seq, mode, attn, masked, frozen)
        recompute += shared_activation_bytes(shape, batch, seq, mode, attn, masked)
    transient = max(logits, recompute) + 2 * compute * n * shape.intermediate
    return {"saved": saved, "transient": transient, "total": saved + transient}


# ---------------------------------------------------------------------------------------------------------------
# The plan.


def usable_capacity(hardware: Hardware) -> int:
    """Bytes per GPU a plan may use: the GPU's memory less GPU_FIXED_RESERVE and GPU_HEADROOM_FRACTION. The
    planner CLI and a launch read a GPU's memory by one rule (hardware.nominal_gpu_memory)."""
    return int(hardware.gpu_memory * (1 - GPU_HEADROOM_FRACTION) - GPU_FIXED_RESERVE)


def usable_host_ram(hardware: Hardware) -> float:
    """Host RAM per node a plan may use: the node's RAM less HOST_HEADROOM_FRACTION."""
    return hardware.host_ram_per_node * (1 - HOST_HEADROOM_FRACTION)


def staging_host_bytes(strategy: Strategy, params: int, world: int, gpus_per_node: int,
                       model_only: bool = False) -> float:
    """Host RAM of --async_save's staging copy on the first node (shardtune.checkpoint), kept from the first
    asynchronous save on: each rank's share of the checkpoint. With Adam, full state: FSDP and ZeRO-3 12P/N per
    rank (fp32 weights or master 4, m and v 8); ZeRO-1/2 the same plus 4P on rank 0 while it saves the 16-bit
    module; DDP 12P on rank 0 alone. Model only: FSDP 4P/N per rank; DDP and DeepSpeed the weights on rank 0
    (twice under ZeRO-3, which gathers them first)."""
    p, n, local = float(params), world, min(gpus_per_node, world)
    low = 2 if strategy.mixed_precision in ("bf16", "fp16") else 4
    if model_only:
        if strategy.kind == "fsdp":
            return 4 * p / n * local
        return (4 if strategy.kind == "ddp" else low) * p * (2 if strategy.shard >= 3 else 1)
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
    per_param = 4 if peft is None or strategy.mixed_precision == "no" else 2
    return float(per_param * params * copies)


CHECKPOINT_BYTES = 2  # bytes per parameter of a Hugging Face Llama-class checkpoint (bf16)


def checkpoint_page_cache_bytes(params: int) -> float:
    """The checkpoint's safetensors files, memory-mapped by every process that reads them: their pages count in
    each reader's resident set (measured: a rank that loads a bf16 checkpoint for fp32 training rises by 6 bytes
    per parameter, 4 of them the model's) but are one page cache per node, and clean: the kernel can drop them
    under pressure. Listed beside model_loading, not counted in "fits"."""
    return float(CHECKPOINT_BYTES * params)


# ---------------------------------------------------------------------------------------------------------------
# Phases: the peak of a run is the largest of them, not their sum (measured in tests/test_memory_phases.py).

PHASES = ("forward_backward", "optimizer", "eval", "save")
EVAL_CHUNK_POSITIONS = 1024  # shardtune.evaluation.CHUNK_POSITIONS: positions upcast to fp32 at once


def decay_tensors(shape: ModelShape) -> list[tuple[int, int]]:
    """(rows, columns) of the matrices torch AdamW steps as one parameter group (the trainer's weight-decay group),
    in parameter order: embedding, per layer q, k, v, o, gate, up, down, then lm_head unless tied. Norm weights
    and biases, the other group, are far smaller."""
    h, q_dim, kv_dim, inter = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, \
        shape.intermediate
    layer = [(q_dim, h), (kv_dim, h), (kv_dim, h), (h, q_dim), (inter, h), (inter, h), (h, inter)]
    return [(shape.vocab, h), *layer * shape.layers] + ([] if shape.tied else [(shape.vocab, h)])


def optimizer_step_bytes(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None = None,
                         foreach: bool = True) -> float:
    """What torch AdamW allocates on top of the model states while it steps (torch/optim/adam.py, AdamW being
    Adam with decoupled decay; lerp_, mul_, addcmul_ and addcdiv_ work in place):
    - `_multi_tensor_adam`, the default where every parameter is on CUDA: `_foreach_sqrt(exp_avg_sqs)` makes one
      fp32 copy of a parameter group's local elements, divided and added to in place, freed after the group;
    - `_single_tensor_adam` (the default on CPU): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)` holds
      two copies of one tensor while dividing, and the previous tensor's denom until it is reassigned: the most
      of (previous + 2 x current) over consecutive tensors.
    Local elements: FSDP2 shards every parameter on dim 0, the ranks holding ceil(rows / N). DeepSpeed hands the
    torch optimizer one flat fp32 partition per group (ZeRO-1/2: the decay group's P/N; ZeRO-3: a sub-group of at
    most sub_group_size elements), so either path copies that one tensor (foreach once, the loop twice); the
    ZeRO optimizer's own copies are not modelled. An offloaded step runs on the host: nothing on the GPU."""
    if strategy.offload_optimizer != "none" or strategy.offload_params != "none":
        return 0.0
    if strategy.kind == "deepspeed":
        flat = (peft.trainable_params(shape) if peft else shape.params) / world
        if strategy.shard >= 3:
            flat = min(flat, strategy.sub_group or DS_SUB_GROUP)
        return (4.0 if foreach else 8.0) * flat
    shard = world if strategy.kind == "fsdp" else 1
    if peft is not None:  # the adapters A (r x in) and B (out x r) of every target
        local = 4 * peft.trainable_params(shape) / shard
        return local if foreach else 3 * local / max(1, 2 * shape.layers)  # about the largest adapter pair
    sizes = [-(-rows // shard) * columns for rows, columns in decay_tensors(shape)]
    if foreach:
        return 4.0 * sum(sizes)
    return 4.0 * max(previous + 2 * current for previous, current in zip([0, *sizes], sizes, strict=False))


def eval_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, masked: bool = True,
                          adapted_up: bool = False) -> float:
    """The eval forward under no_grad (shardtune.evaluation): only what the running op needs is alive. Throughout,
    four n x h tensors of the residual stream (the embedding output, which the model's forward keeps, the layer's
    input, the residual and the normalised input), the additive mask (c·b·s², `masked`: SDPA and eager) and
    RoPE's cos and sin (b·s·head_dim each). On top, the larger of the SwiGLU MLP (SiLU of gate, up and their
    product, 3·c·n·intermediate; measured with the profiler's allocator events; a LoRA adapter on up_proj adds
    its scaled output and the sum, `result + lora_B(lora_A(x)) * scaling` in peft, while SiLU of gate is alive:
    4) and the head: the logits in the compute dtype (c·n·vocab, kept for the whole batch) with one chunk of
    CHUNK_POSITIONS positions upcast to fp32 and cross-entropy's log-softmax of it."""
    compute, residual = _dtypes(mode)
    n = batch * seq
    mask = compute * batch * seq * seq if masked else 0
    stream = 4 * residual * n * shape.hidden + mask + 2 * residual * n * shape.head_dim
    upcasts = 2 if compute != 4 else 1  # the chunk's fp32 copy (none when fp32 already) and its log-softmax
    head = compute * n * shape.vocab + 4 * min(seq, EVAL_CHUNK_POSITIONS) * shape.vocab * upcasts
    return float(stream + max(head, (4 if adapted_up else 3) * compute * n * shape.intermediate))


def eval_gather_bytes(strategy: Strategy, shape: ModelShape) -> float:
    """Parameters gathered for the eval forward: FSDP's root unit (embedding, final norm, lm_head) stays gathered,
    one layer computes and one is prefetched, in the compute dtype (as in the training forward, see buffers);
    SHARD_GRAD_OP (reshard_after_forward False) keeps every layer it gathered until a backward that an eval never
    runs: the whole model. ZeRO-3 gathers a module's parameters and the prefetch bucket after them with one
    all-gather into one flat buffer, which lives until every parameter in it is released: two such buffers, the
    one computing and the next (measured on 3 ranks: two to four of them alive through the first eval forward,
    as the training trace's prefetches run ahead of the eval's modules)."""
    low = 2 if strategy.mixed_precision in ("bf16", "fp16") else 4
    layer, root = shape.layer_params, shape.params - shape.layers * shape.layer_params
    if strategy.kind == "fsdp":
        return float((root + 2 * layer) * low if strategy.shard >= 3 else shape.params * low)
    if strategy.kind == "deepspeed" and strategy.shard >= 3:
        largest = max(numel for numel, _ in parameter_sizes(shape))
        return float(2 * (largest + min(deepspeed_sizes(strategy, shape)["prefetch_bucket"], shape.params)) * low)
    return 0.0


def save_gather_bytes(strategy: Strategy, shape: ModelShape, params: int, world: int,
                      export_bytes: int = 2) -> tuple[float, float]:
    """(GPU bytes, host bytes on the rank that holds most) of trainer.save_hf_model's accelerator.get_state_dict:
    - FSDP2: torch's get_model_state_dict(full_state_dict, cpu_offload): each parameter all-gathered in full on the
      GPU (the gathered tensor and its full copy: 2 x the largest, fp32), then copied to rank 0's host RAM (4P);
    - ZeRO-3: _zero3_consolidated_16bit_state_dict gathers module by module (the largest module's own weights:
      the embedding or lm_head), rank 0 keeping a host copy of each (16-bit, or fp32 in fp32 runs);
    - ZeRO-1/2: clone_tensors_for_torch_save copies the whole 16-bit module to every rank's host RAM;
    - an fp32 export (`export_bytes` 4) of a 16-bit DeepSpeed run also assembles the fp32 masters on the main
      process's host beside that state dict (trainer.deepspeed_master_weights);
    - DDP: the state dict is the live parameters; an export in another dtype casts each into a new tensor on the
      GPU (trainer.cast_floating), `export_bytes` x P in all.
    FSDP's state dict is cast on the host one tensor at a time (one copy plus one tensor: not counted)."""
    low = 2 if strategy.mixed_precision in ("bf16", "fp16") else 4
    largest = max(rows * columns for rows, columns in decay_tensors(shape))
    if strategy.kind == "fsdp":
        return 2.0 * 4 * largest, 4.0 * params
    if strategy.kind == "deepspeed":
        masters = 4.0 * params if export_bytes == 4 and low == 2 else 0.0
        return (float(low * largest) if strategy.shard >= 3 else 0.0), float(low * params) + masters
    return (float(export_bytes * params) if export_bytes != 4 else 0.0), 0.0


def persistent_buffer_bytes(strategy: Strategy, shape: ModelShape) -> float:
    """Buffers that outlive forward/backward: ZeRO-3's reduce bucket, allocated whole at start-up. ZeRO-1/2
    allocate theirs when a backward starts and free them when it ends (stage_1_and_2.py `setup_buckets`,
    `_release_ipg_buffers`)."""
    if strategy.kind != "deepspeed" or strategy.shard < 3:
        return 0.0
    low = 2 if strategy.mixed_precision in ("bf16", "fp16") else 4
    return float(low * deepspeed_sizes(strategy, shape)["reduce_bucket"])


def swap_buffer_bytes(strategy: Strategy, shape: ModelShape, trainable: int, world: int) -> float:
    """Pinned host RAM per rank of DeepSpeed's NVMe offload, allocated at start-up and held for the run:
    offload_param's buffer_count buffers of buffer_size elements in the module's dtype (partitioned_param_swapper.py)
    and offload_optimizer's buffer_count fp32 buffers of the largest sub-group each (optimizer_utils.py
    `SwapBufferManager`, largest_numel)."""
    if strategy.kind != "deepspeed":
        return 0.0
    low = 2 if strategy.mixed_precision in ("bf16", "fp16") else 4
    total = 0.0
    if strategy.offload_params == "nvme":
        count, size = strategy.nvme_param_buffers
        total += count * size * low
    if strategy.offload_optimizer == "nvme":
        total += strategy.nvme_optimizer_buffers * 4 * largest_sub_group(strategy, shape, trainable, world)
    return total


def host_step_bytes(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None) -> float:
    """The optimizer step's transient on the host: FSDP's CPUOffloadPolicy steps torch AdamW on host tensors, where
    it runs its per-tensor loop (foreach needs CUDA tensors). DeepSpeed's CPU Adam steps in place: nothing."""
    if strategy.kind != "fsdp" or strategy.offload_params == "none":
        return 0.0
    on_gpu = dataclasses.replace(strategy, offload_optimizer="none", offload_params="none")
    return optimizer_step_bytes(on_gpu, shape, world, peft, foreach=False)


def phase_bytes(strategy: Strategy, shape: ModelShape, world: int, forward_backward: dict[str, float],
                eval_batch: int, seq: int, peft: Peft | None = None, foreach: bool = True,
                host: float = 0.0, export_bytes: int = 2, attn: str = "sdpa", graph: float = 0.0
                ) -> dict[str, dict]:
    """Per GPU, each phase's parts and total; `forward_backward` is the step's (model states, activations,
    buffers). Gradients are freed by the step (the trainer's zero_grad sets them to None), so eval and save hold
    the weights and optimizer states; DDP's gradients are views into its reducer's buckets, which stay, and
    ZeRO-3 keeps its gradient partitions allocated (ZeRO-1/2 free theirs with the step). Each phase also lists
    the host RAM one rank holds in it ("on_host", not in the GPU total): `host`, its offloaded states (FSDP's
    host gradients freed by the step), NVMe offload's pinned buffers, an optimizer step that runs on the host and
    the save's host copy. `graph`: what the last micro-batch's spent graph still holds while the optimizer steps."""
    params = shape.params
    states = {key: forward_backward[key] for key in ("weights", "gradients", "optimizer")}
    kept = {"weights": states["weights"], "optimizer": states["optimizer"],
            "gradients": states["gradients"] if (strategy.kind == "ddp" and world > 1)
            or (strategy.kind == "deepspeed" and strategy.shard >= 3) else 0.0,
            "buffers": persistent_buffer_bytes(strategy, shape)}
    mode = activation_mode(strategy)
    # Autocast caches its 16-bit copy of every matmul weight for the whole forward, an eval's too (buffers()).
    autocast_cache = buffers(strategy, shape, params, world, mode, peft) \
        if strategy.kind == "ddp" else 0.0
    # A PEFT model exports its adapters as trained: nothing is cast.
    gathered, saved_on_host = save_gather_bytes(strategy, shape, params, world, 4 if peft else export_bytes)
    # ZeRO-3's persistent parameters, whole on every rank: released before the optimizer steps and gathered again
    # after it (stage3.py `_post_step`), so the step holds the larger of its transient and them.
    low = 2 if strategy.mixed_precision in ("bf16", "fp16") else 4
    persistent = float(low * persistent_elements(strategy, shape, peft)) \
        if strategy.kind == "deepspeed" and strategy.shard >= 3 else 0.0
    kept["persistent"] = persistent
    phases = {
        "forward_backward": dict(forward_backward),
        "optimizer": {**states, "buffers": kept["buffers"], "graph": graph,
                      "step": max(optimizer_step_bytes(strategy, shape, world, peft, foreach), persistent)},
        "eval": {**kept, "gathered": eval_gather_bytes(strategy, shape) + autocast_cache,
                 "activations": eval_activation_bytes(shape, eval_batch, seq, mode, attn != "flash",
                                                      peft is not None and "up_proj" in peft.target_names())},
        "save": {**kept, "gathered": gathered},
    }
    for parts in phases.values():
        parts["total"] = float(sum(parts.values()))
    trainable = peft.trainable_params(shape) if peft else params
    held_on_host = host + swap_buffer_bytes(strategy, shape, trainable, world)
    for parts in phases.values():
        parts["on_host"] = held_on_host
    if strategy.kind == "fsdp" and strategy.offload_params != "none":  # its host gradients are freed by the step
        for name in ("eval", "save"):
            phases[name]["on_host"] -= 4 * trainable / world
    phases["optimizer"]["on_host"] += host_step_bytes(strategy, shape, world, peft)
    phases["save"]["on_host"] += saved_on_host
    return phases


@dataclass
class Plan:
    model: str
    hardware: str
    config: str
    params: int
    trainable_params: int
    world_size: int
    micro_batch: int
    max_seq_length: int
    gradient_checkpointing: bool
    mixed_precision: str
    activation_mode: str
    per_gpu: dict[str, float]
    host_ram_per_node: float
    host_ram: dict[str, float]
    nvme_per_node: float
    capacity: int
    gpu_fits: bool
    host_ram_capacity: float
    host_ram_fits: bool
    notes: list[str] = field(default_factory=list)
    # Per GPU, each phase's parts and "total" (see phase_bytes); per_gpu["total"] is the largest, this one's.
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_phase: str = "forward_backward"

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_ram_fits

    def binding_limit(self) -> str:
        """What stops this plan, as a phrase: '' when it fits."""
        limits = []
        if not self.gpu_fits:
            limits.append(f"GPU memory ({_gb(self.per_gpu['total'])} planned per GPU, {_gb(self.capacity)} usable)")
        if not self.host_ram_fits:
            limits.append(f"host RAM ({_gb(self.host_ram_per_node)} planned per node, "
                          f"{_gb(self.host_ram_capacity)} usable)")
        return " and ".join(limits)

    def to_json(self) -> dict:
        return {**asdict(self), "fits": self.fits}


def plan(shape: ModelShape, hardware: Hardware, strategy: Strategy, micro_batch: int = 1, seq: int = 4096,
         checkpointing: bool = True, attn: str = "sdpa", peft: Peft | None = None,
         packing: bool = False, async_save: bool = False, save_only_model: bool = False, eval_batch: int = 8,
         foreach: bool = True, export_bytes: int = 2) -> Plan:
    """Per-GPU memory of a run, the largest of its phases (forward/backward, optimizer step, eval at
    `eval_batch` rows, final gather and save; see phase_bytes), and host RAM per node (the hardware's, less
    headroom). per_gpu's components are the forward/backward phase's. `export_bytes`: bytes per parameter of the
    final export (bf16, the Llama checkpoints' dtype, unless --save_dtype says otherwise). `foreach`: torch
    AdamW's CUDA default; False plans its per-tensor loop (the CPU default). Runs in microseconds: nothing is
    built or loaded. With `peft`, activations are the base model's (LoRA's rank-r intermediates and dropout
    copies are not counted). `attn`: "sdpa", "eager" or "flash" (PLANNED_ATTENTION). With `packing` a training
    micro-batch is one row of micro_batch x seq tokens (DataCollatorWithFlattening); eval batches are padded."""
    params, world = shape.params, hardware.world_size
    mode = activation_mode(strategy)
    states = peft_states(strategy, shape, world, peft) if peft else model_states(strategy, params, world, shape)
    rows, length = (1, micro_batch * seq) if packing else (micro_batch, seq)
    masked = attn != "flash"  # SDPA and eager get a dense mask: a padded batch's, or a packed row's block-diagonal
    acts = activation_bytes(shape, rows, length, mode, checkpointing, attn, masked, frozen=peft is not None)
    buffer = buffers(strategy, shape, params, world, mode, peft)
    buffer -= freed_under_layer_gradients(strategy, shape, rows, length, mode, attn, masked, peft)
    per_gpu = {"weights": states.weights, "gradients": states.gradients, "optimizer": states.optimizer,
               "activations": float(acts["total"]), "buffers": float(buffer)}
    # With recomputation peft makes the embedding output require grad (enable_input_require_grads): a leaf of the
    # loss's graph, which then holds it and its gradient; accelerate steps DeepSpeed's engine inside backward, while
    # that graph is alive (the trainer drops it before stepping any other strategy).
    graph = 2.0 * _dtypes(mode)[1] * rows * length * shape.hidden \
        if peft and checkpointing and strategy.kind == "deepspeed" else 0.0
    phases = phase_bytes(strategy, shape, world, per_gpu, eval_batch, seq, peft, foreach, states.host,
                         export_bytes, attn, graph)
    peak_phase = max(PHASES, key=lambda name: phases[name]["total"])
    per_gpu["total"] = phases[peak_phase]["total"]
    offloaded = states.host * hardware.gpus_per_node
    swap_buffers = swap_buffer_bytes(strategy, shape, peft.trainable_params(shape) if peft else params, world)
    swap_buffers *= hardware.gpus_per_node
    loading = loading_host_bytes(strategy, params, hardware.gpus_per_node, peft)
    staging = (staging_host_bytes(strategy, params, world, hardware.gpus_per_node, save_only_model)
               if async_save else 0.0)
    host = {"offloaded_states": offloaded, "swap_buffers": swap_buffers, "model_loading": loading,
            "checkpoint_page_cache": checkpoint_page_cache_bytes(params), "checkpoint_staging": staging}
    training_host = offloaded + swap_buffers + staging  # held while training; loading comes before
    capacity = usable_capacity(hardware)
    notes = []
    if strategy.kind == "ddp" and mode == "autocast":
        notes.append("DDP autocast: 16-bit weight copies cached during forward are counted in buffers")
    return Plan(
        model=shape.name, hardware=hardware.name, config=strategy.name, params=params,
        trainable_params=peft.trainable_params(shape) if peft else params, world_size=world,
        micro_batch=micro_batch, max_seq_length=seq, gradient_checkpointing=checkpointing,
        mixed_precision=strategy.mixed_precision, activation_mode=mode, per_gpu=per_gpu,
        host_ram_per_node=max(training_host, loading), host_ram=host,
        nvme_per_node=states.nvme * hardware.gpus_per_node,
        capacity=capacity, gpu_fits=per_gpu["total"] <= capacity, host_ram_capacity=usable_host_ram(hardware),
        host_ram_fits=max(training_host, loading) <= usable_host_ram(hardware), notes=notes,
        phases=phases, peak_phase=peak_phase,
    )


def config_paths(configs_dir: str = CONFIGS_DIR) -> list[str]:
    """Every YAML in the directory, fastest first (SPEED_ORDER), unknown names last."""
    paths = glob.glob(os.path.join(configs_dir, "*.yaml"))
    rank = {name: index for index, name in enumerate(SPEED_ORDER)}
    return sorted(paths, key=lambda p: (rank.get(os.path.splitext(os.path.basename(p))[0], len(rank)), p))


@dataclass
class Recommendation:
    plan: Plan | None
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


MAX_NODES = 64  # how far "nothing fits" looks for a node count that does


def candidates(shape: ModelShape, hardware: Hardware, global_batch: int | None = None, seq: int = 4096,
               mixed_precision: str = "bf16", configs_dir: str = CONFIGS_DIR, attn: str = "sdpa",
               peft: Peft | None = None, packing: bool = False) -> Iterator[tuple[Plan, int, bool]]:
    """(plan, accumulation, offloads) for every config, checkpointing and micro-batch, fastest first: GPU-only
    configs before offload; within each, no recomputation before recomputation, configs in SPEED_ORDER, then the
    largest micro-batch that keeps the global batch (accumulation derived; it must divide)."""
    pairs = micro_batches(global_batch, hardware.world_size)
    strategies = [read_accelerate_config(path, mixed_precision) for path in config_paths(configs_dir)]
    # Recomputation (~1/3 more compute) costs more than sharding on NVLink, offload more than both.
    for offload in (False, True):
        group = [s for s in strategies if (s.offload_optimizer != "none" or s.offload_params != "none") == offload]
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


def _gb(value: float) -> str:
    return f"{value / 1e9:,.1f} GB"


def _describe(p: Plan, accumulation: int) -> str:
    return (f"{p.config}, micro-batch {p.micro_batch} x accumulation {accumulation}, gradient checkpointing "
            f"{'on' if p.gradient_checkpointing else 'off'}")


def _fit_message(chosen: Plan, accumulation: int, offload: bool, shape: ModelShape, hardware: Hardware,
                 *search) -> str:
    text = (f"{shape.name} on {hardware.name}: {_describe(chosen, accumulation)}: {_gb(chosen.per_gpu['total'])} "
            f"of {_gb(chosen.capacity)} usable per GPU, {_gb(chosen.host_ram_per_node)} of "
            f"{_gb(chosen.host_ram_capacity)} usable host RAM per node.")
    if offload:
        smallest = min((p for p, _, off in candidates(shape, hardware, *search) if not off),
                       key=lambda p: p.per_gpu["total"])
        text += (f" No GPU-only config fits: the smallest, {smallest.config} with micro-batch "
                 f"{smallest.micro_batch} and checkpointing, needs {_gb(smallest.per_gpu['total'])} per GPU against "
                 f"{_gb(smallest.capacity)} usable.")
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
        binding = (f"host RAM: the plans that fit the GPUs need {_gb(least.host_ram_per_node)} per node at the "
                   f"least ({least.config}), {_gb(least.host_ram_capacity)} is usable (give the node's RAM with "
                   "--host_ram_gb)")
    else:
        least = min(plans, key=lambda p: p.per_gpu["total"])
        binding = (f"GPU memory: the smallest plan, {least.config} with micro-batch {least.micro_batch} and "
                   f"checkpointing, needs {_gb(least.per_gpu['total'])} per GPU, {_gb(least.capacity)} is usable")
    text = f"Nothing fits {shape.name} on {hardware.name}; the binding limit is {binding}."
    found = fewest_nodes(shape, hardware.with_nodes(hardware.nodes + 1), global_batch, seq, *search)
    if found is None:
        text += f" It fits on no number of such nodes up to {MAX_NODES} with this global batch."
    else:
        nodes, fitting = found
        text += (f" It fits on {nodes} such nodes ({fitting.plan.hardware}): "
                 f"{_describe(fitting.plan, fitting.accumulation)}, {_gb(fitting.plan.per_gpu['total'])} per GPU.")
        if not fitting.gpu_only:
            fast = fewest_nodes(shape, hardware.with_nodes(nodes + 1), global_batch, seq, *search, gpu_only=True)
            text += (f" Without offload it fits on {fast[0]} nodes: {_describe(fast[1].plan, fast[1].accumulation)}."
                     if fast else f" Without offload it fits on no number of nodes up to {MAX_NODES} with this "
                     "global batch.")
    peft = search[-1] if search else None
    return text + ("" if peft else " LoRA or QLoRA (--use_peft true) needs far less.")


# ---------------------------------------------------------------------------------------------------------------
# Output.

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "buffers")


def format_plan(p: Plan) -> str:
    rows = [f"{p.model} ({p.params:,} params) on {p.hardware} ({p.world_size} GPUs) with {p.config}, "
            f"micro-batch {p.micro_batch} x {p.max_seq_length} tokens, checkpointing "
            f"{'on' if p.gradient_checkpointing else 'off'}, {p.mixed_precision} ({p.activation_mode})"]
    rows += [f"  {name:<12}{_gb(p.per_gpu[name]):>12}" for name in (*COMPONENTS, "total")]
    if p.phases:  # the total is the largest phase's; the components above are forward/backward's
        phases = [f"{name} {_gb(parts['total'])}{' (peak)' if name == p.peak_phase else ''}"
                  for name, parts in p.phases.items()]
        rows.append("  per phase: " + ", ".join(phases))
    rows.append(f"  {'usable':<12}{_gb(p.capacity):>12}   ({GPU_HEADROOM_FRACTION:.0%} and "
                f"{GPU_FIXED_RESERVE / GiB:.0f} GiB kept free){'' if p.gpu_fits else '   -> GPU memory binds'}")
    rows.append(f"  host RAM per node: {_gb(p.host_ram_per_node)} of {_gb(p.host_ram_capacity)} usable "
                f"(offloaded states {_gb(p.host_ram['offloaded_states'])}, model loading "
                f"{_gb(p.host_ram['model_loading'])} and the checkpoint's page cache "
                f"{_gb(p.host_ram['checkpoint_page_cache'])}, which the kernel can drop"
                + (f", NVMe swap buffers {_gb(p.host_ram['swap_buffers'])}" if p.host_ram["swap_buffers"] else "")
                + (f", checkpoint staging {_gb(p.host_ram['checkpoint_staging'])}"
                   if p.host_ram["checkpoint_staging"] else "") + ")"
                + ("" if p.host_ram_fits else "   -> host RAM binds"))
    rows.append(f"  -> {'fits' if p.fits else 'DOES NOT FIT'}")
    if p.nvme_per_node:
        rows.append(f"  NVMe per node: {_gb(p.nvme_per_node)}")
    return "\n".join(rows + [f"  note: {note}" for note in p.notes])


def format_compare(plans: list[Plan]) -> str:
    header = f"{'config':<30}" + "".join(f"{c:>13}" for c in (*COMPONENTS, "total")) + f"{'host/node':>13}  fits"
    lines = [header]
    for p in plans:
        cells = "".join(f"{p.per_gpu[c] / 1e9:>12.1f}G" for c in (*COMPONENTS, "total"))
        lines.append(f"{p.config:<30}{cells}{p.host_ram_per_node / 1e9:>12.1f}G  {'yes' if p.fits else 'no'}")
    lines.append(f"usable per GPU: {_gb(plans[0].capacity)}")
    return "\n".join(lines)


def write_chart(plans: list[Plan], path: str) -> None:
    """Stacked bars of the per-GPU components for each config, with the usable capacity as a line."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes or CI
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(max(6, 1.2 * len(plans)), 5))
    names = [p.config for p in plans]
    bottom = [0.0] * len(plans)
    for component in COMPONENTS:
        values = [p.per_gpu[component] / 1e9 for p in plans]
        axes.bar(names, values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes.axhline(plans[0].capacity / 1e9, color="black", linestyle="--", label="usable capacity")
    axes.set_ylabel("GB per GPU")
    axes.set_title(f"{plans[0].model} on {plans[0].hardware}")
    axes.tick_params(axis="x", labelrotation=45)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def strategy_from_launch_env(mixed_precision: str) -> Strategy:
    """The strategy `accelerate launch` set up for this process, read from the variables it exports: under
    DeepSpeed, from the JSON file it names (ACCELERATE_DEEPSPEED_CONFIG_FILE), where accelerate exports no stage
    or offload variables."""
    env = os.environ.get
    on = "true"
    if env("ACCELERATE_USE_DEEPSPEED", "false").lower() == on:
        settings = launch_deepspeed_settings()
        precision = settings.pop("mixed_precision") or mixed_precision
        name = f"DeepSpeed ZeRO-{settings['stage']}"
        return _deepspeed_strategy(name, settings, env("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false").lower() == on,
                                   precision)
    if env("ACCELERATE_USE_FSDP", "false").lower() == on:
        reshard = env("FSDP_RESHARD_AFTER_FORWARD", on).lower() == on
        offload = "cpu" if env("FSDP_OFFLOAD_PARAMS", "false").lower() == on else "none"
        return Strategy(f"FSDP {'FULL_SHARD' if reshard else 'SHARD_GRAD_OP'}", "fsdp", 3 if reshard else 2,
                        offload, offload, env("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == on,
                        mixed_precision)
    return Strategy("DDP", "ddp", 0, mixed_precision=mixed_precision)


def launch_hardware(spec: str) -> Hardware | None:
    """`--hardware NAME`, or the GPUs this process sees (nodes from WORLD_SIZE / LOCAL_WORLD_SIZE) with this
    node's RAM, each GPU's memory read by the CLI's rule (nominal_gpu_memory)."""
    if spec:
        return parse_hardware(spec)
    import psutil
    import torch

    if not torch.cuda.is_available():
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(1, int(os.environ.get("WORLD_SIZE", "1")) // per_node)
    name = torch.cuda.get_device_name(0)
    memory = nominal_gpu_memory(torch.cuda.get_device_properties(0).total_memory)
    return Hardware(nodes, per_node, memory, name, f"{nodes}x{per_node}x {name} ({memory / 1e9:.0f} GB)",
                    float(psutil.virtual_memory().total))


def plan_launch(shape: ModelShape, hardware: Hardware, recipe, config_file: str | None = None
                ) -> tuple[Plan, str | None]:
    """The plan of a recipe under the accelerate config it was launched with (or `config_file`, for a dry run
    outside `accelerate launch`); with the fastest plan that fits this hardware when it does not (None when it
    does)."""
    if config_file:
        strategy = read_accelerate_config(config_file, recipe.mixed_precision)
    else:
        strategy = strategy_from_launch_env(recipe.mixed_precision)
    peft = Peft(recipe.lora_r, recipe.lora_target_modules, recipe.load_in_4bit) if recipe.use_peft else None
    attn = PLANNED_ATTENTION[recipe.attn_implementation]
    chosen = plan(shape, hardware, strategy, recipe.per_device_train_batch_size, recipe.max_seq_length,
                  recipe.gradient_checkpointing, attn, peft=peft, packing=recipe.packing, async_save=recipe.async_save,
                  save_only_model=recipe.save_only_model, eval_batch=recipe.per_device_eval_batch_size)
    if chosen.fits:
        return chosen, None
    found = recommend(shape, hardware, recipe.global_batch_size, recipe.max_seq_length, recipe.mixed_precision,
                      attn=attn, peft=peft, packing=recipe.packing)
    return chosen, f"The fastest plan that fits: {found.message}" if found.plan else found.message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardtune.plan", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="Built-in name, any Hugging Face model id (only its config.json is fetched), a local "
                             "model directory or config.json, or a recipe file")
    parser.add_argument("--hardware", default="8xh100-80gb", help="e.g. 8xh100-80gb, 2x8xh100-80gb, 4x40gb")
    parser.add_argument("--config_file", help="accelerate config YAML; without it, recommend one")
    parser.add_argument("--per_device_train_batch_size", type=int)
    parser.add_argument("--global_batch_size", type=int)
    parser.add_argument("--max_seq_length", type=int)
    parser.add_argument("--gradient_checkpointing", type=_bool)
    parser.add_argument("--mixed_precision", choices=("bf16", "fp16", "no"))
    parser.add_argument("--attn_implementation", default="sdpa", choices=tuple(PLANNED_ATTENTION))
    parser.add_argument("--packing", type=_bool, default=False,
                        help="Padding-free packed micro-batches (one row of micro-batch x length tokens)")
    parser.add_argument("--host_ram_gb", type=float,
                        help="Host RAM per node in GB (default: 250 GB per GPU, as DGX nodes carry)")
    parser.add_argument("--use_peft", type=_bool, help="LoRA on a frozen base")
    parser.add_argument("--lora_r", type=int)
    parser.add_argument("--lora_target_modules", help="all-linear or comma-separated names")
    parser.add_argument("--load_in_4bit", type=_bool, help="QLoRA: the frozen base in 4-bit NF4")
    parser.add_argument("--compare", action="store_true", help="All accelerate_configs/*.yaml side by side")
    parser.add_argument("--chart", help="With --compare: write a stacked-bar PNG here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    problems = check_args(args)
    for problem in problems:
        print(f"shardtune.plan: error: {problem}", file=sys.stderr)
    if problems:
        return 2
    try:
        return _run(args)
    except (PlanError, HardwareError, ModelError) as error:
        print(f"shardtune.plan: error: {error}", file=sys.stderr)
        return 2


def check_args(args: argparse.Namespace) -> list[str]:
    """Every impossible value, one line each, before anything is planned."""
    problems = []
    for name, lowest in (("per_device_train_batch_size", 1), ("global_batch_size", 1), ("max_seq_length", 2),
                         ("lora_r", 1)):
        value = getattr(args, name)
        if value is not None and value < lowest:
            problems.append(f"--{name} must be >= {lowest}, got {value}.")
    if args.host_ram_gb is not None and not args.host_ram_gb > 0:
        problems.append(f"--host_ram_gb is host RAM per node in GB and must be > 0, got {args.host_ram_gb}.")
    peft_flags = [f"--{name}" for name in ("lora_r", "lora_target_modules", "load_in_4bit")
                  if getattr(args, name) is not None]
    if peft_flags and args.use_peft is not True and not args.model.endswith(".py"):
        problems.append(f"{', '.join(peft_flags)} shape{'s' if len(peft_flags) == 1 else ''} LoRA adapters: add "
                        "--use_peft true, or drop them.")
    if args.chart and not args.chart.lower().endswith(".png"):
        problems.append(f"--chart writes a PNG: give a path ending in .png, got {args.chart!r}.")
    if args.config_file and not os.path.isfile(args.config_file):
        problems.append(f"--config_file {args.config_file!r} does not exist: give an accelerate config YAML, e.g. "
                        "accelerate_configs/fsdp_full_shard.yaml.")
    return problems


def _given(value, fallback):
    return fallback if value is None else value


def _run(args: argparse.Namespace) -> int:
    hardware = parse_hardware(args.hardware, args.host_ram_gb)
    shape = resolve_model(args.model)
    recipe = recipe_fields(args.model) if args.model.endswith(".py") else {}
    seq = _given(args.max_seq_length, recipe.get("max_seq_length") or 4096)
    micro = _given(args.per_device_train_batch_size, recipe.get("per_device_train_batch_size") or 1)
    checkpointing = _given(args.gradient_checkpointing, recipe.get("gradient_checkpointing", True))
    precision = args.mixed_precision or recipe.get("mixed_precision")
    attn = PLANNED_ATTENTION[args.attn_implementation]
    packing = args.packing or recipe.get("packing", False)
    peft = None
    if _given(args.use_peft, recipe.get("use_peft", False)):
        peft = Peft(_given(args.lora_r, recipe.get("lora_r", 16)),
                    args.lora_target_modules or recipe.get("lora_target_modules", "all-linear"),
                    _given(args.load_in_4bit, recipe.get("load_in_4bit", False)))
        peft.trainable_params(shape)  # unknown target names: one line now
    if args.compare or args.chart:
        plans = [plan(shape, hardware, read_accelerate_config(path, precision), micro, seq, checkpointing, attn,
                      peft, packing) for path in config_paths()]
        if args.chart:
            write_chart(plans, args.chart)
        print(json.dumps([p.to_json() for p in plans]) if args.json else format_compare(plans))
        return 0
    if args.config_file:
        strategy = read_accelerate_config(args.config_file, precision)
        result = plan(shape, hardware, strategy, micro, seq, checkpointing, attn, peft, packing)
        print(json.dumps(result.to_json()) if args.json else format_plan(result))
        return 0 if result.fits else 1
    global_batch = _given(args.global_batch_size, recipe.get("global_batch_size"))
    found = recommend(shape, hardware, global_batch, seq, precision or "bf16", attn=attn, peft=peft, packing=packing)
    if args.json:
        body = found.plan.to_json() if found.plan else {"params": shape.params, "fits": False}
        print(json.dumps({**body, "recommendation": found.message, "gpu_only": found.gpu_only,
                          "accumulation": found.accumulation}))
    else:
        print(found.message)
        if found.plan:
            print(format_plan(found.plan))
    return 0 if found.plan else 1


if __name__ == "__main__":
    sys.exit(main())
