"""--lr_scheduler_type, its warm-up and --lr_scheduler_kwargs: what transformers' get_scheduler takes, and
refusals of what it would ignore."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION

from shardtune.config import LR_SCHEDULERS, ConfigError, Recipe
from shardtune.schedule import SCHEDULE_ARGUMENTS, check_schedule, make_scheduler

COMMON = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}


@pytest.mark.parametrize("name", LR_SCHEDULERS)
def test_each_schedule_takes_the_arguments_transformers_gives_it(name):
    parameters = set(inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[name]).parameters) - COMMON
    assert parameters == set(SCHEDULE_ARGUMENTS[name])


def rates(recipe: Recipe, steps: int = 20) -> list[float]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=recipe.learning_rate)
    scheduler = make_scheduler(optimizer, recipe, steps)
    values = []
    for _ in range(steps):
        values.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return values


def test_schedule_arguments_act():
    """Restarts come back up to the peak rate after each cycle; without --lr_scheduler_kwargs the same name is
    one cosine."""
    plain = Recipe(learning_rate=1.0, warmup_ratio=0.0, lr_scheduler_type="cosine_with_restarts")
    restarts = Recipe(learning_rate=1.0, warmup_ratio=0.0, lr_scheduler_type="cosine_with_restarts",
                      lr_scheduler_kwargs='{"num_cycles": 2}')
    check_schedule(restarts)
    assert rates(plain) == rates(Recipe(learning_rate=1.0, warmup_ratio=0.0, lr_scheduler_type="cosine"))
    assert rates(restarts)[10] == 1.0 and rates(plain)[10] == pytest.approx(0.5)


@pytest.mark.parametrize(("fields", "message"), [
    ({"lr_scheduler_type": "constant", "warmup_ratio": 0.03}, "constant has no warm-up"),
    ({"lr_scheduler_kwargs": '{"num_cycle": 2}'}, "num_cycle: --lr_scheduler_type cosine takes num_cycles"),
    ({"lr_scheduler_type": "linear", "lr_scheduler_kwargs": '{"power": 2}'}, "linear takes no arguments"),
    ({"lr_scheduler_kwargs": "num_cycles=2"}, "is not a JSON object"),
    ({"warmup_ratio": 1.5}, "between 0 and 1"),
])
def test_a_schedule_that_would_not_act_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_schedule(Recipe(**fields))
    assert len(error.value.messages) == 1
    check_schedule(Recipe(lr_scheduler_type="constant", warmup_ratio=0.0))
