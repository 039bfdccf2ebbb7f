"""gpu_check's launch target: a recipe (the first argument, then its flags) run as `accelerate launch` would run it,
with what the trainer's Liger and fp8 conversions replaced counted in the very model they were applied to
(shardtune.gpu_check.figures.replaced_modules), rank 0's counts written as JSON to the file that the environment's
SHARDTUNE_REPLACED_FILE names. The trainer is not changed: its two conversion functions are wrapped, in its module,
before the recipe runs.

    accelerate launch ... scripts/device_counted_launch.py recipes/tiny.py --flag value ...
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # shardtune from this checkout, as the recipes have it

from shardtune.checks.command_line import OneLineParser  # noqa: E402

REPLACED_FILE = "SHARDTUNE_REPLACED_FILE"


def counted(convert: Callable, path: str | None) -> Callable:
    """`convert` (a function taking the model first), the model's replaced-module counts written to `path` after
    each call (rank 0 only)."""
    from shardtune.gpu_check.figures import replaced_modules

    def run(model, *args, **kwargs):
        result = convert(model, *args, **kwargs)
        if path and os.environ.get("RANK", "0") == "0":
            Path(path).write_text(json.dumps(replaced_modules(model)))
        return result

    return run


def install_counters(path: str | None) -> None:
    """The trainer's Liger and fp8 conversions, counted (its module's own names, the ones its training calls)."""
    import shardtune.trainer as trainer

    trainer.apply_liger_kernels = counted(trainer.apply_liger_kernels, path)
    trainer.convert_linears = counted(trainer.convert_linears, path)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="the recipe file to run (recipes/tiny.py)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="the recipe's own flags, passed on as given")
    args = parser.parse_or_exit(argv)
    install_counters(os.environ.get(REPLACED_FILE))
    sys.argv = [args.recipe, *args.flags]
    runpy.run_path(args.recipe, run_name="__main__")


if __name__ == "__main__":
    main()
