"""Context parallelism in the plan (accelerate_configs/fsdp_cp.yaml, shardtune.parallel.context): each GPU holds
1/cp of every row's positions, so its activations, logits and loss tiles are those of length / cp tokens with the
model's whole shape (every head, every position's hidden state), and no mask reaches the kernel. Beside them, for
one layer at a time, what torch's ring attention holds (ring_attention_bytes). The states are FSDP2's over every
GPU (dp_shard x cp)."""

from __future__ import annotations

from shardtune.models.flops import ModelShape
from shardtune.plan.activations import dtype_bytes

FP32_BYTES = 4


def context_length(length: int, masked: bool, cp: int) -> tuple[int, bool]:
    """(tokens per row on one GPU, masked) under a context split over `cp` GPUs: 1/cp of the positions, and no mask
    (the ring attention runs the causal kernel without one)."""
    return (length, masked) if cp == 1 else (length // cp, False)


def ring_attention_bytes(shape: ModelShape, rows: int, length: int, mode: str, cp: int, backward: bool = True
                         ) -> float:
    """What torch's ring attention holds beside the layer's own tensors at its peak, `length` being this GPU's
    positions (torch/distributed/tensor/experimental/_context_parallel/_attention.py): the key and value chunks of
    the whole row, all-gathered (accelerate's default cp_comm_strategy) beside this GPU's own concatenated for the
    gather, in the compute dtype; then in the backward the fp32 gradients it accumulates for this GPU's query, key
    and value, the key/value gradients it passes around the ring (fp32, one arriving, one leaving), each round's
    kernel gradients (compute dtype) and the flash kernel's own fp32 accumulator of the query's gradient; in a
    forward alone (`backward` false: eval) the fp32 output and log-sum-exp it merges the rounds into. 0 without the
    split."""
    if cp == 1:
        return 0.0
    compute, _ = dtype_bytes(mode)
    query = rows * length * shape.heads * shape.head_dim
    key_value = 2 * rows * length * shape.kv_heads * shape.head_dim
    gathered = compute * key_value * (cp + 1)
    if not backward:
        return float(gathered + FP32_BYTES * (query + rows * length * shape.heads))
    accumulated = FP32_BYTES * (2 * query + key_value) + 2 * FP32_BYTES * key_value
    return float(gathered + accumulated + compute * (query + key_value))
