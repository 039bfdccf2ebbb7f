"""Fine-tuning data through `datasets`: local json/jsonl/parquet/csv files, `save_to_disk` directories or Hub
datasets, one source or a weighted mixture; `text`, `prompt`/`completion`, chat `messages`, Alpaca or ShareGPT
rows, or rows tokenized before (scripts/prepare_data.py); tokenized once per node (cached by `datasets`), each
source in its own format by shardtune.data.tokenize. Their micro-batches: shardtune.data.batches."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator

from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from shardtune.config import DATA_FILE_TYPES, ConfigError, Recipe
from shardtune.data.sources import (
    FORMATS,
    TOKENIZED_FORMATS,
    check_row_formats,
    check_text_encoding,
    dataset_sources,
    dataset_weights,
    json_problem,
    only_whitespace,
    source_format,
)
from shardtune.data.templates import apply_chat_template_flag
from shardtune.data.tokenize import tokenize

logger = logging.getLogger(__name__)
PREPARED_SPLITS = ("train", "eval")  # what scripts/prepare_data.py writes
PREPARED_INFO = "shardtune_data.json"  # beside them: the recipe values the rows were tokenized with


# ---------------------------------------------------------------------------------------------------------------
# Sources.


def load_source(source: str, split: str, dataset_format: str = "auto") -> Dataset:
    """One split of a local file (its only split), a `save_to_disk` directory or a Hub dataset, its rows checked
    to be of one format (check_row_formats)."""
    try:
        if os.path.isdir(source):
            loaded = load_from_disk(source)
            if isinstance(loaded, DatasetDict):
                if split not in loaded:
                    raise ConfigError(f"{source!r} has splits {sorted(loaded)}, not {split!r}: set --dataset_split.")
                loaded = loaded[split]
        elif os.path.isfile(source):
            if os.path.getsize(source) == 0 or only_whitespace(source):
                raise ConfigError(f"The data file {source!r} is empty.")
            builder = DATA_FILE_TYPES[os.path.splitext(source)[1].lower()]
            if builder != "parquet":
                check_text_encoding(source)
            with quiet_json_loader():
                loaded = load_dataset(builder, data_files=source, split="train")
        else:
            loaded = load_dataset(source, split=split)
    except ConfigError:
        raise
    except Exception as error:  # datasets raises many types; the user needs the file and the place
        reason = (json_problem(source) if os.path.isfile(source) and DATA_FILE_TYPES.get(
            os.path.splitext(source)[1].lower()) == "json" else None) or str(error) or type(error).__name__
        raise ConfigError(f"Cannot read dataset {source!r}: {reason}") from error
    check_row_formats(loaded, dataset_format, source)
    return loaded


@contextlib.contextmanager
def quiet_json_loader() -> Iterator[None]:
    """datasets' JSON builder logs its own error before raising it: the refusal names the line instead."""
    json_logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_logger.level
    json_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        json_logger.setLevel(level)


def prepared_eval(source: str) -> Dataset | None:
    """The eval split that scripts/prepare_data.py held out of a source it tokenized, if the source is one."""
    if not os.path.isfile(os.path.join(source, "dataset_dict.json")):
        return None
    loaded = load_from_disk(source)
    split = loaded.get(PREPARED_SPLITS[1])
    return split if split is not None and any(set(FORMATS[kind]) <= set(split.column_names)
                                              for kind in TOKENIZED_FORMATS) else None


def warn_if_prepared_differently(source: str, recipe: Recipe) -> None:
    """Tokens are only right for the tokenizer and template they were made with: say so when the recipe differs."""
    path = os.path.join(source, PREPARED_INFO)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as file:
        info = json.load(file)
    for key in ("model_name_or_path", "chat_template"):
        if info.get(key, "") != getattr(recipe, key):
            logger.warning("%s was tokenized with --%s %r and this run has %r: the tokens (and the template saved "
                           "with the model) may not match; prepare the data again with this recipe",
                           source, key, info.get(key, ""), getattr(recipe, key))


def load_eval_sources(recipe: Recipe, sources: list[str]) -> list[tuple[str, Dataset]] | None:
    """Eval rows from --eval_split (a file, or a split of every source), or the eval split of data that
    prepare_data.py tokenized; None: hold --eval_fraction out of the training mixture."""
    name = recipe.eval_split
    if name and os.path.exists(name):
        return [(name, load_source(name, name, recipe.dataset_format))]
    if name:
        files = [source for source in sources if os.path.isfile(source)]
        if files:
            raise ConfigError(f"--eval_split {name!r}: a data file has one split ({files[0]!r}). Give an eval file, "
                              "or leave --eval_split empty to hold out --eval_fraction of the rows.")
        return [(source, load_source(source, name, recipe.dataset_format)) for source in sources]
    prepared = [prepared_eval(source) for source in sources]
    if all(split is not None for split in prepared):
        return list(zip(sources, prepared, strict=True))
    return None


def draw(raw: Dataset, weight: float, seed: int) -> Dataset:
    """`weight` of the rows, drawn at random with `seed` (all of them, in order, for 1.0)."""
    if weight >= 1.0:
        return raw
    return raw.shuffle(seed=seed).select(range(max(1, round(weight * len(raw)))))


# ---------------------------------------------------------------------------------------------------------------
# Splits and mixtures.


def mix(parts: list[Dataset], seed: int, shuffle: bool) -> Dataset:
    """The parts concatenated (in one schema: the first part's) and, for a mixture, shuffled with the seed."""
    if len(parts) == 1 and not shuffle:
        return parts[0]
    parts = [part if part.features == parts[0].features else part.cast(parts[0].features) for part in parts]
    mixed = concatenate_datasets(parts)
    return mixed.shuffle(seed=seed) if shuffle else mixed


def load_train(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, raw_parts: list[tuple[str, Dataset]],
               weights: list[float]) -> Dataset:
    """Each source's --dataset_weights share, tokenized in its own format; a mixture is shuffled with the seed."""
    parts, summary = [], []
    for position, ((source, raw), weight) in enumerate(zip(raw_parts, weights, strict=True)):
        if os.path.isdir(source):
            warn_if_prepared_differently(source, recipe)
        taken = draw(raw, weight, recipe.seed + position)
        parts.append(tokenize(taken, recipe, tokenizer, "train", source))
        summary.append(f"{source}: {len(taken)} of {len(raw)} rows "
                       f"({source_format(raw, recipe.dataset_format)})")
    mixture = len(parts) > 1 or weights[0] < 1.0
    if mixture:
        logger.warning("train mixture of %d source(s), shuffled with seed %d: %s", len(parts), recipe.seed,
                       "; ".join(summary))
    return mix(parts, recipe.seed, shuffle=mixture)


def load_splits(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> tuple[Dataset, Dataset]:
    """Tokenized (train, eval) datasets. Puts --chat_template on the tokenizer first. Call under
    `accelerator.local_main_process_first()`: one process per node tokenizes and `datasets` caches the result,
    which the node's other ranks (and later runs) reuse."""
    weights = dataset_weights(recipe)  # a bad --dataset_weights before anything loads
    apply_chat_template_flag(tokenizer, recipe)
    sources = dataset_sources(recipe.dataset)
    raw_parts = [(source, load_source(source, recipe.dataset_split, recipe.dataset_format)) for source in sources]
    eval_parts = load_eval_sources(recipe, sources)
    train = load_train(recipe, tokenizer, raw_parts, weights)
    if eval_parts is not None:
        return train, mix([tokenize(raw, recipe, tokenizer, "eval", source) for source, raw in eval_parts],
                          recipe.seed, shuffle=False)
    if len(train) < 2:
        raise ConfigError(f"Dataset {recipe.dataset!r} has {len(train)} usable row(s); it needs at least 2 "
                          "(train and eval).")
    splits = train.train_test_split(test_size=recipe.eval_fraction, seed=recipe.seed)
    return splits["train"], splits["test"]
