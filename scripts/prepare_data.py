"""Tokenize a recipe's dataset (or mixture) once, ahead of training, into a `save_to_disk` directory with a
`train` and an `eval` split; training on that directory uses the rows as they are (no tokenization, on any node).

    python scripts/prepare_data.py recipes/llama8b.py --output_dir data/llama8b-tok \
        --dataset data/alpaca.jsonl,data/chats.parquet --dataset_weights 1.0,0.5 --max_seq_length 4096
    accelerate launch --config_file accelerate_configs/fsdp_full_shard.yaml recipes/llama8b.py \
        --dataset data/llama8b-tok --max_seq_length 4096

Every other flag is the recipe's (--chat_template, --seed, --eval_fraction, --dataset_num_proc ...): give the same
model, template and --max_seq_length to the training run. The directory is written under a temporary name, then
renamed: it appears whole or not at all. With --method dpo it tokenizes preference pairs as a DPO run does
(prompt_ids, chosen_ids and rejected_ids, uncut as TRL keeps them: the run cuts each to its --max_seq_length);
train on them with --method dpo.

    python scripts/prepare_data.py recipes/llama8b.py --benchmark_rows 1000000 [--benchmark_file rows.jsonl]

measures the rows/s of shardtune's tokenization (shardtune.data.tokenize, with the recipe's --dataset_num_proc) on
N rows (synthetic prompt/completion rows, or the first N of the file) against the tokenizer's own batched call on
the same texts, and prints both.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from shardtune.checks.command_line import OneLineParser
from shardtune.config import ConfigError, Recipe
from shardtune.data.sources import (
    check_chat_template,
    check_dataset_num_proc,
    check_dataset_sources,
    check_dataset_weights,
)
from shardtune.flags import parse_recipe

BATCH = 1000  # rows per call of the tokenizer in the baseline: datasets' own default batch size for `map`


def load_recipe(path: str) -> Recipe:
    """The RECIPE of a recipe file, imported without running its `main`."""
    if not os.path.isfile(path):
        raise ConfigError(f"Recipe file not found: {path!r}. Give a file such as recipes/llama8b.py.")
    spec = importlib.util.spec_from_file_location(f"recipe_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise ConfigError(f"{path!r} does not parse as Python ({error.msg}, line {error.lineno}): give a recipe "
                          "file such as recipes/llama8b.py.") from None
    if not isinstance(getattr(module, "RECIPE", None), Recipe):
        raise ConfigError(f"{path!r} defines no RECIPE = Recipe(...).")
    return module.RECIPE


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, Recipe]:
    parser = OneLineParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                           see="scripts/prepare_data.py --help")
    parser.add_argument("recipe", help="A recipe file, e.g. recipes/llama8b.py.")
    parser.add_argument("--output_dir", help="Where the tokenized DatasetDict goes (train and eval).")
    parser.add_argument("--benchmark_rows", type=int, default=0, help="Measure tokenization throughput on N rows.")
    parser.add_argument("--benchmark_file", default="", help="Rows for the benchmark (default: synthetic rows).")
    args, rest = parser.parse_known_args(argv)
    if bool(args.output_dir) == bool(args.benchmark_rows):
        raise ConfigError("Give --output_dir (to prepare the data) or --benchmark_rows N (to measure), one of them.")
    check_data_flags(rest)
    recipe = parse_recipe(load_recipe(args.recipe), rest)
    return args, recipe


# The recipe flags that change what tokenization writes; the others (optimizer, packing, strategy ...) act only
# in training, so here they would be accepted and do nothing.
DATA_FLAGS = {"method", "model_name_or_path", "chat_template", "dataset", "dataset_weights", "dataset_split",
              "eval_split", "eval_fraction", "dataset_format", "dataset_num_proc", "max_seq_length", "truncation",
              "completion_only_loss", "no_completion_only_loss", "seed"}


def check_data_flags(argv: list[str]) -> None:
    given = [token[2:].split("=", 1)[0] for token in argv if token.startswith("--")]
    ignored = [f"--{name}" for name in given if name not in DATA_FLAGS]
    if ignored:
        raise ConfigError(f"{', '.join(ignored)}: not used in preparing data (only in training); give "
                          f"{'it' if len(ignored) == 1 else 'them'} to the training run. prepare_data.py takes "
                          f"--{', --'.join(sorted(DATA_FLAGS))}.")


def check_model_source(recipe: Recipe) -> None:
    """--model_name_or_path, whose tokenizer tokenizes, judged as a training run judges it before loading: its
    config.json can be had (a Hub id's, or a local directory's) and a local directory holds a tokenizer."""
    from shardtune.checks.model import check_tokenizer_files, read_model_config
    from shardtune.hub import is_hub_id, looks_like_path, probe_hub

    path = recipe.model_name_or_path
    if not (os.path.exists(path) or is_hub_id(path) or looks_like_path(path)):  # the Hub would be asked, retrying
        raise ConfigError(f"--model_name_or_path {path!r} is no directory here and no Hub model id (owner/name): "
                          "give the model's directory, or its Hub id.")
    if is_hub_id(path) and not os.path.isdir(path):
        probe_hub()  # out of reach: the lookup fails at once, not after huggingface_hub's retries
    read_model_config(path)
    if os.path.isdir(path):
        check_tokenizer_files(path)


def check_output_dir(path: str) -> None:
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(f"--output_dir {path!r} already exists: remove it or give a new directory.")


def prepare(recipe: Recipe, output_dir: str) -> None:
    """Tokenize as the trainer would (same checks, tokenizer and template) and save train and eval."""
    from datasets import DatasetDict

    from shardtune.data.loading import PREPARED_INFO, PREPARED_SPLITS, load_splits
    from shardtune.model import load_tokenizer

    for check in (check_dataset_sources, check_dataset_weights, check_dataset_num_proc, check_chat_template,
                  check_model_source):
        check(recipe)
    check_output_dir(output_dir)
    tokenizer = load_tokenizer(recipe)
    train, evaluation = load_splits(recipe, tokenizer)
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".prepare-", dir=parent)
    try:
        DatasetDict(dict(zip(PREPARED_SPLITS, (train, evaluation), strict=True))).save_to_disk(scratch)
        info = {key: value for key, value in dataclasses.asdict(recipe).items()
                if key in ("method", "model_name_or_path", "chat_template", "dataset", "dataset_weights",
                           "dataset_format", "max_seq_length", "truncation", "completion_only_loss", "eval_fraction",
                           "seed")}
        with open(os.path.join(scratch, PREPARED_INFO), "w", encoding="utf-8") as file:
            json.dump(info | {"train_rows": len(train), "eval_rows": len(evaluation)}, file, indent=2)
        if os.path.isdir(output_dir):
            os.rmdir(output_dir)  # empty (checked above)
        os.rename(scratch, output_dir)
        scratch = ""  # renamed: nothing of this run's is left to delete
    finally:
        if scratch:  # made by mkdtemp above: this run's own
            shutil.rmtree(scratch, ignore_errors=True)
    rows = "pairs" if recipe.method == "dpo" else "rows"
    print(f"prepare_data: {len(train)} train and {len(evaluation)} eval {rows} in {output_dir}; train with "
          f"--dataset {output_dir} --max_seq_length {recipe.max_seq_length}{' --method dpo' * (rows == 'pairs')}")


# ---------------------------------------------------------------------------------------------------------------
# Throughput.


def synthetic_rows(count: int, seed: int = 0) -> list[dict]:
    """Instruction-sized rows (a 40-word prompt, an 80-word completion) of lowercase pseudo-words."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]
    return [{"prompt": " ".join(rng.choices(words, k=40)), "completion": " ".join(rng.choices(words, k=80))}
            for _ in range(count)]


def benchmark_source(rows: int, path: str, scratch: str) -> str:
    """A jsonl file of `rows` rows: the first of `path`, or synthetic."""
    target = os.path.join(scratch, "rows.jsonl")
    with open(target, "w", encoding="utf-8") as out:
        if path:
            with open(path, encoding="utf-8") as source:
                for _, line in zip(range(rows), source, strict=False):
                    out.write(line)
        else:
            for row in synthetic_rows(rows):
                out.write(json.dumps(row) + "\n")
    return target


def baseline_texts(raw, tokenizer, recipe: Recipe) -> list[tuple[list[str], bool]]:
    """The texts the tokenizer itself is timed on, each list with its add_special_tokens: the same prompt and
    target strings as ours, or the rendered conversations for chat rows (rendered before the clock starts)."""
    from shardtune.data.sources import detect_format
    from shardtune.data.templates import has_chat_template
    from shardtune.data.tokenize import alpaca_messages, prompt_and_target, row_messages

    data_format = detect_format(raw.column_names, recipe.dataset_format)
    rows = raw.to_list()
    if data_format in ("messages", "sharegpt") or (data_format == "alpaca" and has_chat_template(tokenizer)):
        convert = alpaca_messages if data_format == "alpaca" else (lambda row: row_messages(row, data_format))
        return [([tokenizer.apply_chat_template(convert(row), tokenize=False) for row in rows], False)]
    pairs = [prompt_and_target(row, data_format) for row in rows]
    return [([prompt for prompt, _ in pairs], True), ([target for _, target in pairs], False)]


def benchmark(recipe: Recipe, rows: int, path: str) -> dict[str, float]:
    """rows/s of shardtune.data.tokenize.tokenize and of the tokenizer's own batched call, on the same rows."""
    import datasets
    import pyarrow.compute as pc

    from shardtune.data.loading import load_source
    from shardtune.data.templates import apply_chat_template_flag
    from shardtune.data.tokenize import tokenize, tokenize_processes
    from shardtune.model import load_tokenizer

    tokenizer = load_tokenizer(recipe)
    apply_chat_template_flag(tokenizer, recipe)
    datasets.disable_caching()  # measure tokenization, not a cache hit
    with tempfile.TemporaryDirectory(prefix="prepare-bench-") as scratch:
        source = benchmark_source(rows, path, scratch)
        raw = load_source(source, "train")
        start = time.perf_counter()
        tokenized = tokenize(raw, recipe, tokenizer, "benchmark", source)
        ours = time.perf_counter() - start
        tokens = pc.sum(pc.list_value_length(tokenized.flatten_indices().data.column("input_ids"))).as_py()
        texts = baseline_texts(raw, tokenizer, recipe)
        start = time.perf_counter()
        for batch_texts, special in texts:
            for offset in range(0, len(batch_texts), BATCH):
                tokenizer(batch_texts[offset: offset + BATCH], add_special_tokens=special)
        own = time.perf_counter() - start
    processes = tokenize_processes(recipe, len(raw)) or 1
    parallel = os.environ.get("TOKENIZERS_PARALLELISM", "unset")
    print(f"prepare_data: {len(raw)} rows, {tokens / len(raw):,.0f} tokens a row (after the cut)")
    print(f"  shardtune's tokenization ({processes} process(es); labels, filters, Arrow output): "
          f"{len(raw) / ours:,.0f} rows/s ({ours:.1f} s)")
    print(f"  the tokenizer's own batched call ({BATCH} rows a call, TOKENIZERS_PARALLELISM={parallel}): "
          f"{len(raw) / own:,.0f} rows/s ({own:.1f} s)")
    return {"rows": len(raw), "ours_rows_per_s": len(raw) / ours, "tokenizer_rows_per_s": len(raw) / own,
            "processes": processes}


def main(argv: list[str] | None = None) -> int:
    try:
        args, recipe = parse_args(sys.argv[1:] if argv is None else argv)
        if args.benchmark_rows:
            if args.benchmark_rows < 1:
                raise ConfigError(f"--benchmark_rows must be >= 1, got {args.benchmark_rows}.")
            if recipe.method != "sft":
                raise ConfigError(f"--benchmark_rows times SFT's tokenization: drop --method {recipe.method}.")
            if args.benchmark_file and not os.path.isfile(args.benchmark_file):
                raise ConfigError(f"--benchmark_file {args.benchmark_file!r} is not a file.")
            check_model_source(recipe)
            benchmark(recipe, args.benchmark_rows, args.benchmark_file)
        else:
            prepare(recipe, args.output_dir)
    except ConfigError as error:
        print(f"shardtune: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
