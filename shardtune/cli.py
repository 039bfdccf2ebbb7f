"""Entry point of every recipe: flags and checks first, with light imports only, then the trainer."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings

from shardtune.checkpoint import resolve_resume
from shardtune.config import ConfigError, Recipe, launch_env, parse_recipe, validate


def main(recipe: Recipe, argv: list[str] | None = None) -> None:
    """Parse overrides, check everything that needs no model, train. Bad input: one line on stderr, exit 2."""
    try:
        recipe = parse_recipe(recipe, argv)
        if os.environ.get("ACCELERATE_USE_CPU", "false").lower() == "true":  # use_cpu: true in the accelerate config
            recipe = dataclasses.replace(recipe, use_cpu=True)
        world_size, uses_deepspeed, _ = launch_env()
        import torch  # after the flag checks: --help and typos answer at once

        if recipe.dry_run:
            sys.exit(print_memory_plan(recipe, required=True))
        plan = validate(recipe, world_size, uses_deepspeed, has_gpu=torch.cuda.is_available())
        print_memory_plan(recipe, required=bool(recipe.hardware))
        resume_path, start_step = resolve_resume(recipe.resume_from_checkpoint, recipe.resolved_output_dir, world_size)
        # DeepSpeed still calls these collectives by their old names, once per layer and step.
        warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
        from shardtune.trainer import train

        train(recipe, plan, resume_path, start_step)
    except ConfigError as error:
        if reports_errors():
            print(f"shardtune: error: {error}", file=sys.stderr)
        import torch.distributed

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.exit(2)


def reports_errors() -> bool:
    """The first rank of each machine prints the error that every rank hits, so that each machine's log says why
    it stopped; a rank whose own RANK or WORLD_SIZE is wrong prints its own."""
    try:
        valid = 0 <= int(os.environ.get("RANK", "0")) < int(os.environ.get("WORLD_SIZE", "1"))
        return not valid or int(os.environ.get("LOCAL_RANK", "0")) == 0
    except ValueError:
        return True


def print_memory_plan(recipe: Recipe, required: bool) -> int:
    """Plan this launch's memory per GPU before any weight loads; raise ConfigError if it does not fit.
    Without --hardware and without GPUs there is nothing to plan against (returns 0)."""
    from shardtune.flops import ModelError, resolve_model
    from shardtune.hardware import HardwareError
    from shardtune.plan import format_plan, launch_hardware, plan_launch

    try:
        hardware = launch_hardware(recipe.hardware)
        if hardware is None:
            if required:
                raise ConfigError("--dry_run needs --hardware (e.g. 8xh100-80gb) on a machine without GPUs.")
            return 0
        shape = resolve_model(recipe.model_name_or_path)
    except (HardwareError, ModelError) as error:
        if required:
            raise ConfigError(str(error)) from error
        print(f"shardtune: no memory plan: {error}", file=sys.stderr)
        return 0
    chosen, alternative = plan_launch(shape, hardware, recipe)
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_plan(chosen))
    if alternative:
        raise ConfigError(
            f"{shape.name} does not fit {hardware.name} with this accelerate config: "
            f"{chosen.per_gpu['total'] / 1e9:,.1f} GB planned per GPU, {chosen.capacity / 1e9:,.1f} GB usable. "
            f"Nearest plan that fits: {alternative}"
        )
    return 0
