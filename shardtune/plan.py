"""Memory plan per GPU, before a single weight is loaded: model states, activations and buffers for any model x
hardware x accelerate config, and the fastest config, checkpointing and micro-batch that fit.

    python -m shardtune.plan --model llama-3.1-70b --hardware 8xh100-80gb                  # recommendation
    python -m shardtune.plan --model recipes/llama8b.py --config_file accelerate_configs/fsdp_full_shard.yaml
    python -m shardtune.plan --model llama-3.1-8b --compare --chart plan.png

All sizes are bytes. GB in output is 1e9 bytes.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import yaml

from shardtune.flops import ModelError, ModelShape, recipe_fields, resolve_model
from shardtune.hardware import Hardware, HardwareError, parse_hardware

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS_DIR = os.path.join(REPO, "accelerate_configs")
GiB = 1024**3

# Reserved on every GPU for the CUDA context (~0.5-1 GiB with NCCL) and caching-allocator fragmentation.
RESERVE_FRACTION, RESERVE_FIXED = 0.05, 1 * GiB

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py). accelerate fills these from hidden_size only for keys
# set to "auto" in a DeepSpeed JSON; the YAML configs here give no JSON, so the defaults apply.
DS_REDUCE_BUCKET = int(5e8)  # elements; gradients are reduced through a flat bucket of this size
DS_PREFETCH_BUCKET = int(5e7)  # elements; ZeRO-3 prefetches up to this many parameters ahead

# Fastest first: least sharding, then offload. Among offloads DeepSpeed's SIMD CPU Adam is faster than FSDP's
# CPU-side torch AdamW step, and NVMe is slowest.
SPEED_ORDER = (
    "ddp", "ds_zero1", "fsdp_shard_grad_op", "ds_zero2", "fsdp_full_shard", "ds_zero3",
    "ds_zero3_cpu_offload", "fsdp_full_shard_cpu_offload", "ds_zero3_nvme_offload",
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


def read_accelerate_config(path: str, mixed_precision: str | None = None) -> Strategy:
    """Any accelerate config YAML: distributed_type, fsdp_config, deepspeed_config, mixed_precision.
    The GPU count comes from --hardware, not from num_processes."""
    try:
        with open(path) as file:
            config = yaml.safe_load(file) or {}
    except (OSError, yaml.YAMLError) as error:
        raise PlanError(f"Cannot read accelerate config {path!r}: {error}") from error
    name = os.path.splitext(os.path.basename(path))[0]
    precision = mixed_precision or config.get("mixed_precision") or "no"
    if precision not in ("bf16", "fp16", "no"):
        raise PlanError(f"{path}: mixed_precision {precision!r} is not bf16, fp16 or no.")
    kind = str(config.get("distributed_type", "NO")).upper()
    if kind == "FSDP":
        fsdp = config.get("fsdp_config") or {}
        reshard = fsdp.get("fsdp_reshard_after_forward", fsdp.get("fsdp_sharding_strategy", True))
        if isinstance(reshard, str):  # FSDP1 names, also accepted by accelerate for FSDP2
            reshard = {"FULL_SHARD": True, "1": True, "SHARD_GRAD_OP": False, "2": False}.get(reshard.upper(), True)
        offload = "cpu" if fsdp.get("fsdp_offload_params") else "none"
        return Strategy(name, "fsdp", 3 if reshard else 2, offload, offload,
                        bool(fsdp.get("fsdp_cpu_ram_efficient_loading", False)), precision)
    if kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        if ds.get("deepspeed_config_file"):
            ds = _deepspeed_json(ds["deepspeed_config_file"], ds)
        stage = int(ds.get("zero_stage", 0))
        return Strategy(name, "deepspeed", stage, str(ds.get("offload_optimizer_device") or "none"),
                        str(ds.get("offload_param_device") or "none"),
                        bool(ds.get("zero3_init_flag", False)) and stage == 3, precision)
    if kind in ("MULTI_GPU", "NO", "MULTI_CPU"):
        return Strategy(name, "ddp", 0, mixed_precision=precision)
    raise PlanError(f"{path}: distributed_type {kind!r} is not planned (use NO, MULTI_GPU, FSDP or DEEPSPEED).")


def _deepspeed_json(path: str, fallback: dict) -> dict:
    with open(path) as file:
        zero = json.load(file).get("zero_optimization", {})
    return {
        "zero_stage": zero.get("stage", fallback.get("zero_stage", 0)),
        "offload_optimizer_device": zero.get("offload_optimizer", {}).get("device", "none"),
        "offload_param_device": zero.get("offload_param", {}).get("device", "none"),
        "zero3_init_flag": fallback.get("zero3_init_flag", False),
    }


# ---------------------------------------------------------------------------------------------------------------
# Model states.

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

    def trainable_params(self, shape: ModelShape) -> int:
        q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        h, inter = shape.hidden, shape.intermediate
        shapes = {"q_proj": (h, q_dim), "k_proj": (h, kv_dim), "v_proj": (h, kv_dim), "o_proj": (q_dim, h),
                  "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
        names = LORA_TARGETS if self.targets == "all-linear" else [t.strip() for t in self.targets.split(",")]
        unknown = [name for name in names if name not in shapes]
        if unknown:
            raise PlanError(f"LoRA target(s) {unknown} are not linear layers of {shape.name}; use {LORA_TARGETS}.")
        return shape.layers * sum(self.rank * (shapes[name][0] + shapes[name][1]) for name in names)


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


def model_states(strategy: Strategy, params: int, world: int) -> States:
    """Bytes of weights, gradients and Adam states per GPU, as the code stores them.

    - DDP (accelerate's autocast): fp32 weights 4P + fp32 grads 4P + Adam m, v 8P = 16P. Autocast computes in
      16-bit but keeps the fp32 parameters, so their gradients are fp32 too.
    - DeepSpeed with bf16/fp16 converts the module to 16-bit; the ZeRO optimizer keeps fp32 master weights, m
      and v (12P/N). Gradients, as measured at the first step (tests/test_memory_measured.py): ZeRO-1 holds the
      full 16-bit gradients until the reduction at the accumulation boundary (2P). With 16-bit weights the
      trainer accumulates ZeRO-2/3 gradients in fp32 (shardtune.distributed.configure_deepspeed): ZeRO-2 reduces
      them into the fp32 partition the optimizer reads (4P/N); ZeRO-3 into an fp32 partition beside the fp32
      one the optimizer reads ((4 + 4)P/N). So ZeRO-1: 2 + 2 + 12/N, ZeRO-2: 2 + 16/N, ZeRO-3: 22/N bytes per
      parameter, the ZeRO-3 figure where one optimizer sub-group covers a rank's whole partition.
    - DeepSpeed fp32 (mixed_precision no): the same with 4-byte weights and gradients; the fp32 "master" is still a
      separate clone (stage_1_and_2.py: `.clone().to(master dtype)`).
    - FSDP2 (FULL_SHARD and SHARD_GRAD_OP): the sharded parameters stay fp32 and serve as master weights
      (MixedPrecisionPolicy only casts the all-gathered copies), so 4P/N + 4P/N + 8P/N. SHARD_GRAD_OP keeps the
      16-bit unsharded weights between forward and backward: counted in buffers().
    - Offload: DeepSpeed offload_optimizer moves the fp32 master, m and v (12P/N) to host RAM or NVMe; the
      16-bit gradient partition and two fp32 ones (the one reduced into, the one CPU Adam reads) go to host RAM
      in both cases: (2 + 8)P/N. offload_param moves the 16-bit weight partition too (2P/N).
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
        grads = 8 * p / n  # the partition reduced into is fp32 (the trainer's fp32 accumulation) or fp32 already
    elif strategy.shard == 2:
        grads = 4 * p / n if half else 8 * p / n  # fp32 accumulation: the reduced partition is the optimizer's
    else:
        grads = low * p
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


def buffers(strategy: Strategy, shape: ModelShape, params: int, world: int, activation_mode: str,
            trainable: int | None = None) -> float:
    """Transient 16-bit copies and communication buffers alive during forward/backward (assumptions documented
    per case; DeepSpeed values are its defaults, see DS_REDUCE_BUCKET).

    - DDP: the trainer sets gradient_as_bucket_view, so the gradients are the all-reduce buckets (counted as
      gradients). Autocast caches one 16-bit copy of every matmul weight for the whole forward.
    - DeepSpeed ZeRO-1/2: one reduce bucket of DS_REDUCE_BUCKET gradient elements (overlap_comm is off below
      stage 3). ZeRO-3: the module being computed plus the one prefetched (2 x the largest module, which for
      Llama 3 is the embedding or lm_head), the prefetch bucket and the reduce bucket.
    - FSDP FULL_SHARD: the root unit (embedding, final norm, lm_head) stays gathered from forward to backward;
      one layer computing and one prefetched; the unsharded gradients of one layer and of the root before
      reduce-scatter, in fp32 (the trainer's reduce_dtype). SHARD_GRAD_OP keeps every unsharded 16-bit weight
      from forward to backward instead of re-gathering."""
    low = 2 if strategy.mixed_precision in ("bf16", "fp16") else 4
    layer = shape.layer_params
    root = shape.params - shape.layers * layer
    if strategy.kind == "ddp":  # with LoRA only the adapters have gradients, and a 16-bit base needs no cast
        trainable = params if trainable is None else trainable
        cached = shape.non_embedding_matmul_params if trainable == params else trainable
        return 2 * cached if activation_mode == "autocast" else 0
    if strategy.kind == "deepspeed":
        bucket = DS_REDUCE_BUCKET * low  # allocated at full size, however small the model (measured)
        if strategy.shard < 3:
            return bucket
        largest = max(layer, shape.embedding_params)
        return 2 * largest * low + min(DS_PREFETCH_BUCKET, params) * low + bucket
    reducing = (root + layer) * 4  # unsharded gradients waiting for their fp32 reduce-scatter
    if strategy.shard >= 3:
        return (root + 2 * layer) * low + reducing
    return params * low + reducing


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
                           padded: bool = True) -> int:
    """Bytes one Llama decoder layer saves for backward without recomputation (n = batch x seq tokens,
    c = compute bytes, r = residual bytes; the layer input itself is saved by the first norm).

    - Each RMSNorm: its input upcast to fp32 (4nh; the input itself when already fp32), the fp32 rstd (4n), the
      normalised x in the residual dtype (r·nh, for the weight gradient) and its output as the next matmuls'
      input in the compute dtype (c·nh; under autocast one 16-bit copy per consuming matmul: 3 for q, k, v and
      2 for gate, up, as autocast caches only casts of leaf weights).
    - Attention: RoPE saves only cos/sin (shared). SDPA saves q, k, v, its output (c·n·d each, where k and v are
      repeated to all heads when GQA meets a padding mask, since transformers then calls repeat_kv) and the fp32
      logsumexp (4·n·heads); o_proj reads the output in place. With padding each layer also saves its own copy
      of the additive mask in the compute dtype (c·b·s², measured on CPU SDPA). Eager saves q, repeated k and v,
      the fp32 softmax (4·b·heads·s²) and its 16-bit copy, and the contiguous o_proj input.
    - SwiGLU MLP: gate output, SiLU output, up output and their product (4·c·n·intermediate).
    Residual adds save nothing."""
    compute, residual = _dtypes(mode)
    n, h, inter = batch * seq, shape.hidden, shape.intermediate
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # Autocast casts a matmul input once per matmul (only leaf weights are cached): q, k, v and gate, up.
    attn_inputs, mlp_inputs = (3, 2) if mode == "autocast" else (1, 1)
    norm = 4 * n * h + 4 * n + residual * n * h
    norms = 2 * norm + (attn_inputs + mlp_inputs) * compute * n * h
    if attn == "eager":
        scores = batch * shape.heads * seq * seq
        attention = 4 * compute * n * q_dim + 4 * scores + (compute * scores if compute != 4 else 0)
    else:
        key = value = kv_dim
        if padded and shape.kv_heads != shape.heads:  # repeat_kv copies, except one kv head: a reshape view
            key = value = q_dim if shape.kv_heads > 1 else kv_dim
            key = q_dim if mode == "autocast" else key  # autocast's cast to 16-bit materialises the view
        attention = compute * n * (2 * q_dim + key + value) + 4 * n * shape.heads
        if padded:  # each layer's SDPA call saves its own converted copy of the additive mask
            attention += batch * seq * seq * compute
    return norms + attention + 4 * compute * n * inter


def shared_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, attn: str = "sdpa",
                            padded: bool = True) -> int:
    """Saved once for all layers: RoPE cos and sin (1 x s x head_dim each, residual dtype)."""
    _, residual = _dtypes(mode)
    return 2 * seq * shape.head_dim * residual


def head_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str) -> int:
    """Outside the layers: input ids (int64, for the embedding), the final RMSNorm (as in a layer), the fp32
    log-probabilities saved by cross-entropy (4·n·vocab: the upcast logits' log_softmax) and the int64 targets."""
    compute, residual = _dtypes(mode)
    n, h = batch * seq, shape.hidden
    return 8 * n + (4 * n * h + 4 * n + residual * n * h + compute * n * h) + 4 * n * shape.vocab + 8 * n


def saved_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, checkpointing: bool,
                           attn: str = "sdpa", padded: bool = True) -> int:
    """Everything saved for backward at the end of the forward (what saved_tensors_hooks see). With full
    recomputation (non-reentrant) a layer saves only its input (r·n·h); masks and RoPE tables are then held by
    the recompute closure, not the graph, and are counted in the transient peak instead."""
    _, residual = _dtypes(mode)
    head = head_activation_bytes(shape, batch, seq, mode)
    if checkpointing:
        return shape.layers * residual * batch * seq * shape.hidden + head
    per_layer = layer_activation_bytes(shape, batch, seq, mode, attn, padded)
    return shape.layers * per_layer + shared_activation_bytes(shape, batch, seq, mode, attn, padded) + head


def activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, checkpointing: bool,
                     attn: str = "sdpa", padded: bool = True) -> dict[str, int]:
    """Peak activation memory = saved + the largest transient on top of it:
    - the loss: the forward holds the logits (c·n·vocab) and their fp32 upcast (4·n·vocab); its backward holds
      two fp32 n x vocab gradients (d log-probs, d logits) - the larger, 8·n·vocab, is taken;
    - with recomputation, one layer's full activations while it is recomputed in backward;
    - the MLP backward's two intermediate-size gradients (2·c·n·intermediate)."""
    compute, _ = _dtypes(mode)
    n = batch * seq
    saved = saved_activation_bytes(shape, batch, seq, mode, checkpointing, attn, padded)
    logits = max(compute * n * shape.vocab + (4 * n * shape.vocab if compute != 4 else 0), 8 * n * shape.vocab)
    recompute = 0
    if checkpointing:
        recompute = layer_activation_bytes(shape, batch, seq, mode, attn, padded)
        recompute += shared_activation_bytes(shape, batch, seq, mode, attn, padded)
    transient = max(logits, recompute) + 2 * compute * n * shape.intermediate
    return {"saved": saved, "transient": transient, "total": saved + transient}


# ---------------------------------------------------------------------------------------------------------------
# The plan.


def usable_capacity(hardware: Hardware) -> int:
    return int(hardware.gpu_memory - RESERVE_FRACTION * hardware.gpu_memory - RESERVE_FIXED)


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


def loading_host_bytes(strategy: Strategy, params: int, gpus_per_node: int) -> float:
    """from_pretrained reads an fp32 copy in every local process, unless RAM-efficient loading is on
    (FSDP: rank 0 reads, the others start on the meta device; DeepSpeed zero.Init streams checkpoint shards and
    keeps partitions: approximated as one fp32 copy per node)."""
    copies = 1 if strategy.ram_efficient_loading else gpus_per_node
    return 4.0 * params * copies


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
    fits: bool
    host_ram_fits: bool | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def plan(shape: ModelShape, hardware: Hardware, strategy: Strategy, micro_batch: int = 1, seq: int = 4096,
         checkpointing: bool = True, attn: str = "sdpa", host_ram: float | None = None, peft: Peft | None = None,
         padded: bool = True, async_save: bool = False, save_only_model: bool = False) -> Plan:
    """Per-GPU memory of one training step. Runs in microseconds: nothing is built or loaded. With `peft`,
    activations are the base model's (LoRA's rank-r intermediates and dropout copies are not counted)."""
    params, world = shape.params, hardware.world_size
    mode = activation_mode(strategy)
    states = peft_states(strategy, shape, world, peft) if peft else model_states(strategy, params, world)
    acts = activation_bytes(shape, micro_batch, seq, mode, checkpointing, attn, padded)
    buffer = buffers(strategy, shape, params, world, mode, peft.trainable_params(shape) if peft else None)
    per_gpu = {"weights": states.weights, "gradients": states.gradients, "optimizer": states.optimizer,
               "activations": float(acts["total"]), "buffers": float(buffer)}
    per_gpu["total"] = sum(per_gpu.values())
    offloaded = states.host * hardware.gpus_per_node
    loading = loading_host_bytes(strategy, params, hardware.gpus_per_node)
    staging = (staging_host_bytes(strategy, params, world, hardware.gpus_per_node, save_only_model)
               if async_save else 0.0)
    host = {"offloaded_states": offloaded, "model_loading": loading, "checkpoint_staging": staging}
    training_host = offloaded + staging  # both held while training; loading comes before
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
        capacity=capacity, fits=per_gpu["total"] <= capacity,
        host_ram_fits=None if host_ram is None else max(training_host, loading) <= host_ram, notes=notes,
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


def recommend(shape: ModelShape, hardware: Hardware, global_batch: int | None = None, seq: int = 4096,
              mixed_precision: str = "bf16", configs_dir: str = CONFIGS_DIR, host_ram: float | None = None,
              attn: str = "sdpa", peft: Peft | None = None) -> Recommendation:
    """The fastest plan that fits: GPU-only configs before offload; within each, no recomputation before
    recomputation, configs in SPEED_ORDER, then the largest micro-batch that keeps the global batch
    (accumulation derived; it must divide)."""
    pairs = micro_batches(global_batch, hardware.world_size)
    if not pairs:
        return Recommendation(None, False, None, f"Global batch {global_batch} is not divisible by the "
                              f"{hardware.world_size} GPUs of {hardware.name}: no micro-batch keeps it.")
    strategies = [read_accelerate_config(path, mixed_precision) for path in config_paths(configs_dir)]
    offloads = [s.offload_optimizer != "none" or s.offload_params != "none" for s in strategies]
    gpu_only = [s for s, off in zip(strategies, offloads, strict=True) if not off]
    offloading = [s for s, off in zip(strategies, offloads, strict=True) if off]
    # Recomputation (~1/3 more compute) costs more than sharding on NVLink, offload more than both.
    for group, offload in ((gpu_only, False), (offloading, True)):
        for checkpointing in (False, True):
            for strategy in group:
                for micro, accumulation in pairs:
                    candidate = plan(shape, hardware, strategy, micro, seq, checkpointing, attn, host_ram, peft)
                    if candidate.fits and candidate.host_ram_fits is not False:
                        return Recommendation(candidate, not offload, accumulation,
                                              _fit_message(candidate, accumulation, shape, hardware, offload))
    return Recommendation(None, False, None, nothing_fits(shape, hardware, seq, mixed_precision, configs_dir))


def _gb(value: float) -> str:
    return f"{value / 1e9:,.1f} GB"


def _fit_message(chosen: Plan, accumulation: int, shape: ModelShape, hardware: Hardware, offload: bool) -> str:
    text = (f"{shape.name} on {hardware.name}: {chosen.config}, micro-batch {chosen.micro_batch} x accumulation "
            f"{accumulation}, gradient checkpointing {'on' if chosen.gradient_checkpointing else 'off'}: "
            f"{_gb(chosen.per_gpu['total'])} of {_gb(chosen.capacity)} usable per GPU.")
    if offload:
        zero3 = 16 * shape.params / hardware.world_size
        text = (f"No GPU-only config fits: ZeRO-3 / FULL_SHARD alone needs {_gb(zero3)} of model states per GPU "
                f"(16 bytes x {shape.params:,} params / {hardware.world_size}). " + text +
                f" Needs {_gb(chosen.host_ram_per_node)} of host RAM per node for the offloaded states.")
    return text


def nothing_fits(shape: ModelShape, hardware: Hardware, seq: int, mixed_precision: str, configs_dir: str) -> str:
    """Name what would fit: how many GPUs FULL_SHARD needs, and the other ways out."""
    zero3 = 16 * shape.params / hardware.world_size
    gpus = hardware.world_size
    for _ in range(20):  # double the nodes until FULL_SHARD with recomputation and micro-batch 1 fits
        gpus *= 2
        bigger = Hardware(max(1, gpus // hardware.gpus_per_node), hardware.gpus_per_node, hardware.gpu_memory,
                          hardware.gpu, f"{gpus} GPUs")
        strategy = Strategy("fsdp_full_shard", "fsdp", 3, mixed_precision=mixed_precision)
        if plan(shape, bigger, strategy, 1, seq, True).fits:
            break
    return (f"Nothing fits {shape.name} on {hardware.name}, even micro-batch 1 with recomputation and offload: "
            f"ZeRO-3 / FULL_SHARD needs {_gb(zero3)} of model states per GPU against {_gb(usable_capacity(hardware))}"
            f" usable. It would fit on about {gpus} such GPUs with fsdp_full_shard, or with PEFT (LoRA/QLoRA).")


# ---------------------------------------------------------------------------------------------------------------
# Output.

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "buffers")


def format_plan(p: Plan) -> str:
    rows = [f"{p.model} ({p.params:,} params) on {p.hardware} ({p.world_size} GPUs) with {p.config}, "
            f"micro-batch {p.micro_batch} x {p.max_seq_length} tokens, checkpointing "
            f"{'on' if p.gradient_checkpointing else 'off'}, {p.mixed_precision} ({p.activation_mode})"]
    rows += [f"  {name:<12}{_gb(p.per_gpu[name]):>12}" for name in (*COMPONENTS, "total")]
    rows.append(f"  {'usable':<12}{_gb(p.capacity):>12}   -> {'fits' if p.fits else 'DOES NOT FIT'}")
    rows.append(f"  host RAM per node: {_gb(p.host_ram_per_node)} (offloaded states "
                f"{_gb(p.host_ram['offloaded_states'])}, model loading {_gb(p.host_ram['model_loading'])}"
                + (f", checkpoint staging {_gb(p.host_ram['checkpoint_staging'])}"
                   if p.host_ram["checkpoint_staging"] else "") + ")")
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
    """The strategy `accelerate launch` set up for this process, read from the variables it exports."""
    env = os.environ.get
    on = "true"
    if env("ACCELERATE_USE_DEEPSPEED", "false").lower() == on:
        stage = int(env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "0"))
        return Strategy(f"DeepSpeed ZeRO-{stage}", "deepspeed", stage,
                        env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
                        env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none"),
                        env("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false").lower() == on and stage == 3, mixed_precision)
    if env("ACCELERATE_USE_FSDP", "false").lower() == on:
        reshard = env("FSDP_RESHARD_AFTER_FORWARD", on).lower() == on
        offload = "cpu" if env("FSDP_OFFLOAD_PARAMS", "false").lower() == on else "none"
        return Strategy(f"FSDP {'FULL_SHARD' if reshard else 'SHARD_GRAD_OP'}", "fsdp", 3 if reshard else 2,
                        offload, offload, env("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == on,
                        mixed_precision)
    return Strategy("DDP", "ddp", 0, mixed_precision=mixed_precision)


def launch_hardware(spec: str) -> Hardware | None:
    """`--hardware NAME`, or the GPUs this process sees (nodes from WORLD_SIZE / LOCAL_WORLD_SIZE)."""
    if spec:
        return parse_hardware(spec)
    import torch

    if not torch.cuda.is_available():
        return None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(1, int(os.environ.get("WORLD_SIZE", "1")) // per_node)
    name = torch.cuda.get_device_name(0)
    return Hardware(nodes, per_node, torch.cuda.get_device_properties(0).total_memory, name,
                    f"{nodes}x{per_node}x {name}")


def plan_launch(shape: ModelShape, hardware: Hardware, recipe) -> tuple[Plan, str | None]:
    """The plan of a launched recipe under its accelerate config; with the nearest fitting plan when it does
    not fit (None when it does)."""
    strategy = strategy_from_launch_env(recipe.mixed_precision)
    peft = Peft(recipe.lora_r, recipe.lora_target_modules, recipe.load_in_4bit) if recipe.use_peft else None
    chosen = plan(shape, hardware, strategy, recipe.per_device_train_batch_size, recipe.max_seq_length,
                  recipe.gradient_checkpointing, recipe.attn_implementation, peft=peft,
                  async_save=recipe.async_save, save_only_model=recipe.save_only_model)
    if chosen.fits:
        return chosen, None
    found = recommend(shape, hardware, recipe.global_batch_size, recipe.max_seq_length, recipe.mixed_precision,
                      attn=recipe.attn_implementation, peft=peft)
    return chosen, found.message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardtune.plan", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--model", required=True, help="Built-in name, Hub id of one, model dir/config.json or recipe")
    parser.add_argument("--hardware", default="8xh100-80gb", help="e.g. 8xh100-80gb, 2x8xh100-80gb, 4x40gb")
    parser.add_argument("--config_file", help="accelerate config YAML; without it, recommend one")
    parser.add_argument("--per_device_train_batch_size", type=int)
    parser.add_argument("--global_batch_size", type=int)
    parser.add_argument("--max_seq_length", type=int)
    parser.add_argument("--gradient_checkpointing", type=_bool)
    parser.add_argument("--mixed_precision", choices=("bf16", "fp16", "no"))
    parser.add_argument("--attn_implementation", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--host_ram_gb", type=float, help="Host RAM per node, to check offload plans")
    parser.add_argument("--use_peft", type=_bool, help="LoRA on a frozen base")
    parser.add_argument("--lora_r", type=int)
    parser.add_argument("--lora_target_modules", help="all-linear or comma-separated names")
    parser.add_argument("--load_in_4bit", type=_bool, help="QLoRA: the frozen base in 4-bit NF4")
    parser.add_argument("--compare", action="store_true", help="All accelerate_configs/*.yaml side by side")
    parser.add_argument("--chart", help="With --compare: write a stacked-bar PNG here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (PlanError, HardwareError, ModelError) as error:
        print(f"shardtune.plan: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    hardware = parse_hardware(args.hardware)
    shape = resolve_model(args.model)
    recipe = recipe_fields(args.model) if args.model.endswith(".py") else {}
    seq = args.max_seq_length or recipe.get("max_seq_length") or 4096
    micro = args.per_device_train_batch_size or recipe.get("per_device_train_batch_size") or 1
    checkpointing = args.gradient_checkpointing
    if checkpointing is None:
        checkpointing = recipe.get("gradient_checkpointing", True)
    precision = args.mixed_precision or recipe.get("mixed_precision")
    host_ram = args.host_ram_gb * 1e9 if args.host_ram_gb else None
    peft = None
    if args.use_peft if args.use_peft is not None else recipe.get("use_peft", False):
        peft = Peft(args.lora_r or recipe.get("lora_r", 16),
                    args.lora_target_modules or recipe.get("lora_target_modules", "all-linear"),
                    args.load_in_4bit if args.load_in_4bit is not None else recipe.get("load_in_4bit", False))
    if args.compare or args.chart:
        plans = [plan(shape, hardware, read_accelerate_config(path, precision), micro, seq, checkpointing,
                      args.attn_implementation, host_ram, peft) for path in config_paths()]
        if args.chart:
            write_chart(plans, args.chart)
        print(json.dumps([p.to_json() for p in plans]) if args.json else format_compare(plans))
        return 0
    if args.config_file:
        strategy = read_accelerate_config(args.config_file, precision)
        result = plan(shape, hardware, strategy, micro, seq, checkpointing, args.attn_implementation, host_ram, peft)
        print(json.dumps(result.to_json()) if args.json else format_plan(result))
        return 0
    global_batch = args.global_batch_size or recipe.get("global_batch_size")
    found = recommend(shape, hardware, global_batch, seq, precision or "bf16", host_ram=host_ram,
                      attn=args.attn_implementation, peft=peft)
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
