"""Tensor parallelism in the plan (shardtune.parallel.tensor): transformers' Llama plan splits q, k, v, gate and up
column-wise, o and down row-wise, the embedding over the vocabulary (the embedding_rowwise rule transformers adds to
the plan) and lm_head column-wise with its output gathered; the norms stay whole. So each GPU of a tp group holds
(the embedding's placements in a tp 2 x dp_shard 2 run: tests/launch/test_tp_embedding.py):

- the slices of the linear weights (attention and MLP projections, embedding, lm_head), which FSDP2 shards over the
  data-parallel ranks (world / tp), and the whole norms, sharded over those alone: the plan of the model's TP slice
  (sliced_shape) over world / tp GPUs gives both, with their gradients and optimizer states;
- 1/tp of the heads and of the MLP's intermediate width in every activation inside attention and the MLP (a
  column-wise output is split on that dimension), but the residual stream, the norms' activations, each layer's
  checkpointed input and the gathered logits (with their fp32 upcast in the loss) whole: transformers' sequence
  parallelism is not wired (activation_shape keeps the vocabulary);
- per row-wise linear an all-reduce of the layer's output in forward (o and down, the embedding's partial sums) and
  of a column-wise linear's input gradient in backward: one layer's hidden states of the micro-batch beside the
  partial sums (collective_bytes);
- whole-model host RAM and export: loading reads the checkpoint whole, one copy per node under RAM-efficient
  loading (fsdp_tp.yaml's), and the final export gathers whole tensors (whole_model_terms, whole_model_phases).

The training loss under TP is the plain one over the whole logits: the tiled loss runs as lm_head's forward, which
TP wraps (planner.plan plans the full logits)."""

from __future__ import annotations

from dataclasses import replace

from shardtune.models.flops import ModelShape
from shardtune.plan.activations import activation_mode, dtype_bytes, eval_activation_bytes
from shardtune.plan.host import checkpoint_page_cache_bytes, loading_host_bytes
from shardtune.plan.phases import save_gather_bytes
from shardtune.plan.states import Peft
from shardtune.plan.strategy import PlanError, Strategy

FIX = ("launch accelerate_configs/fsdp_tp.yaml with --parallelism_config_tp_size <GPUs per node> "
       "--parallelism_config_dp_shard_size <processes / tp_size>")


def tensor_parallel_problems(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None = None,
                             reference: str | None = None, liger: bool = False) -> list[str]:
    """What the launch and the trainer refuse with tensor parallelism over `world` GPUs
    (shardtune.parallel.tensor: checked_tensor_parallel, check_tensor_parallel, check_tensor_parallel_heads), one
    line each; [] without TP or where it runs."""
    tp = strategy.tensor_parallel
    if tp == 1:
        return []
    problems = []
    if strategy.kind == "deepspeed":
        problems.append(f"{strategy.name}: tensor parallelism (tp_size {tp}) runs under FSDP2 only: {FIX}.")
    elif tp < 1 or world % tp:
        problems.append(f"tp_size {tp} does not divide the {world} GPUs into groups: {FIX}.")
    elif strategy.kind == "ddp" and tp != world:
        problems.append(f"{strategy.name}: tp_size {tp} under DDP runs over every process ({world}), with no data "
                        f"parallelism beside it: {FIX}.")
    elif strategy.kind == "fsdp" and strategy.shard_group:
        problems.append(f"{strategy.name}: hybrid sharding (dp_replicate_size) with tensor parallelism is not "
                        f"wired: {FIX}.")
    elif strategy.kind == "fsdp" and world // tp < 2:
        problems.append(f"{strategy.name}: tp_size {tp} over {world} GPUs leaves dp_shard_size {world // tp}, and "
                        "FSDP2 needs a dp_shard axis of 2 or more: plan more GPUs, or a smaller tp_size.")
    for what, count in (("attention heads", shape.heads), ("key/value heads", shape.kv_heads)):
        if count % tp:
            problems.append(f"{shape.name} has {count} {what}, which tp_size {tp} does not divide: each GPU computes "
                            "whole heads.")
    if strategy.sequence_split > 1:
        problems.append("tensor parallelism beside the sequence split (sp_size) is not wired.")
    levers = {"--use_peft true": peft is not None, "--use_liger_kernel true": liger,
              "--mixed_precision fp8": strategy.float8, "--method dpo": reference is not None}
    problems += [f"{flag} under tensor parallelism (tp_size {tp}) is not wired: it replaces or rewrites the layers "
                 "that TP splits." for flag, on in levers.items() if on]
    return problems


def check_tensor_parallel_plan(strategy: Strategy, shape: ModelShape, world: int, peft: Peft | None = None,
                               reference: str | None = None, liger: bool = False) -> None:
    """Raise PlanError with tensor_parallel_problems, if any."""
    problems = tensor_parallel_problems(strategy, shape, world, peft, reference, liger)
    if problems:
        raise PlanError(" ".join(problems))


def sliced_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The model as one GPU of a tp group holds its parameters: 1/tp of the heads, the key/value heads, the MLP's
    intermediate width and the vocabulary (the embedding's and lm_head's rows), the hidden size and so the norms
    whole. Its parameter count is that GPU's slice; FSDP2 shards it over the data-parallel ranks."""
    if tp == 1:
        return shape
    return replace(shape, heads=shape.heads // tp, kv_heads=shape.kv_heads // tp,
                   intermediate=-(-shape.intermediate // tp), vocab=-(-shape.vocab // tp))


def activation_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The model as one GPU's activations see it: the sliced heads and MLP width, the whole vocabulary (lm_head's
    output is gathered: the logits are whole on every GPU of the group)."""
    return replace(sliced_shape(shape, tp), vocab=shape.vocab)


def collective_bytes(shape: ModelShape, rows: int, length: int, mode: str, tp: int) -> float:
    """The all-reduce of a row-wise linear's output (forward) or a column-wise linear's input gradient (backward),
    one at a time: one layer's hidden states of the micro-batch in the compute dtype, beside the partial sums it
    reduces. 0 without TP."""
    return float(dtype_bytes(mode)[0] * rows * length * shape.hidden) if tp > 1 else 0.0


def whole_model_phases(phases: dict[str, dict], strategy: Strategy, shape: ModelShape, eval_rows: int, seq: int,
                       attn: str, export_bytes: int, eval_head_positions: int | None = None) -> dict[str, dict]:
    """`phases` as phase_bytes planned them for the TP slice (sliced_shape), with what is whole on every GPU:
    the eval forward's residual stream and gathered logits chunk (activation_shape), its collective, and the
    final save's gather, which assembles each tensor whole (full_tensor over both axes)."""
    tp = strategy.tensor_parallel
    if tp == 1:
        return phases
    mode = activation_mode(strategy)
    eval_parts = phases["eval"]
    eval_acts = eval_activation_bytes(activation_shape(shape, tp), eval_rows, seq, mode, attn != "flash",
                                      head_positions=eval_head_positions)
    eval_acts += collective_bytes(shape, eval_rows, seq, mode, tp)
    eval_parts["total"] += eval_acts - eval_parts["activations"]
    eval_parts["activations"] = eval_acts
    gathered, on_host = save_gather_bytes(strategy, shape, shape.params, 1, export_bytes)
    _, sliced_on_host = save_gather_bytes(strategy, sliced_shape(shape, tp), shape.params, 1, export_bytes)
    save = phases["save"]
    save["total"] += gathered - save["gathered"]
    save["gathered"] = gathered
    save["on_host"] += on_host - sliced_on_host
    return phases


def whole_model_terms(host: dict[str, float], strategy: Strategy, shape: ModelShape, gpus_per_node: int,
                      export_bytes: int = 2, bf16_weights: bool = False) -> dict[str, float]:
    """`host` (host_ram_terms of the TP slice) with the terms that read or write the whole model: loading (the
    whole model: one copy per node under RAM-efficient loading, fsdp_tp.yaml's, where rank 0 reads and the others
    receive their slices; else one per process), the checkpoint's page cache, and the export's output shard of
    whole tensors."""
    if strategy.tensor_parallel == 1:
        return host
    return {**host, "model_loading": loading_host_bytes(strategy, shape.params, gpus_per_node,
                                                        bf16_weights=bf16_weights),
            "checkpoint_page_cache": checkpoint_page_cache_bytes(shape.params),
            "export": save_gather_bytes(strategy, shape, shape.params, 1, export_bytes)[1]}
