"""The phases of a run, each with its own per-GPU peak: forward/backward, the optimizer step, eval and the final
save. A run's peak is the largest of them, not their sum (measured in tests/launch/test_memory_phases.py)."""

from __future__ import annotations

import dataclasses

from shardtune.flops import ModelShape
from shardtune.plan.activations import activation_mode, eval_activation_bytes
from shardtune.plan.buffers import buffers, persistent_buffer_bytes
from shardtune.plan.host import swap_buffer_bytes
from shardtune.plan.states import Peft, decay_tensors, deepspeed_sizes, parameter_sizes, persistent_elements
from shardtune.plan.strategy import DS_SUB_GROUP, Strategy

PHASES = ("forward_backward", "optimizer", "eval", "save")


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
    if strategy.offloads:
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


def host_step_bytes(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None) -> float:
    """The optimizer step's transient on the host: FSDP's CPUOffloadPolicy steps torch AdamW on host tensors, where
    it runs its per-tensor loop (foreach needs CUDA tensors). DeepSpeed's CPU Adam steps in place: nothing."""
    if strategy.kind != "fsdp" or strategy.offload_params == "none":
        return 0.0
    on_gpu = dataclasses.replace(strategy, offload_optimizer="none", offload_params="none")
    return optimizer_step_bytes(on_gpu, shape, world, peft, foreach=False)


def eval_gather_bytes(strategy: Strategy, shape: ModelShape) -> float:
    """Parameters gathered for the eval forward: FSDP's root unit (embedding, final norm, lm_head) stays gathered,
    one layer computes and one is prefetched, in the compute dtype (as in the training forward, see buffers);
    SHARD_GRAD_OP (reshard_after_forward False) keeps every layer it gathered until a backward that an eval never
    runs: the whole model. ZeRO-3 gathers a module's parameters and the prefetch bucket after them with one
    all-gather into one flat buffer, which lives until every parameter in it is released: two such buffers, the
    one computing and the next (measured on 3 ranks: two to four of them alive through the first eval forward,
    as the training trace's prefetches run ahead of the eval's modules)."""
    low = strategy.compute_bytes
    layer, root = shape.layer_params, shape.params - shape.layers * shape.layer_params
    if strategy.kind == "fsdp":
        return float((root + 2 * layer) * low if strategy.shard >= 3 else shape.params * low)
    if strategy.kind == "deepspeed" and strategy.shard >= 3:
        largest = max(numel for numel, _ in parameter_sizes(shape))
        return float(2 * (largest + min(deepspeed_sizes(strategy, shape)["prefetch_bucket"], shape.params)) * low)
    return 0.0


def save_gather_bytes(strategy: Strategy, shape: ModelShape, params: int, world: int,
                      export_bytes: int = 2) -> tuple[float, float]:
    """(GPU bytes, host bytes on the rank that holds most) of export.save_hf_model's accelerator.get_state_dict:
    - FSDP2: torch's get_model_state_dict(full_state_dict, cpu_offload): each parameter all-gathered in full on the
      GPU (the gathered tensor and its full copy: 2 x the largest, fp32), then copied to rank 0's host RAM (4P);
    - ZeRO-3: _zero3_consolidated_16bit_state_dict gathers module by module (the largest module's own weights:
      the embedding or lm_head), rank 0 keeping a host copy of each (16-bit, or fp32 in fp32 runs);
    - ZeRO-1/2: clone_tensors_for_torch_save copies the whole 16-bit module to every rank's host RAM;
    - an fp32 export (`export_bytes` 4) of a 16-bit DeepSpeed run also assembles the fp32 masters on the main
      process's host beside that state dict (export.deepspeed_master_weights);
    - DDP: the state dict is the live parameters; an export in another dtype casts each into a new tensor on the
      GPU (export.cast_floating), `export_bytes` x P in all.
    FSDP's state dict is cast on the host one tensor at a time (one copy plus one tensor: not counted)."""
    low = strategy.compute_bytes
    largest = max(rows * columns for rows, columns in decay_tensors(shape))
    if strategy.kind == "fsdp":
        return 2.0 * 4 * largest, 4.0 * params
    if strategy.kind == "deepspeed":
        masters = 4.0 * params if export_bytes == 4 and low == 2 else 0.0
        return (float(low * largest) if strategy.shard >= 3 else 0.0), float(low * params) + masters
    return (float(export_bytes * params) if export_bytes != 4 else 0.0), 0.0


def export_host_bytes(strategy: Strategy, shape: ModelShape, world: int, gpus_per_node: int,
                      peft: Peft | None = None, export_bytes: int = 2) -> float:
    """Host RAM per node of the final export's gathered state dict (save_gather_bytes), beside the run's resident
    host RAM: on the main process alone, except under ZeRO-1/2, where every rank copies the 16-bit module
    (the main process alone adds the fp32 masters of an fp32 export)."""
    _, on_host = save_gather_bytes(strategy, shape, shape.params, world, 4 if peft else export_bytes)
    if strategy.kind == "deepspeed" and strategy.shard < 3:
        module = float(strategy.compute_bytes * shape.params)
        return module * min(gpus_per_node, world) + (on_host - module)
    return on_host


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
    persistent = float(strategy.compute_bytes * persistent_elements(strategy, shape, peft)) \
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
