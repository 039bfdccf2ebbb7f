"""Micro-batches and optimizer steps: the collator that pads or packs rows and counts their tokens on the host,
and this rank's micro-batches of each optimizer step with those counts (the loss divisor among them)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerBase

from shardtune.config import BatchSizes
from shardtune.data.packing import SEQUENCE_LENGTHS, split_rows
from shardtune.data.tokenize import IGNORE_INDEX

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


COUNTS = "counts"  # batch key of the collator's host-side counts; taken out before the batch reaches the model
COUNT_KEYS = ("targets", "tokens", "processed", "sequences")  # what CountingCollator counts, in this order
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")


def make_collator(tokenizer: PreTrainedTokenizerBase, packing: bool = False, attn_implementation: str = "sdpa",
                  multiple: int = 1, unmasked: bool = False) -> CountingCollator:
    """Padded: each micro-batch padded to its longest row (padded labels IGNORE_INDEX). Packed (padding-free):
    the micro-batch's sequences concatenated into one row with position ids restarting at every sequence and
    the first label of each sequence masked. Flash attention gets the sequence boundaries from the collator
    (`cu_seq_lens`, computed on the host: no device sync in every layer); flex attention, SDPA and eager derive
    per-sequence attention from the position ids (SDPA and eager through a dense mask, see checks.check_attention).
    Rows packed before (--packing_strategy bfd, shardtune.data.packing) are split into their sequences first, so a
    micro-batch of them is packed the same way.
    `multiple` (shardtune.config.token_multiple): the padded length, or the packed row's, a multiple of it; a
    packed row is padded with one more sequence of pad tokens that carries no loss (its own positions, so it
    attends to nothing else). `unmasked`: for the sequence split (shardtune.parallel.sequence), padded rows carry
    their position ids (0, 1, ... per row), which the split needs before it cuts the rows, and no attention mask:
    Ulysses drops it, and without one transformers builds no dense mask of the whole sequence. Rows are padded on
    the right, after every real token, which a causal kernel never lets them see. Packed rows carry no mask."""
    if packing:
        # Under the sequence split flash attention finds the boundaries in the position ids Ulysses gathers whole:
        # the collator's would be those of the unsplit row.
        inner = DataCollatorWithFlattening(return_tensors="pt", separator_id=IGNORE_INDEX,
                                           return_flash_attn_kwargs=attn_implementation in FLASH_ATTENTION
                                           and not unmasked)
    else:
        inner = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=IGNORE_INDEX,
                                       return_tensors="pt", pad_to_multiple_of=multiple if multiple > 1 else None)
    return CountingCollator(inner, tokenizer.pad_token_id if packing else None, multiple, unmasked and not packing)


class CountingCollator:
    """Adds, under COUNTS, what the trainer needs to know of a micro-batch as plain integers counted on the host
    while the batch is built: the step never reads them back from the device.
    targets: tokens that carry loss (labels shifted by one, as the causal LM loss compares them);
    tokens: sequence tokens (not padding); processed: tokens the model runs on; sequences: sequences before
    packing (several per row packed by shardtune.data.packing, whose rows are split into them here)."""

    def __init__(self, inner, row_pad_id: int | None = None, multiple: int = 1, unmasked: bool = False) -> None:
        self.inner = inner
        self.row_pad_id, self.multiple = row_pad_id, multiple  # row_pad_id: packing's, None when inner pads
        self.unmasked = unmasked  # padded rows: position ids in place of the attention mask

    def __call__(self, features: list[dict]) -> dict:
        if SEQUENCE_LENGTHS in features[0]:
            features = split_rows(features)
        batch = self.inner(features + self.padding_sequence(features))
        if self.unmasked:
            rows, length = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
            del batch["attention_mask"]
        lengths = [len(feature["input_ids"]) for feature in features]
        batch[COUNTS] = {
            "targets": int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()),
            "tokens": sum(lengths),
            "processed": batch["input_ids"].numel(),
            "sequences": len(features),
        }
        return batch

    def padding_sequence(self, features: list[dict]) -> list[dict]:
        """The packed row's padding up to `multiple`, as one more sequence with no targets; [] when none."""
        missing = -sum(len(feature["input_ids"]) for feature in features) % self.multiple
        if self.row_pad_id is None or not missing:
            return []
        return [{"input_ids": [self.row_pad_id] * missing, "labels": [IGNORE_INDEX] * missing}]


def take_counts(micro_batches: list[dict]) -> dict[str, int]:
    """Remove the collator's counts from the batches (the model must not see them) and add them up."""
    counts = [batch.pop(COUNTS) for batch in micro_batches]
    return {key: sum(count[key] for count in counts) for key in COUNT_KEYS}


# ---------------------------------------------------------------------------------------------------------------
# Optimizer steps.


def global_batches(loader: DataLoader, batching: BatchSizes, steps_per_epoch: int, start_step: int = 0
                   ) -> Iterator[list[dict]]:
    """This rank's micro-batches of each optimizer step after `start_step`. The prepared loader deals
    micro-batches to ranks in turn, so one step covers `global_batch` consecutive rows of the epoch's seeded
    shuffle on any split. The epoch's tail that does not fill a global batch is skipped. A resumed run
    re-seeds the same epoch and skips the micro-batches already trained on, so it sees the same data."""
    epoch, done_in_epoch = divmod(start_step, steps_per_epoch)
    while True:
        loader.set_epoch(epoch)
        micro_batches = iter(loader)
        for _ in range(done_in_epoch * batching.accumulation):
            next(micro_batches)
        for _ in range(steps_per_epoch - done_in_epoch):
            yield [next(micro_batches) for _ in range(batching.accumulation)]
        epoch, done_in_epoch = epoch + 1, 0


@dataclass
class StepBatch:
    """One optimizer step's data on this rank: its micro-batches (counts taken out), their host-side counts, and
    the next step's target count (shardtune.metrics sums it over ranks in this step's all-reduce)."""

    micro_batches: list[dict]
    counts: dict[str, int]
    next_targets: int


def counted_steps(batches: Iterator[list[dict]]) -> Iterator[StepBatch]:
    """Each step's micro-batches with their counts, one step ahead: a step is handed out once the next one's
    batches are loaded, so that its `next_targets` is known."""
    current = next(batches)
    counts = take_counts(current)
    for upcoming in batches:
        upcoming_counts = take_counts(upcoming)
        yield StepBatch(current, counts, upcoming_counts["targets"])
        current, counts = upcoming, upcoming_counts


# ---------------------------------------------------------------------------------------------------------------
# Which rows each step trained, for the tests that compare the data order of two runs.

TRACE_ROWS_ENV = "SHARDTUNE_TRACE_ROWS"  # a directory: each rank appends its rows of each step to rows-rank<i>.jsonl


def row_digests(micro_batches: list[dict]) -> list[str]:
    """One digest per row of these micro-batches: of its tokens where the attention mask is set (padding differs
    with the micro-batch a row lands in), or of the whole row where there is no mask."""
    digests = []
    for batch in micro_batches:
        if "input_ids" not in batch:  # preference pairs: not traced
            continue
        ids = batch["input_ids"].cpu()
        mask = batch["attention_mask"].cpu().bool() if "attention_mask" in batch else torch.ones_like(ids).bool()
        for row, kept in zip(ids, mask, strict=True):
            digests.append(hashlib.sha256(row[kept].to(torch.int64).numpy().tobytes()).hexdigest()[:16])
    return digests


class RowTrace:
    """Appends this rank's row digests of each step to $SHARDTUNE_TRACE_ROWS/rows-rank<i>.jsonl; does nothing when
    the variable is unset."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    @classmethod
    def from_env(cls, rank: int) -> RowTrace:
        directory = os.environ.get(TRACE_ROWS_ENV)
        if not directory:
            return cls(None)
        os.makedirs(directory, exist_ok=True)
        return cls(os.path.join(directory, f"rows-rank{rank}.jsonl"))

    def record(self, step: int, micro_batches: list[dict]) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as file:
            file.write(json.dumps({"step": step, "rows": row_digests(micro_batches)}) + "\n")
