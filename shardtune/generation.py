"""What the model now answers: greedy completions of held-out prompts at each eval.

The prompts are the first rows of the eval split, cut before their first target token (the completion or the
first assistant turn); the reference is that target span. Every rank runs the same batch: under ZeRO-3 and FSDP
each forward gathers the sharded parameters, so all ranks must take part in every forward
(`generate(synced_gpus=True)` keeps them in step until the slowest rank is done). Under ZeRO-3 and FSDP that is
one all-gather of the whole model per generated token: the prompts go in one left-padded batch, so the
cost is max_new_tokens gathers, not N times that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator
from transformers import GenerationConfig, PreTrainedTokenizerBase

from shardtune.data.tokenize import IGNORE_INDEX
from shardtune.parallel.context import context_parallel_size
from shardtune.parallel.sequence import split_size, unsplit

MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class HeldOutPrompts:
    """Token ids of the prompts and of their reference answers, and the longest a sample may get (prompt and
    answer: the recipe's max_seq_length)."""

    prompts: list[list[int]]
    references: list[list[int]]
    max_length: int


def first_target(labels: list[int]) -> int | None:
    """Index of the first token that carries loss. Label 0 never does (position t predicts label t + 1), so a
    `text` row's prompt is its first token."""
    return next((index for index, label in enumerate(labels) if index > 0 and label != IGNORE_INDEX), None)


def held_out_prompts(eval_rows, count: int, max_length: int) -> HeldOutPrompts | None:
    """The first `count` eval rows (tokenized: input_ids and labels) split into prompt and reference; None for
    count 0 (or no row with a target)."""
    if count <= 0:
        return None
    if "prompt_ids" in eval_rows.column_names:  # preference pairs: the prompt, and its chosen answer
        rows = eval_rows.select(range(min(count, len(eval_rows))))
        return HeldOutPrompts(rows["prompt_ids"], rows["chosen_ids"], max_length)
    prompts, references = [], []
    for row in eval_rows.select(range(min(count, len(eval_rows)))):
        start = first_target(row["labels"])
        if start is None:  # cannot happen for rows the data module keeps; skipped rather than trusted
            continue
        end = next((index for index in range(start, len(row["labels"])) if row["labels"][index] == IGNORE_INDEX),
                   len(row["labels"]))
        prompts.append(row["input_ids"][:start])
        references.append(row["input_ids"][start:end])
    return HeldOutPrompts(prompts, references, max_length) if prompts else None


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One batch, padded on the left so that every prompt's last token is the batch's last position (decoders
    continue from there); generate derives position ids from the mask."""
    width = max(len(prompt) for prompt in prompts)
    ids = [[pad_id] * (width - len(prompt)) + prompt for prompt in prompts]
    mask = [[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts]
    return {"input_ids": torch.tensor(ids, device=device), "attention_mask": torch.tensor(mask, device=device)}


@torch.no_grad()
def generate_samples(accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                     held_out: HeldOutPrompts) -> list[dict[str, str]]:
    """Greedy answers to the held-out prompts, up to eos or MAX_NEW_TOKENS (fewer where max_length ends first),
    on every rank together. The KV cache is on for this call only: the model's config keeps use_cache False for
    training. Returns {prompt, completion, reference} per prompt, decoded without special tokens. Under the
    sequence split without it, one prompt at a time (Ulysses drops the attention mask that left padding needs),
    each cut to its last max_length / sp tokens, which one GPU holds (shardtune.parallel.sequence). Under context
    parallelism too, outside its ring attention: accelerate's hooks drop every attention mask of the model it
    prepared for CP, so left padding would be attended."""
    split, context = split_size(accelerator), context_parallel_size(accelerator)
    # under a split, one prompt at a time, cut to the length a GPU holds of a training row
    held = held_out.max_length // (split * context)
    batches = [[prompt[-held:]] for prompt in held_out.prompts] if split * context > 1 else [held_out.prompts]
    was_training = model.training
    model.eval()
    try:
        with unsplit(split > 1):  # every rank runs the same prompts whole
            completions = [completion for prompts in batches for completion in
                           greedy_completions(accelerator, model, tokenizer, prompts, held_out.max_length)]
    finally:
        model.train(was_training)
    return [{"prompt": tokenizer.decode(prompt, skip_special_tokens=True), "completion": completion,
             "reference": tokenizer.decode(reference, skip_special_tokens=True)}
            for prompt, completion, reference in zip(held_out.prompts, completions, held_out.references,
                                                     strict=True)]


def greedy_completions(accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                       prompts: list[list[int]], max_length: int) -> list[str]:
    """The decoded greedy completions of one left-padded batch of prompts."""
    batch = left_padded(prompts, tokenizer.pad_token_id, accelerator.device)
    width = batch["input_ids"].shape[1]
    config = GenerationConfig(
        max_new_tokens=max(1, min(MAX_NEW_TOKENS, max_length - width)), do_sample=False, use_cache=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    generated = accelerator.unwrap_model(model).generate(
        **batch, generation_config=config, synced_gpus=accelerator.num_processes > 1)
    return tokenizer.batch_decode(generated[:, width:].tolist(), skip_special_tokens=True)
