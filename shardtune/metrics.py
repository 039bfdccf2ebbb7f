"""The training metrics: one all-reduce and one device-to-host sync per optimizer step, and a logging window.

Every rank must learn at once whether any rank saw a non-finite loss or a stop signal, so one small reduce per
step is needed anyway; it also carries the loss, the gradient norm, the host-side token counts and the next
step's target count (the global loss divisor), so that neither the loss nor a logging step costs an extra
collective or an extra sync. `TrainMetrics` owns that look-ahead: `global_targets` hands each step the divisor
that the previous step's reduce brought (the first step reduces its own), `after_step` reduces the next one's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from shardtune.config import BatchSizes
from shardtune.data.batches import COUNT_KEYS, StepBatch
from shardtune.memory import peak_memory_gb, reset_phase_peak
from shardtune.models.flops import ModelShape, flops_per_token, mfu
from shardtune.parallel.groups import counted_here, loss_counted_here
from shardtune.plan.hardware import peak_flops
from shardtune.step import StepOutput

# Loss-scale overflows in a row after which a run stops as non-finite: from torch's initial scale (2^16) that many
# halvings reach 2^-16.
MAX_SKIPPED_IN_A_ROW = 32


@dataclass(frozen=True)
class StepSummary:
    """What every rank knows after a step, the same on every rank."""

    non_finite: bool
    stop_requested: bool
    loss: float
    grad_norm: float
    skipped_in_a_row: int = 0  # a loss scaler's overflows up to this step: the optimizer did not step


def step_vector(out: StepOutput, batch: StepBatch, stop_requested: bool, is_main_process: bool,
                loss_scaled: bool = False, counted: bool = True, loss_counted: bool = True) -> torch.Tensor:
    """[non-finite, stop, skipped, loss share, gradient norm, *counts, *method sums, *routing (a mixture of experts'
    load-balancing loss share and tokens per expert, shardtune.models.routing), next step's targets] on the loss's
    device, to be summed over ranks. The norm is global (the same on every rank): only the main process adds it, so the
    sum is exact; so are the counts (integers far below 2**53). With a dynamic loss scaler (`loss_scaled`, fp16)
    an infinite norm is an overflow the scaler skips the step for and lowers its scale after, as torch's
    GradScaler and DeepSpeed's do: counted as skipped, not as an error; a non-finite loss still is one. `counted`
    false (a tensor- or context-parallel rank after its group's first, which ran the same rows): its counts are
    left out of the sums, so that each token counts once; `loss_counted` false (a tensor-parallel rank after its
    group's first, which computed the same loss): its loss share too. A context-parallel rank's loss is its own
    positions' share: summed."""
    share, loss_share = (1.0 if counted else 0.0), (1.0 if loss_counted else 0.0)
    device = out.loss.device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if out.grad_norm is None:  # a strategy that computes none: nothing to check, NaN logged
        norm, overflow = torch.full((), float("nan"), device=device), zero
    else:
        norm, overflow = out.grad_norm, (~torch.isfinite(out.grad_norm)).to(torch.float64)
    non_finite = (~torch.isfinite(out.loss)).to(torch.float64)
    return torch.stack([
        non_finite if loss_scaled else torch.maximum(non_finite, overflow),
        torch.full((), float(stop_requested), dtype=torch.float64, device=device),
        overflow if loss_scaled else zero,
        out.loss.to(torch.float64) * loss_share,
        norm.to(torch.float64) if is_main_process else zero,  # not inf x 0: that would sum to NaN
        *(torch.full((), share * batch.counts[key], dtype=torch.float64, device=device) for key in COUNT_KEYS),
        *(out.method_sums.to(torch.float64) if out.method_sums is not None else ()),
        *(share * out.routing if out.routing is not None else ()),
        torch.full((), share * batch.next_targets, dtype=torch.float64, device=device),
    ])


def max_peaks(earlier: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """peak_memory_gb's figures, the larger of two times."""
    return {name: max(value, earlier.get(name, 0.0)) for name, value in now.items()}


class TrainMetrics:
    """Sums the steps of the current logging window on the host; `window` turns them into the logged row. Keeps
    the first and the last loss logged, for the run's closing line."""

    def __init__(self, accelerator: Accelerator, batching: BatchSizes, steps_per_epoch: int, shape: ModelShape,
                 peak_flops_per_gpu: float | None, loss_scaled: bool = False, adapters: int | None = None,
                 method_metrics: tuple[str, ...] = ()) -> None:
        """`adapters`: the trainable parameters of a frozen base (LoRA), which MFU counts (flops_per_token).
        `method_metrics`: the names of the step's method sums (StepOutput.method_sums), logged per target (per
        pair under DPO)."""
        self.accelerator, self.batching, self.steps_per_epoch = accelerator, batching, steps_per_epoch
        self.shape, self.peak_flops_per_gpu, self.loss_scaled = shape, peak_flops_per_gpu, loss_scaled
        self.adapters, self.method_metrics = adapters, method_metrics
        self._next_targets: torch.Tensor | None = None
        self.counted = counted_here(accelerator)  # this rank's rows enter the sums (shardtune.parallel.groups)
        self.loss_counted = loss_counted_here(accelerator)  # and its loss share
        self.skipped_in_a_row = 0
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self._reset()

    def global_targets(self, batch: StepBatch) -> torch.Tensor:
        """The step's target count over all ranks, on the device: summed with the previous step's vector, or
        (the first step) by an all-reduce of its own."""
        if self._next_targets is not None:
            return self._next_targets
        local = torch.full((), batch.counts["targets"] if self.counted else 0, dtype=torch.long,
                           device=self.accelerator.device)
        return self.accelerator.reduce(local, "sum")

    def _reset(self) -> None:
        self.started, self.paused_s, self.steps, self.skipped, self.loss = time.perf_counter(), 0.0, 0, 0, 0.0
        self.counts = dict.fromkeys(COUNT_KEYS, 0.0)
        self.method_sums = [0.0] * len(self.method_metrics)
        self.routing = [0.0] * (1 + self.shape.experts if self.shape.experts else 0)
        self.peak_before_pauses: dict[str, float] = {}  # the window's training peak up to its last pause
        reset_phase_peak(self.accelerator.device)  # each window logs its own peak

    @contextmanager
    def paused(self) -> Iterator[dict[str, float]]:
        """Time and memory that are not training's (a checkpoint save, an eval): left out of the window's time and
        peak. Yields the pause's own peak (peak_memory_gb's keys), filled in as it ends."""
        device, started = self.accelerator.device, time.perf_counter()
        self.peak_before_pauses = max_peaks(self.peak_before_pauses, peak_memory_gb(device))
        reset_phase_peak(device)
        measured: dict[str, float] = {}
        try:
            yield measured
        finally:
            self.paused_s += time.perf_counter() - started
            measured.update(peak_memory_gb(device))
            reset_phase_peak(device)

    def after_step(self, out: StepOutput, batch: StepBatch, stop_requested: bool) -> StepSummary:
        vector = step_vector(out, batch, stop_requested, self.accelerator.is_main_process, self.loss_scaled,
                             self.counted, self.loss_counted)
        summed = self.accelerator.reduce(vector, "sum")  # the step's one collective
        self._next_targets = summed[-1].to(torch.long)  # stays on the device: the next step's loss divisor
        non_finite, stop, skipped, loss, grad_norm, *rest, _ = summed.tolist()  # the step's one device-to-host sync
        counts, method_sums = rest[:len(COUNT_KEYS)], rest[len(COUNT_KEYS):len(COUNT_KEYS) + len(self.method_metrics)]
        routing = rest[len(COUNT_KEYS) + len(self.method_metrics):]
        self.routing = [total + value for total, value in zip(self.routing, routing, strict=True)]
        self.steps += 1
        self.skipped += skipped > 0
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped > 0 else 0
        self.loss += loss
        for key, value in zip(COUNT_KEYS, counts, strict=True):
            self.counts[key] += value
        self.method_sums = [total + value for total, value in zip(self.method_sums, method_sums, strict=True)]
        # A scaler halves its scale at each overflow: so many in a row are gradients that are not finite at any
        # scale, which torch's GradScaler would skip forever (DeepSpeed's stops at its minimum scale).
        non_finite = non_finite > 0 or self.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW
        return StepSummary(non_finite, stop > 0, loss, grad_norm, self.skipped_in_a_row)

    def window(self, step: int, last: StepSummary, lr: float) -> dict[str, float]:
        """The row logged at `step`, over the steps since the previous one; starts the next window. With a loss
        scaler, the steps it skipped on an overflow."""
        elapsed, tokens = time.perf_counter() - self.started - self.paused_s, self.counts["tokens"]
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
            **max_peaks(self.peak_before_pauses, peak_memory_gb(self.accelerator.device)),
            **{name: total / self.counts["targets"] for name, total in zip(self.method_metrics, self.method_sums,
                                                                            strict=True)},
        }
        if self.routing:  # the load-balancing loss as transformers' aux_loss (its weighted share is in "loss")
            row["aux_loss"] = self.routing[0] / self.steps
            row["routed_tokens_per_expert"] = [round(count) for count in self.routing[1:]]
            routed = self.routing[1:]  # the busiest expert's load over the mean: 1.0 is a perfect balance
            row["expert_load_max_over_mean"] = max(routed) * len(routed) / sum(routed) if sum(routed) else 0.0
        if not math.isfinite(row["grad_norm"]):  # the last step overflowed under a loss scaler (or had no norm):
            del row["grad_norm"]  # metrics.jsonl stays JSON, which has no inf or NaN
        if self.loss_scaled:
            row["skipped_steps"] = self.skipped
        if self.peak_flops_per_gpu:  # MFU as PaLM defines it; T is the mean sequence length of the window
            per_token = flops_per_token(self.shape, round(tokens / self.counts["sequences"]), adapters=self.adapters)
            row["tflops_per_gpu"] = tokens / elapsed * per_token / world / 1e12
            row["mfu"] = mfu(tokens / elapsed, per_token, world, self.peak_flops_per_gpu)
        self.first_loss = row["loss"] if self.first_loss is None else self.first_loss
        self.last_loss = row["loss"]
        self._reset()
        return row


def device_peak_flops(accelerator: Accelerator) -> float | None:
    """The GPU's peak bf16 FLOP/s, for MFU (None on CPU, or for a GPU shardtune.plan.hardware does not know)."""
    on_gpu = accelerator.device.type == "cuda"
    return peak_flops(torch.cuda.get_device_name(accelerator.device)) if on_gpu else None
