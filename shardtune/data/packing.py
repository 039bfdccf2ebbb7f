"""Packing to full rows (--packing_strategy bfd): the tokenized training sequences bin-packed, best-fit decreasing,
into rows of at most --max_seq_length tokens by TRL's `pack_dataset`, and each row split back into its sequences
when it is collated, so that a micro-batch of packed rows is flattened padding-free like any packed micro-batch
(shardtune.data.batches.make_collator)."""

from __future__ import annotations

import logging

import pyarrow.compute as pc
from datasets import Dataset

from shardtune.config import Recipe

logger = logging.getLogger(__name__)

SEQUENCE_LENGTHS = "seq_lengths"  # TRL's column: the lengths of the sequences packed into each row, in order


def pack_rows(train: Dataset, recipe: Recipe) -> Dataset:
    """The training rows bin-packed into rows of --max_seq_length tokens, with --packing_strategy bfd; as they are
    otherwise. Every sequence already fits (tokenization truncated or dropped the longer ones), so TRL's own
    truncation cuts nothing. Cached by `datasets` like the tokenization."""
    if recipe.packing_strategy != "bfd":
        return train
    # Here, not at the top: trl imports several seconds of modules that a run without bfd never needs.
    from trl.data_utils import pack_dataset

    packed = pack_dataset(train, recipe.max_seq_length, strategy="bfd",
                          map_kwargs={"desc": f"packing to rows of {recipe.max_seq_length} tokens (bfd)"})
    logger.warning("train data packed (bfd): %d sequences into %d rows of up to %d tokens, %.1f%% full",
                   len(train), len(packed), recipe.max_seq_length, 100 * fill_ratio(packed, recipe.max_seq_length))
    return packed


def fill_ratio(packed: Dataset, max_seq_length: int) -> float:
    """The rows' sequence tokens over the positions of as many rows of max_seq_length tokens."""
    tokens = pc.sum(pc.list_value_length(packed.data.column("input_ids"))).as_py() or 0
    return tokens / (len(packed) * max_seq_length)


def split_rows(features: list[dict]) -> list[dict]:
    """The sequences of packed rows, in order, each with its own input_ids and labels."""
    sequences = []
    for row in features:
        start = 0
        for length in row[SEQUENCE_LENGTHS]:
            end = start + length
            sequences.append({"input_ids": row["input_ids"][start:end], "labels": row["labels"][start:end]})
            start = end
    return sequences
