"""The training loss over tiles of positions, so that one tile of fp32 logits is alive at a time, never the whole
micro-batch's (--chunked_cross_entropy, on by default; TRL's SFTTrainer computes its loss in tiles too).

The loss runs as the LM head module's forward, swapped in for one call of the model's forward: the model computes
the loss where it would compute the logits, inside its own forward, so that each strategy's machinery finds the
head's weight gathered where the tiles read it, in the forward and in the backward's recomputation:
- ZeRO-3 partitions every weight outside its module's forward: DeepSpeed's hooks on the head module gather it for
  this forward and again before its backward (the hook on the module's output). Reading `lm_head.weight` outside
  a forward of the module reads an empty partition.
- FSDP2: accelerate's preparation puts the final norm and the head in one unit of their own, gathered at its
  forward and kept gathered until its backward (reshard_after_forward False), its pre-backward hook on the unit's
  outputs. Differentiating a head applied outside a forward of its unit runs the head's backward outside FSDP's
  hooks (measured on CPU when the head was in the root unit: a segmentation fault in the backward).
- DDP and ZeRO-1/2 hold the whole weight.
Each tile runs under torch.utils.checkpoint: its forward frees the tile's logits, its backward recomputes them.
The result is the plain loss of transformers' ForCausalLMLoss (logits upcast to fp32, summed over the target
tokens, divided by `targets`) up to the order of the fp32 sums.

With --use_liger_kernel the same swapped-in forward runs Liger's fused linear cross-entropy instead of the tiles
(fused_linear_cross_entropy): it reads the weight where the tiles would, gathered, and computes the hidden states'
and the weight's gradients already in its forward, chunk by chunk, so its backward reads no weight at all.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardtune.config import LOSS_TILE_POSITIONS
from shardtune.data.tokenize import IGNORE_INDEX

# A batch's labels, which the loss reads and the model must not see: plain, or shifted before a sequence split.
LABEL_KEYS = ("labels", "shift_labels")


def logits_after_head(config: object) -> tuple[float, float | None]:
    """What a family's forward does to the LM head's output before the loss: Granite divides it by
    logits_scaling, Gemma soft-caps it (tanh(logits / c) x c) where final_logit_softcapping is set."""
    return float(getattr(config, "logits_scaling", None) or 1.0), getattr(config, "final_logit_softcapping", None)


def tile_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, scaling: float = 1.0,
              softcap: float | None = None) -> torch.Tensor:
    """The summed cross-entropy of one tile of positions: its logits in the compute dtype (autocast's, where on),
    scaled and soft-capped as the model's forward does (logits_after_head), upcast to fp32 as ForCausalLMLoss
    does."""
    logits = F.linear(hidden, weight)
    if scaling != 1.0:
        logits = logits / scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor,
                        tile: int = LOSS_TILE_POSITIONS, scaling: float = 1.0, softcap: float | None = None
                        ) -> torch.Tensor:
    """Sum over tiles of `tile` positions of the tile's loss, divided by `targets`. `hidden` (rows, positions, h)
    and `labels` (rows, positions) are already aligned: position t's label is the token at t + 1."""
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = None
    for start in range(0, flat_labels.shape[0], tile):
        part = checkpoint(tile_loss, flat_hidden[start:start + tile], weight, flat_labels[start:start + tile],
                          scaling, softcap, use_reentrant=False)
        total = part if total is None else total + part
    return total / targets


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               targets: torch.Tensor) -> torch.Tensor:
    """Liger's fused linear cross-entropy (CUDA only: Triton kernels) of `hidden` through `weight`, summed over
    the target tokens and divided by `targets`, as tiled_cross_entropy's. Its per-token losses are fp32; the
    weight's gradient is accumulated in fp32 over Liger's chunks (accum_dtype), then cast to the weight's dtype.
    Liger counts the targets on the host (`.item()`) in its forward and compares the incoming gradient with 1.0
    (`torch.equal`) in its backward: two device syncs per micro-batch, which the tiles do not make."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                            ignore_index=IGNORE_INDEX, reduction="sum", accum_dtype=torch.float32)
    return loss / targets


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token label, IGNORE_INDEX after the last, as ForCausalLMLoss shifts them (so the hidden
    states need no shifted copy)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


@contextmanager
def forward_replaced(module: torch.nn.Module, forward):
    """Run `forward` as `module`'s forward for the calls inside: the hooks registered on the module (DeepSpeed's
    gathering) still run around it."""
    module.forward = forward
    try:
        yield module
    finally:
        del module.forward  # back to the class's forward


@contextmanager
def head_output_kept(config: object):
    """For the calls inside, the model's forward returns its LM head's output as the head returned it: the tiles
    applied the family's scaling and soft-cap already (logits_after_head), and the loss the head returns must not
    be scaled or capped again by the forward's code after the head. The forward reads both from its config."""
    neutral = {"logits_scaling": 1.0, "final_logit_softcapping": None}
    kept = {name: getattr(config, name) for name in neutral if getattr(config, name, None) is not None}
    for name in kept:
        setattr(config, name, neutral[name])
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(config, name, value)


def chunked_token_loss(model: torch.nn.Module, unwrapped: torch.nn.Module, batch: dict, targets: torch.Tensor,
                       tile: int = LOSS_TILE_POSITIONS, fused: bool = False) -> torch.Tensor:
    """The micro-batch's summed target-token loss over `targets`, in fp32, without its full logits: the model's
    forward runs with the tiled loss (`fused`: Liger's fused loss) as its LM head's forward, and returns it in
    place of the logits."""
    # A slice of the sequence split carries its labels shifted before the cut (shardtune.parallel.sequence).
    labels = batch["shift_labels"] if "shift_labels" in batch else shifted_labels(batch["labels"])
    head = unwrapped.get_output_embeddings()
    scaling, softcap = logits_after_head(unwrapped.config)  # Liger's path is refused where they act (models/)
    computed = []

    def loss_forward(hidden_states: torch.Tensor) -> torch.Tensor:
        loss = fused_linear_cross_entropy(hidden_states, head.weight, labels, targets) if fused else \
            tiled_cross_entropy(hidden_states, head.weight, labels, targets, tile, scaling, softcap)
        computed.append(loss)
        return loss

    with forward_replaced(head, loss_forward), head_output_kept(unwrapped.config):
        returned = model(**{key: value for key, value in batch.items() if key not in LABEL_KEYS}).logits
    # FSDP2's output cast (MixedPrecisionPolicy.output_dtype) rounds the root's outputs to bf16, after it hooked
    # its pre-backward on the fp32 tensor the head returned: that one is the loss. Elsewhere the returned tensor is
    # the one to differentiate: ZeRO-3 hooks the head's backward onto a copy of its output.
    return returned if returned.dtype == computed[0].dtype else computed[0]
