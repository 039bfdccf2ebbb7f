"""--help of the recipe, planner and FLOPs commands: every option says what it does, and a recipe's shows the value
each flag takes when not given."""

from __future__ import annotations

import dataclasses

import pytest

from shardtune.config import Recipe
from shardtune.flags import recipe_parser
from shardtune.models.flops import main as flops_main
from shardtune.plan.__main__ import main as plan_main


def help_entries(text: str) -> dict[str, str]:
    """Each option of argparse's --help output (its first spelling) and the help text printed for it."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, rest = line.strip().partition("  ")  # argparse pads the help column with spaces
            current = invocation.split(",")[0].split()[0]
            entries[current] = rest.strip()
        elif line.startswith("    ") and current:  # the help continued, or begun on the next line
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


@pytest.fixture
def wide(monkeypatch):
    """argparse wraps at $COLUMNS: wide enough that no '(default: ...)' is split."""
    monkeypatch.setenv("COLUMNS", "1000")


def test_every_recipe_flag_has_help_and_its_default(wide):
    recipe = Recipe(name="tiny", learning_rate=3e-3, max_seq_length=64)
    text = recipe_parser(recipe).format_help()
    entries = help_entries(text)
    entries.pop("-h")
    assert {f"--{item.name}" for item in dataclasses.fields(Recipe)} <= set(entries)
    assert not [flag for flag, help_text in entries.items() if not help_text], "options without help"
    no_default = [flag for flag, help_text in entries.items()
                  if "(default: " not in help_text and help_text != f"Same as --{flag[len('--no_'):]} false."]
    assert not no_default, "options whose default --help does not show"
    # The recipe's own values, and an empty string that reads as one.
    assert "(default: 0.003)" in entries["--learning_rate"] and "(default: 64)" in entries["--max_seq_length"]
    assert entries["--output_dir"].endswith("(default: '')") and "(default: )" not in text


@pytest.mark.parametrize("main", [plan_main, flops_main], ids=["plan", "flops"])
def test_every_planner_and_flops_option_has_help(main, wide, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    assert len(entries) > 3
    assert not [flag for flag, help_text in entries.items() if not help_text], "options without help"
