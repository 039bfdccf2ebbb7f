"""The memory plan of one run: per GPU the largest of its phases, per node the host RAM, against what the
hardware leaves usable. All sizes are bytes; GB in output is 1e9 bytes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from shardtune.config import LOSS_TILE_POSITIONS, OFFLOADING_NEEDS_RECOMPUTATION, OFFLOADING_UNDER_DEEPSPEED_OFFLOAD
from shardtune.models.flops import ModelShape
from shardtune.plan.activations import (
    activation_bytes,
    activation_mode,
    dtype_bytes,
    offloaded_host_bytes,
    recomputed_layers,
)
from shardtune.plan.backward_moments import (
    ddp_bucket_bytes,
    forward_backward_parts,
    gradients_fresh_each_micro_batch,
)
from shardtune.plan.buffers import buffers, freed_under_layer_gradients
from shardtune.plan.context import context_length, ring_attention_bytes
from shardtune.plan.hardware import Hardware
from shardtune.plan.host import loading_host_bytes
from shardtune.plan.host_fit import host_ram_peak, host_ram_terms
from shardtune.plan.layouts import hpz_secondary_bytes
from shardtune.plan.phases import phase_bytes
from shardtune.plan.preference import (
    PAIR_SEQUENCES,
    dpo_phases,
    head_positions,
    reference_advice,
    reference_resident,
    reference_whole,
)
from shardtune.plan.states import Peft, model_states, peft_states
from shardtune.plan.strategy import PlanError, Strategy
from shardtune.plan.tensor import (
    activation_shape,
    check_tensor_parallel_plan,
    collective_bytes,
    sliced_shape,
    whole_model_phases,
    whole_model_terms,
)

GiB = 1024**3
# Headroom kept free on every GPU: the CUDA context and NCCL's communicator buffers (about 0.5-1 GiB each on an
# 8-GPU node), and the caching allocator's fragmentation (reserved minus allocated: typically 5-10% of a training
# step's peak). A plan fits when its peak of live tensor bytes stays below what is left.
GPU_FIXED_RESERVE = 2 * GiB
GPU_HEADROOM_FRACTION = 0.10
# Host RAM kept free on every node: the OS, the page cache that loading reads through, dataloader workers.
HOST_HEADROOM_FRACTION = 0.10


def usable_capacity(hardware: Hardware) -> int:
    """Bytes per GPU a plan may use: the GPU's memory less GPU_FIXED_RESERVE and GPU_HEADROOM_FRACTION. The
    planner CLI and a launch read a GPU's memory by one rule (hardware.nominal_gpu_memory)."""
    return int(hardware.gpu_memory * (1 - GPU_HEADROOM_FRACTION) - GPU_FIXED_RESERVE)


def usable_host_ram(hardware: Hardware) -> float:
    """Host RAM per node a plan may use: the node's RAM less HOST_HEADROOM_FRACTION."""
    return hardware.host_ram_per_node * (1 - HOST_HEADROOM_FRACTION)


def gb(value: float) -> str:
    return f"{value / 1e9:,.1f} GB"


@dataclass
class MemoryPlan:
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
    optim: str
    bf16_stochastic_round: bool
    activation_mode: str
    chunked_cross_entropy: bool
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
    gradient_checkpointing_mode: str = "full"
    gradient_checkpointing_interval: int = 1  # every k-th layer recomputed
    activation_offloading: bool = False
    layout: str = ""  # how the states lie over the GPUs (Strategy.layout)
    tensor_parallel: int = 1  # each layer split over this many GPUs (plan.tensor); data parallel: world / it
    gradient_accumulation_steps: int | None = None
    # Planned memory-neutral: a compiled layer saves only what its backward graph reads, at most eager's
    # activations (measured 12.6% below eager's forward/backward peak, docs/planner.md): eager's bytes bound it.
    torch_compile: bool = False
    use_liger_kernel: bool = False  # Liger's layers and fused loss (activations.py's `liger` terms)
    # --method dpo: micro_batch counts pairs, each two sequences; the reference's mode (preference.py), "" for SFT.
    method: str = "sft"
    reference_mode: str = ""
    reference_layout: str = ""  # a live reference's: "whole on every GPU" or "sharded as the policy"
    reference_advice: str = ""  # what to change where a whole live reference is what does not fit (a note too)
    # A reference model of its own (--ref_model_name_or_path): its name and parameter count; "" and 0 otherwise.
    reference_model: str = ""
    reference_params: int = 0

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_ram_fits

    def binding_limit(self) -> str:
        """What stops this plan, as a phrase: '' when it fits."""
        limits = []
        if not self.gpu_fits:
            limits.append(f"GPU memory ({gb(self.per_gpu['total'])} planned per GPU, {gb(self.capacity)} usable)")
        if not self.host_ram_fits:
            limits.append(f"host RAM ({gb(self.host_ram_per_node)} planned per node, "
                          f"{gb(self.host_ram_capacity)} usable)")
        return " and ".join(limits)

    def to_json(self) -> dict:
        return {**asdict(self), "fits": self.fits}


def sequence_split(shape: ModelShape, length: int, masked: bool, split: int) -> tuple[ModelShape, int, bool]:
    """(shape, tokens per row, masked) of one GPU's activations under a sequence split over `split` GPUs (Ulysses,
    shardtune.parallel.sequence): each holds 1/split of every row's positions; around attention, the whole row
    for 1/split of the heads, which is as many bytes per head and position, except the key/value heads, replicated
    up to `split` where there are fewer (DeepSpeed's kv_replication_factor); and no dense mask reaches the kernel
    (Ulysses drops it). The parameters are the model's: only the activation terms take the returned shape."""
    if split == 1:
        return shape, length, masked
    return replace(shape, kv_heads=max(shape.kv_heads, split)), length // split, False


def with_output_copies(acts: dict[str, int], shape: ModelShape, rows: int, length: int, mode: str,
                       checkpointing: bool, recomputed: int) -> dict[str, int]:
    """`acts` with what the sequence split adds per layer: o_proj's input is the attention output exchanged back
    to this GPU's positions (a copy, c·n·heads·head_dim), saved beside SDPA's own output, which unsplit o_proj
    reads in place. Saved by every layer that is not recomputed, and by the one being recomputed."""
    compute, _ = dtype_bytes(mode)
    copy = compute * rows * length * shape.heads * shape.head_dim
    saved = copy * (shape.layers - recomputed if checkpointing else shape.layers)
    transient = copy if checkpointing else 0
    return {**acts, "saved": acts["saved"] + saved, "layer": acts["layer"] + transient,
            "transient": max(acts["loss"], acts["layer"] + transient),
            "total": acts["saved"] + saved + max(acts["loss"], acts["layer"] + transient)}


def plan(shape: ModelShape, hardware: Hardware, strategy: Strategy, micro_batch: int = 1, seq: int = 4096,
         checkpointing: bool = True, attn: str = "sdpa", peft: Peft | None = None,
         packing: bool = False, async_save: bool = False, save_only_model: bool = False, eval_batch: int = 8,
         foreach: bool = True, export_bytes: int = 2, checkpointing_mode: str = "full",
         activation_offloading: bool = False, chunked_cross_entropy: bool = False, optim: str = "adamw_torch",
         bf16_stochastic_round: bool = False, gradient_accumulation_steps: int | None = None,
         torch_compile: bool = False, use_liger_kernel: bool = False, checkpointing_interval: int = 1,
         reference: str | None = None, reference_shape: ModelShape | None = None) -> MemoryPlan:
    """Per-GPU memory of a run, the largest of its phases (forward/backward, optimizer step, eval at
    `eval_batch` rows, final gather and save; see phase_bytes), and host RAM per node (the hardware's, less
    headroom). per_gpu's components are the forward/backward phase's. `export_bytes`: bytes per parameter of the
    final export (bf16, the Llama checkpoints' dtype, unless --save_dtype says otherwise). `foreach`: torch
    AdamW's CUDA default; False plans its per-tensor loop (the CPU default). Runs in microseconds: nothing is
    built or loaded. With `peft`, activations are the base model's (LoRA's rank-r intermediates and dropout
    copies are not counted). `attn`: "sdpa", "eager" or "flash" (config.PLANNED_ATTENTION). With `packing` a
    training micro-batch is one row of micro_batch x seq tokens (DataCollatorWithFlattening); eval batches are
    padded. `checkpointing_mode` "selective" keeps what shardtune.model.selective_policy saves per layer;
    `activation_offloading` moves the layers' inputs to pinned host RAM (activations.offloaded_host_bytes); it
    needs `checkpointing`.
    `chunked_cross_entropy`: the training loss over tiles of LOSS_TILE_POSITIONS positions (the recipe's
    default, which plan_recipe passes), not over the micro-batch's full logits; the recommendation's search plans
    the full logits only where the recipe turns the tiled loss off. `optim`: the recipe's --optim, whose
    optimizer states model_states plans; `bf16_stochastic_round`: bf16 weights and gradients, no fp32 master.
    `gradient_accumulation_steps`: micro-batches per step; at 1 on one process no gradient exists when a backward
    starts (backward_moments), above 1 under DDP over several ranks its buckets hold a second copy of the gradients
    (ddp_bucket_bytes), unknown (None) is planned as accumulating. `torch_compile` is recorded and planned
    as eager (MemoryPlan.torch_compile). `use_liger_kernel`: Liger's RMSNorm and SwiGLU in the layers and its fused
    linear cross-entropy in place of the tiles, which it needs (chunked_cross_entropy). `checkpointing_interval`:
    with `checkpointing`, every k-th layer recomputed (activations.recomputed_layers), the others saving all.
    `reference`: a DPO run's reference mode (shardtune.config.reference_mode; None: SFT): `micro_batch` and
    `eval_batch` are pairs, each two padded sequences (never packed), and the reference is planned as its mode holds
    it (preference.dpo_phases); `reference_shape`: the shape of the model --ref_model_name_or_path names, live or
    loaded for the precomputing pass (None: the reference is the policy's model, in the policy's shape)."""
    params = shape.params
    tp = strategy.tensor_parallel
    check_tensor_parallel_plan(strategy, shape, hardware.world_size, peft, reference, use_liger_kernel)
    if tp > 1:  # the plain loss over the whole logits: the tiled loss runs as lm_head's forward, which TP wraps
        chunked_cross_entropy = False
    if use_liger_kernel and not chunked_cross_entropy:
        raise PlanError("--use_liger_kernel replaces the tiled loss with Liger's fused loss: it needs "
                        "--chunked_cross_entropy true.")
    if use_liger_kernel and checkpointing and checkpointing_mode == "selective":
        raise PlanError("--use_liger_kernel's RoPE rotates q_proj's output in place, which selective checkpointing "
                        "keeps: plan --gradient_checkpointing_mode full.")
    if strategy.kind == "deepspeed" and (optim != "adamw_torch" or bf16_stochastic_round):
        raise PlanError(f"{strategy.name}: DeepSpeed steps its own fp32 master partitions with adamw_torch; "
                        f"--optim {optim} and --bf16_stochastic_round run under DDP or FSDP only.")
    if strategy.float8 and (not strategy.takes_float8 or peft):
        raise PlanError("--mixed_precision fp8 trains full fine-tuning under FSDP2 without offload or DDP: use "
                        "fsdp_full_shard, fsdp_shard_grad_op, fsdp_hybrid_shard or ddp.")
    if bf16_stochastic_round and (strategy.mixed_precision != "bf16" or peft):
        raise PlanError("--bf16_stochastic_round trains bf16 weights: full fine-tuning with --mixed_precision bf16.")
    if activation_offloading and not (checkpointing and checkpointing_interval == 1):
        raise PlanError(OFFLOADING_NEEDS_RECOMPUTATION)
    if activation_offloading and strategy.kind == "deepspeed" and strategy.offloads:
        raise PlanError(OFFLOADING_UNDER_DEEPSPEED_OFFLOAD)
    # Every term below is per GPU over the GPUs the states are sharded over: all of them, or under hybrid
    # sharding one replica's (its own copy of everything, as if the job were that replica alone).
    # Under TP the states are the plan of each GPU's slice (plan.tensor.sliced_shape) over the data-parallel ranks.
    world = strategy.sharded_over(hardware.world_size) // tp
    whole, shape = shape, sliced_shape(shape, tp)
    mode = activation_mode(strategy)
    states = peft_states(strategy, shape, world, peft, optim) if peft else \
        model_states(strategy, shape.params, world, shape, optim, bf16_stochastic_round=bf16_stochastic_round)
    secondary = hpz_secondary_bytes(strategy, shape, world, peft)  # ZeRO++ hpZ: beside the primary partitions
    if strategy.offload_params in ("cpu", "nvme"):  # made on the partitions' device (remote_device)
        states.host += secondary
    else:
        states.weights += secondary
    pair = PAIR_SEQUENCES if reference else 1
    rows, length = (1, micro_batch * seq) if packing and not reference else (micro_batch * pair, seq)
    masked = attn != "flash"  # SDPA and eager get a dense mask: a padded batch's, or a packed row's block-diagonal
    # Activations are those of this GPU's tokens, with the model's shape as its attention sees them (sequence_split).
    # Under TP: 1/tp of the heads and the MLP width, the residual stream and logits whole (plan.tensor).
    seen, length, masked = sequence_split(activation_shape(whole, tp), length, masked, strategy.sequence_split)
    length, masked = context_length(length, masked, strategy.context_parallel)  # torch's ring attention
    lora = (peft.rank, tuple(peft.target_names())) if peft else (0, ())
    selective = checkpointing and checkpointing_mode == "selective"
    loss_tile = LOSS_TILE_POSITIONS if chunked_cross_entropy else None
    recomputed = recomputed_layers(shape.layers, checkpointing_interval)
    acts = activation_bytes(seen, rows, length, mode, checkpointing, attn, masked, peft is not None, selective,
                            *lora, offloading=activation_offloading, loss_tile=loss_tile, liger=use_liger_kernel,
                            recomputed=recomputed)
    if strategy.sequence_split > 1:
        acts = with_output_copies(acts, seen, rows, length, mode, checkpointing, recomputed)
    buffer = buffers(strategy, shape, params, world, mode, peft, bf16_stochastic_round)
    buffer -= freed_under_layer_gradients(strategy, shape, rows, length, mode, attn, masked, peft,
                                          bf16_stochastic_round, use_liger_kernel)
    buffer += collective_bytes(whole, rows, length, mode, tp)
    buffer += ring_attention_bytes(seen, rows, length, mode, strategy.context_parallel)
    per_gpu = {"weights": states.weights, "gradients": states.gradients, "optimizer": states.optimizer,
               "activations": float(acts["total"]), "buffers": float(buffer)}
    cache = buffer if strategy.kind == "ddp" else 0.0  # DDP's buffers are autocast's weight copies alone
    fresh = tp == 1 and gradients_fresh_each_micro_batch(strategy.kind, world, gradient_accumulation_steps)
    buckets = ddp_bucket_bytes(strategy.kind, world, gradient_accumulation_steps, states.gradients) if tp == 1 \
        else 0.0
    peak_moment = forward_backward_parts(seen, rows, length, mode, checkpointing, acts, states.gradients, cache,
                                         buffer - cache, fresh, attn, masked, peft, selective, loss_tile,
                                         use_liger_kernel, recomputed, buckets)
    # With recomputation peft makes the embedding output require grad (enable_input_require_grads): a leaf of the
    # loss's graph, which then holds it and its gradient; accelerate steps DeepSpeed's engine inside backward, while
    # that graph is alive (the trainer drops it before stepping any other strategy).
    graph = 2.0 * dtype_bytes(mode)[1] * rows * length * shape.hidden \
        if peft and checkpointing and strategy.kind == "deepspeed" else 0.0
    eval_split_seq = seq // strategy.split_positions
    phases = phase_bytes(strategy, shape, world, per_gpu, eval_batch * pair, seq, peft, foreach, states.host,
                         export_bytes, attn, graph, optim, bf16_stochastic_round, peak_moment,
                         head_positions(eval_batch * pair, eval_split_seq, loss_tile) if reference else None)
    phases = whole_model_phases(phases, strategy, whole, eval_batch * pair, eval_split_seq, attn, export_bytes)
    # A named reference loaded for the precomputing pass is placed as a live one, and freed after it.
    named = reference_shape if reference in ("live", "precomputed") else None
    resident = reference_resident(strategy, named or shape, world, "live" if named else reference)
    if reference:
        phases = dpo_phases(phases, strategy, shape, reference, resident, 0.0 if fresh else states.gradients,
                            states.optimizer if strategy.kind == "deepspeed" else 0.0, rows,
                            pair * max(micro_batch, eval_batch), length, masked, loss_tile, named)
        states.nvme += resident.nvme
    peak_phase = max(phases, key=lambda name: phases[name]["total"])
    per_gpu["total"] = phases[peak_phase]["total"]
    host = host_ram_terms(strategy, shape, world, hardware.gpus_per_node, states.host, peft, async_save,
                          save_only_model, export_bytes, bf16_stochastic_round)
    host = whole_model_terms(host, strategy, whole, hardware.gpus_per_node, export_bytes, bf16_stochastic_round)
    if reference == "live" or named:  # loaded after the policy is prepared, like it (16-bit, a copy a process or node)
        host["reference_loading"] = loading_host_bytes(strategy, named.params if named else params,
                                                       hardware.gpus_per_node, bf16_weights=True)
        host["reference_offloaded"] = resident.host * hardware.gpus_per_node
    if activation_offloading:
        host["offloaded_activations"] = hardware.gpus_per_node * offloaded_host_bytes(shape, rows, length, mode)
    capacity = usable_capacity(hardware)
    notes = []
    if strategy.kind == "ddp" and mode == "autocast":
        notes.append("DDP autocast: 16-bit weight copies cached during forward are counted in the buffers of "
                     "forward/backward and eval")
    if tp > 1:
        notes.append(f"tensor parallel over {tp} GPUs: the loss is the plain one over the whole logits (the tiled "
                     "loss is not used under TP)")
    # Refused with what to change where a whole live reference is what does not fit the GPUs.
    binding_reference = per_gpu["total"] > capacity >= per_gpu["total"] - resident.gpu
    advice = reference_advice(strategy, reference, resident.gpu) if binding_reference else ""
    notes += [advice] if advice else []
    return MemoryPlan(
        model=shape.name, hardware=hardware.name, config=strategy.name, params=params,
        trainable_params=peft.trainable_params(shape) if peft else params, world_size=hardware.world_size,
        micro_batch=micro_batch, max_seq_length=seq, gradient_checkpointing=checkpointing,
        mixed_precision=strategy.mixed_precision, optim=optim, bf16_stochastic_round=bf16_stochastic_round,
        activation_mode=mode,
        chunked_cross_entropy=chunked_cross_entropy, per_gpu=per_gpu,
        host_ram_per_node=host_ram_peak(host), host_ram=host,
        nvme_per_node=states.nvme * hardware.gpus_per_node,
        capacity=capacity, gpu_fits=per_gpu["total"] <= capacity, host_ram_capacity=usable_host_ram(hardware),
        host_ram_fits=host_ram_peak(host) <= usable_host_ram(hardware), notes=notes,
        phases=phases, peak_phase=peak_phase,
        gradient_checkpointing_mode=checkpointing_mode if checkpointing else "full",
        gradient_checkpointing_interval=checkpointing_interval if checkpointing else 1,
        activation_offloading=activation_offloading, layout=strategy.layout(hardware.world_size),
        tensor_parallel=tp,
        gradient_accumulation_steps=gradient_accumulation_steps, torch_compile=torch_compile,
        use_liger_kernel=use_liger_kernel, method="dpo" if reference else "sft", reference_mode=reference or "",
        reference_layout=("whole on every GPU" if reference_whole(strategy) else "sharded as the policy")
        if reference == "live" else "", reference_advice=advice,
        reference_model=named.name if named else "", reference_params=named.params if named else 0,
    )
