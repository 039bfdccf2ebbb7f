"""Fine-tuning data through `datasets`: local json/jsonl/parquet/csv files, `save_to_disk` directories or Hub
datasets; `text`, `prompt`/`completion` or chat `messages` rows; tokenized once (cached by `datasets`), with the
loss on completion / assistant tokens only; padded or packed (padding-free) micro-batches."""

from __future__ import annotations

import json
import logging
import os

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerBase

from shardtune.config import DATA_FILE_TYPES, ConfigError, Recipe

IGNORE_INDEX = -100  # label of tokens that carry no loss (prompt, padding)
logger = logging.getLogger(__name__)
FORMATS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}


# ---------------------------------------------------------------------------------------------------------------
# Sources.


def load_source(source: str, split: str) -> Dataset:
    """One split of a local file (its only split), a `save_to_disk` directory or a Hub dataset."""
    try:
        if os.path.isdir(source):
            loaded = load_from_disk(source)
            if isinstance(loaded, DatasetDict):
                if split not in loaded:
                    raise ConfigError(f"{source!r} has splits {sorted(loaded)}, not {split!r}: set --dataset_split.")
                loaded = loaded[split]
            return loaded
        if os.path.isfile(source):
            if os.path.getsize(source) == 0:
                raise ConfigError(f"The data file {source!r} is empty.")
            builder = DATA_FILE_TYPES[os.path.splitext(source)[1].lower()]
            return load_dataset(builder, data_files=source, split="train")
        return load_dataset(source, split=split)
    except ConfigError:
        raise
    except Exception as error:  # datasets raises many types; the user needs the file and the place
        reason = first_bad_line(source) or str(error) or type(error).__name__
        raise ConfigError(f"Cannot read dataset {source!r}: {reason}") from error


def first_bad_line(path: str) -> str | None:
    """For a JSON Lines file that does not parse: which line, and why (datasets' own error does not say)."""
    if not (os.path.isfile(path) and path.lower().endswith((".jsonl", ".json"))):
        return None
    with open(path, encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, start=1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as error:
                    if number == 1 and path.lower().endswith(".json"):
                        return None  # a single JSON document, not JSON Lines
                    return f"line {number} is not valid JSON ({error.msg})"
    return None


def load_raw_splits(recipe: Recipe) -> tuple[Dataset, Dataset | None]:
    """(train rows, eval rows): eval from --eval_split (a split name or a file) when given."""
    train = load_source(recipe.dataset, recipe.dataset_split)
    if not recipe.eval_split:
        return train, None
    eval_source = recipe.eval_split if os.path.exists(recipe.eval_split) else recipe.dataset
    if os.path.isfile(eval_source) and eval_source == recipe.dataset:
        raise ConfigError(f"--eval_split {recipe.eval_split!r}: a data file has one split. Give an eval file, or "
                          "leave --eval_split empty to hold out --eval_fraction of the rows.")
    return train, load_source(eval_source, recipe.eval_split)


# ---------------------------------------------------------------------------------------------------------------
# Formats and tokenization.


def detect_format(columns: list[str], requested: str = "auto") -> str:
    if requested != "auto":
        missing = [column for column in FORMATS[requested] if column not in columns]
        if missing:
            raise ConfigError(f"--dataset_format {requested} needs column(s) {missing}; the dataset has "
                              f"{sorted(columns)}.")
        return requested
    for name, needed in FORMATS.items():
        if all(column in columns for column in needed):
            return name
    raise ConfigError(
        f"Dataset columns {sorted(columns)} match no known format: give `messages` (chat), `prompt` and "
        "`completion`, or `text`."
    )


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                         return_dict=True)["input_ids"]


def tokenize_chat(messages: list[dict], tokenizer: PreTrainedTokenizerBase, completion_only: bool
                  ) -> tuple[list[int], list[int]]:
    """The conversation through the tokenizer's chat template; labels keep each assistant turn: the tokens
    between the prompt rendered up to that turn (with the generation prompt) and the prompt including it."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                                 for m in messages):
        raise ValueError("`messages` must be a list of {role, content} objects")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("the chat has no assistant turn, so nothing to learn")
    input_ids = chat_ids(tokenizer, messages)
    if not completion_only:
        return input_ids, list(input_ids)
    labels = [IGNORE_INDEX] * len(input_ids)
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(chat_ids(tokenizer, messages[:index], generation_prompt=True))
            end = len(chat_ids(tokenizer, messages[: index + 1]))
            labels[start:end] = input_ids[start:end]
    return input_ids, labels


def tokenize_example(example: dict, index: int, *, tokenizer: PreTrainedTokenizerBase, data_format: str,
                     max_len: int, completion_only: bool = True) -> dict:
    """input_ids and labels (IGNORE_INDEX where no loss), cut to max_len; `length` before the cut."""
    try:
        if data_format == "messages":
            input_ids, labels = tokenize_chat(example["messages"], tokenizer, completion_only)
        else:
            if data_format == "prompt_completion":
                prompt = tokenizer(example["prompt"], add_special_tokens=True)["input_ids"]
                target = tokenizer(example["completion"], add_special_tokens=False)["input_ids"]
            else:
                prompt, target = [], tokenizer(example["text"], add_special_tokens=True)["input_ids"]
            input_ids = prompt + target + [tokenizer.eos_token_id]
            labels = input_ids if not completion_only else [IGNORE_INDEX] * len(prompt) + input_ids[len(prompt):]
    except (TypeError, ValueError) as error:
        raise ConfigError(f"Dataset row {index}: {error}.") from error
    return {"input_ids": input_ids[:max_len], "labels": labels[:max_len], "length": len(input_ids)}


def load_splits(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> tuple[Dataset, Dataset]:
    """Tokenized (train, eval) datasets. Call under `accelerator.main_process_first()`: the main process
    tokenizes and `datasets` caches the result, which the other ranks (and later runs) reuse."""
    raw_train, raw_eval = load_raw_splits(recipe)
    train = tokenize(raw_train, recipe, tokenizer, "train")
    if raw_eval is not None:
        return train, tokenize(raw_eval, recipe, tokenizer, "eval")
    if len(train) < 2:
        raise ConfigError(f"Dataset {recipe.dataset!r} has {len(train)} usable row(s); it needs at least 2 "
                          "(train and eval).")
    splits = train.train_test_split(test_size=recipe.eval_fraction, seed=recipe.seed)
    return splits["train"], splits["test"]


def tokenize(raw: Dataset, recipe: Recipe, tokenizer: PreTrainedTokenizerBase, name: str) -> Dataset:
    if len(raw) == 0:
        raise ConfigError(f"The {name} data of {recipe.dataset!r} is empty.")
    data_format = detect_format(raw.column_names, recipe.dataset_format)
    if data_format == "messages" and tokenizer.chat_template is None:
        raise ConfigError(f"{recipe.model_name_or_path!r} has no chat template for `messages` rows: use a chat "
                          "(instruct) model or tokenizer, or rows with `prompt` and `completion`.")
    tokenized = raw.map(
        tokenize_example, with_indices=True,
        fn_kwargs={"tokenizer": tokenizer, "data_format": data_format, "max_len": recipe.max_seq_length,
                   "completion_only": recipe.completion_only_loss},
        remove_columns=raw.column_names, desc=f"tokenizing {name}",
    )
    too_long = sum(length > recipe.max_seq_length for length in tokenized["length"])
    if recipe.truncation == "drop":
        tokenized = tokenized.filter(lambda length: length <= recipe.max_seq_length, input_columns="length")
    no_target = len(tokenized)
    tokenized = tokenized.filter(lambda labels: any(label != IGNORE_INDEX for label in labels[1:]),
                                 input_columns="labels", desc="dropping rows with no target token")
    no_target -= len(tokenized)
    action = "dropped" if recipe.truncation == "drop" else "truncated"
    logger.warning("%s data: %d rows, %s format; %d longer than %d tokens (%s), %d without a target token "
                   "(dropped)", name, len(tokenized), data_format, too_long, recipe.max_seq_length, action, no_target)
    if len(tokenized) == 0:
        raise ConfigError(f"No {name} row of {recipe.dataset!r} is left with a target token after tokenization.")
    return tokenized.remove_columns("length")


# ---------------------------------------------------------------------------------------------------------------
# Batches.


COUNTS = "counts"  # batch key of the collator's host-side counts; taken out before the batch reaches the model
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")


def make_collator(tokenizer: PreTrainedTokenizerBase, packing: bool = False, attn_implementation: str = "sdpa"
                  ) -> CountingCollator:
    """Padded: each micro-batch padded to its longest row (padded labels IGNORE_INDEX). Packed (padding-free):
    the micro-batch's sequences concatenated into one row with position ids restarting at every sequence and
    the first label of each sequence masked. Flash attention gets the sequence boundaries from the collator
    (`cu_seq_lens`, computed on the host: no device sync in every layer); flex attention, SDPA and eager derive
    per-sequence attention from the position ids (SDPA and eager through a dense mask, see config.py)."""
    if packing:
        inner = DataCollatorWithFlattening(return_tensors="pt", separator_id=IGNORE_INDEX,
                                           return_flash_attn_kwargs=attn_implementation in FLASH_ATTENTION)
    else:
        inner = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=IGNORE_INDEX,
                                       return_tensors="pt")
    return CountingCollator(inner)


class CountingCollator:
    """Adds, under COUNTS, what the trainer needs to know of a micro-batch as plain integers counted on the host
    while the batch is built: the step never reads them back from the device.
    targets: tokens that carry loss (labels shifted by one, as the causal LM loss compares them);
    tokens: sequence tokens (not padding); processed: tokens the model runs on; sequences: rows before packing."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, features: list[dict]) -> dict:
        batch = self.inner(features)
        lengths = [len(feature["input_ids"]) for feature in features]
        batch[COUNTS] = {
            "targets": int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()),
            "tokens": sum(lengths),
            "processed": batch["input_ids"].numel(),
            "sequences": len(features),
        }
        return batch
