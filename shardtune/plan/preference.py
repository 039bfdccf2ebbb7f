"""What DPO (--method dpo) adds to a plan: a micro-batch of pairs runs as one forward of twice as many sequences
(the chosen rows, then the rejected), and the reference model, held one of three ways
(shardtune.methods.reference): "adapter" (the policy with its LoRA adapter off: no second model), "precomputed"
(its log-probs computed in one pass before training: nothing held while training) or "live" (a frozen copy in the
compute dtype, placed as the policy's strategy places it). The reference's forward runs under no_grad before the
policy's forward and backward: its activations are transient and it saves none. A reference of its own
(--ref_model_name_or_path) is planned in its own shape, live or loaded for the precomputing pass alone; the
policy's shape stands for the policy's own copy. Light like the rest of the planner (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.models.flops import ModelShape
from shardtune.plan.activations import activation_mode, batch_tensor_bytes, eval_activation_bytes
from shardtune.plan.buffers import persistent_buffer_bytes, resharded_after_forward
from shardtune.plan.layouts import hpz_secondary_bytes
from shardtune.plan.phases import eval_gather_bytes
from shardtune.plan.states import deepspeed_sizes, largest_module, persistent_elements
from shardtune.plan.strategy import Strategy

PAIR_SEQUENCES = 2  # a pair's chosen and rejected rows, run in one forward (shardtune.methods.dpo)


@dataclass
class ReferenceBytes:
    """One GPU's share of the live reference between its forwards (`gpu`), and what its placement puts on the
    host and NVMe instead (per rank)."""

    gpu: float = 0.0
    host: float = 0.0
    nvme: float = 0.0


def reference_whole(strategy: Strategy) -> bool:
    """Whether the live reference is a whole copy on every GPU: under DDP and ZeRO-1/2, whose reference engine is
    stage 0 (shardtune.methods.reference.prepare_reference, as TRL)."""
    return strategy.kind == "ddp" or (strategy.kind == "deepspeed" and strategy.shard < 3)


def reference_resident(strategy: Strategy, shape: ModelShape, world: int, mode: str | None) -> ReferenceBytes:
    """The live reference as it stays between its forwards, in the compute dtype (c bytes a parameter), P the
    reference's parameter count (`shape`: the reference's own, which is the policy's unless
    --ref_model_name_or_path names another model), N the GPUs the states are sharded over:
    - DDP, ZeRO-1/2: c·P, whole on every GPU.
    - ZeRO-3 (an engine of its own, no optimizer): its partition c·P/N (on the host or NVMe where the config
      offloads parameters), its persistent small parameters whole, and ZeRO++'s secondary copy where configured.
    - FSDP2 FULL_SHARD: the shard c·P/N (on the host under CPU offload) and the final norm and head, whose unit
      accelerate prepares with reshard_after_forward False: a reference never runs the backward that would
      reshard them, so they stay gathered from its first forward on.
    - FSDP2 SHARD_GRAD_OP (reshard_after_forward False everywhere): for the same reason every layer stays
      gathered: the shard and c·P.
    Nothing under "adapter" and "precomputed"."""
    if mode != "live":
        return ReferenceBytes()
    low, params = strategy.compute_bytes, shape.params
    if reference_whole(strategy):
        return ReferenceBytes(gpu=float(low * params))
    shard = low * params / world
    if strategy.kind == "deepspeed":
        held = low * persistent_elements(strategy, shape) + hpz_secondary_bytes(strategy, shape, world)
        if strategy.offload_params == "cpu":
            return ReferenceBytes(gpu=held, host=shard)
        if strategy.offload_params == "nvme":
            return ReferenceBytes(gpu=held, nvme=shard)
        return ReferenceBytes(gpu=held + shard)
    root = params - shape.layers * shape.layer_params
    gathered = low * (root - resharded_after_forward(shape)) if strategy.shard >= 3 else low * params
    if strategy.offload_params != "none":
        return ReferenceBytes(gpu=float(gathered), host=shard)
    return ReferenceBytes(gpu=gathered + shard)


def reference_gather_bytes(strategy: Strategy, shape: ModelShape, mode: str) -> float:
    """Parameters gathered while the reference's forward runs, beyond reference_resident: the adapter-off policy
    gathers as the policy's eval forward does (phases.eval_gather_bytes); a live reference under ZeRO-3 as well
    (its engine has the policy's JSON: the module computing and the prefetch bucket, twice), under FSDP2
    FULL_SHARD one layer computing and one prefetched and its embedding's own unit, in the compute dtype (the
    reference is not converted to float8); nothing more where it is whole or stays gathered."""
    if mode == "adapter":
        return eval_gather_bytes(strategy, shape)
    low = strategy.compute_bytes
    if reference_whole(strategy) or (strategy.kind == "fsdp" and strategy.shard < 3):
        return 0.0
    if strategy.kind == "deepspeed":
        prefetch = min(deepspeed_sizes(strategy, shape)["prefetch_bucket"], shape.params)
        return float(2 * (largest_module(shape) + prefetch) * low)
    return float(low * (2 * shape.layer_params + resharded_after_forward(shape)))


def head_positions(rows: int, seq: int, loss_tile: int | None) -> int:
    """Positions whose logits a DPO forward computes at once: tiles of `loss_tile` (config.LOSS_TILE_POSITIONS
    under --chunked_cross_entropy) over the micro-batch's flat positions, or all of them without the tiled loss
    (shardtune.methods.dpo.sequence_log_probs)."""
    return min(rows * seq, loss_tile) if loss_tile else rows * seq


def reference_forward_parts(strategy: Strategy, shape: ModelShape, mode: str, rows: int, seq: int, masked: bool,
                            loss_tile: int | None) -> dict[str, float]:
    """What the reference's forward over `rows` sequences holds beyond the states and reference_resident:
    gathered parameters (reference_gather_bytes) and its transient activations, those of a no_grad forward
    (activations.eval_activation_bytes; a live reference's residual stream in its compute dtype, the adapter-off
    policy's as the policy's), with the micro-batch's tensors (batch_tensor_bytes). No activation is saved."""
    policy_mode = activation_mode(strategy)
    forward_mode = policy_mode if mode == "adapter" or policy_mode == "fp32" else "half"
    acts = eval_activation_bytes(shape, rows, seq, forward_mode, masked,
                                 head_positions=head_positions(rows, seq, loss_tile))
    return {"gathered": reference_gather_bytes(strategy, shape, mode),
            "activations": acts + batch_tensor_bytes(rows, seq, mode == "adapter")}


def dpo_phases(phases: dict[str, dict], strategy: Strategy, shape: ModelShape, mode: str,
               reference: ReferenceBytes, gradients: float, optimizer_at_start: float, rows: int,
               precompute_rows: int, seq: int, masked: bool, loss_tile: int | None,
               reference_shape: ModelShape | None = None) -> dict[str, dict]:
    """`phases` (phases.phase_bytes of the policy at DPO's rows) with a live reference in every phase
    ("reference": reference_resident's GPU part, its host part in "on_host"), and DPO's own phases:
    - "reference_forward" (adapter, live): the step's reference forward, before the policy's: the states (the
      `gradients` a previous micro-batch left), the reference and reference_forward_parts. A step's measured peak
      is the larger of it and "forward_backward" (profiled_phase_totals).
    - "reference_precompute" (precomputed): the one pass over the train and eval pairs before the first step, a
      no_grad forward of the policy as loaded at `precompute_rows` sequences, holding what the eval holds but the
      optimizer states, which torch's optimizers make at their first step (`optimizer_at_start`: DeepSpeed's,
      made at start-up). The eval's reference forward (adapter, live) runs after the policy's, at the same rows
      and with no more gathered: the eval's own parts bound it.
    `reference_shape`: the model --ref_model_name_or_path names (None: the policy's shape). Live, it is what
    `reference` holds and what the reference's forward runs; precomputed, it is loaded for the pass alone, placed
    as a live one (`reference`, held in that phase only), and the pass is its forward."""
    held = {"reference": reference.gpu} if mode == "live" else {}
    for parts in phases.values():
        parts.update(held)
        parts["on_host"] += reference.host if mode == "live" else 0.0
    step_forward = phases["forward_backward"]
    if mode in ("adapter", "live"):
        phases["reference_forward"] = {
            "weights": step_forward["weights"], "gradients": gradients, "optimizer": step_forward["optimizer"],
            "buffers": persistent_buffer_bytes(strategy, shape), **held,
            **reference_forward_parts(strategy, reference_shape or shape, mode, rows, seq, masked, loss_tile),
            "on_host": step_forward["on_host"]}
    if mode == "precomputed" and reference_shape is not None:
        evaluation = phases["eval"]
        phases["reference_precompute"] = {
            **evaluation, "optimizer": optimizer_at_start, "reference": reference.gpu,
            **reference_forward_parts(strategy, reference_shape, "live", precompute_rows, seq, masked, loss_tile),
            "on_host": evaluation["on_host"] + reference.host}
    elif mode == "precomputed":
        evaluation = phases["eval"]
        pass_mode = activation_mode(strategy)
        phases["reference_precompute"] = {
            **evaluation, "optimizer": optimizer_at_start,
            "activations": eval_activation_bytes(shape, precompute_rows, seq, pass_mode, masked,
                                                 head_positions=head_positions(precompute_rows, seq, loss_tile))}
    for parts in phases.values():
        parts["total"] = float(sum(value for name, value in parts.items() if name not in ("total", "on_host")))
    return phases


def reference_advice(strategy: Strategy, mode: str | None, reference_gpu: float) -> str:
    """What to do where a whole live reference (DDP, ZeRO-1/2) does not fit, as a clause: '' for any other
    reference or strategy."""
    if mode != "live" or not reference_whole(strategy):
        return ""
    return (f"the live reference is a whole {reference_gpu / 1e9:,.1f} GB copy on every GPU under {strategy.name}: "
            "shard it with the policy (accelerate_configs/ds_zero3.yaml or fsdp_full_shard.yaml), precompute its "
            "log-probs (--precompute_ref_log_probs true), or train LoRA (--use_peft true: the base with the adapter "
            "off is the reference).")


def profiled_phase_totals(phases: dict[str, dict]) -> dict[str, float]:
    """Each phase's planned total per GPU under the names shardtune.profiling measures: a step's peak
    ("forward_backward") is the larger of the policy's forward/backward and the reference's forward before it;
    "reference_precompute" only where planned."""
    totals = {name: parts["total"] for name, parts in phases.items() if name != "reference_forward"}
    if "reference_forward" in phases:
        totals["forward_backward"] = max(totals["forward_backward"], phases["reference_forward"]["total"])
    return totals

