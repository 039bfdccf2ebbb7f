"""The learning-rate schedule: transformers' get_scheduler with --lr_scheduler_type, its warm-up, and
--lr_scheduler_kwargs (TrainingArguments' lr_scheduler_kwargs: the schedule's own arguments), checked before
anything loads."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from shardtune.config import ConfigError, Recipe

if TYPE_CHECKING:  # the checks import this module before anything heavy
    import torch

# The arguments of each of transformers' schedule functions beyond the optimizer, the warm-up and the step count
# (transformers.optimization get_*_schedule*; tests/unit/test_schedule.py reads them from its signatures).
SCHEDULE_ARGUMENTS = {
    "linear": (), "constant": (), "constant_with_warmup": (),
    "cosine": ("num_cycles",), "cosine_with_restarts": ("num_cycles",), "polynomial": ("lr_end", "power"),
    "inverse_sqrt": ("timescale",),
}


def scheduler_kwargs(recipe: Recipe) -> dict:
    """--lr_scheduler_kwargs as a dict; {} when not given. Raises ConfigError for anything but a JSON object."""
    if not recipe.lr_scheduler_kwargs:
        return {}
    try:
        kwargs = json.loads(recipe.lr_scheduler_kwargs)
    except json.JSONDecodeError:
        kwargs = None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--lr_scheduler_kwargs {recipe.lr_scheduler_kwargs!r} is not a JSON object: give e.g. "
                          '\'{"num_cycles": 3}\' or leave it out.')
    return kwargs


def check_schedule(recipe: Recipe) -> None:
    """The warm-up in range and given once; a warm-up the schedule would ignore, and schedule arguments it does
    not take, refused (transformers' get_scheduler drops a warm-up for `constant` and raises on the rest only once
    the model is loaded)."""
    problems = []
    if not 0.0 <= recipe.warmup_ratio <= 1.0:
        problems.append(f"--warmup_ratio is the share of steps spent warming up: between 0 and 1, got "
                        f"{recipe.warmup_ratio}.")
    if recipe.warmup_steps < 0:
        problems.append(f"--warmup_steps must be >= 0, got {recipe.warmup_steps}.")
    if recipe.warmup_steps > 0 and recipe.warmup_ratio > 0:
        problems.append(f"--warmup_steps {recipe.warmup_steps} and --warmup_ratio {recipe.warmup_ratio} both set "
                        "the warm-up: give one of them (--warmup_ratio 0 to count in steps).")
    if recipe.lr_scheduler_type == "constant" and (recipe.warmup_steps > 0 or recipe.warmup_ratio > 0):
        problems.append("--lr_scheduler_type constant has no warm-up (transformers' constant schedule ignores it): "
                        "use constant_with_warmup, or --warmup_ratio 0.")
    try:
        kwargs = scheduler_kwargs(recipe)
    except ConfigError as error:
        problems.extend(error.messages)
        kwargs = {}
    taken = SCHEDULE_ARGUMENTS.get(recipe.lr_scheduler_type, ())
    if unknown := sorted(set(kwargs) - set(taken)):
        problems.append(f"--lr_scheduler_kwargs {', '.join(unknown)}: --lr_scheduler_type "
                        f"{recipe.lr_scheduler_type} takes {', '.join(taken) if taken else 'no arguments'}.")
    if problems:
        raise ConfigError(problems)


def make_scheduler(optimizer: torch.optim.Optimizer, recipe: Recipe, max_steps: int
                   ) -> torch.optim.lr_scheduler.LRScheduler:
    # Here, not at the top: transformers.optimization imports peft where it is installed (3-4 s per rank), so
    # the modules that only read a step's output (metrics, tests) stay light.
    from transformers import get_scheduler

    return get_scheduler(recipe.lr_scheduler_type, optimizer, num_warmup_steps=recipe.warmup_steps_for(max_steps),
                         num_training_steps=max_steps, scheduler_specific_kwargs=scheduler_kwargs(recipe))


def learning_rate_at(recipe: Recipe, max_steps: int, step: int) -> float:
    """The learning rate the step after `step` uses, on the recipe's schedule over `max_steps` steps."""
    import torch

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=recipe.learning_rate)
    return recipe.learning_rate * make_scheduler(optimizer, recipe, max_steps).lr_lambdas[0](step)
