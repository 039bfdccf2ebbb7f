"""Preference pairs: prompt/chosen/rejected rows (text, or chat messages rendered by the chat template), or
chosen/rejected alone with the prompt taken as their shared leading turns (UltraFeedback's form), tokenized as TRL
1.16's DPOTrainer tokenizes them; and the collator that runs a micro-batch's chosen and rejected sequences as one
right-padded batch.

Tokenization (TRL's `_prepare_dataset`): text completions get the EOS text unless they end with it; the prompt and
prompt + completion are tokenized whole (with the tokenizer's special tokens, or through the chat template, the
prompt with the generation prompt) and the completion starts where the prompt's ids and each full sequence's ids
first differ. Truncation is TRL's too, per sequence, keeping the start: prompt + completion cut to --max_seq_length.
A pair whose prompt alone fills that length, or whose chosen and rejected sequences are the same once cut, teaches
nothing: it is dropped and counted in the data's start-up line."""

from __future__ import annotations

import logging

import pyarrow.compute as pc
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from shardtune.config import ConfigError, Recipe
from shardtune.data.sources import FORMATS, joined_parts, row_error
from shardtune.data.templates import chat_ids, has_chat_template

logger = logging.getLogger(__name__)
PAIR_COLUMNS = FORMATS["tokenized_pairs"]  # a tokenized pair (scripts/prepare_data.py writes them)


def is_chat(value: object) -> bool:
    return isinstance(value, list)


def common_prefix_length(items: list, other: list) -> int:
    """How many leading items (token ids, or a conversation's turns) the two sequences share."""
    length = 0
    for item, other_item in zip(items, other, strict=False):
        if item != other_item:
            break
        length += 1
    return length


def pair_parts(row: dict, chat: bool) -> tuple[str | list, str | list, str | list]:
    """(prompt, chosen, rejected) of a row of a source of chat pairs (`chat`, the first row's kind) or of text
    pairs; raises ValueError, one sentence, where the row cannot be one."""
    chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
    parts = {"prompt": prompt, "chosen": chosen, "rejected": rejected} if prompt is not None else \
        {"chosen": chosen, "rejected": rejected}
    kinds = {is_chat(value) for value in parts.values()}
    if len(kinds) > 1:
        named, both = ("`prompt`, `chosen` and `rejected`", "all three") if prompt is not None else \
            ("`chosen` and `rejected`", "both")
        raise ValueError(f"{named} mix text and chat messages: give {both} as text or {both} as chat messages")
    if kinds != {chat}:
        raise ValueError(f"a {'text' if chat else 'chat'} pair among {'chat' if chat else 'text'} pairs (the first "
                         "row's kind): a source holds pairs of one kind; put each kind in a file of its own")
    for name, value in parts.items():
        if chat and not all(isinstance(turn, dict) and {"role", "content"} <= turn.keys() for turn in value):
            raise ValueError(f"`{name}` must be a list of {{role, content}} messages")
        if not chat and not isinstance(value, str):
            raise ValueError(f"`{name}` must be text or a list of chat messages")
    if chosen == rejected:
        raise ValueError("`chosen` and `rejected` are the same: a pair needs two different answers; delete the row")
    if prompt is not None:
        return prompt, chosen, rejected
    if not chat:
        raise ValueError("a text pair without `prompt`: where the prompt ends in the text cannot be told; add a "
                         "`prompt` column, or give `chosen` and `rejected` as chat messages")
    shared = common_prefix_length(chosen, rejected)  # the prompt is implied: the conversations' shared leading turns
    if shared == 0:
        raise ValueError("`chosen` and `rejected` share no leading turn, and without `prompt` the prompt is their "
                         "shared turns: start both with the same prompt turns, or add a `prompt` column")
    if shared in (len(chosen), len(rejected)):
        raise ValueError("one of `chosen` and `rejected` is the other's start, so after their shared turns (the "
                         "implied prompt) one has no answer: give each its own final answer, or add a `prompt` column")
    if chosen[shared].get("role") != "assistant" or rejected[shared].get("role") != "assistant":
        raise ValueError("after their shared turns (the implied prompt) `chosen` and `rejected` must go on with an "
                         "assistant turn: add a `prompt` column if the prompt is not those turns")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def tokenize_pairs(batch: dict[str, list], indices: list[int], *, tokenizer: PreTrainedTokenizerBase,
                   max_len: int, source: str, chat: bool) -> dict:
    """prompt_ids, chosen_ids and rejected_ids of each row (untruncated, as TRL keeps them), and `keep`: whether the
    pair still teaches something once cut to `max_len`. `chat`: the source's pairs are chat messages."""
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    parts = []
    for index, row in zip(indices, rows, strict=True):
        try:
            prompt, chosen, rejected = pair_parts(row, chat)
            parts.append(tuple(joined_parts(part) for part in (prompt, chosen, rejected)) if chat else
                         (prompt, chosen, rejected))
        except ValueError as error:
            raise row_error(index, source, error) from error
    if chat:
        try:
            prompt_ids, chosen_full, rejected_full = chat_pair_ids(tokenizer, parts)
        except Exception:  # the template's own refusal (jinja2's TemplateError, e.g. roles that must alternate)
            for index, pair in zip(indices, parts, strict=True):
                try:
                    chat_pair_ids(tokenizer, [pair])
                except Exception as error:
                    raise row_error(index, source, error) from error
            raise
    else:
        eos = tokenizer.eos_token
        ended = [(prompt, chosen if chosen.endswith(eos) else chosen + eos,
                  rejected if rejected.endswith(eos) else rejected + eos) for prompt, chosen, rejected in parts]
        prompt_ids = tokenizer([prompt for prompt, _, _ in ended])["input_ids"]
        chosen_full = tokenizer([prompt + chosen for prompt, chosen, _ in ended])["input_ids"]
        rejected_full = tokenizer([prompt + rejected for prompt, _, rejected in ended])["input_ids"]
    out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "keep": []}
    for prompt, chosen, rejected in zip(prompt_ids, chosen_full, rejected_full, strict=True):
        start = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
        out["prompt_ids"].append(prompt[:start])
        out["chosen_ids"].append(chosen[start:])
        out["rejected_ids"].append(rejected[start:])
        out["keep"].append(start < max_len and chosen[:max_len] != rejected[:max_len])
    return out


def chat_pair_ids(tokenizer: PreTrainedTokenizerBase, parts: list[tuple]) -> tuple[list, list, list]:
    """The prompts' ids (with the generation prompt), and the prompt + chosen and prompt + rejected ids, each
    conversation rendered whole as TRL renders it."""
    return (chat_ids(tokenizer, [prompt for prompt, _, _ in parts], generation_prompt=True),
            chat_ids(tokenizer, [prompt + chosen for prompt, chosen, _ in parts]),
            chat_ids(tokenizer, [prompt + rejected for prompt, _, rejected in parts]))


def tokenize_preferences(raw: Dataset, recipe: Recipe, tokenizer: PreTrainedTokenizerBase, name: str, source: str,
                         data_format: str, processes: int | None) -> Dataset:
    """One source's pairs as PAIR_COLUMNS, the pairs that teach nothing once cut dropped and counted."""
    if data_format == "tokenized_pairs":
        tokenized = raw.remove_columns([column for column in raw.column_names if column not in PAIR_COLUMNS])
        described = "tokenized before"
        tokenized = tokenized.map(lambda row: {"keep": pair_teaches(row, recipe.max_seq_length)},
                                  desc=f"checking {name} pairs ({source})")
    else:
        first = raw[0]
        chat = is_chat(first.get("chosen"))
        if chat and not has_chat_template(tokenizer):
            raise ConfigError(f"{recipe.model_name_or_path!r} has no chat template for the chat pairs of {source!r}: "
                              "pass --chat_template, or use a chat (instruct) tokenizer.")
        tokenized = raw.map(tokenize_pairs, batched=True, with_indices=True, num_proc=processes,
                            fn_kwargs={"tokenizer": tokenizer, "max_len": recipe.max_seq_length, "source": source,
                                       "chat": chat},
                            remove_columns=raw.column_names, desc=f"tokenizing {name} pairs ({source})")
        described = "chat via the chat template" if chat else "text"
    keep = tokenized.data.column("keep")
    dropped = pc.sum(pc.invert(keep)).as_py() or 0
    prompt_full = pc.sum(pc.greater_equal(pc.list_value_length(tokenized.data.column("prompt_ids")),
                                          recipe.max_seq_length)).as_py() or 0
    if dropped:
        tokenized = tokenized.filter(lambda kept: kept, input_columns=["keep"], num_proc=processes,
                                     desc="dropping pairs that teach nothing")
    lengths = [pc.list_value_length(tokenized.data.column(column)) for column in PAIR_COLUMNS]
    longest = pc.add(lengths[0], pc.max_element_wise(lengths[1], lengths[2]))
    longer = pc.sum(pc.greater(longest, recipe.max_seq_length)).as_py() or 0
    logger.warning("%s pairs of %s: %d pairs, %s; %d with a sequence longer than %d tokens (truncated), %d whose "
                   "prompt fills the length and %d whose chosen and rejected are the same once truncated (dropped)",
                   name, source, len(tokenized), described, longer, recipe.max_seq_length, prompt_full,
                   dropped - prompt_full)
    if len(tokenized) == 0:
        raise ConfigError(f"No {name} pair of {source!r} is left once cut to --max_seq_length "
                          f"{recipe.max_seq_length}: raise it.")
    return tokenized.remove_columns(["keep"])


def pair_teaches(row: dict, max_len: int) -> bool:
    chosen, rejected = (row["prompt_ids"] + row[key] for key in ("chosen_ids", "rejected_ids"))
    return len(row["prompt_ids"]) < max_len and chosen[:max_len] != rejected[:max_len]
