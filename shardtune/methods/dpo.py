"""DPO's micro-batch: the policy's and the reference's summed completion log-probs of each pair, then the pairwise
loss (shardtune.methods.dpo_loss) and TRL's reward metrics; and DPO's eval on held-out pairs.

The log-probs run as the LM head's forward, swapped in for one call of the model's forward as the tiled SFT loss
does (levers.tiled_loss says why each strategy needs it there): the head computes one tile of positions' logits
at a time, upcast to fp32, and keeps only each target token's log-prob; each tile is recomputed in backward. The
reference's forward runs first, under no_grad, so that the policy's graph is never held across it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.checkpoint import checkpoint

from shardtune.config import LOSS_TILE_POSITIONS
from shardtune.data.batches import COUNTS
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.levers.tiled_loss import forward_replaced, shifted_labels
from shardtune.methods.dpo_loss import PAIR_METRICS, DPOSettings, PairLogProbs, pair_losses, pair_metrics

MODEL_KEYS = ("input_ids", "attention_mask")  # what the forward takes of a preference batch


def tile_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's log-prob of its label (0 where it has none), fp32: the tile's logits in the compute dtype,
    upcast as TRL's log-softmax is."""
    return -F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=IGNORE_INDEX, reduction="none")


def sequence_log_probs(model: torch.nn.Module, unwrapped: torch.nn.Module, batch: dict,
                       tile: int | None = LOSS_TILE_POSITIONS) -> torch.Tensor:
    """Each row's summed log-prob of its labelled tokens, fp32: in tiles of `tile` positions, each recomputed in
    backward (None: the whole micro-batch's logits at once, --chunked_cross_entropy false)."""
    labels = shifted_labels(batch["labels"])
    head = unwrapped.get_output_embeddings()
    computed = []

    def log_probs_forward(hidden_states: torch.Tensor) -> torch.Tensor:
        flat_hidden, flat_labels = hidden_states.reshape(-1, hidden_states.shape[-1]), labels.reshape(-1)
        if tile is None or not torch.is_grad_enabled():  # nothing to recompute without a backward
            per_token = [tile_log_probs(flat_hidden[start:start + (tile or len(flat_labels))], head.weight,
                                        flat_labels[start:start + (tile or len(flat_labels))])
                         for start in range(0, len(flat_labels), tile or len(flat_labels))]
        else:
            per_token = [checkpoint(tile_log_probs, flat_hidden[start:start + tile], head.weight,
                                    flat_labels[start:start + tile], use_reentrant=False)
                         for start in range(0, len(flat_labels), tile)]
        computed.append(torch.cat(per_token).view(labels.shape).sum(-1))
        return computed[-1]

    with forward_replaced(head, log_probs_forward):
        returned = model(**{key: batch[key] for key in MODEL_KEYS}).logits
    # As in levers.tiled_loss: FSDP2's output cast rounds the returned tensor to bf16 after hooking its backward
    # on the fp32 one; elsewhere the returned tensor is the one to differentiate.
    return returned if returned.dtype == computed[0].dtype else computed[0]


@dataclass
class DPOStep:
    """What a DPO micro-batch needs beyond the policy: the loss settings, and the reference's log-probs of a batch
    (shardtune.methods.reference) unless the batch carries them (precomputed)."""

    settings: DPOSettings
    reference_log_probs: Callable[[dict], torch.Tensor] | None
    tile: int | None = LOSS_TILE_POSITIONS
    precompute_with: Callable[[dict], torch.Tensor] | None = None  # where precomputed: the adapter-off base, or None

    def pair_log_probs(self, model: torch.nn.Module, unwrapped: torch.nn.Module, batch: dict) -> PairLogProbs:
        if "ref_logps" in batch:
            reference = batch["ref_logps"].to(torch.float32)
            ref_chosen, ref_rejected = reference[:, 0], reference[:, 1]
        else:
            with torch.no_grad():  # first: the policy's graph is not held while the reference runs
                ref_chosen, ref_rejected = self.reference_log_probs(batch).chunk(2)
        chosen, rejected = sequence_log_probs(model, unwrapped, batch, self.tile).chunk(2)
        completion = (batch["labels"] != IGNORE_INDEX).sum(-1).to(torch.float32)
        chosen_tokens, rejected_tokens = completion.chunk(2)
        chosen_targets = (shifted_labels(batch["labels"]).chunk(2)[0] != IGNORE_INDEX).sum(-1).to(torch.float32)
        return PairLogProbs(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens,
                            chosen_targets)

    def loss(self, model: torch.nn.Module, unwrapped: torch.nn.Module, batch: dict, pairs: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's share of the global batch's mean pair loss (`pairs`: the global batch's pair count,
        on the device), and its PAIR_METRICS sums."""
        logps = self.pair_log_probs(model, unwrapped, batch)
        return pair_losses(logps, self.settings).sum() / pairs, pair_metrics(logps, self.settings.beta)


def window_metrics(sums: list[float], pairs: float) -> dict[str, float]:
    """PAIR_METRICS over a logging window's (or an eval's) pairs."""
    return {name: value / pairs for name, value in zip(PAIR_METRICS, sums, strict=True)}


@torch.no_grad()
def evaluate_pairs(model: torch.nn.Module, loader, accelerator: Accelerator, step: DPOStep) -> dict[str, float]:
    """The held-out pairs' mean loss and PAIR_METRICS, all ranks together (gather_for_metrics drops the pairs
    accelerate repeats to even out the last batch)."""
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    totals = torch.zeros(1 + len(PAIR_METRICS), dtype=torch.float64, device=accelerator.device)
    pairs = 0
    for batch in loader:
        batch.pop(COUNTS)
        logps = step.pair_log_probs(model, unwrapped, batch)
        beta = step.settings.beta
        chosen_rewards, rejected_rewards = beta * (logps.chosen - logps.ref_chosen), \
            beta * (logps.rejected - logps.ref_rejected)
        per_pair = torch.stack([pair_losses(logps, step.settings), chosen_rewards, rejected_rewards,
                                (chosen_rewards > rejected_rewards).float(), chosen_rewards - rejected_rewards,
                                logps.chosen, logps.rejected], dim=1)
        gathered = accelerator.gather_for_metrics(per_pair)
        totals += gathered.sum(0).to(torch.float64)
        pairs += gathered.shape[0]
    model.train()
    loss, *sums = totals.tolist()
    return {"eval_loss": loss / pairs, **{f"eval_{key}": value for key, value in window_metrics(sums, pairs).items()}}
