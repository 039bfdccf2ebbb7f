"""Preference pairs in micro-batches: each pair numbered in its split (the key of its precomputed reference
log-probs), and the collator that runs a micro-batch's chosen and rejected sequences as one right-padded batch, as
TRL's DataCollatorForPreference does. Their tokenization: shardtune.methods.preference."""

from __future__ import annotations

import torch
from datasets import Dataset

from shardtune.data.batches import COUNTS
from shardtune.data.tokenize import IGNORE_INDEX

PAIR_ID = "pair_id"  # a pair's row in its split: the key of its precomputed reference log-probs


def numbered(dataset: Dataset) -> Dataset:
    """The split with each pair's row number (PAIR_ID), by which its precomputed reference log-probs are found."""
    return dataset.add_column(PAIR_ID, list(range(len(dataset))))


class PreferenceCollator:
    """A micro-batch of pairs as one right-padded batch, its chosen sequences first, then its rejected ones, each
    prompt + completion cut to `max_len` (TRL's DataCollatorForPreference): input_ids, attention_mask and labels
    (the completion's tokens, IGNORE_INDEX elsewhere). With precomputed reference log-probs (`reference`: a
    (pairs, 2) table of the split), `ref_logps` per pair. COUNTS as the SFT collator's, `targets` being pairs: the
    unit the DPO loss is averaged over."""

    def __init__(self, pad_id: int, max_len: int, multiple: int = 1) -> None:
        self.pad_id, self.max_len, self.multiple = pad_id, max_len, multiple
        self.reference: torch.Tensor | None = None  # set once the reference log-probs are computed or read

    def __call__(self, features: list[dict]) -> dict:
        sequences, labels = [], []
        for side in ("chosen_ids", "rejected_ids"):
            for feature in features:
                prompt, completion = feature["prompt_ids"], feature[side]
                sequences.append((prompt + completion)[: self.max_len])
                labels.append(([IGNORE_INDEX] * len(prompt) + completion)[: self.max_len])
        longest = max(len(sequence) for sequence in sequences)
        length = -(-longest // self.multiple) * self.multiple
        batch = {
            "input_ids": torch.tensor([seq + [self.pad_id] * (length - len(seq)) for seq in sequences]),
            "attention_mask": torch.tensor([[1] * len(seq) + [0] * (length - len(seq)) for seq in sequences]),
            "labels": torch.tensor([label + [IGNORE_INDEX] * (length - len(label)) for label in labels]),
        }
        if self.reference is not None:
            batch["ref_logps"] = self.reference[torch.tensor([feature[PAIR_ID] for feature in features])]
        batch[COUNTS] = {"targets": len(features), "tokens": sum(len(sequence) for sequence in sequences),
                         "processed": batch["input_ids"].numel(), "sequences": len(sequences)}
        return batch
