"""The README stays a short guide, and every page a reader can follow a link to is there: each relative link and
image of the README and the docs resolves to a file, each #anchor to a heading of its page, every page of docs/
is linked from the README, and every repository path and `shardtune.` module or name the pages give exists.
Every planner command the pages give runs, and prints the figures, output and chart the page shows beside it; every
multi-machine launch comes with the dry run that shows it fits."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.documented_commands import (
    NOT_FITTING,
    Documented,
    commands_in_page,
    figures_missing,
    flag_pairs,
    flag_value,
    outside_a_launch,
    run,
)

README = REPO / "README.md"
README_MAX_LINES = 250  # the guide; the detail lives in docs/
PAGES = [README, *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "accelerate_configs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)
# Backticked paths into the repository that name a file or folder (not a command line or a placeholder).
TOP_FOLDERS = ("recipes/", "accelerate_configs/", "scripts/", "shardtune/", "tests/", "docs/")
DOTTED = re.compile(r"\bshardtune(?:\.\w+)+")  # a module, or a name in one: shardtune.plan, shardtune.parallel.ranks.x


def prose(page: Path) -> str:
    """The page without its code blocks, whose lines are commands and output, not markdown."""
    return FENCE.sub("", page.read_text())


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    ids = set()
    for heading in HEADING.findall(prose(page)):
        base = anchor(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        ids.add(base if count == 0 else f"{base}-{count}")  # GitHub numbers repeated headings
    return ids


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(INLINE_CODE.sub("", prose(page)))
            if not re.match(r"[a-z]+:", target)]  # http:, https:, mailto: are not the repository's


def test_readme_is_a_short_guide():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the detail into docs/"


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, fragment = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_doc_page_is_linked_from_the_readme():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    unlinked = [page.relative_to(REPO) for page in PAGES if page.parent == REPO / "docs" and page not in linked]
    assert not unlinked, f"pages no link of the README reaches: {unlinked}"


def test_repository_paths_named_in_the_docs_exist():
    missing = []
    for page in PAGES:
        for span in INLINE_CODE.findall(prose(page)):
            for word in span.strip("`").split():
                if word.startswith(TOP_FOLDERS) and not re.search(r"[<*]|\.\.\.|/x\.py$", word):
                    if not (REPO / word.rstrip(",;:")).exists():
                        missing.append(f"{page.relative_to(REPO)}: {word}")
    assert not missing, "\n".join(missing)


def resolves(dotted: str) -> bool:
    """Whether a dotted name is a module of the package or a name defined in one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_modules_named_in_the_docs_exist():
    missing = sorted({f"{page.relative_to(REPO)}: {dotted}" for page in PAGES
                      for span in INLINE_CODE.findall(page.read_text()) for dotted in DOTTED.findall(span)
                      if not resolves(dotted)})
    assert not missing, "\n".join(missing)


COMMANDS = [command for page in PAGES for command in commands_in_page(page)[0]]
LAUNCHES = [launch for page in PAGES for launch in commands_in_page(page)[1]]
PLAN_NEUTRAL_FLAGS = ("--dataset", "--output_dir")  # read by a run, not by the plan


def test_the_pages_give_planner_commands_and_launches():
    """The parsing below finds what the pages hold (a change of layout would otherwise check nothing)."""
    assert any(command.argv[:2] == ["-m", "shardtune.plan"] for command in COMMANDS)
    assert any("--dry_run" in command.argv for command in COMMANDS)
    assert any(command.shown for command in COMMANDS) and LAUNCHES


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.where)
def test_every_planner_command_prints_what_its_page_quotes(command: Documented, tmp_path, monkeypatch):
    """Run as the page gives it: it exits 0 unless the page says it does not fit; every "N GB" of its comment and
    every line the page shows of its output (up to each "...") is printed so; a chart it writes into the
    repository is the one committed there."""
    outside_a_launch(monkeypatch)
    code, printed = run(command.argv, tmp_path)
    quoted = f"{command.comment}\n{command.shown}"
    where = f"{command.where}: python {' '.join(command.argv)}"
    if NOT_FITTING.search(quoted):
        assert code != 0 and NOT_FITTING.search(printed), f"{where} fits now:\n{printed}"
    else:
        assert code == 0, f"{where} exits {code}:\n{printed}"
    missing = figures_missing(quoted, printed)
    assert not missing, f"{where} does not print {missing}:\n{printed}"
    flat = " ".join(printed.split())
    for line in command.shown.splitlines():
        for fragment in line.split("..."):
            assert " ".join(fragment.split()) in flat, f"{where} no longer prints {fragment.strip()!r}:\n{printed}"
    chart = flag_value(command.argv, "--chart")
    if chart and (REPO / chart).is_file():
        written = (tmp_path / Path(chart).name).read_bytes()
        assert written == (REPO / chart).read_bytes(), f"{chart} is not the planner's now: run {where}"


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda launch: launch.where)
def test_every_multi_machine_launch_shows_its_dry_run(launch):
    """A launch over several machines has, in its code block, the recipe's --dry_run on that many nodes with its
    config and plan-shaping flags (which the test above runs and finds fitting)."""
    words = launch.words
    recipe = next(word for word in words if re.fullmatch(r"recipes/\w+\.py", word))
    after = words[words.index(recipe) + 1:]
    if words[0] == "sbatch":  # train.sbatch RECIPE CONFIG [recipe flags]
        config, after = after[0], after[1:]
    else:
        config = flag_value(words, "--config_file")
    wanted = {pair for pair in flag_pairs(after) if pair[0] not in PLAN_NEUTRAL_FLAGS}
    dry_runs = [command.argv for command in launch.block if command.argv[0] == recipe and "--dry_run" in command.argv
                and not NOT_FITTING.search(f"{command.comment}\n{command.shown}")]  # one that fits
    matching = [argv for argv in dry_runs if flag_value(argv, "--config_file") == config and wanted <= flag_pairs(argv)
                and (flag_value(argv, "--hardware") or "").startswith(f"{launch.machines}x")]
    assert matching, (f"{launch.where}: give its plan beside it: python {recipe} --dry_run --hardware "
                      f"{launch.machines}x<node> --config_file {config} {' '.join(map(' '.join, sorted(wanted)))}")
