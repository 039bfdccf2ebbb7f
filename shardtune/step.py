"""One optimizer step: this rank's micro-batches, the token-normalised loss, backward, clip, step.

Nothing here reads a value back from the device: the step returns device tensors (and the learning rate it
used, already a host number), and the metrics window (shardtune.metrics) syncs once per step. DeepSpeed's own
step is the exception: with gradient clipping on it checks its device norm for inf/NaN on the host
(deepspeed.runtime.utils.is_invalid_grad_norm, in every ZeRO stage), one sync inside `backward` that this module
cannot remove. Mixing devices is the usual way a loop that runs on CPU crashes on CUDA: every tensor made here is
made on the model's device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from shardtune.config import BatchSizes
from shardtune.levers.tiled_loss import LABEL_KEYS, chunked_token_loss
from shardtune.models.routing import routers_recorded, with_router_loss
from shardtune.parallel.context import context_parallel
from shardtune.parallel.sequence import SequenceSplit, sequence_shards

if TYPE_CHECKING:
    from shardtune.methods.dpo import DPOStep


@dataclass
class StepOutput:
    loss: torch.Tensor  # this rank's share of the global batch's mean loss (the ranks' shares add up to it)
    grad_norm: torch.Tensor | None  # the global gradient norm before clipping; None where the strategy has none
    lr: float  # the learning rate this step's update used (a host number: no sync)
    method_sums: torch.Tensor | None = None  # a method's metrics summed over this rank's micro-batches (DPO's rewards)
    # a mixture of experts': [load-balancing loss share, tokens routed per expert...] over this rank's micro-batches
    routing: torch.Tensor | None = None


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
               micro_batches: list[dict], targets: torch.Tensor, batching: BatchSizes, max_grad_norm: float,
               after_backward: Callable[[int], None] | None = None, *, chunked_cross_entropy: bool,
               fused_loss: bool = False, sequence_split: SequenceSplit | None = None, method: DPOStep | None = None,
               context_size: int = 1) -> StepOutput:
    """The loss of an update is (sum of all target-token losses of the global batch) / (their count), however
    the batch is split over micro-batches and ranks: `targets` is that count over every rank, on the device
    (shardtune.metrics.TrainMetrics.global_targets). `after_backward(i)` runs after the backward of micro-batch
    i (the memory probe, fault injection). `chunked_cross_entropy`: the loss over tiles of positions
    (shardtune.levers.tiled_loss) instead of over the micro-batch's full logits; with `fused_loss` (--use_liger_kernel),
    Liger's fused linear cross-entropy in the tiles' place. `sequence_split`: this rank runs its slice of every
    micro-batch of its group instead (shardtune.parallel.sequence): sp x as many micro-batches, each 1/sp long,
    whose losses over `targets` still add up, over the ranks, to the global batch's mean. `context_size` over 1: each
    micro-batch runs as this rank's chunks of its rows, torch's ring attention inside (shardtune.parallel.context):
    as many micro-batches, each 1/cp long. `method`: DPO's loss over the micro-batch's pairs instead, `targets`
    counting pairs (shardtune.methods.dpo)."""
    # accelerate (DeepSpeed's engine) divides by the accumulation steps and the ranks average gradients: the loss is
    # scaled by both, so that the update's gradient is the global batch's. Under the split the engine's steps are
    # sp x the accumulation and it averages over world / sp ranks (x reduction_factor): the same product, times that.
    # Under tensor parallelism FSDP2 averages over the data ranks only (world / tp): the ranks of a group hold slices.
    # Under context parallelism it averages over every rank (world), cp of which share each row's tokens.
    scale = batching.accumulation * batching.data_parallel_size * \
        (sequence_split.reduction_factor if sequence_split else 1) * context_size
    device = accelerator.device
    unwrapped = accelerator.unwrap_model(model)
    # Read before anything steps the scheduler: afterwards it holds the next step's rate.
    lr = float(scheduler.get_last_lr()[0])  # torchao's optimizers keep it as a host tensor: no sync
    loss_sum, method_sums, routing = torch.zeros((), device=device), None, None
    if sequence_split is not None:
        micro_batches = sequence_shards(micro_batches, device)
    for index, whole in enumerate(micro_batches):
        with accelerator.accumulate(model), context_parallel(accelerator, whole, context_size) as batch:
            with routers_recorded(unwrapped) as router_logits:  # a mixture of experts' (shardtune.models.routing)
                if method is not None:
                    loss, sums = method.loss(model, unwrapped, batch, targets)
                    method_sums = sums if method_sums is None else method_sums + sums
                elif chunked_cross_entropy:  # this micro-batch's share of the mean
                    loss = chunked_token_loss(model, unwrapped, batch, targets, fused=fused_loss)
                else:
                    loss = token_loss(model, unwrapped, batch, targets)
            loss, routed = with_router_loss(unwrapped, loss, router_logits, batch,
                                            batching.accumulation * batching.data_parallel_size)
            routing = routed if routing is None else routing + routed
            loss_sum += loss.detach()
            accelerator.backward(loss * scale)
            # The spent graph would outlive the loop into the optimizer step: under LoRA with recomputation its
            # leaves include the embedding output (made to require grad by peft) and that output's gradient.
            del loss
            if after_backward is not None:
                after_backward(index)
    grad_norm = global_grad_norm(accelerator, model, max_grad_norm)  # only on the update
    optimizer.step()
    if not accelerator.optimizer_step_was_skipped:  # a loss scaler's overflow (a host flag): the schedule waits too,
        scheduler.step()  # as in transformers' Trainer
    optimizer.zero_grad()
    return StepOutput(loss=loss_sum, grad_norm=norm_on_device(grad_norm, device), lr=lr, method_sums=method_sums,
                      routing=routing)


def token_loss(model: torch.nn.Module, unwrapped: torch.nn.Module, batch: dict, targets: torch.Tensor
               ) -> torch.Tensor:
    """The micro-batch's summed target-token loss over `targets`, in fp32, by the model's own loss function
    (transformers' ForCausalLMLoss: it upcasts the logits) applied outside the model's forward. A loss the forward
    returned would pass through FSDP2's output cast (MixedPrecisionPolicy.output_dtype, bf16 here so that eval's
    logits stay bf16), which casts every floating output of the root module: the loss would come back rounded to
    bf16 (up to 0.4%). The logits lose nothing in that cast: they are computed in bf16."""
    logits = model(**{key: value for key, value in batch.items() if key not in LABEL_KEYS}).logits
    # A slice of the sequence split carries its labels already shifted (its last position's label is the next
    # slice's first token).
    return unwrapped.loss_function(logits=logits, labels=batch.get("labels"), shift_labels=batch.get("shift_labels"),
                                   vocab_size=unwrapped.config.vocab_size, num_items_in_batch=targets)


def global_grad_norm(accelerator: Accelerator, model: torch.nn.Module, max_grad_norm: float
                     ) -> torch.Tensor | float | None:
    """Clip (DDP, FSDP) and return the global gradient norm before clipping. DeepSpeed clipped inside the step
    `accelerator.backward` ran on the last micro-batch; its engine holds that step's norm, a device tensor (a float
    inf after an overflow, None where it computes none). Read from the engine, not through
    accelerator.clip_grad_norm_, which calls `.item()` on it: a host sync that waits for the whole optimizer step."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return model.get_global_grad_norm()
    max_grad_norm = clipping_limit(max_grad_norm)
    parameters = [param for param in model.parameters() if param.grad is not None]
    if parameters and parameters[0].grad.dtype == torch.bfloat16:
        return clip_bf16_gradients(parameters, max_grad_norm)
    return accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)


def clipping_limit(max_grad_norm: float) -> float:
    """The norm torch clips to: --max_grad_norm 0 clips nothing, as in transformers' Trainer (and DeepSpeed's
    gradient_clipping 0); torch would scale every gradient to zero."""
    return max_grad_norm if max_grad_norm > 0 else float("inf")


def clip_bf16_gradients(parameters: list[torch.nn.Parameter], max_grad_norm: float) -> torch.Tensor:
    """Clip bf16 gradients (--bf16_stochastic_round) by their global norm summed in fp32, and return that norm.
    torch's clip_grad_norm_ keeps each tensor's norm, and their total, in the gradients' dtype: the norm that
    decides the clipping would be rounded to bf16's three digits. Each norm reads its bf16 gradient in place."""
    norms = [torch.linalg.vector_norm(param.grad, 2.0, dtype=torch.float32) for param in parameters]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    if isinstance(total, DTensor):  # FSDP2: a sum over the shards, replicated on every rank
        total = total.full_tensor()
        replicated = DTensor.from_local(total, parameters[0].grad.device_mesh)
        torch.nn.utils.clip_grads_with_norm_(parameters, max_grad_norm, replicated)
    else:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_grad_norm, total)
    return total


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
