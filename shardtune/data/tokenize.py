"""Rows as input_ids and labels, tokenized per method: the row formats (`text`, `prompt`/`completion`, chat
`messages`, Alpaca, ShareGPT) as prompt and target or as a chat, through the tokenizer or its chat template, with
the loss on completion / assistant tokens only; rows tokenized before (scripts/prepare_data.py) as they are; DPO's
preference pairs through shardtune.methods.preference. Called by shardtune.data.loading once per source."""

from __future__ import annotations

import logging
import os

import pyarrow.compute as pc
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from shardtune.config import ConfigError, Recipe
from shardtune.data.sources import (
    FORMATS,
    PREFERENCE_FORMATS,
    bundled_chat_templates,
    joined_parts,
    row_error,
    source_format,
)
from shardtune.data.templates import chat_ids, has_chat_template

IGNORE_INDEX = -100  # label of tokens that carry no loss (prompt, padding)
logger = logging.getLogger(__name__)
CHAT_FORMATS = ("messages", "sharegpt")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
# Stanford Alpaca's prompts (tatsu-lab/stanford_alpaca, train.py PROMPT_DICT), for tokenizers without a chat template.
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. "
                          "Write a response that appropriately completes the request.\n\n"
                          "### Instruction:\n{instruction}\n\n### Response:")
# Below this many rows per process, forking workers and writing and joining their cache shards costs more than
# the second process saves (2,000 instruction rows: 7.8 s in one process, 11.0 s in two; 10,000: even).
MIN_ROWS_PER_PROCESS = 20_000
MAX_PROCESSES = 8


# ---------------------------------------------------------------------------------------------------------------
# Formats.


def sharegpt_messages(conversation: list[dict]) -> list[dict]:
    """ShareGPT's `conversations` ({from, value}) as chat `messages` ({role, content})."""
    if not isinstance(conversation, list) or not all(isinstance(turn, dict) and {"from", "value"} <= turn.keys()
                                                     for turn in conversation):
        raise ValueError("`conversations` must be a list of {from, value} objects")
    messages = []
    for turn in conversation:
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise ValueError(f"unknown ShareGPT role {turn['from']!r} in `from`; known roles: "
                             f"{', '.join(SHAREGPT_ROLES)}")
        messages.append({"role": role, "content": turn["value"]})
    return messages


def alpaca_fields(row: dict) -> tuple[str, str, str]:
    """(instruction, input, output); `input` may be missing, null or empty."""
    instruction, extra, output = row["instruction"], row.get("input") or "", row["output"]
    if not all(isinstance(value, str) for value in (instruction, extra, output)):
        raise ValueError("Alpaca's `instruction`, `input` and `output` must be text")
    return instruction, extra.strip(), output


def alpaca_messages(row: dict) -> list[dict]:
    """An Alpaca row as one chat exchange: the instruction, then a blank line and the input when there is one."""
    instruction, extra, output = alpaca_fields(row)
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def row_messages(row: dict, data_format: str) -> list[dict]:
    if data_format == "sharegpt":
        return joined_parts(sharegpt_messages(row["conversations"]))
    if data_format == "alpaca":
        return alpaca_messages(row)
    return joined_parts(row["messages"])


def prompt_and_target(row: dict, data_format: str) -> tuple[str, str]:
    """The text that carries no loss and the text that does (an empty prompt for plain text)."""
    if data_format == "alpaca":
        instruction, extra, output = alpaca_fields(row)
        template = ALPACA_PROMPT if extra else ALPACA_PROMPT_NO_INPUT
        return template.format(instruction=instruction, input=extra), output
    prompt, target = ("", row["text"]) if data_format == "text" else (row["prompt"], row["completion"])
    if not isinstance(prompt, str) or not isinstance(target, str):
        raise ValueError(f"{'`text`' if data_format == 'text' else '`prompt` and `completion`'} must be text")
    return prompt, target


# ---------------------------------------------------------------------------------------------------------------
# Tokenization.


def check_chat(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                                 for m in messages):
        raise ValueError("`messages` must be a list of {role, content} objects")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("the chat has no assistant turn, so nothing to learn")
    if messages[0]["role"] == "assistant":
        raise ValueError("the chat opens with an assistant turn: nothing comes before it to answer")


def tokenize_chats(conversations: list[list[dict]], tokenizer: PreTrainedTokenizerBase, completion_only: bool
                   ) -> list[tuple[list[int], list[int]]]:
    """Each conversation through the tokenizer's chat template; labels keep each assistant turn: the tokens
    between the prompt rendered up to that turn (with the generation prompt) and the prompt including it. The
    whole batch and all its prefixes go through two calls of the template (checked with `check_chat` before)."""
    turns = [[index for index, message in enumerate(messages) if message["role"] == "assistant"]
             for messages in conversations] if completion_only else [[] for _ in conversations]
    ends = chat_ids(tokenizer, list(conversations) +
                    [messages[: index + 1] for messages, indices in zip(conversations, turns, strict=True)
                     for index in indices])
    starts = iter(chat_ids(tokenizer, [messages[:index] for messages, indices in zip(conversations, turns, strict=True)
                                       for index in indices], generation_prompt=True))
    full, prefix_ends = ends[: len(conversations)], iter(ends[len(conversations):])
    encoded = []
    for input_ids, indices in zip(full, turns, strict=True):
        if not completion_only:
            encoded.append((input_ids, list(input_ids)))
            continue
        labels = [IGNORE_INDEX] * len(input_ids)
        for _ in indices:
            start, end = len(next(starts)), len(next(prefix_ends))
            labels[start:end] = input_ids[start:end]
        encoded.append((input_ids, labels))
    return encoded


def tokenize_plain(rows: list[dict], indices: list[int], tokenizer: PreTrainedTokenizerBase, data_format: str,
                   completion_only: bool, source: str) -> tuple[list[list[int]], list[int]]:
    """Prompt + target + EOS (only where the target does not already end with it), the whole batch in two calls
    of the (Rust) tokenizer. Returns the token ids and, for each row, where its target starts (0 when every token
    carries loss)."""
    pairs = []
    for index, row in zip(indices, rows, strict=True):
        try:
            pairs.append(prompt_and_target(row, data_format))
        except (KeyError, TypeError, ValueError) as error:
            raise row_error(index, source, error) from error
    targets = [target for _, target in pairs]
    if data_format == "text":  # continued pretraining: BOS + text, every token learnt
        prompt_ids, target_ids = [[]] * len(pairs), tokenizer(targets, add_special_tokens=True)["input_ids"]
    else:
        prompt_ids = tokenizer([prompt for prompt, _ in pairs], add_special_tokens=True)["input_ids"]
        target_ids = tokenizer(targets, add_special_tokens=False)["input_ids"]
    return ([prompt + with_eos(target, tokenizer.eos_token_id) for prompt, target in
             zip(prompt_ids, target_ids, strict=True)],
            [len(prompt) if completion_only else 0 for prompt in prompt_ids])


def with_eos(target: list[int], eos_id: int) -> list[int]:
    """The target ending in one EOS: a completion whose text already ends with the EOS token keeps its own, so
    the model does not learn to repeat it."""
    return target if target and target[-1] == eos_id else [*target, eos_id]


def tokenize_batch(batch: dict[str, list], indices: list[int], *, tokenizer: PreTrainedTokenizerBase,
                   data_format: str, chat: bool, max_len: int, completion_only: bool, source: str) -> dict:
    """input_ids and labels (IGNORE_INDEX where no loss), cut to max_len; `length` before the cut and `targets`,
    the tokens that carry loss after it (the first token never does: nothing predicts it)."""
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    if not chat:  # labels are the ids from the target's start on: counted, not compared token by token
        ids, starts = tokenize_plain(rows, indices, tokenizer, data_format, completion_only, source)
        return {"input_ids": [row[:max_len] for row in ids],
                "labels": [[IGNORE_INDEX] * min(start, max_len) + row[start:max_len] for row, start in
                           zip(ids, starts, strict=True)],
                "length": [len(row) for row in ids],
                "targets": [max(0, min(len(row), max_len) - max(1, start)) for row, start in
                            zip(ids, starts, strict=True)]}
    conversations = []
    for index, row in zip(indices, rows, strict=True):
        try:
            conversations.append(row_messages(row, data_format))
            check_chat(conversations[-1])
        except (TypeError, ValueError) as error:
            raise row_error(index, source, error) from error
    try:
        encoded = tokenize_chats(conversations, tokenizer, completion_only)
    except Exception:  # the template's own refusal (jinja2's TemplateError, e.g. roles that must alternate)
        for index, messages in zip(indices, conversations, strict=True):
            try:
                tokenize_chats([messages], tokenizer, completion_only)
            except Exception as error:
                raise row_error(index, source, error) from error
        raise
    labels = [row_labels[:max_len] for _, row_labels in encoded]
    return {"input_ids": [input_ids[:max_len] for input_ids, _ in encoded], "labels": labels,
            "length": [len(input_ids) for input_ids, _ in encoded],
            "targets": [sum(label != IGNORE_INDEX for label in row_labels[1:]) for row_labels in labels]}


def keep_rows(lengths: list[int], targets: list[int], *, max_len: int, drop_long: bool) -> list[bool]:
    return [count > 0 and not (drop_long and length > max_len) for length, count in zip(lengths, targets, strict=True)]


def tokenize_processes(recipe: Recipe, rows: int) -> int | None:
    """Processes for `Dataset.map` (None: this one). The other ranks of the node wait while one tokenizes, so its
    cores are free; every rank computes the same number (os.cpu_count, not its own CPU affinity), which names the
    cache files they share. Small data stays in one process: forking and merging would cost more."""
    if recipe.dataset_num_proc is not None:
        return recipe.dataset_num_proc if recipe.dataset_num_proc > 1 else None
    count = min(MAX_PROCESSES, os.cpu_count() or 1, rows // MIN_ROWS_PER_PROCESS)
    return count if count > 1 else None


def tokenize(raw: Dataset, recipe: Recipe, tokenizer: PreTrainedTokenizerBase, name: str,
             source: str | None = None) -> Dataset:
    """One source's rows as input_ids and labels, in its own format."""
    source = source or recipe.dataset
    if len(raw) == 0:
        raise ConfigError(f"The {name} data of {source!r} is empty.")
    data_format = source_format(raw, recipe.dataset_format)
    if (data_format in PREFERENCE_FORMATS) != (recipe.method == "dpo"):
        raise ConfigError(f"{source!r} holds {data_format} rows, which --method {recipe.method} does not train: " + (
            "give it preference pairs (`chosen` and `rejected`, with or without `prompt`), or drop --method dpo."
            if recipe.method == "dpo" else "add --method dpo to train on its pairs."))
    if recipe.method == "dpo":  # preference pairs: shardtune.methods.preference
        from shardtune.methods.preference import tokenize_preferences

        return tokenize_preferences(raw, recipe, tokenizer, name, source, data_format,
                                    tokenize_processes(recipe, len(raw)))
    if data_format == "tokenized":
        return use_tokenized(raw, recipe, name, source)
    if data_format in CHAT_FORMATS and not has_chat_template(tokenizer):
        raise ConfigError(f"{recipe.model_name_or_path!r} has no chat template for the `{data_format}` rows of "
                          f"{source!r}: pass --chat_template (a Jinja file or one of "
                          f"{', '.join(bundled_chat_templates())}), or use a chat (instruct) tokenizer.")
    chat = data_format in CHAT_FORMATS or (data_format == "alpaca" and has_chat_template(tokenizer))
    if recipe.chat_template and not chat:  # as TRL, which renders plain prompt/completion and text rows as they are
        logger.warning("--chat_template %s is not applied to the `%s` rows of %s (only messages, sharegpt and alpaca "
                       "rows are): drop it, or give the data as messages.", recipe.chat_template, data_format, source)
    processes = tokenize_processes(recipe, len(raw))
    tokenized = raw.map(
        tokenize_batch, batched=True, with_indices=True, num_proc=processes,
        fn_kwargs={"tokenizer": tokenizer, "data_format": data_format, "chat": chat, "max_len": recipe.max_seq_length,
                   "completion_only": recipe.completion_only_loss, "source": source},
        remove_columns=raw.column_names, desc=f"tokenizing {name} ({source})",
    )
    return drop_unusable(tokenized, recipe, name, source, f"{data_format}{' via the chat template' * chat}",
                         processes)


def drop_unusable(tokenized: Dataset, recipe: Recipe, name: str, source: str, described: str,
                  processes: int | None) -> Dataset:
    """Rows over --max_seq_length (with --truncation drop) and rows without a target token, counted in Arrow."""
    lengths, targets = tokenized.data.column("length"), tokenized.data.column("targets")
    too_long_mask = pc.greater(lengths, recipe.max_seq_length)
    too_long = pc.sum(too_long_mask).as_py() or 0
    drop_long = recipe.truncation == "drop"
    no_target_mask = pc.equal(targets, 0)
    if drop_long:
        no_target_mask = pc.and_(no_target_mask, pc.invert(too_long_mask))
    no_target = pc.sum(no_target_mask).as_py() or 0
    if no_target or (drop_long and too_long):
        tokenized = tokenized.filter(keep_rows, input_columns=["length", "targets"], batched=True,
                                     num_proc=processes, desc="dropping unusable rows",
                                     fn_kwargs={"max_len": recipe.max_seq_length, "drop_long": drop_long})
    action = "dropped" if drop_long else "truncated"
    logger.warning("%s data of %s: %d rows, %s; %d longer than %d tokens (%s), %d without a target token "
                   "(dropped)", name, source, len(tokenized), described, too_long, recipe.max_seq_length, action,
                   no_target)
    if len(tokenized) == 0:
        raise ConfigError(f"No {name} row of {source!r} is left with a target token after tokenization.")
    return tokenized.remove_columns(["length", "targets"])


def use_tokenized(raw: Dataset, recipe: Recipe, name: str, source: str) -> Dataset:
    """Rows tokenized before (scripts/prepare_data.py): as they are, if they fit --max_seq_length."""
    longest = pc.max(pc.list_value_length(raw.data.column("input_ids"))).as_py() or 0
    if longest > recipe.max_seq_length:
        raise ConfigError(f"{source!r} holds tokenized rows of up to {longest} tokens, more than --max_seq_length "
                          f"{recipe.max_seq_length}: tokenize it again with this --max_seq_length "
                          "(scripts/prepare_data.py), or raise --max_seq_length.")
    extra = [column for column in raw.column_names if column not in FORMATS["tokenized"]]
    logger.warning("%s data of %s: %d rows, tokenized before (used as they are)", name, source, len(raw))
    return raw.remove_columns(extra) if extra else raw
