"""Model states per GPU (weights, gradients, optimizer states) and what is offloaded, as each strategy's code
stores them; the parameter layout that DeepSpeed's partitions, groups and sub-groups follow; LoRA's adapters."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardtune.models.flops import ModelShape
from shardtune.plan.optimizer_states import optimizer_state_bytes, parameter_matrices
from shardtune.plan.strategy import DS_MAX_LIVE_PARAMETERS, DS_SUB_GROUP, PlanError, Strategy

CHECKPOINT_SHARD_BYTES = 5e9  # Hugging Face checkpoints of large models come in shards of up to 5 GB
# QLoRA's NF4: 4 bits per weight plus double-quantized block constants (0.127 bits per weight, QLoRA paper).
NF4_BYTES = (4 + 0.127) / 8
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OFFLOADED_TO = {"cpu": "host", "nvme": "nvme"}  # offload device -> States field


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

    def adapter_matrices(self, shape: ModelShape) -> list[tuple[int, int]]:
        """(rows, columns) of every adapter matrix as torch holds it (A: rank x in, B: out x rank)."""
        sizes = self.adapter_sizes(shape)
        return [(self.rank, size // self.rank) if index % 2 == 0 else (size // self.rank, self.rank)
                for index, size in enumerate(sizes)]


@dataclass
class States:
    """Per GPU (weights, gradients, optimizer) and per rank on host RAM or NVMe."""

    weights: float
    gradients: float
    optimizer: float
    host: float = 0.0
    nvme: float = 0.0

    def offload(self, source: str, device: str, size: float) -> None:
        """Add `size` bytes where `device` ("cpu" or "nvme") keeps them, after they left `source` (set to 0)."""
        where = OFFLOADED_TO[device]
        setattr(self, where, getattr(self, where) + size)
        setattr(self, source, 0.0)


def peft_states(strategy: Strategy, shape: ModelShape, world: int, peft: Peft, optim: str = "adamw_torch"
                ) -> States:
    """The adapters train like a small full model (model_states of the trainable parameters: fp32 weights and
    Adam, DeepSpeed's 16-bit copy and master); the frozen base adds weights only, no gradient and no optimizer
    state, in 16 bits (4 in fp32 runs) or NF4, sharded where the strategy shards weights."""
    states = model_states(strategy, peft.trainable_params(shape), world, optim=optim,
                          matrices=peft.adapter_matrices(shape))
    per_param = NF4_BYTES if peft.load_in_4bit else strategy.compute_bytes
    sharded = strategy.kind == "fsdp" or (strategy.kind == "deepspeed" and strategy.shard >= 3)
    base = per_param * shape.params / (world if sharded else 1)
    if strategy.offload_params != "none" and sharded:
        states.host += base
    else:
        states.weights += base
    return states


@lru_cache(maxsize=64)  # the search plans one shape thousands of times; callers only read the list
def parameter_sizes(shape: ModelShape) -> list[tuple[int, bool]]:
    """(elements, weight-decayed) of every parameter of a dense decoder, in `model.parameters()` order: the
    order in which DeepSpeed fills each parameter group's sub-groups. Decayed as the trainer splits them
    (shardtune.levers.optimizers.param_groups: matrices decay, norms and biases do not)."""
    h = shape.hidden
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    sizes = [(shape.vocab * h, True)]
    layer = [(h * q_dim, True), *([(q_dim, False)] if shape.qkv_bias else []),
             (h * kv_dim, True), *([(kv_dim, False)] if shape.qkv_bias else []),
             (h * kv_dim, True), *([(kv_dim, False)] if shape.qkv_bias else []),
             (q_dim * h, True), *([(h, False)] if shape.o_bias else []), *[(norm, False) for norm in shape.qk_norms]]
    for rows, columns in shape.mlp_matrices():
        layer += [(rows * columns, True)] + ([(rows, False)] if shape.mlp_bias else [])
    sizes += (layer + [(h, False)] * shape.layer_norms) * shape.layers + [(h, False)]
    return sizes + ([] if shape.tied else [(shape.vocab * h, True)])


@lru_cache(maxsize=64)
def largest_parameter(shape: ModelShape) -> int:
    """Elements of the largest parameter (the embedding or lm_head for Llama)."""
    return max(numel for numel, _ in parameter_sizes(shape))


def largest_module(shape: ModelShape) -> int:
    """Elements of the largest leaf module, which ZeRO-3 gathers whole: the largest parameter, or a mixture of
    experts' packed experts (gate_up_proj and down_proj, one module)."""
    return max(largest_parameter(shape), shape.experts * 3 * shape.hidden * shape.intermediate)


@lru_cache(maxsize=64)  # as parameter_sizes
def decay_tensors(shape: ModelShape) -> list[tuple[int, int]]:
    """(rows, columns) of the matrices torch AdamW steps as one parameter group (the trainer's weight-decay group),
    in parameter order: embedding, per layer q, k, v, o, gate, up, down, then lm_head unless tied. Norm weights
    and biases, the other group, are far smaller."""
    h, q_dim, kv_dim = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layer = [(q_dim, h), (kv_dim, h), (kv_dim, h), (h, q_dim), *shape.mlp_matrices()]
    return [(shape.vocab, h), *layer * shape.layers] + ([] if shape.tied else [(shape.vocab, h)])


def largest_sub_group(strategy: Strategy, shape: ModelShape | None, params: int, world: int) -> float:
    """Elements of the largest ZeRO-3 optimizer sub-group of one rank (see sub_group_sizes). Without a shape
    (LoRA's adapters: many small matrices) the partition is taken as finely divisible: min(sub_group_size, P/N)."""
    sub_group = strategy.sub_group if strategy.sub_group is not None else DS_SUB_GROUP
    if shape is None or params != shape.params:
        return float(min(sub_group, -(-params // world)))
    return float(max(sub_group_sizes(strategy, parameter_sizes(shape), world)))


def sub_group_sizes(strategy: Strategy, sizes: list[tuple[int, bool]], world: int) -> list[int]:
    """Elements of every ZeRO-3 optimizer sub-group of one rank, from the trainable parameters' (elements,
    weight-decayed) in parameter order, as stage3.py `_create_fp16_sub_groups` cuts them: within each parameter
    group, partitions (ceil(numel / N) each) are added in order until the sum reaches sub_group_size."""
    sub_group = strategy.sub_group if strategy.sub_group is not None else DS_SUB_GROUP
    groups = []
    for decayed in (True, False):
        current = 0
        for numel, decay in sizes:
            if decay != decayed:
                continue
            current += -(-numel // world)
            if current >= sub_group:
                groups.append(current)
                current = 0
        if current:
            groups.append(current)
    return groups


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


def model_states(strategy: Strategy, params: int, world: int, shape: ModelShape | None = None,
                 optim: str = "adamw_torch", matrices: list[tuple[int, int]] | None = None,
                 bf16_stochastic_round: bool = False) -> States:
    """Bytes of weights, gradients and Adam states per GPU, as the code stores them. `shape` gives DeepSpeed's
    parameter groups and sub-groups and ZeRO-3's persistent parameters their real sizes (without it: P/N each).

    - DDP (accelerate's autocast): fp32 weights 4P + fp32 grads 4P + Adam m, v 8P = 16P. Autocast computes in
      16-bit but keeps the fp32 parameters, so their gradients are fp32 too.
    - DeepSpeed with bf16/fp16 converts the module to 16-bit; the ZeRO optimizer keeps fp32 master weights, m
      and v (12P/N). Gradients, as measured at the first step (tests/launch/test_memory_measured.py): ZeRO-1 holds the
      full 16-bit gradients until the reduction at the accumulation boundary (2P), at the step one group's fp32
      partition beside the whole gradients of the parameters its partition overlaps. With 16-bit weights the
      trainer accumulates ZeRO-2/3 gradients in fp32 (parallel.distributed.configure_deepspeed): ZeRO-2 reduces
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
      states on the host.
    - Another --optim (DDP and FSDP2 only; plan.optimizer_states): its own states, tensor by tensor over `matrices`
      (the trainable parameters' shapes; the model's from `shape` without them). `bf16_stochastic_round`: bf16
      weights and gradients (2P/N each) and no fp32 master anywhere, the states as torchao keeps them."""
    p, n = float(params), world
    if strategy.kind in ("ddp", "fsdp") and (optim != "adamw_torch" or bf16_stochastic_round):
        shards = n if strategy.kind == "fsdp" else 1
        weight_bytes = 2 if bf16_stochastic_round else 4
        tensors = matrices if matrices is not None else parameter_matrices(shape) if shape else [(params, 1)]
        states = States(weight_bytes * p / shards, weight_bytes * p / shards,
                        optimizer_state_bytes(optim, tensors, shards, weight_bytes, bf16_stochastic_round))
        if strategy.offload_params != "none":
            return States(0.0, 0.0, 0.0, host=states.weights + states.gradients + states.optimizer)
        return states
    if strategy.kind == "ddp":
        return States(4 * p, 4 * p, 8 * p)
    if strategy.kind == "fsdp":
        states = States(4 * p / n, 4 * p / n, 8 * p / n)
        if strategy.offload_params != "none":
            return States(0.0, 0.0, 0.0, host=states.weights + states.gradients + states.optimizer)
        return states
    low = strategy.compute_bytes  # bytes of the module's weights and gradients
    weights = low * p / n if strategy.shard >= 3 else low * p
    if strategy.shard >= 3:
        return _zero3_states(strategy, p, n, weights, largest_sub_group(strategy, shape, params, world))
    if strategy.shard == 2:  # fp32 accumulation: the reduced partition is the optimizer's gradient
        grads = 4 * p / n if strategy.half_precision else 4 * p / n + 4 * largest_group(shape, params, world)
    else:  # ZeRO-1: the full gradients after backward, or at the step one group's fp32 partition (built as in
        # ZeRO-2) beside the reduced partitions (`averaged_gradients`), views that keep the whole gradient of every
        # parameter overlapping the rank's partition alive: measured 3P at N = 2 and 2.27P at N = 3 in bf16
        grads = max(low * p, 4 * largest_group(shape, params, world) + low * overlapping_elements(shape, params, world))
    states = States(weights, grads, 12 * p / n)
    if strategy.offload_optimizer in OFFLOADED_TO:
        states.host += states.gradients + 4 * p / n  # the gradient partitions stay in host RAM, even with NVMe
        states.offload("optimizer", strategy.offload_optimizer, states.optimizer)
        states.gradients = 0.0
    if strategy.offload_params in OFFLOADED_TO and strategy.shard >= 3:
        states.offload("weights", strategy.offload_params, weights)
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


def _zero3_states(strategy: Strategy, p: float, n: int, weights: float, sub_group: float) -> States:
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
    if strategy.offload_optimizer in OFFLOADED_TO:
        states.host += 8 * p / n
        states.offload("optimizer", strategy.offload_optimizer, states.optimizer)
        states.gradients = 0.0
    if strategy.offload_params in OFFLOADED_TO:
        in_host = weights if strategy.offload_params == "cpu" else min(
            weights, strategy.compute_bytes * strategy.nvme_max_in_cpu)
        states.host += in_host
        states.nvme += weights - in_host
        states.weights = 0.0
    return states
