"""DPO's pairwise losses over summed completion log-probs, as TRL 1.16's DPOTrainer computes them
(trl/trainer/dpo_trainer.py, `_compute_loss`): each loss per pair, several weighted and summed. The caller divides
the sum over pairs by the global batch's pair count, which is TRL's mean over a micro-batch's pairs averaged over
micro-batches and ranks when every micro-batch holds the same number of pairs (shardtune's always do).

TRL's f-divergence variants, WPO weighting, `ld_alpha` and the batch-sorted AOT losses are not taken: each needs
more than the pair's own log-probs, or changes the log-probs themselves. --label_smoothing is read by robust and
exo_pair alone, as in TRL; with no such loss it is refused (shardtune.methods.checks.SMOOTHED_LOSSES)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardtune.config import Recipe

# The metrics TRL logs per pair (rewards are beta x the policy's log-prob over the reference's), summed over pairs.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


@dataclass(frozen=True)
class DPOSettings:
    beta: float
    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    label_smoothing: float

    @classmethod
    def of(cls, recipe: Recipe) -> DPOSettings:
        weights = recipe.loss_weights or [1.0] * len(recipe.loss_type)
        return cls(recipe.beta, tuple(recipe.loss_type), tuple(weights), recipe.label_smoothing)


@dataclass
class PairLogProbs:
    """Per pair (one entry per pair of the micro-batch): the policy's and the reference's summed completion
    log-probs, each completion's token count (after truncation: IPO's length), and the chosen completion's tokens
    that carry a log-prob (its count less one where the completion opens the sequence: the SFT term's divisor)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_targets: torch.Tensor


def pair_losses(logps: PairLogProbs, settings: DPOSettings) -> torch.Tensor:
    """Each pair's loss: the weighted sum of every --loss_type's, fp32."""
    beta, smoothing = settings.beta, settings.label_smoothing
    chosen_ratio, rejected_ratio = logps.chosen - logps.ref_chosen, logps.rejected - logps.ref_rejected
    delta = chosen_ratio - rejected_ratio
    total = torch.zeros_like(delta)
    for loss_type, weight in zip(settings.loss_types, settings.loss_weights, strict=True):
        if loss_type == "sigmoid":
            loss = -F.logsigmoid(beta * delta)
        elif loss_type == "hinge":
            loss = torch.relu(1 - beta * delta)
        elif loss_type == "ipo":  # length-normalised, as TRL (agreed with the IPO authors)
            mean_delta = chosen_ratio / logps.chosen_tokens.clamp(min=1) - \
                rejected_ratio / logps.rejected_tokens.clamp(min=1)
            loss = (mean_delta - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":
            loss = torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - math.log1p(-smoothing)) + \
                torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - math.log(smoothing))
        elif loss_type == "nca_pair":
            loss = -F.logsigmoid(beta * chosen_ratio) - 0.5 * F.logsigmoid(-beta * chosen_ratio) \
                - 0.5 * F.logsigmoid(-beta * rejected_ratio)
        elif loss_type == "robust":
            loss = (-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)) \
                / (1 - 2 * smoothing)
        elif loss_type == "bco_pair":
            loss = -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
        elif loss_type == "sppo_hard":
            loss = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        elif loss_type == "apo_zero":
            loss = 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
        elif loss_type == "apo_down":
            loss = torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * delta)
        elif loss_type == "sigmoid_norm":
            mean_delta = chosen_ratio / logps.chosen_tokens.clamp(min=1) - \
                rejected_ratio / logps.rejected_tokens.clamp(min=1)
            loss = -F.logsigmoid(beta * mean_delta)
        elif loss_type == "sft":  # the micro-batch's mean chosen-token NLL, the same for each of its pairs (RPO)
            loss = (-logps.chosen.sum() / logps.chosen_targets.sum().clamp(min=1)).expand_as(delta)
        else:
            raise ValueError(f"unknown DPO loss type {loss_type!r}")
        total = total + weight * loss
    return total


def pair_metrics(logps: PairLogProbs, beta: float) -> torch.Tensor:
    """PAIR_METRICS summed over the micro-batch's pairs (detached), fp32."""
    chosen_rewards = beta * (logps.chosen - logps.ref_chosen).detach()
    rejected_rewards = beta * (logps.rejected - logps.ref_rejected).detach()
    return torch.stack([chosen_rewards.sum(), rejected_rewards.sum(),
                        (chosen_rewards > rejected_rewards).float().sum(),
                        (chosen_rewards - rejected_rewards).sum(),
                        logps.chosen.detach().sum(), logps.rejected.detach().sum()])
