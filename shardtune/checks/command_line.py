"""The parser of every command line beside a recipe's (the planner, the scripts): argparse's own refusals in one
line, as a recipe gives them (shardtune.flags.RecipeParser). Kept off transformers, so a script's --help stays
instant."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from shardtune.config import ConfigError


class OneLineParser(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a value of the wrong type, a missing argument) as ConfigError: one
    line, which the command prints with exit code 2, instead of argparse's usage block. `see` names where the
    flags are listed."""

    def __init__(self, *args: Any, see: str = "--help", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.see = see

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"Bad command line: {message.rstrip('.')}; see {self.see}.")

    def parse_or_exit(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """parse_args for a script that prints its own refusals: this one as they are, `<script>: error: <line>`
        (the script's name without .py), exit code 2."""
        try:
            return self.parse_args(argv)
        except ConfigError as error:
            print(f"{self.prog.removesuffix('.py')}: error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
