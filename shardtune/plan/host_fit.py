"""Host RAM per node: every term a run holds on a node's host, and the most demanding of the moments it holds
them in (loading, training, a resume, the final export)."""

from __future__ import annotations

from shardtune.models.flops import ModelShape
from shardtune.plan.host import (
    checkpoint_page_cache_bytes,
    loading_host_bytes,
    pinned_rounding_bytes,
    resume_host_bytes,
    staging_host_bytes,
    swap_buffer_bytes,
)
from shardtune.plan.phases import export_host_bytes
from shardtune.plan.states import Peft
from shardtune.plan.strategy import Strategy


def host_ram_terms(strategy: Strategy, shape: ModelShape, world: int, gpus_per_node: int, states_host: float,
                   peft: Peft | None = None, async_save: bool = False, save_only_model: bool = False,
                   export_bytes: int = 2, bf16_weights: bool = False) -> dict[str, float]:
    """Each host-RAM term per node: `states_host` is one rank's offloaded states (States.host); `bf16_weights`:
    the model loads and trains in bf16 (--bf16_stochastic_round)."""
    params = shape.params
    trainable = peft.trainable_params(shape) if peft else params
    local = gpus_per_node
    return {
        "offloaded_states": states_host * local,
        "swap_buffers": swap_buffer_bytes(strategy, shape, trainable, world) * local,
        "pinned_rounding": pinned_rounding_bytes(strategy, shape, world, peft) * local,
        "model_loading": loading_host_bytes(strategy, params, local, peft, bf16_weights),
        "checkpoint_page_cache": checkpoint_page_cache_bytes(params),
        "checkpoint_staging": (staging_host_bytes(strategy, params, world, local, save_only_model)
                               if async_save else 0.0),
        "resume": resume_host_bytes(strategy, shape, trainable, world) * min(local, world),
        "export": export_host_bytes(strategy, shape, world, local, peft, export_bytes),
    }


def host_ram_peak(host: dict[str, float]) -> float:
    """Host RAM per node at the most demanding of a run's moments, from host_ram_terms: the weights loading
    (before anything else is resident); training (offloaded states, pinned swap buffers, the pinned allocator's
    rounding, the --async_save staging copy); a live DPO reference loading (after the policy: beside its resident
    terms, "reference_loading"); a resume (the same before any staging copy, plus the moment
    tensor it copies off the mapped checkpoint); the final export (training's, plus one output shard)."""
    resident = host["offloaded_states"] + host["swap_buffers"] + host["pinned_rounding"]
    resident += host.get("offloaded_activations", 0.0)  # --activation_offloading's pinned activations
    # A live DPO reference loads once the policy is prepared: beside the policy's resident terms, not its load;
    # its own offloaded partitions are what it loads into.
    loading_reference = resident + host.get("reference_loading", 0.0)
    resident += host.get("reference_offloaded", 0.0)
    training = resident + host["checkpoint_staging"]
    return max(host["model_loading"], loading_reference, training, resident + host["resume"],
               training + host["export"])
