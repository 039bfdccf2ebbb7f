"""The README stays a short guide, and every page a reader can follow a link to is there: each relative link and
image of the README and the docs resolves to a file, each #anchor to a heading of its page, every page of docs/
is linked from the README, and every repository path and `shardtune.` module or name the pages give exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from tests.conftest import REPO

README = REPO / "README.md"
README_MAX_LINES = 250  # the guide; the detail lives in docs/
PAGES = [README, *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "accelerate_configs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)
# Backticked paths into the repository that name a file or folder (not a command line or a placeholder).
TOP_FOLDERS = ("recipes/", "accelerate_configs/", "scripts/", "shardtune/", "tests/", "docs/")
DOTTED = re.compile(r"\bshardtune(?:\.\w+)+")  # a module, or a name in one: shardtune.plan, shardtune.ranks.x


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
