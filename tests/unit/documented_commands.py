"""The planner commands that the README, docs/ and the recipe headers give — `python -m shardtune.plan ...`,
`python -m shardtune.models.flops ...` and a recipe's `--dry_run` — read from the text, run in-process from the
repository root as a user would run them, and the figures the text quotes compared with what they print."""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from shardtune.models.flops import main as flops_main
from shardtune.plan.__main__ import main as plan_main
from tests.conftest import REPO

FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`([^`\n]*)`")
# A command the planner answers: its modules given arguments (a bare module name is a mention), or a recipe run
# with --dry_run.
PLANNER_COMMAND = re.compile(r"^python (?:-m shardtune\.(?:plan|flops) --|recipes/\w+\.py\b.*--dry_run\b)")
# A multi-machine launch: sbatch over several nodes, or accelerate launch on several machines.
LAUNCH_COMMAND = re.compile(r"^(?:sbatch\b.*--nodes (\d+)|accelerate launch\b.*--num_machines (\d+))")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
GB_FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)? GB")
# What a page writes beside a command that does not fit: the planner's own words.
NOT_FITTING = re.compile(r"Nothing fits|DOES NOT FIT|does not fit")


@dataclass
class Documented:
    where: str  # page:line
    argv: list[str]  # the words after `python`
    comment: str = ""  # what the page writes after `#` on the command's line
    shown: str = ""  # the output the page shows under a `$ ` command ("..." where it leaves some out)


@dataclass
class Launch:
    where: str
    words: list[str]
    machines: int
    block: list[Documented]  # the planner commands of the same code block


def logical_lines(block: str) -> list[tuple[int, str]]:
    """(offset of the first line, the line) with backslash continuations joined."""
    lines, start, pending = [], 0, ""
    for number, line in enumerate(block.splitlines()):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    return lines


def split_comment(line: str) -> tuple[str, str]:
    """(the command, what follows its ` # `)."""
    marker = re.search(r"\s+#\s*", line)
    if not marker:
        return line.strip(), ""
    return line[:marker.start()].strip(), line[marker.end():].strip()


def commands_in_block(block: str, first_line: int, name: str) -> tuple[list[Documented], list[Launch]]:
    commands: list[Documented] = []
    launches: list[tuple[int, str]] = []
    lines = logical_lines(block)
    for index, (offset, line) in enumerate(lines):
        prompted = line.startswith("$ ")
        command, comment = split_comment(line.removeprefix("$ ").strip())
        where = f"{name}:{first_line + offset + 1}"
        if PLANNER_COMMAND.match(command):
            shown = []
            if prompted:  # the output shown follows, up to the next prompt or comment
                for _, after in lines[index + 1:]:
                    if after.startswith(("$ ", "# ")):
                        break
                    shown.append(after)
            commands.append(Documented(where, shlex.split(command)[1:], comment, "\n".join(shown)))
        elif LAUNCH_COMMAND.match(command):
            launches.append((offset, command))
    found = []
    for offset, command in launches:
        match = LAUNCH_COMMAND.match(command)
        machines = int(match.group(1) or match.group(2))
        if machines > 1:
            found.append(Launch(f"{name}:{first_line + offset + 1}", shlex.split(command), machines, commands))
    return commands, found


def commands_in_page(page: Path) -> tuple[list[Documented], list[Launch]]:
    """Every planner command of a markdown page (in code blocks and inline code) and its multi-machine
    launches."""
    text = page.read_text()
    name = str(page.relative_to(REPO))
    commands: list[Documented] = []
    launches: list[Launch] = []
    for block in FENCE.finditer(text):
        first_line = text[:block.start()].count("\n") + 1  # the line after the opening fence
        body = block.group(0).split("\n", 1)[1].rsplit("\n", 1)[0]
        block_commands, block_launches = commands_in_block(body, first_line, name)
        commands += block_commands
        launches += block_launches
    prose = FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), text)
    for span in INLINE_CODE.finditer(prose):
        if PLANNER_COMMAND.match(span.group(1)):
            line = prose[:span.start()].count("\n") + 1
            commands.append(Documented(f"{name}:{line}", shlex.split(span.group(1))[1:]))
    return commands, launches


def run(argv: list[str], scratch: Path) -> tuple[int, str]:
    """(exit code, stdout and stderr) of `python ARGV` run in-process from the repository root; a --chart is
    written under `scratch` instead of where the page says."""
    argv = [str(scratch / Path(word).name) if before == "--chart" else word
            for before, word in zip(["", *argv[:-1]], argv, strict=True)]
    output = io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            if argv[:2] == ["-m", "shardtune.plan"]:
                code = plan_main(argv[2:])
            elif argv[:2] == ["-m", "shardtune.models.flops"]:
                code = flops_main(argv[2:])
            else:
                code = run_script(argv)
        except SystemExit as stop:  # argparse's refusals, and every recipe's exit
            code = stop.code if isinstance(stop.code, int) else 1
    return code, output.getvalue()


def run_script(argv: list[str]) -> int:
    """A recipe run as `python recipes/x.py ...`: as __main__, so that it reads its own header's launch line."""
    saved = sys.argv
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
        return 0
    finally:
        sys.argv = saved


def agrees(claimed: str, printed: str) -> bool:
    """Whether a number as a page writes it is the number the planner printed, each rounded as written: 128 GB
    claims the 128.5 GB printed of 128.46 GB (half a unit of the last digit each)."""
    def tolerance(text: str) -> float:
        decimals = len(text.partition(".")[2])
        return 0.5 * 10 ** -decimals

    value, truth = float(claimed.replace(",", "")), float(printed.replace(",", ""))
    return abs(value - truth) <= tolerance(claimed) + tolerance(printed) + 1e-9


def same_sentence(claimed: str, printed: str) -> bool:
    """Whether a sentence a page quotes is one the planner printed, words as printed (line breaks aside) and
    each number within the rounding of both."""
    claimed, printed = " ".join(claimed.split()), " ".join(printed.split())
    template = re.escape(NUMBER.sub("\0", claimed)).replace("\0", f"({NUMBER.pattern})")
    for match in re.finditer(template, printed):
        if all(agrees(number, found) for number, found in zip(NUMBER.findall(claimed), match.groups(), strict=True)):
            return True
    return False


def figures_missing(text: str, printed: str) -> list[str]:
    """The "N GB" figures of `text` that the printed output does not give as written."""
    return [figure for figure in GB_FIGURE.findall(text) if figure not in printed]


def outside_a_launch(monkeypatch) -> None:
    """The environment of a shell, not of `accelerate launch`: a dry run then plans the config its page names."""
    for name in [*os.environ]:
        if name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") or name.startswith(
                ("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)


def flag_value(words: list[str], flag: str) -> str | None:
    return words[words.index(flag) + 1] if flag in words[:-1] else None


def flag_pairs(words: list[str]) -> set[tuple[str, str]]:
    """The (--flag, value) pairs among command-line words."""
    return {(flag, value) for flag, value in zip(words, words[1:], strict=False) if flag.startswith("--") and not
            value.startswith("--")}
