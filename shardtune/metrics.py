"""The training metrics: one all-reduce and one device-to-host sync per optimizer step, and a logging window.

Every rank must learn at once whether any rank saw a non-finite loss or a stop signal, so one small reduce per
step is needed anyway; it also carries the loss, the gradient norm, the host-side token counts and the next
step's target count (the global loss divisor), so that neither the loss nor a logging step costs an extra
collective or an extra sync. `TrainMetrics` owns that look-ahead: `global_targets` hands each step the divisor
that the previous step's reduce brought (the first step reduces its own), `after_step` reduces the next one's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from shardtune.batches import COUNT_KEYS, StepBatch
from shardtune.config import BatchSizes
from shardtune.flops import ModelShape, flops_per_token, mfu
from shardtune.memory import peak_memory_gb
from shardtune.step import StepOutput


@dataclass(frozen=True)
class StepSummary:
    """What every rank knows after a step, the same on every rank."""

    non_finite: bool
    stop_requested: bool
    loss: float
    grad_norm: float


def step_vector(out: StepOutput, batch: StepBatch, stop_requested: bool, is_main_process: bool) -> torch.Tensor:
    """[non-finite, stop, loss share, gradient norm, *counts, next step's targets] on the loss's device, to be
    summed over ranks. The norm is global (the same on every rank): only the main process adds it, so the sum is
    exact; so are the counts (integers far below 2**53)."""
    device = out.loss.device
    norm = out.grad_norm if out.grad_norm is not None else torch.full((), float("nan"), device=device)
    checked = norm if out.grad_norm is not None else torch.zeros((), device=device)
    non_finite = ~(torch.isfinite(out.loss) & torch.isfinite(checked))
    return torch.stack([
        non_finite.to(torch.float64),
        torch.full((), float(stop_requested), dtype=torch.float64, device=device),
        out.loss.to(torch.float64),
        norm.to(torch.float64) * float(is_main_process),
        *(torch.full((), float(batch.counts[key]), dtype=torch.float64, device=device) for key in COUNT_KEYS),
        torch.full((), float(batch.next_targets), dtype=torch.float64, device=device),
    ])


class TrainMetrics:
    """Sums the steps of the current logging window on the host; `window` turns them into the logged row. Keeps
    the first and the last loss logged, for the run's closing line."""

    def __init__(self, accelerator: Accelerator, batching: BatchSizes, steps_per_epoch: int, shape: ModelShape,
                 peak_flops_per_gpu: float | None) -> None:
        self.accelerator, self.batching, self.steps_per_epoch = accelerator, batching, steps_per_epoch
        self.shape, self.peak_flops_per_gpu = shape, peak_flops_per_gpu
        self._next_targets: torch.Tensor | None = None
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._reset()

    def global_targets(self, batch: StepBatch) -> torch.Tensor:
        """The step's target count over all ranks, on the device: summed with the previous step's vector, or
        (the first step) by an all-reduce of its own."""
        if self._next_targets is not None:
            return self._next_targets
        local = torch.full((), batch.counts["targets"], dtype=torch.long, device=self.accelerator.device)
        return self.accelerator.reduce(local, "sum")

    def _reset(self) -> None:
        self.started, self.steps, self.loss = time.perf_counter(), 0, 0.0
        self.counts = dict.fromkeys(COUNT_KEYS, 0.0)

    def after_step(self, out: StepOutput, batch: StepBatch, stop_requested: bool) -> StepSummary:
        vector = step_vector(out, batch, stop_requested, self.accelerator.is_main_process)
        summed = self.accelerator.reduce(vector, "sum")  # the step's one collective
        self._next_targets = summed[-1].to(torch.long)  # stays on the device: the next step's loss divisor
        non_finite, stop, loss, grad_norm, *counts, _ = summed.tolist()  # the step's one device-to-host sync
        self.steps += 1
        self.loss += loss
        for key, value in zip(COUNT_KEYS, counts, strict=True):
            self.counts[key] += value
        return StepSummary(non_finite > 0, stop > 0, loss, grad_norm)

    def window(self, step: int, last: StepSummary, lr: float) -> dict[str, float]:
        """The row logged at `step`, over the steps since the previous one; starts the next window."""
        elapsed, tokens = time.perf_counter() - self.started, self.counts["tokens"]
        world = self.batching.world_size
        row = {
            "loss": self.loss / self.steps,
            "lr": lr,
            "grad_norm": last.grad_norm,
            "tokens_per_second": tokens / elapsed,
            "tokens_per_second_per_device": tokens / elapsed / world,
            "token_utilization": tokens / self.counts["processed"],  # padding wastes the rest
            # means over the window: with --packing_strategy bfd a step's rows hold a varying number of sequences
            "sequences_per_step": self.counts["sequences"] / self.steps,
            "tokens_per_step": tokens / self.steps,
            "step_time_s": elapsed / self.steps,
            "epoch": step / self.steps_per_epoch,
            **peak_memory_gb(self.accelerator.device),
        }
        if self.peak_flops_per_gpu:  # MFU as PaLM defines it; T is the mean sequence length of the window
            per_token = flops_per_token(self.shape, seq_len=round(tokens / self.counts["sequences"]))
            row["tflops_per_gpu"] = tokens / elapsed * per_token / world / 1e12
            row["mfu"] = mfu(tokens / elapsed, per_token, world, self.peak_flops_per_gpu)
        self.first_loss = row["loss"] if self.first_loss is None else self.first_loss
        self.last_loss = row["loss"]
        self._reset()
        return row
