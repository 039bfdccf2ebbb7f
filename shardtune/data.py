"""Local JSONL data through `datasets`: tokenized, prompt tokens masked, split into train and held-out eval."""

from __future__ import annotations

import logging

from datasets import Dataset, load_dataset
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase

from shardtune.config import ConfigError, Recipe

IGNORE_INDEX = -100  # label of tokens that carry no loss (prompt, padding)
logger = logging.getLogger(__name__)
FORMATS = {"prompt_completion": ("prompt", "completion"), "text": ("text",)}


def detect_format(columns: list[str]) -> str:
    for name, needed in FORMATS.items():
        if all(column in columns for column in needed):
            return name
    raise ConfigError(
        f"Dataset columns {sorted(columns)} match no known format: give `prompt` and `completion` "
        "(loss on the completion only) or `text` (loss on every token)."
    )


def tokenize_example(example: dict, tokenizer: PreTrainedTokenizerBase, data_format: str, max_len: int) -> dict:
    """input_ids = [bos] prompt completion [eos]; labels mask the prompt. Truncated to max_len."""
    if data_format == "prompt_completion":
        prompt = tokenizer(example["prompt"], add_special_tokens=True)["input_ids"]
        target = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    else:
        prompt = []
        target = tokenizer(example["text"], add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt + target)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt) + target)[:max_len]
    return {"input_ids": input_ids, "labels": labels, "truncated": len(prompt) + len(target) > max_len}


def load_splits(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> tuple[Dataset, Dataset]:
    """Tokenized (train, eval) datasets. Call under `accelerator.main_process_first()` so ranks share the cache."""
    raw = load_dataset("json", data_files=recipe.dataset, split="train")
    if len(raw) < 2:
        raise ConfigError(f"Dataset {recipe.dataset!r} has {len(raw)} row(s); it needs at least 2 (train and eval).")
    data_format = detect_format(raw.column_names)
    tokenized = raw.map(
        tokenize_example,
        fn_kwargs={"tokenizer": tokenizer, "data_format": data_format, "max_len": recipe.max_seq_length},
        remove_columns=raw.column_names,
        desc="tokenizing",
    )
    tokenized = tokenized.filter(lambda labels: any(label != IGNORE_INDEX for label in labels[1:]),
                                 input_columns="labels", desc="dropping rows with no target token")
    truncated = sum(tokenized["truncated"])
    logger.info("%d of %d rows truncated to %d tokens", truncated, len(tokenized), recipe.max_seq_length)
    splits = tokenized.train_test_split(test_size=recipe.eval_fraction, seed=recipe.seed)
    return splits["train"].remove_columns("truncated"), splits["test"].remove_columns("truncated")


def make_collator(tokenizer: PreTrainedTokenizerBase) -> DataCollatorForSeq2Seq:
    """Pads each micro-batch to its longest row; padded labels are IGNORE_INDEX."""
    return DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
