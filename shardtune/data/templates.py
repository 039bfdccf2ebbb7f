"""The chat template: --chat_template put on the tokenizer (a Jinja file or a bundled one, saved with every
checkpoint and export), and conversations rendered through it as token ids."""

from __future__ import annotations

import logging
import re

from transformers import PreTrainedTokenizerBase

from shardtune.config import ConfigError, Recipe
from shardtune.data.sources import chat_template_path

logger = logging.getLogger(__name__)



def apply_chat_template_flag(tokenizer: PreTrainedTokenizerBase, recipe: Recipe) -> None:
    """Put --chat_template (a Jinja file or a bundled name) on the tokenizer. The trainer saves this tokenizer
    beside every checkpoint and the final model, so the template the model learnt travels with it."""
    if not recipe.chat_template:
        return
    with open(chat_template_path(recipe.chat_template), encoding="utf-8") as file:
        template = file.read()
    if not template.strip():
        raise ConfigError(f"--chat_template {recipe.chat_template!r} is an empty file: give a Jinja chat template.")
    tokenizer.chat_template = template
    try:  # a Jinja error now, not in the middle of tokenization
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                      tokenize=False)
    except Exception as error:  # jinja2 raises many types
        raise ConfigError(f"--chat_template {recipe.chat_template!r} does not render a conversation: "
                          f"{error}") from error
    warn_split_markers(tokenizer, template, recipe.chat_template)


def warn_split_markers(tokenizer: PreTrainedTokenizerBase, template: str, name: str) -> None:
    """A template's control markers (`<|im_start|>`) that the tokenizer splits into pieces still train, but the
    model has to learn them as several tokens: worth a warning, not a refusal."""
    split = sorted({marker for marker in re.findall(r"<\|[^|<>]+\|>", template)
                    if tokenizer.convert_tokens_to_ids(marker) in (None, tokenizer.unk_token_id)})
    if split:
        logger.warning("--chat_template %s: %s are not tokens of this tokenizer and are split into pieces; add them "
                       "as special tokens (and resize the embeddings) or pick a template made for this model",
                       name, ", ".join(split))


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(tokenizer.chat_template)


def chat_ids(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]], generation_prompt: bool = False
             ) -> list[list[int]]:
    if not conversations:
        return []
    return tokenizer.apply_chat_template(conversations, tokenize=True, add_generation_prompt=generation_prompt,
                                         return_dict=True)["input_ids"]
