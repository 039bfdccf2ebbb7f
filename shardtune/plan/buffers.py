"""Transient 16-bit parameter copies and communication buffers alive during forward and backward, and the
buffers that outlive them, at the sizes each strategy allocates."""

from __future__ import annotations

from shardtune.config import FP8_DIM_MULTIPLE
from shardtune.models.flops import ModelShape
from shardtune.plan.activations import layer_activation_bytes
from shardtune.plan.states import Peft, deepspeed_sizes, largest_module, persistent_elements
from shardtune.plan.strategy import Strategy


def buffers(strategy: Strategy, shape: ModelShape, params: int, world: int, activation_mode: str,
            peft: Peft | None = None, pure_bf16: bool = False) -> float:
    """Transient 16-bit copies and communication buffers alive during forward/backward (assumptions documented
    per case; DeepSpeed values are its defaults, see strategy.DS_REDUCE_BUCKET).

    - DDP: the trainer sets gradient_as_bucket_view, so the gradients are the all-reduce buckets (counted as
      gradients; beside the gradients a step accumulates, backward_moments.ddp_bucket_bytes). Autocast caches one
      16-bit copy of every matmul weight for the whole forward.
    - DeepSpeed ZeRO-1/2: one reduce bucket of DS_REDUCE_BUCKET gradient elements (overlap_comm is off below
      stage 3). ZeRO-3: the module being computed plus the one prefetched (2 x the largest module, which for
      Llama 3 is the embedding or lm_head), the prefetch bucket and the reduce bucket.
    - FSDP FULL_SHARD: the final norm and lm_head stay gathered from forward to backward, an untied embedding
      does not (resharded_after_forward); one layer computing and one prefetched (with --mixed_precision fp8 its
      float8 weights gathered in 1 byte each, gathered_layer_bytes); the unsharded gradients of one layer and of
      norm and head before reduce-scatter, in fp32 (the trainer's reduce_dtype; with LoRA one layer's adapters),
      or with `pure_bf16` (--bf16_stochastic_round, reduced in bf16) only the bf16 gradients themselves.
      SHARD_GRAD_OP keeps every unsharded 16-bit weight from forward to backward instead of re-gathering."""
    low = strategy.compute_bytes
    layer = shape.layer_params
    root = shape.params - shape.layers * layer
    if strategy.kind == "ddp":  # with LoRA only the adapters have gradients, and a 16-bit base needs no cast
        cached = peft.trainable_params(shape) if peft else shape.linear_params
        if strategy.float8:  # a float8 linear casts its fp32 weight to float8 itself, per call: nothing cached
            cached -= shape.layers * float8_weight_elements(shape)
        return 2 * cached if activation_mode == "autocast" else 0
    if strategy.kind == "deepspeed":
        return deepspeed_buffers(strategy, shape, params, peft)
    reduced = reduce_bytes(pure_bf16)
    if strategy.shard >= 3:
        root -= resharded_after_forward(shape)
    reducing = reduced * layer_gradient_elements(shape, peft) + (0 if peft else reduced * root)
    gathered = gathered_layer_bytes(strategy, shape)
    if strategy.shard >= 3:
        return root * low + 2 * gathered + reducing
    return root * low + shape.layers * gathered + reducing


def resharded_after_forward(shape: ModelShape) -> int:
    """Parameters outside the decoder layers that FULL_SHARD gathers only for their own forward and backward:
    accelerate's fsdp2_prepare_model gives an untied embedding a unit of its own (resharded after its forward,
    gathered again at the very end of the backward); the final norm and the head share a unit that stays
    gathered from its forward to its backward (reshard_after_forward False), as does a tied embedding with them."""
    return 0 if shape.tied else shape.embedding_params


def float8_weight_elements(shape: ModelShape) -> int:
    """Elements of one decoder layer's weights that --mixed_precision fp8 trains in float8 (levers.float8.converts):
    the projections whose two dimensions are multiples of FP8_DIM_MULTIPLE (biases and norms stay 16-bit)."""
    q_out, kv_out, h, inter = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, \
        shape.intermediate
    dims = ((h, q_out), (h, kv_out), (h, kv_out), (q_out, h), (h, inter), (h, inter), (inter, h))
    return sum(rows * cols for rows, cols in dims if rows % FP8_DIM_MULTIPLE == 0 and cols % FP8_DIM_MULTIPLE == 0)


def gathered_layer_bytes(strategy: Strategy, shape: ModelShape) -> float:
    """Bytes of one decoder layer's parameters as FSDP2 gathers them: in the compute dtype, except that with
    --mixed_precision fp8 the float8 weights are cast before the all-gather and gathered in 1 byte each (torchao's
    float8 all-gather; their per-tensor scales are a few bytes)."""
    float8 = float8_weight_elements(shape) if strategy.float8 else 0
    return float((shape.layer_params - float8) * strategy.compute_bytes + float8)


def reduce_bytes(pure_bf16: bool) -> int:
    """Bytes per element of an unsharded gradient being reduced under FSDP (parallel.distributed.fsdp_plugin)."""
    return 2 if pure_bf16 else 4


def layer_gradient_elements(shape: ModelShape, peft: Peft | None = None) -> float:
    """Elements of one decoder layer's gradients: all its parameters, or under LoRA its adapters' (all adapters
    are in the layers)."""
    return peft.trainable_params(shape) / shape.layers if peft else shape.layer_params


def freed_under_layer_gradients(strategy: Strategy, shape: ModelShape, batch: int, seq: int, mode: str,
                                attn: str = "sdpa", masked: bool = True, peft: Peft | None = None,
                                pure_bf16: bool = False, liger: bool = False) -> float:
    """FSDP: a layer's unsharded fp32 gradients (in buffers()) grow while that layer's backward frees the
    activations it saved or recomputed, so they sit on top of the peak activations only by what exceeds one
    layer's activations (measured on CPU: counting both overshoots the forward/backward peak by 5-9%)."""
    if strategy.kind != "fsdp":
        return 0.0
    activations = layer_activation_bytes(shape, batch, seq, mode, attn, masked, peft is not None, liger)
    return float(min(reduce_bytes(pure_bf16) * layer_gradient_elements(shape, peft), activations))


def deepspeed_buffers(strategy: Strategy, shape: ModelShape, params: int, peft: Peft | None = None) -> float:
    """DeepSpeed's communication buffers and gathered parameters, at the sizes the JSON sets (allocated at full
    size, however small the model: measured).

    - ZeRO-1/2 (stage_1_and_2.py `setup_buckets`): a reduce bucket of reduce_bucket_size elements, and a second
      one with overlap_comm (one fills while the other is reduced), in the dtype gradients are reduced in: the
      module's, or fp32 where the trainer accumulates ZeRO-2 gradients in fp32.
    - ZeRO-3 (stage3.py): one reduce bucket in the module's dtype (contiguous_gradients). Gathered 16-bit
      parameters: the module computing, at most the largest leaf module (the embedding or lm_head for Llama),
      and what is prefetched ahead of it (stage3_prefetch_bucket_size), capped by stage3_max_live_parameters;
      plus the persistent parameters (at most stage3_param_persistence_threshold elements each), gathered on
      every rank from the end of the first step on."""
    low = strategy.compute_bytes
    sizes = deepspeed_sizes(strategy, shape)
    if strategy.shard < 3:
        bucket_bytes = 4 if strategy.shard == 2 else low
        return (2 if strategy.overlap_comm else 1) * sizes["reduce_bucket"] * bucket_bytes
    largest = largest_module(shape)
    gathered = min(max(sizes["max_live_parameters"], largest), largest + min(sizes["prefetch_bucket"], params))
    return (gathered + persistent_elements(strategy, shape, peft) + sizes["reduce_bucket"]) * low


def persistent_buffer_bytes(strategy: Strategy, shape: ModelShape) -> float:
    """Buffers that outlive forward/backward: ZeRO-3's reduce bucket, allocated whole at start-up. ZeRO-1/2
    allocate theirs when a backward starts and free them when it ends (stage_1_and_2.py `setup_buckets`,
    `_release_ipg_buffers`)."""
    if strategy.kind != "deepspeed" or strategy.shard < 3:
        return 0.0
    return float(strategy.compute_bytes * deepspeed_sizes(strategy, shape)["reduce_bucket"])
