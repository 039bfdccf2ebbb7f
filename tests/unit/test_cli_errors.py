"""The flags users bring from transformers' TrainingArguments, and the recipe values they become."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import get_scheduler

from shardtune.config import Recipe
from shardtune.flags import ALIASES, parse_recipe

SPELLINGS = [
    # (the recipe's own values, the command line, the values it must end with)
    ({"mixed_precision": "no"}, ["--bf16", "true"], {"mixed_precision": "bf16"}),
    ({"mixed_precision": "no"}, ["--bf16"], {"mixed_precision": "bf16"}),  # a bool flag alone means true
    ({"mixed_precision": "bf16"}, ["--fp16", "true"], {"mixed_precision": "fp16"}),
    ({"mixed_precision": "bf16"}, ["--bf16", "false"], {"mixed_precision": "no"}),  # TrainingArguments' fp32
    ({"mixed_precision": "bf16"}, ["--fp16", "false"], {"mixed_precision": "bf16"}),  # switches off fp16 only
    ({"mixed_precision": "fp16"}, ["--bf16", "false", "--fp16", "false"], {"mixed_precision": "no"}),
    ({"mixed_precision": "no"}, ["--mixed_precision", "bf16", "--bf16", "true"], {"mixed_precision": "bf16"}),
    ({"warmup_ratio": 0.05}, ["--warmup_steps", "7"], {"warmup_steps": 7, "warmup_ratio": 0.0}),
    ({"warmup_ratio": 0.05}, ["--warmup_steps=7"], {"warmup_steps": 7, "warmup_ratio": 0.0}),
    ({"warmup_ratio": 0.05}, ["--warmup_steps", "7", "--warmup_ratio", "0"], {"warmup_steps": 7, "warmup_ratio": 0.0}),
    ({"warmup_ratio": 0.05}, ["--warmup_steps", "0"], {}),  # 0: the ratio stays in charge
    ({"gradient_checkpointing": True}, ["--gradient_checkpointing_kwargs", '{"use_reentrant": false}'], {}),
]


@pytest.mark.parametrize(("values", "argv", "expected"), SPELLINGS, ids=[" ".join(case[1]) for case in SPELLINGS])
def test_training_arguments_spellings(values, argv, expected):
    recipe = Recipe(name="x", **values)
    assert parse_recipe(recipe, argv) == dataclasses.replace(recipe, **expected)


def test_warmup_steps_set_the_schedule():
    """The trainer's scheduler warms up over --warmup_steps optimizer steps (Recipe.warmup_steps_for), and over
    --warmup_ratio of them without it."""
    assert Recipe(warmup_ratio=0.05).warmup_steps_for(100) == 5
    recipe = parse_recipe(Recipe(warmup_ratio=0.05), ["--warmup_steps", "4"])
    assert recipe.warmup_steps_for(100) == 4
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=recipe.warmup_steps_for(10), num_training_steps=10)
    rates = []
    for _ in range(6):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[:5] == [0.0, 0.25, 0.5, 0.75, 1.0] and rates[5] < 1.0  # the peak at step 4, then the decay


def test_help_documents_the_spellings(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe(Recipe(), ["--help"])
    assert exit_info.value.code == 0
    help_text = "".join(capsys.readouterr().out.split())  # argparse wraps lines wherever it likes
    for flag, text in {**ALIASES, "--warmup_steps": "Warm-up optimizer steps, instead of --warmup_ratio"}.items():
        assert flag in help_text and "".join(text.split()) in help_text, flag
