"""What --dataset, --dataset_weights and --chat_template name, read and checked without loading any data."""

from __future__ import annotations

import os

from shardtune.config import DATA_FILE_TYPES, ConfigError, Recipe
from shardtune.hub import looks_like_path

# Bundled chat templates, one `<name>.jinja` each, shipped with the package.
CHAT_TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")


def dataset_sources(dataset: str) -> list[str]:
    """--dataset's sources: one, or several separated by commas (a mixture)."""
    return [source.strip() for source in dataset.split(",")]


def dataset_weights(recipe: Recipe) -> list[float]:
    """The share of each source's rows to take (1.0 = all of it). Raises ConfigError on a bad --dataset_weights."""
    count = len(dataset_sources(recipe.dataset))
    if not recipe.dataset_weights.strip():
        return [1.0] * count
    texts = [text.strip() for text in recipe.dataset_weights.split(",")]
    if len(texts) != count:
        raise ConfigError(f"--dataset_weights gives {len(texts)} weight(s) for {count} --dataset source(s): give one "
                          "share per source, in the same order (e.g. --dataset_weights 1.0,0.5).")
    weights = []
    for text in texts:
        try:
            weight = float(text)
        except ValueError:
            weight = float("nan")
        if not 0.0 < weight <= 1.0:  # also NaN and infinities
            raise ConfigError(f"--dataset_weights {text!r} is not a share of a source's rows: give a number above 0 "
                              "and at most 1 (1.0 = all rows, 0.5 = half).")
        weights.append(weight)
    return weights


def check_dataset_sources(recipe: Recipe) -> None:
    """Every --dataset source (comma-separated) is a usable path or a Hub name."""
    for source in dataset_sources(recipe.dataset):
        if not source:
            raise ConfigError(f"--dataset {recipe.dataset!r} has an empty source between commas: separate the "
                              "sources with single commas.")
        check_dataset_path(source)
        if recipe.dataset_split != "train" and holds_one_split(source):
            raise ConfigError(f"--dataset_split {recipe.dataset_split!r}: {source!r} has one split, loaded whole "
                              "whatever the flag names. Drop --dataset_split, or give a dataset with that split (a "
                              "saved DatasetDict or a Hub dataset).")


def holds_one_split(source: str) -> bool:
    """A data file, or a directory that `save_to_disk` wrote from a single Dataset: either loads whole, as "train"."""
    return os.path.isfile(source) or (os.path.isdir(source)
                                      and not os.path.exists(os.path.join(source, "dataset_dict.json")))


def check_dataset_weights(recipe: Recipe) -> None:
    dataset_weights(recipe)


def check_dataset_num_proc(recipe: Recipe) -> None:
    if recipe.dataset_num_proc is not None and recipe.dataset_num_proc < 1:
        raise ConfigError(f"--dataset_num_proc must be >= 1, got {recipe.dataset_num_proc}; leave it unset for the "
                          "default (up to 8 processes).")


def bundled_chat_templates() -> list[str]:
    """Names of the chat templates shipped in shardtune/chat_templates (`<name>.jinja`)."""
    names = os.listdir(CHAT_TEMPLATES_DIR) if os.path.isdir(CHAT_TEMPLATES_DIR) else []
    return sorted(name[: -len(".jinja")] for name in names if name.endswith(".jinja"))


def chat_template_path(value: str) -> str:
    """The Jinja file of --chat_template: a file path, else a bundled name. Raises ConfigError for neither."""
    if os.path.isfile(value):
        return value
    if value in bundled_chat_templates():
        return os.path.join(CHAT_TEMPLATES_DIR, f"{value}.jinja")
    raise ConfigError(f"--chat_template {value!r} is neither a Jinja file nor a bundled template: give a file path "
                      f"or one of {', '.join(bundled_chat_templates())}.")


def check_chat_template(recipe: Recipe) -> None:
    if recipe.chat_template:
        chat_template_path(recipe.chat_template)


def check_dataset_path(dataset: str) -> None:
    """A local file of a known type or a `save_to_disk` directory; anything that does not look like a path is taken
    as a Hub dataset name (checked when it loads)."""
    suffix = os.path.splitext(dataset)[1].lower()
    if os.path.isdir(dataset):
        markers = ("dataset_info.json", "dataset_dict.json")
        if not any(os.path.exists(os.path.join(dataset, marker)) for marker in markers):
            raise ConfigError(f"--dataset {dataset!r} is a directory but not one written by `save_to_disk`; "
                              "give a data file or a saved dataset.")
    elif os.path.isfile(dataset):
        if suffix not in DATA_FILE_TYPES:
            raise ConfigError(f"--dataset {dataset!r}: unknown file type {suffix!r}; use one of "
                              f"{', '.join(DATA_FILE_TYPES)} or a `save_to_disk` directory.")
        if os.path.getsize(dataset) == 0:
            raise ConfigError(f"The data file {dataset!r} is empty; give --dataset a file with training rows.")
    elif looks_like_path(dataset):
        raise ConfigError(f"Dataset file not found: {dataset!r}. Check the path given to --dataset.")
