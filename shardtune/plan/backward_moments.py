"""The forward/backward phase's peak, moment by moment: what gradients, activations and autocast weight copies
are alive together at each moment of a micro-batch's forward and backward, the phase's peak being the largest.

A step's gradients exist before its backward where the step accumulates (the earlier micro-batches' gradients
stay) or where a strategy keeps them allocated (DDP's buckets on several ranks). One process that steps after
every micro-batch frees its gradients at each step (the trainer's and a plain loop's zero_grad set them to None):
its backward then creates them while it frees the activations, lm_head's first and the embedding's last, so the
full gradients never meet the full activations (measured in tests/unit/plan/test_plan_accuracy.py).

DDP over several ranks that accumulates holds the gradients twice: its reducer's all-reduce buckets stay allocated
(the gradients are views into them, gradient_as_bucket_view) while the step's zero_grad sets the views to None,
and a micro-batch under accelerate's no_sync runs no reducer hook, so autograd accumulates its gradients into
tensors of their own; only the synchronising micro-batch copies them into the buckets (reducer.cpp
`mark_variable_ready_dense`) and frees them, as its backward goes (measured: tests/launch/test_moe.py)."""

from __future__ import annotations

from shardtune.models.flops import ModelShape
from shardtune.plan.activations import (
    dtype_bytes,
    layer_activation_bytes,
    liger_loss_transient_bytes,
    loss_transient_bytes,
    recompute_held_bytes,
    selective_layer_bytes,
)
from shardtune.plan.states import Peft


def gradients_fresh_each_micro_batch(kind: str, world: int, accumulation: int | None) -> bool:
    """Whether no gradient exists when a micro-batch's backward starts: one process (no DDP buckets to keep them)
    stepping after every micro-batch. An unknown accumulation (None) is planned as accumulating."""
    return kind == "ddp" and world == 1 and accumulation == 1


def ddp_bucket_bytes(kind: str, world: int, accumulation: int | None, gradients: float) -> float:
    """DDP's all-reduce buckets alive beside the accumulated gradients (module docstring): over several ranks
    with more than one micro-batch per step (None: planned as accumulating); else 0 (one micro-batch's backward
    copies each gradient into its bucket as it is made, and frees it)."""
    return gradients if kind == "ddp" and world > 1 and accumulation != 1 else 0.0


def forward_backward_parts(shape: ModelShape, batch: int, seq: int, mode: str, checkpointing: bool,
                           acts: dict[str, int], gradients: float, cache: float, other_buffers: float,
                           fresh: bool, attn: str = "sdpa", masked: bool = True, peft: Peft | None = None,
                           selective: bool = False, loss_tile: int | None = None, liger: bool = False,
                           recomputed: int | None = None, buckets: float = 0.0) -> dict[str, float]:
    """The parts ("gradients", "activations", "buffers") of the forward/backward's largest moment, from
    activation_bytes' `acts`, the step's `gradients` bytes, autocast's 16-bit weight copies (`cache`, DDP's
    buffers) and the strategy's `other_buffers`, alive throughout. The moments:
    - the loss's forward: everything saved, the logits and their upcast; autocast caches every weight copy while
      its context is open (torch clears the cache as it exits, before the backward);
    - the loss's backward: everything saved and the two fp32 logits gradients; of the copies, those the graph
      saved (with recomputation only lm_head's: the checkpointed layers' graphs were dropped);
    - the top layer's backward: everything saved and the layer's backward (layer_backward_bytes); fresh
      gradients: lm_head's and the layer's own (counted whole);
    - the bottom layer's backward: fresh gradients all but the embedding's; one layer's saved activations, its
      backward, the closures' mask and RoPE tables, the incoming gradient of the residual stream and the ids;
    - the end: every gradient, the embedding's incoming gradient and the ids.
    Where gradients are not `fresh`, all of them are alive at every moment. With `liger` the loss is Liger's
    (liger_loss_transient_bytes), and the weight gradient it saved has been handed to lm_head before the layers'
    backward ("head_gradient": counted as a gradient from then on). With checkpointing of only `recomputed` layers
    (default all), the others' graphs keep their weight copies to their backward, as without recomputation.
    `buckets` (ddp_bucket_bytes): DDP's buckets beside the gradients at every moment, counted with them."""
    compute, residual = dtype_bytes(mode)
    n, h = batch * seq, shape.hidden
    frozen = peft is not None
    per_element = gradients / (peft.trainable_params(shape) if peft else shape.params)
    layer_grads = per_element * (peft.trainable_params(shape) / shape.layers if peft else shape.layer_params)
    head_grads = 0.0 if peft else per_element * (shape.vocab * h + h)
    embedding_grads = 0.0 if peft else per_element * shape.vocab * h
    head_copy = 2.0 * shape.vocab * h if cache and not peft else 0.0
    layer_copy = (cache - head_copy) / shape.layers
    recomputed = shape.layers if recomputed is None else recomputed
    kept_whole = shape.layers - recomputed if checkpointing else 0  # layers that save all they save without
    saved_copies = head_copy + kept_whole * layer_copy if checkpointing else cache
    stream = residual * n * h + 8 * n  # the residual stream's incoming gradient, and the ids the embedding saved
    if checkpointing:
        one_layer_saved = residual * n * h + (selective_layer_bytes(shape, batch, seq, mode, attn) if selective
                                              else 0)
        one_layer_saved += recompute_held_bytes(shape, batch, seq, mode, attn, masked)
    else:
        one_layer_saved = layer_activation_bytes(shape, batch, seq, mode, attn, masked, frozen, liger)
    saved = acts["saved"]

    def loss(moment: str) -> int:
        return liger_loss_transient_bytes(shape, n, mode, frozen, moment) if liger else \
            loss_transient_bytes(shape, n, mode, loss_tile, moment)

    def moment(fresh_grads: float, activations: float, copies: float) -> dict[str, float]:
        return {"gradients": (gradients if not fresh else fresh_grads) + buckets, "activations": float(activations),
                "buffers": copies + other_buffers}

    moments = [
        moment(0.0, saved + loss("forward"), cache),
        moment(0.0, saved + loss("backward"), saved_copies),
        moment(head_grads + layer_grads, saved - acts.get("head_gradient", 0) + acts["layer"],
               min((1 + kept_whole) * layer_copy, cache - head_copy) if checkpointing else cache - head_copy),
        moment(gradients - embedding_grads, one_layer_saved + acts["layer"] + stream, layer_copy),
        moment(gradients, stream, 0.0),
    ]
    return max(moments, key=lambda parts: sum(parts.values()))
