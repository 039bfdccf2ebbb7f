"""Held-out loss and next-token accuracy, without the full-vocabulary logits.

The loss and the argmax run as the LM head's forward, swapped in for the eval forward (as the tiled training loss
does, shardtune.levers.tiled_loss): the head computes its logits for one chunk of positions at a time, in the compute
dtype, each upcast to fp32 on its own. For Llama 3 (128,256 tokens) the logits of 8 x 4096 positions would be
8.4 GB in bf16, and accelerate's autocast wrapper returns a model's outputs in fp32 (convert_outputs_to_fp32:
17 GB more, which FSDP2's output cast then rounds back to bf16 in a third copy); a chunk of 1,024 positions is
0.5 GB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

from shardtune.config import EVAL_CHUNK_POSITIONS
from shardtune.data.batches import COUNTS
from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.levers.tiled_loss import forward_replaced, shifted_labels
from shardtune.parallel.context import context_group, context_parallel, context_parallel_size
from shardtune.parallel.groups import rows_once
from shardtune.parallel.sequence import sequence_group, sequence_shards, split_size


def chunk_statistics(logits_of: Callable[[int, int, int], torch.Tensor], targets: torch.Tensor, positions: int,
                     device: torch.device, chunk: int) -> torch.Tensor:
    """Per row: [sum of target-token losses, targets, correct next-token predictions], fp32, on `device`, from
    `logits_of(row, start, end)`, the logits of positions start..end-1 of a row of `positions`, and `targets`,
    each position's next-token label (labels shifted as the causal LM loss compares them: batch_targets)."""
    rows = []
    for row, row_targets in enumerate(targets):
        totals = torch.zeros(3, device=device)
        for start in range(0, positions, chunk):
            end = min(start + chunk, positions)
            predicted, expected = logits_of(row, start, end).float(), row_targets[start:end]
            mask = expected != IGNORE_INDEX
            loss = F.cross_entropy(predicted, expected, ignore_index=IGNORE_INDEX, reduction="sum")
            correct = ((predicted.argmax(-1) == expected) & mask).sum()
            totals += torch.stack([loss, mask.sum().float(), correct.float()])
        rows.append(totals)
    return torch.stack(rows)


def batch_targets(batch: dict) -> torch.Tensor:
    """Each position's next-token label: a slice of the sequence split carries them (`shift_labels`), else the
    labels shifted by one."""
    return batch["shift_labels"] if "shift_labels" in batch else shifted_labels(batch["labels"])


def row_statistics(logits: torch.Tensor, targets: torch.Tensor, chunk: int = EVAL_CHUNK_POSITIONS) -> torch.Tensor:
    """chunk_statistics of full (batch, positions, vocab) logits and each position's next-token label."""
    return chunk_statistics(lambda row, start, end: logits[row, start:end], targets, logits.shape[1], logits.device,
                            chunk)


def head_statistics(model: torch.nn.Module, unwrapped: torch.nn.Module, batch: dict,
                    chunk: int = EVAL_CHUNK_POSITIONS) -> torch.Tensor:
    """chunk_statistics of a batch, computed inside the model's forward as its LM head's, which reads the head's
    weight where each strategy gathers it and applies it to one chunk of positions at a time (under autocast, in
    the compute dtype, as the head's own forward would)."""
    head = unwrapped.get_output_embeddings()
    targets = batch_targets(batch)
    computed = []

    def statistics_forward(hidden_states: torch.Tensor) -> torch.Tensor:
        def logits_of(row: int, start: int, end: int) -> torch.Tensor:
            return F.linear(hidden_states[row, start:end], head.weight, head.bias)

        computed.append(chunk_statistics(logits_of, targets, hidden_states.shape[1], hidden_states.device, chunk))
        return computed[-1]

    with forward_replaced(head, statistics_forward):
        model(**model_inputs(batch))
    return computed[0]  # not the forward's output: FSDP2's output cast would round it to bf16


def logits_statistics(model: torch.nn.Module, unwrapped: torch.nn.Module, batch: dict) -> torch.Tensor:
    """chunk_statistics from the model's full logits (a head that is not plain_head)."""
    return row_statistics(model(**model_inputs(batch)).logits, batch_targets(batch))


def model_inputs(batch: dict) -> dict:
    """What the eval forward takes of a batch: the ids, and the mask or (under the sequence split) positions."""
    return {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids") if key in batch}


def plain_head(unwrapped: torch.nn.Module) -> bool:
    """Whether the LM head is a linear layer whose output is the logits: torch's Linear forward (FSDP2's
    fully_shard makes it an FSDPLinear subclass with that forward), not one with a LoRA adapter (peft's layer
    reads its base weight as `.weight`), nor one whose forward an instance replaced (transformers' tensor-parallel
    wrapper, which gathers the logits), nor a model that scales or caps its logits after it."""
    config, head = unwrapped.config, unwrapped.get_output_embeddings()
    own_forward = type(head).forward is torch.nn.Linear.forward and "forward" not in vars(head)
    return isinstance(head, torch.nn.Linear) and own_forward and \
        getattr(config, "final_logit_softcapping", None) is None and getattr(config, "logit_scale", 1.0) == 1.0 \
        and getattr(config, "logits_scaling", 1.0) == 1.0


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, accelerator: Accelerator) -> dict[str, float]:
    """Mean loss and next-token accuracy over every target token of the held-out split, all ranks together. A head
    that is not plain_head runs its own forward: the statistics come from its full logits, a chunk at a time.
    Under the sequence split each batch runs split as in training (split_statistics), under context parallelism
    too (context_statistics)."""
    model.eval()
    unwrapped = accelerator.unwrap_model(model)
    statistics = head_statistics if plain_head(unwrapped) else logits_statistics
    split, context = split_size(accelerator) > 1, context_parallel_size(accelerator)
    totals = torch.zeros(3, device=accelerator.device)  # loss sum, targets, correct
    for batch in loader:
        batch.pop(COUNTS)
        if split:
            per_row = split_statistics(statistics, model, unwrapped, batch, accelerator.device)
        elif context > 1:
            per_row = context_statistics(statistics, model, unwrapped, batch, accelerator, context)
        else:
            per_row = statistics(model, unwrapped, batch)
        totals += rows_once(accelerator, per_row).sum(0)  # drops the rows padded in for even batches
    model.train()
    loss_sum, targets, correct = totals.tolist()
    return {"eval_loss": loss_sum / targets, "eval_accuracy": correct / targets}


def split_statistics(statistics: Callable[..., torch.Tensor], model: torch.nn.Module, unwrapped: torch.nn.Module,
                     batch: dict, device: torch.device) -> torch.Tensor:
    """This rank's rows' `statistics` under the sequence split: each rank computes its slice of every batch of its
    group (shardtune.parallel.sequence.sequence_shards, in the group's rank order), and a sum over the group
    gives every batch's per-row statistics, of which this rank keeps its own (so that gather_for_metrics drops
    the padded rows as without the split)."""
    import torch.distributed as dist

    group, rank = sequence_group()
    slices = torch.stack([statistics(model, unwrapped, shard) for shard in sequence_shards([batch], device)])
    dist.all_reduce(slices, group=group)
    return slices[rank]


def context_statistics(statistics: Callable[..., torch.Tensor], model: torch.nn.Module, unwrapped: torch.nn.Module,
                       batch: dict, accelerator: Accelerator, cp_size: int) -> torch.Tensor:
    """The rows' `statistics` under context parallelism: each rank of a group computes those of its chunks of the
    group's rows (the ring attention inside, shardtune.parallel.context), and a sum over the group gives each
    row's, the same on every rank of it (rows_once keeps the group's first)."""
    import torch.distributed as dist

    with context_parallel(accelerator, batch, cp_size) as chunks:
        per_row = statistics(model, unwrapped, chunks)
    dist.all_reduce(per_row, group=context_group(accelerator))
    return per_row
