"""Held-out loss and next-token accuracy, without full-vocabulary fp32 logits.

The model's logits stay in its compute dtype (one copy); loss and argmax run over chunks of positions, each
upcast to fp32 on its own. For Llama 3 (128,256 tokens) a full fp32 copy of 8 x 4096 positions is 17 GB, and
cross-entropy on it makes a second one; a chunk of 1,024 positions is 0.5 GB.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from shardtune.batches import COUNTS
from shardtune.config import EVAL_CHUNK_POSITIONS
from shardtune.data import IGNORE_INDEX


def row_statistics(logits: torch.Tensor, labels: torch.Tensor, chunk: int = EVAL_CHUNK_POSITIONS) -> torch.Tensor:
    """Per row: [sum of target-token losses, targets, correct next-token predictions], fp32, on the logits'
    device. Position t predicts label t + 1, as the causal LM loss compares them."""
    rows = []
    for row_logits, row_labels in zip(logits, labels, strict=True):
        totals = torch.zeros(3, device=logits.device)
        positions = row_logits.shape[0] - 1
        for start in range(0, positions, chunk):
            end = min(start + chunk, positions)
            predicted, targets = row_logits[start:end].float(), row_labels[start + 1:end + 1]
            mask = targets != IGNORE_INDEX
            loss = F.cross_entropy(predicted, targets, ignore_index=IGNORE_INDEX, reduction="sum")
            correct = ((predicted.argmax(-1) == targets) & mask).sum()
            totals += torch.stack([loss, mask.sum().float(), correct.float()])
        rows.append(totals)
    return torch.stack(rows)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
    """Mean loss and next-token accuracy over every target token of the held-out split, all ranks together."""
    model.eval()
    totals = torch.zeros(3, device=accelerator.device)  # loss sum, targets, correct
    for batch in loader:
        batch.pop(COUNTS)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        per_row = row_statistics(logits, batch["labels"])
        del logits
        totals += accelerator.gather_for_metrics(per_row).sum(0)  # drops the rows padded in for even batches
    model.train()
    loss_sum, targets, correct = totals.tolist()
    return {"eval_loss": loss_sum / targets, "eval_accuracy": correct / targets}
