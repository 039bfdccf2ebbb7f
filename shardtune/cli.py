"""Entry point of every recipe: flags and checks first, with light imports only, then the trainer."""

from __future__ import annotations

import os
import sys
import warnings

from shardtune.checkpoint import resolve_resume
from shardtune.config import ConfigError, Recipe, launch_env, parse_recipe, validate


def main(recipe: Recipe, argv: list[str] | None = None) -> None:
    """Parse overrides, check everything that needs no model, train. Bad input: one line on stderr, exit 2."""
    try:
        recipe = parse_recipe(recipe, argv)
        world_size, uses_deepspeed, _ = launch_env()
        import torch  # after the flag checks: --help and typos answer at once

        plan = validate(recipe, world_size, uses_deepspeed, has_gpu=torch.cuda.is_available())
        resume_path, start_step = resolve_resume(recipe.resume_from_checkpoint, recipe.resolved_output_dir, world_size)
        # DeepSpeed still calls these collectives by their old names, once per layer and step.
        warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
        from shardtune.trainer import train

        train(recipe, plan, resume_path, start_step)
    except ConfigError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"shardtune: error: {error}", file=sys.stderr)
        import torch.distributed

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.exit(2)
