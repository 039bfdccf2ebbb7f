"""One optimizer step: this rank's micro-batches, the token-normalised loss, backward, clip, step.

Nothing here reads a value back from the device: the step returns device tensors and the host-side counts the
collator made, and the metrics window (shardtune.metrics) syncs once per step. Mixing devices is the usual way
a loop that runs on CPU crashes on CUDA: every tensor made here is made on the model's device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor

from shardtune.config import BatchPlan
from shardtune.data import COUNTS

COUNT_KEYS = ("targets", "tokens", "processed", "sequences")


@dataclass
class StepOutput:
    loss: torch.Tensor  # this rank's share of the global batch's mean loss (the ranks' shares add up to it)
    grad_norm: torch.Tensor | None  # the global gradient norm before clipping; None where the strategy has none
    counts: dict[str, int]  # this rank's host-side counts over the step's micro-batches (see data.CountingCollator)


def take_counts(micro_batches: list[dict]) -> dict[str, int]:
    """Remove the collator's counts from the batches (the model must not see them) and add them up."""
    counts = [batch.pop(COUNTS) for batch in micro_batches]
    return {key: sum(count[key] for count in counts) for key in COUNT_KEYS}


def with_counts(batches: Iterator[list[dict]]) -> Iterator[tuple[list[dict], dict[str, int], dict[str, int]]]:
    """Each step's micro-batches with their host-side counts, and the next step's counts: the next step's
    target count can then travel in this step's one all-reduce (shardtune.metrics), so that the global count
    every loss is divided by costs no collective of its own."""
    current = next(batches)
    counts = take_counts(current)
    for upcoming in batches:
        upcoming_counts = take_counts(upcoming)
        yield current, counts, upcoming_counts
        current, counts = upcoming, upcoming_counts


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
               micro_batches: list[dict], counts: dict[str, int], targets: torch.Tensor, plan: BatchPlan,
               max_grad_norm: float, after_backward: Callable[[int], None] | None = None) -> StepOutput:
    """The loss of an update is (sum of all target-token losses of the global batch) / (their count), however
    the batch is split over micro-batches and ranks: `targets` is that count over every rank, on the device,
    and `counts` this rank's host-side counts (see `with_counts`). `after_backward(i)` runs after the
    backward of micro-batch i (the memory probe, fault injection)."""
    device = accelerator.device
    loss_sum = torch.zeros((), device=device)
    for index, batch in enumerate(micro_batches):
        with accelerator.accumulate(model):
            loss = model(**batch, num_items_in_batch=targets).loss  # this micro-batch's share of the mean
            loss_sum += loss.detach()
            # accelerate divides by the accumulation steps and the ranks average gradients: undo both.
            accelerator.backward(loss * plan.accumulation * plan.world_size)
            # The spent graph would outlive the loop into the optimizer step: under LoRA with recomputation its
            # leaves include the embedding output (made to require grad by peft) and that output's gradient.
            del loss
            if after_backward is not None:
                after_backward(index)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)  # only on the update
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return StepOutput(loss=loss_sum, grad_norm=norm_on_device(grad_norm, device), counts=counts)


def norm_on_device(norm: torch.Tensor | float | None, device: torch.device) -> torch.Tensor | None:
    """The gradient norm as a plain fp32 tensor on `device`: FSDP2 returns a DTensor, DeepSpeed a tensor or a
    float (inf after an overflow), or None where it computes no norm."""
    if norm is None:
        return None
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if isinstance(norm, torch.Tensor):
        return norm.detach().to(device=device, dtype=torch.float32)
    return torch.full((), float(norm), device=device)
