"""The phases of a run, each with its own per-GPU peak: forward/backward, the optimizer step, eval and the final
save. A run's peak is the largest of them, not their sum (measured in tests/launch/test_memory_phases.py)."""

from __future__ import annotations

import dataclasses

from shardtune.config import TORCHAO_OPTIMIZERS
from shardtune.models.flops import ModelShape
from shardtune.plan.activations import activation_mode, eval_activation_bytes
from shardtune.plan.buffers import buffers, gathered_layer_bytes, persistent_buffer_bytes
from shardtune.plan.context import ring_attention_bytes
from shardtune.plan.host import swap_buffer_bytes
from shardtune.plan.optimizer_states import local_elements, parameter_matrices, torchao_step_bytes
from shardtune.plan.states import (
    Peft,
    decay_tensors,
    deepspeed_sizes,
    largest_module,
    largest_parameter,
    persistent_elements,
)
from shardtune.plan.strategy import DS_SUB_GROUP, Strategy

PHASES = ("forward_backward", "optimizer", "eval", "save")
# shardtune.export.model.MAX_SHARD_SIZE ("5GB") in bytes, as huggingface_hub's parse_size_to_int reads it.
EXPORT_SHARD_BYTES = 5_000_000_000


def optimizer_step_bytes(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None = None,
                         foreach: bool = True, optim: str = "adamw_torch", stochastic: bool = False) -> float:
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
    ZeRO optimizer's own copies are not modelled. An offloaded step runs on the host: nothing on the GPU.
    torchao's optimizers (another `optim`, or `stochastic` rounding) step one tensor at a time: the largest local
    tensor's temporaries (optimizer_states.torchao_step_bytes)."""
    if strategy.offloads:
        return 0.0
    if strategy.kind != "deepspeed" and peft is None and (optim in TORCHAO_OPTIMIZERS or stochastic):
        shard = world if strategy.kind == "fsdp" else 1
        largest = max(local_elements(rows, columns, shard) for rows, columns in parameter_matrices(shape))
        return torchao_step_bytes(optim, stochastic, largest)
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


def host_step_bytes(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None,
                    optim: str = "adamw_torch", stochastic: bool = False) -> float:
    """The optimizer step's transient on the host: FSDP's CPUOffloadPolicy steps torch AdamW on host tensors, where
    it runs its per-tensor loop (foreach needs CUDA tensors). DeepSpeed's CPU Adam steps in place: nothing."""
    if strategy.kind != "fsdp" or strategy.offload_params == "none":
        return 0.0
    on_gpu = dataclasses.replace(strategy, offload_optimizer="none", offload_params="none")
    return optimizer_step_bytes(on_gpu, shape, world, peft, foreach=False, optim=optim, stochastic=stochastic)


def eval_gather_bytes(strategy: Strategy, shape: ModelShape) -> float:
    """Parameters gathered for the eval forward: FSDP's embedding, final norm and lm_head (the whole root) are
    counted. Under FULL_SHARD accelerate reshards an untied embedding after its forward, but while lm_head computes
    its unit holds its flat all-gather buffer beside the copied-out weights (measured with the profiler on CPU: twice
    the head's bytes live at the eval's peak, tests/launch/test_memory_phases.py), which the embedding's size
    stands for where the two have the vocabulary's size. One layer computes and one is prefetched, in the compute
    dtype (as in the training forward, see buffers);
    SHARD_GRAD_OP (reshard_after_forward False) keeps every layer it gathered until a backward that an eval never
    runs: the whole model. ZeRO-3 gathers a module's parameters and the prefetch bucket after them with one
    all-gather into one flat buffer, which lives until every parameter in it is released: two such buffers, the
    one computing and the next (measured on 3 ranks: two to four of them alive through the first eval forward,
    as the training trace's prefetches run ahead of the eval's modules)."""
    low = strategy.compute_bytes
    root = shape.params - shape.layers * shape.layer_params
    if strategy.kind == "fsdp":  # a layer's float8 weights gathered in 1 byte each (gathered_layer_bytes)
        layers = 2 if strategy.shard >= 3 else shape.layers
        return float(root * low + layers * gathered_layer_bytes(strategy, shape))
    if strategy.kind == "deepspeed" and strategy.shard >= 3:
        largest = largest_module(shape)
        return float(2 * (largest + min(deepspeed_sizes(strategy, shape)["prefetch_bucket"], shape.params)) * low)
    return 0.0


def export_shard_bytes(shape: ModelShape, export_bytes: int = 2) -> float:
    """The largest output shard of the final export (shardtune.export.model.write_streamed_shards): huggingface_hub's
    split_torch_state_dict_into_shards fills each shard up to EXPORT_SHARD_BYTES and gives a larger tensor a
    shard of its own; a model smaller than that is one shard."""
    largest = largest_parameter(shape)
    return float(max(min(EXPORT_SHARD_BYTES, export_bytes * shape.params), export_bytes * largest))


def save_gather_bytes(strategy: Strategy, shape: ModelShape, params: int, world: int,
                      export_bytes: int = 2, peft: Peft | None = None) -> tuple[float, float]:
    """(GPU bytes, host bytes on the main process) of export.save_hf_model. A full model streams: every rank
    gathers one tensor at a time, the main process casts it on the device and copies it to its host, which holds
    one output shard (export_shard_bytes) until it is written. On the GPU, beside the states, one tensor whole
    (the largest: the embedding or lm_head):
    - FSDP2: full_tensor() of the fp32 parameter, plus its cast;
    - ZeRO-3: the parameter gathered in the compute dtype (GatheredParameters), plus its cast; an fp32 export of
      a 16-bit run assembles a trained parameter's fp32 master instead (safe_get_full_fp32_param), no larger;
    - ZeRO-1/2 and DDP: the whole local parameter, cast into a new tensor where the export dtype differs;
    - under tensor parallelism, whatever the config (TP alone runs under DDP's): every parameter is a DTensor
      split or replicated over the tp group, so full_tensor() of the fp32 parameter, as under FSDP2.
    A PEFT model gathers its adapters alone, fp32, all of them on the main process's host (adapter_state_dict)."""
    low = strategy.compute_bytes
    largest = float(largest_parameter(shape))
    stored = 4 if strategy.kind in ("fsdp", "ddp") else low  # FSDP2 and DDP keep fp32 parameters
    dtensors = strategy.kind == "fsdp" or strategy.tensor_parallel > 1
    if dtensors or (strategy.kind == "deepspeed" and strategy.shard >= 3):
        gathered = stored * largest
    else:
        gathered = 0.0
    cast = export_bytes * largest if export_bytes != stored else 0.0
    if peft is not None:
        return gathered + cast, 4.0 * peft.trainable_params(shape)
    return gathered + cast, export_shard_bytes(shape, export_bytes)


def export_host_bytes(strategy: Strategy, shape: ModelShape, world: int, gpus_per_node: int,
                      peft: Peft | None = None, export_bytes: int = 2) -> float:
    """Host RAM per node of the final export beside the run's resident host RAM: on the main process alone,
    one output shard (a PEFT model: its adapters)."""
    return save_gather_bytes(strategy, shape, shape.params, world, 4 if peft else export_bytes, peft)[1]


def phase_bytes(strategy: Strategy, shape: ModelShape, world: int, forward_backward: dict[str, float],
                eval_batch: int, seq: int, peft: Peft | None = None, foreach: bool = True,
                host: float = 0.0, export_bytes: int = 2, attn: str = "sdpa", graph: float = 0.0,
                optim: str = "adamw_torch", stochastic: bool = False,
                peak_moment: dict[str, float] | None = None, eval_head_positions: int | None = None
                ) -> dict[str, dict]:
    """Per GPU, each phase's parts and total; `forward_backward` is the step's (model states, activations,
    buffers). Gradients are freed by the step (the trainer's zero_grad sets them to None), so eval and save hold
    the weights and optimizer states; DDP's gradients are views into its reducer's buckets, which stay, and
    ZeRO-3 keeps its gradient partitions allocated (ZeRO-1/2 free theirs with the step). Each phase also lists
    the host RAM one rank holds in it ("on_host", not in the GPU total): `host`, its offloaded states (FSDP's
    host gradients freed by the step), NVMe offload's pinned buffers, an optimizer step that runs on the host and
    the save's host copy. `graph`: what the last micro-batch's spent graph still holds while the optimizer steps.
    `peak_moment`: the gradients, activations and buffers of forward/backward's largest moment
    (backward_moments.forward_backward_parts), in place of `forward_backward`'s. `eval_batch` counts rows (a DPO
    eval's pairs twice) and `eval_head_positions` where the eval's head computes otherwise than in
    EVAL_CHUNK_POSITIONS per row (a DPO eval: preference.head_positions)."""
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
    gathered, saved_on_host = save_gather_bytes(strategy, shape, params, world, 4 if peft else export_bytes, peft)
    # ZeRO-3's persistent parameters, whole on every rank: released before the optimizer steps and gathered again
    # after it (stage3.py `_post_step`), so the step holds the larger of its transient and them.
    persistent = float(strategy.compute_bytes * persistent_elements(strategy, shape, peft)) \
        if strategy.kind == "deepspeed" and strategy.shard >= 3 else 0.0
    kept["persistent"] = persistent
    phases = {
        "forward_backward": {**forward_backward, **(peak_moment or {})},
        "optimizer": {**states, "buffers": kept["buffers"], "graph": graph,
                      "step": max(optimizer_step_bytes(strategy, shape, world, peft, foreach, optim, stochastic),
                                  persistent)},
        "eval": {**kept, "gathered": eval_gather_bytes(strategy, shape) + autocast_cache,
                 # under the sequence split (or context parallelism) each GPU runs its slice of the rows, without
                 # a mask
                 "activations": eval_activation_bytes(shape, eval_batch, seq // strategy.split_positions, mode,
                                                      attn != "flash" and strategy.split_positions == 1,
                                                      peft is not None and "up_proj" in peft.target_names(),
                                                      eval_head_positions)
                 + ring_attention_bytes(shape, eval_batch, seq // strategy.split_positions, mode,
                                        strategy.context_parallel, backward=False)},
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
    phases["optimizer"]["on_host"] += host_step_bytes(strategy, shape, world, peft, optim, stochastic)
    phases["save"]["on_host"] += saved_on_host
    return phases
