"""Activation memory of a Llama-class decoder: what autograd saves for backward (calibrated against
torch.autograd.graph.saved_tensors_hooks in tests/unit/plan/test_plan.py), the transient on top of it, and the eval
forward's live tensors."""

from __future__ import annotations

from shardtune.config import EVAL_CHUNK_POSITIONS
from shardtune.models.families import FAMILIES
from shardtune.models.flops import ModelShape
from shardtune.plan.host import pinned_block_bytes
from shardtune.plan.strategy import Strategy


def activation_mode(strategy: Strategy) -> str:
    """"fp32" (mixed_precision no); "half": 16-bit weights and compute (DeepSpeed converts the module, FSDP2's
    MixedPrecisionPolicy gathers 16-bit parameters); "autocast": fp32 weights and residual stream, 16-bit matmuls
    (accelerate's native AMP under DDP)."""
    if strategy.mixed_precision == "no":
        return "fp32"
    return "autocast" if strategy.kind == "ddp" else "half"


def dtype_bytes(mode: str) -> tuple[int, int]:
    """(compute bytes, residual-stream bytes) of an activation_mode."""
    return {"fp32": (4, 4), "half": (2, 2), "autocast": (2, 4)}[mode]


def layer_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, attn: str = "sdpa",
                           masked: bool = True, frozen: bool = False, liger: bool = False) -> int:
    """Bytes one Llama decoder layer saves for backward without recomputation (n = batch x seq tokens,
    c = compute bytes, r = residual bytes; the layer input itself is saved by the first norm).

    - Each RMSNorm: its input upcast to fp32 (4nh; the input itself when already fp32), the fp32 rstd (4n), the
      normalised x in the residual dtype (r·nh, for the weight gradient: not with a `frozen` base, LoRA's) and
      its output as the next matmuls' input in the compute dtype (c·nh; under autocast one 16-bit copy per
      consuming matmul: 3 for q, k, v and 2 for gate, up, as autocast caches only casts of leaf weights).
    - Attention: RoPE saves only cos/sin (shared). SDPA saves q, k, v, its output (c·n·d each, where k and v are
      repeated to all heads when GQA meets a mask, since transformers then calls repeat_kv) and the fp32
      logsumexp (4·n·heads); o_proj reads the output in place. `masked` (a dense mask reaches the kernel: a
      padded batch, or a packed row's block-diagonal mask under SDPA or eager): each layer also saves its own copy
      of the mask in the compute dtype (c·b·s², measured on CPU SDPA). The flash kernels ("flash":
      flash_attention_2/3, flex_attention) take no dense mask and save what unmasked SDPA saves. Eager saves q,
      repeated k and v, the fp32 softmax (4·b·heads·s²) and its 16-bit copy, and the contiguous o_proj input.
    - SwiGLU MLP: gate output, SiLU output, up output and their product (4·c·n·intermediate).
    Residual adds save nothing.
    With `liger` (--use_liger_kernel; read from liger-kernel 0.8.5's ops, not measured: its kernels need CUDA):
    LigerRMSNormFunction saves its input X as it comes (r·nh, also under a frozen base: X's gradient flows on)
    and the fp32 rstd (4n), no fp32 copy and no normalised x; its output, in X's dtype, feeds the matmuls as
    before. LigerSiLUMulFunction saves only gate's and up's outputs, and down_proj its input, the product
    (3·c·n·intermediate): SiLU is recomputed in the backward. Liger's RoPE saves cos and sin as the plain one."""
    compute, residual = dtype_bytes(mode)
    n, h, inter = batch * seq, shape.hidden, shape.intermediate
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # Autocast casts a matmul input once per matmul (only leaf weights are cached): q, k, v and gate, up.
    attn_inputs, mlp_inputs = (3, 2) if mode == "autocast" else (1, 1)
    norm = residual * n * h + 4 * n if liger else 4 * n * h + 4 * n + (0 if frozen else residual * n * h)
    norms = 2 * norm + (attn_inputs + mlp_inputs) * compute * n * h
    if attn == "eager":
        scores = batch * shape.heads * seq * seq
        attention = 4 * compute * n * q_dim + 4 * scores + (compute * scores if compute != 4 else 0)
    else:
        key = value = kv_dim
        if masked and shape.kv_heads != shape.heads:  # repeat_kv copies, except one kv head: a reshape view
            key = value = q_dim if shape.kv_heads > 1 else kv_dim
            key = q_dim if mode == "autocast" else key  # autocast's cast to 16-bit materialises the view
        attention = compute * n * (2 * q_dim + key + value) + 4 * n * shape.heads
        if masked:  # each layer's SDPA call saves its own converted copy of the additive mask
            attention += batch * seq * seq * compute
    mlp = expert_saved_bytes(shape, n, mode) if shape.experts else (3 if liger else 4) * compute * n * inter
    return norms + attention + mlp + family_norm_bytes(shape, n, mode, frozen, liger)


def expert_saved_bytes(shape: ModelShape, n: int, mode: str) -> int:
    """What a mixture of experts' MLP saves (transformers 5.24's grouped_mm experts over S = n x top-k routed
    tokens, c = the experts' bytes: grouped_mm is not autocast, it casts its input to the weights' dtype, so under
    autocast the experts run in fp32): the routed copies of the hidden states (c·S·h), gate_up's output (c·S·2·inter),
    SiLU's output and the product (2·c·S·inter), down's output for the routing weights' product (c·S·h), the sort
    and gather indices (int64, 3 x 8·S); the router's fp32 softmax (4·n·experts) and the logits recorded for the
    load-balancing loss (router_held_bytes)."""
    compute = expert_bytes(mode)
    routed = n * shape.experts_per_token
    experts = compute * routed * (2 * shape.hidden + 4 * shape.intermediate) + 24 * routed
    return experts + 4 * n * shape.experts + router_held_bytes(shape, n, dtype_bytes(mode)[0])


def expert_bytes(mode: str) -> int:
    """Bytes per element of the experts' activations: the weights' dtype (fp32 under autocast)."""
    return dtype_bytes(mode)[1]


def router_held_bytes(shape: ModelShape, n: int, compute: int) -> int:
    """Per MoE layer, held from its forward to the backward whatever is recomputed (shardtune.models.routing): the
    router's logits, recorded for the load-balancing loss (c·n·experts), and that loss's fp32 softmax of them,
    saved for its backward (4·n·experts)."""
    return (compute + 4) * n * shape.experts


def family_norm_bytes(shape: ModelShape, n: int, mode: str, frozen: bool = False, liger: bool = False) -> int:
    """What a layer's norms beyond Llama's two save (shardtune.models.families), each as a Llama norm saves
    (layer_activation_bytes) over its own width:
    - hidden-size norms beyond two (Gemma 3's after attention and after the MLP), whose outputs go to the residual
      add, which saves nothing;
    - q and k norms (Qwen3 and Gemma 3 per head, OLMo 2 over all heads' width), over q_proj's and k_proj's outputs
      in the compute dtype: their fp32 upcast, the fp32 rstd per head (or per token), the normalised x in the
      compute dtype. The rotated output is what SDPA saves, counted already.
    Gemma's norms multiply by (1 + weight) in fp32: their normalised x is kept in fp32 whatever the dtype. Under
    Liger, its RMSNorm's (layer_activation_bytes) where its patch replaces the norm."""
    compute, residual = dtype_bytes(mode)
    kept = 4 if shape.norm_scale_fp32 else None

    def norm(elements: int, rows: int, dtype: int, patched: bool) -> int:
        if patched:
            return dtype * elements + 4 * rows
        return 4 * elements + 4 * rows + (0 if frozen else (kept or dtype) * elements)

    extra = (shape.layer_norms - 2) * norm(n * shape.hidden, n, residual, liger)
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    patched = liger and FAMILIES[shape.family].liger_qk_norms  # the q/k norms Liger leaves are plain ones
    if shape.qk_norms:
        per_head = shape.qk_norms[0] == shape.head_dim and shape.heads > 1
        extra += norm(n * q_dim, n * (shape.heads if per_head else 1), compute, patched)
        extra += norm(n * kv_dim, n * (shape.kv_heads if per_head else 1), compute, patched)
    return extra


def shared_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, attn: str = "sdpa",
                            masked: bool = True) -> int:
    """Saved once for all layers: RoPE cos and sin (1 x s x head_dim each, residual dtype)."""
    _, residual = dtype_bytes(mode)
    return 2 * seq * shape.head_dim * residual


def head_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, frozen: bool = False,
                          loss_tile: int | None = None, liger: bool = False) -> int:
    """Outside the layers: input ids (int64, for the embedding's weight gradient), the final RMSNorm (as in a
    layer), the fp32 log-probabilities saved by cross-entropy (4·n·vocab: the upcast logits' log_softmax) and the
    int64 targets. A `frozen` base saves neither the ids nor lm_head's input, nor the norm's normalised x. With a
    `loss_tile` (--chunked_cross_entropy) each tile is recomputed in backward: no log-probabilities are saved, and
    lm_head's input is the norm's output as the checkpointed tiles keep it, in the residual dtype (under autocast
    each tile casts it again as it runs: loss_transient_bytes). With `liger` the final norm is Liger's
    (layer_activation_bytes) and the loss saves liger_loss_saved_bytes in place of lm_head's input and the targets.
    """
    compute, residual = dtype_bytes(mode)
    n, h = batch * seq, shape.hidden
    if liger:
        return (0 if frozen else 8 * n) + residual * n * h + 4 * n + liger_loss_saved_bytes(shape, n, mode, frozen)
    head_input = residual * n * h if loss_tile else (0 if frozen else compute * n * h)
    norm = 4 * n * h + 4 * n + (0 if frozen else residual * n * h) + head_input
    log_probs = 0 if loss_tile else 4 * n * shape.vocab
    return (0 if frozen else 8 * n) + norm + log_probs + 8 * n


def liger_chunk_positions(shape: ModelShape, n: int) -> int:
    """Positions per chunk of Liger's fused linear cross-entropy over n positions (ops/fused_linear_cross_entropy.py:
    its chunk's logits are bounded by n x hidden elements): n / ceil(vocab / hidden), rounded up to a power of
    two, at most n."""
    split = -(-shape.vocab // shape.hidden)
    return min(1 << (max(-(-n // split), 1) - 1).bit_length(), n)


def liger_loss_saved_bytes(shape: ModelShape, n: int, mode: str, frozen: bool = False) -> int:
    """What LigerFusedLinearCrossEntropyFunction saves for backward: the gradients it computed in its forward, of
    the hidden states (r·n·h, their dtype) and, unless the base is `frozen`, of the head's weight (vocab x h in
    the weight's dtype: the residual one, bf16 under FSDP2's and DeepSpeed's 16-bit compute, fp32 under
    autocast). Neither the hidden states, the weight nor the targets are saved."""
    _, residual = dtype_bytes(mode)
    return residual * n * shape.hidden + (0 if frozen else residual * shape.vocab * shape.hidden)


def liger_loss_transient_bytes(shape: ModelShape, n: int, mode: str, frozen: bool = False,
                               moment: str = "peak") -> int:
    """Liger's fused loss on top of what it saves (liger_loss_saved_bytes), in its `moment`. The forward, chunk by
    chunk (liger_chunk_positions): the chunk's logits in the compute dtype, turned into their gradient in place
    (c·chunk·vocab); under autocast the chunk's 16-bit input cast (c·chunk·h); the fp32 weight-gradient
    accumulator (accum_dtype fp32: 4·vocab·h) where the weight is 16-bit, beside which the saved 16-bit gradient
    exists only once the last chunk is summed; in fp32 the weight gradient of each chunk before it is added
    (4·vocab·h: torch.mm(...).float(); 16-bit gradients go through addmm into the accumulator on Ampere and
    later); and throughout the fp32 per-token losses, the targets' mask and the shifted targets (13·n). The
    backward scales the saved gradients in place: nothing on top."""
    compute, residual = dtype_bytes(mode)
    if moment == "backward":
        return 0
    h, vocab = shape.hidden, shape.vocab
    chunk = liger_chunk_positions(shape, n)
    cast = compute * chunk * h if compute != residual else 0
    accumulator = 0 if frozen or residual == 4 else 4 * vocab * h
    chunk_gradient = 4 * vocab * h if compute == 4 and not frozen else 0
    during = (accumulator - residual * vocab * h if accumulator else 0) + chunk_gradient + compute * chunk * vocab
    return max(during + cast, accumulator) + 13 * n


def loss_transient_bytes(shape: ModelShape, n: int, mode: str, loss_tile: int | None = None,
                         moment: str = "peak") -> int:
    """The loss's transient on top of what is saved, over n positions, in its `moment`: "forward", "backward" or
    the larger ("peak"). Plain (transformers' ForCausalLMLoss, loss_utils.py: `logits = logits.float()`, then
    cross_entropy, whose log_softmax output is saved): the forward holds the logits (c·n·vocab) and their fp32
    upcast (4·n·vocab, none when fp32 already); the backward holds two fp32 n x vocab gradients (nll_loss's and
    log_softmax's, 8·n·vocab). With a `loss_tile` of t positions (shardtune.levers.tiled_loss), one tile at a time: its
    backward recomputes the tile's log-probabilities (4·t·vocab, fp32) and holds the two fp32 gradients beside
    them, 12·t·vocab in every mode (measured in tests/unit/levers/test_tiled_loss.py), and under autocast the tile's
    16-bit cast of lm_head's input (c·t·h)."""
    compute, residual = dtype_bytes(mode)
    if loss_tile:
        tile = min(n, loss_tile)
        return 12 * tile * shape.vocab + (compute * tile * shape.hidden if compute != residual else 0)
    forward = compute * n * shape.vocab + (4 * n * shape.vocab if compute != 4 else 0)
    backward = 8 * n * shape.vocab
    return {"forward": forward, "backward": backward, "peak": max(forward, backward)}[moment]


# The matmuls of a Llama decoder layer, in the order its forward runs them (shardtune.model.selective_policy saves
# the 1st, 3rd, ... of them).
LAYER_MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def matmul_outputs(shape: ModelShape, mode: str, lora_rank: int = 0, lora_targets: tuple[str, ...] = ()
                   ) -> list[int]:
    """Bytes per token of each matmul output of one layer, in the order they run: each projection in the compute
    dtype, and after a LoRA target's base matmul its adapter's two (A: rank wide, B: the output's width), in fp32
    (peft casts the adapter's input to the adapters' fp32)."""
    compute, _ = dtype_bytes(mode)
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    widths = {"q_proj": q_dim, "k_proj": kv_dim, "v_proj": kv_dim, "o_proj": shape.hidden,
              "gate_proj": shape.intermediate, "up_proj": shape.intermediate, "down_proj": shape.hidden}
    outputs = []
    for name in LAYER_MATMULS:
        outputs.append(compute * widths[name])
        if name in lora_targets:
            outputs += [4 * lora_rank, 4 * widths[name]]
    return outputs


def selective_layer_bytes(shape: ModelShape, batch: int, seq: int, mode: str, attn: str = "sdpa",
                          lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> int:
    """What op-level selective checkpointing (--gradient_checkpointing_mode selective) keeps per layer beside its
    input: the outputs of the layer's 1st, 3rd, ... matmul (q, v, gate and down without LoRA) and the attention
    kernel's output (c·n·heads·head_dim) with its fp32 logsumexp (4·n·heads). Eager attention runs no kernel that
    is kept: its products are recomputed."""
    compute, _ = dtype_bytes(mode)
    n = batch * seq
    kept = sum(matmul_outputs(shape, mode, lora_rank, lora_targets)[::2])
    attention = 0 if attn == "eager" else compute * n * shape.heads * shape.head_dim + 4 * n * shape.heads
    return n * kept + attention


def recomputed_layers(layers: int, interval: int) -> int:
    """Decoder layers recomputed under --gradient_checkpointing_interval: transformers' every_n_layers checkpoints
    the layers whose index is a multiple of it (modeling_utils `layer_index % every_n_layers == 0`)."""
    return -(-layers // interval)


def saved_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, checkpointing: bool,
                           attn: str = "sdpa", masked: bool = True, frozen: bool = False, selective: bool = False,
                           lora_rank: int = 0, lora_targets: tuple[str, ...] = (), loss_tile: int | None = None,
                           liger: bool = False, recomputed: int | None = None) -> int:
    """Everything saved for backward at the end of the forward (what saved_tensors_hooks see, and with `selective`
    checkpointing what its policy keeps, selective_layer_bytes). With full recomputation (non-reentrant) a layer
    saves only its input (r·n·h); masks and RoPE tables are then held by the recompute closure, not the graph, and
    are counted by recompute_held_bytes instead. With a `loss_tile` the head saves no full log-probabilities.
    With checkpointing only `recomputed` layers of them (default: all; recomputed_layers), the others save as
    without (their RoPE tables are the closures' too)."""
    _, residual = dtype_bytes(mode)
    head = head_activation_bytes(shape, batch, seq, mode, frozen, loss_tile, liger)
    per_layer = layer_activation_bytes(shape, batch, seq, mode, attn, masked, frozen, liger)
    if checkpointing:
        recomputed = shape.layers if recomputed is None else recomputed
        kept = selective_layer_bytes(shape, batch, seq, mode, attn, lora_rank, lora_targets) if selective else 0
        held = router_held_bytes(shape, batch * seq, dtype_bytes(mode)[0]) if shape.experts else 0
        return recomputed * (residual * batch * seq * shape.hidden + kept + held) + \
            (shape.layers - recomputed) * per_layer + head
    return shape.layers * per_layer + shared_activation_bytes(shape, batch, seq, mode, attn, masked) + head


def offloaded_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str) -> int:
    """Bytes per rank that --activation_offloading moves from the GPU to host memory: what the decoder layers save
    through autograd's saved-tensor hooks (TRL's OffloadActivations packs those). Every layer is recomputed
    (shardtune.checks.values.check_activation_offloading), so that is each layer's input: the rest a layer saves goes
    through its checkpoint's own hooks, and a selective policy's kept outputs stay on the GPU (torch's checkpoint
    caches them itself). The head's (lm_head's input, which TRL keeps, and the loss, computed outside the
    offloaded forward) stays on the GPU."""
    _, residual = dtype_bytes(mode)
    return shape.layers * residual * batch * seq * shape.hidden


def offloaded_host_bytes(shape: ModelShape, batch: int, seq: int, mode: str) -> float:
    """Pinned host RAM per rank that holds the offloaded activations: one block per layer, as torch's caching host
    allocator sizes it (host.pinned_block_bytes: the next power of two)."""
    _, residual = dtype_bytes(mode)
    return float(shape.layers * pinned_block_bytes(residual * batch * seq * shape.hidden))


def recompute_held_bytes(shape: ModelShape, batch: int, seq: int, mode: str, attn: str = "sdpa",
                         masked: bool = True) -> int:
    """With recomputation, what the recomputed layers' closures hold from the forward to the end of the backward:
    the arguments of the checkpointed call (transformers' modeling_layers.py GradientCheckpointingLayer checkpoints
    `partial(forward, self, **kwargs)`), shared by every layer: RoPE's cos and sin (shared_activation_bytes) and
    the dense mask as transformers builds it (`masked`), a bool under SDPA (b·s² bytes, masking_utils.py
    `sdpa_mask`), additive in the residual dtype under eager (`eager_mask`)."""
    _, residual = dtype_bytes(mode)
    mask = batch * seq * seq * (1 if attn != "eager" else residual) if masked and attn != "flash" else 0
    return mask + shared_activation_bytes(shape, batch, seq, mode, attn, masked)


def batch_tensor_bytes(batch: int, seq: int, frozen: bool = False) -> int:
    """The micro-batch the training loop holds through its step (int64), beyond the ids the embedding saves
    (head_activation_bytes): its labels and attention mask (a packed row's position ids), and the ids themselves
    where the embedding saves none (a `frozen` base)."""
    return (24 if frozen else 16) * batch * seq


def layer_backward_bytes(shape: ModelShape, batch: int, seq: int, mode: str, checkpointing: bool,
                         attn: str = "sdpa", masked: bool = True, frozen: bool = False, selective: bool = False,
                         lora_rank: int = 0, lora_targets: tuple[str, ...] = (), liger: bool = False) -> int:
    """A layer's backward on top of what is saved: with recomputation its full activations, recomputed (less what
    a `selective` policy kept, already saved), and in every case the MLP backward's two intermediate-size
    gradients (2·c·n·intermediate); with `liger` one, the product's: Liger's SwiGLU backward writes gate's and
    up's gradients over their saved outputs."""
    compute, _ = dtype_bytes(mode)
    recompute = 0
    if checkpointing:
        recompute = layer_activation_bytes(shape, batch, seq, mode, attn, masked, frozen, liger)
        if selective:
            recompute -= selective_layer_bytes(shape, batch, seq, mode, attn, lora_rank, lora_targets)
    if shape.experts:  # one routed-width gradient at a time over the recompute (measured: tests/unit/plan)
        return recompute + expert_bytes(mode) * batch * seq * shape.experts_per_token * shape.intermediate
    return recompute + (1 if liger else 2) * compute * batch * seq * shape.intermediate


def activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, checkpointing: bool,
                     attn: str = "sdpa", masked: bool = True, frozen: bool = False, selective: bool = False,
                     lora_rank: int = 0, lora_targets: tuple[str, ...] = (), offloading: bool = False,
                     loss_tile: int | None = None, liger: bool = False, recomputed: int | None = None
                     ) -> dict[str, int]:
    """Peak activation memory = saved (what the graph saves, with recomputation what the recompute closures
    hold, recompute_held_bytes, and the micro-batch itself, batch_tensor_bytes) + the largest transient on top
    of it. The loss's (loss_transient_bytes: the full
    logits, or one `loss_tile` of them) runs before any layer's backward (layer_backward_bytes), so the
    transient is the larger of the two, never their sum ("loss" and "layer" name each).
    With `offloading`, offloaded_activation_bytes leave the saved part for host memory ("offloaded"). With `liger`
    Liger's layers and fused loss (liger_loss_transient_bytes in place of the tiles'); "head_gradient": the weight
    gradient Liger's loss saved, handed to lm_head before any layer's backward. `recomputed`: the layers recomputed
    with checkpointing (default all); a layer's backward transient is planned as a recomputed one's."""
    saved = saved_activation_bytes(shape, batch, seq, mode, checkpointing, attn, masked, frozen, selective,
                                   lora_rank, lora_targets, loss_tile, liger, recomputed)
    if checkpointing:
        saved += recompute_held_bytes(shape, batch, seq, mode, attn, masked)
    saved += batch_tensor_bytes(batch, seq, frozen)
    offloaded = offloaded_activation_bytes(shape, batch, seq, mode) if offloading else 0
    n = batch * seq
    loss = liger_loss_transient_bytes(shape, n, mode, frozen) if liger else \
        loss_transient_bytes(shape, n, mode, loss_tile)
    layer = layer_backward_bytes(shape, batch, seq, mode, checkpointing, attn, masked, frozen, selective,
                                 lora_rank, lora_targets, liger)
    transient = max(loss, layer)
    head_gradient = liger_loss_saved_bytes(shape, n, mode, frozen) - liger_loss_saved_bytes(shape, n, mode, True) \
        if liger else 0
    return {"saved": saved - offloaded, "transient": transient, "total": saved - offloaded + transient,
            "offloaded": offloaded, "loss": loss, "layer": layer, "head_gradient": head_gradient}


def eval_activation_bytes(shape: ModelShape, batch: int, seq: int, mode: str, masked: bool = True,
                          adapted_up: bool = False, head_positions: int | None = None) -> float:
    """The eval forward under no_grad (shardtune.evaluation): only what the running op needs is alive. Throughout,
    four n x h tensors of the residual stream (the embedding output, which the model's forward keeps, the layer's
    input, the residual and the normalised input), the additive mask (c·b·s², `masked`: SDPA and eager) and
    RoPE's cos and sin (b·s·head_dim each). On top, the larger of the SwiGLU MLP (SiLU of gate, up and their
    product, 3·c·n·intermediate; measured with the profiler's allocator events; a LoRA adapter on up_proj adds
    its scaled output and the sum, `result + lora_B(lora_A(x)) * scaling` in peft, while SiLU of gate is alive:
    4) and the head, which computes one chunk of EVAL_CHUNK_POSITIONS positions at a time
    (shardtune.evaluation.head_statistics): the chunk's logits in the compute dtype, their fp32 upcast and
    cross-entropy's log-softmax of it. `head_positions`: the positions one head chunk computes where the head runs
    otherwise (a DPO forward's tiles of flat positions, shardtune.methods.dpo.sequence_log_probs)."""
    compute, residual = dtype_bytes(mode)
    n = batch * seq
    mask = compute * batch * seq * seq if masked else 0
    stream = 4 * residual * n * shape.hidden + mask + 2 * residual * n * shape.head_dim
    upcasts = 2 if compute != 4 else 1  # the chunk's fp32 copy (none when fp32 already) and its log-softmax
    chunk = head_positions or min(seq, EVAL_CHUNK_POSITIONS)
    head = compute * chunk * shape.vocab + 4 * chunk * shape.vocab * upcasts
    mlp = (4 if adapted_up else 3) * compute * n * shape.intermediate
    if shape.experts:  # the routed copies, gate_up's output, SiLU's and the product (expert_saved_bytes)
        mlp = expert_bytes(mode) * n * shape.experts_per_token * (shape.hidden + 4 * shape.intermediate)
    return float(stream + max(head, mlp))
