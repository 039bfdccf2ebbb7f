"""The package's shape: no import circle between its modules (imports inside functions counted), no module that has
grown past what one reader holds in mind, a top level that reads as the architecture (a few modules beside the
packages, each package saying what lives in it), and unit tests in folders that mirror the packages."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "shardtune"
MAX_MODULE_LINES = 400
MAX_TOP_MODULES = 15  # beside the packages and __init__
UNIT_TESTS = PACKAGE.parent / "tests" / "unit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in its body, functions and TYPE_CHECKING blocks too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target):], target] if target in path else [node, target]
            if target not in state and (cycle := visit(target, [*path, target])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "shardtune.plan.strategy" in graph and graph["shardtune.cli"], graph  # the walk sees the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_over_the_line_limit():
    long = {module_name(path): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_the_top_level_holds_few_modules_and_every_package_says_what_it_holds():
    top = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")
    assert len(top) <= MAX_TOP_MODULES, top
    packages = [path.parent for path in PACKAGE.glob("*/__init__.py")]
    assert len(packages) >= 9, packages
    silent = [package.name for package in packages
              if not (ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or "").strip()]
    assert not silent, silent


def test_unit_tests_mirror_the_packages():
    folders = {path.parent.name for path in UNIT_TESTS.glob("*/__init__.py")}
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert folders and folders <= packages, folders - packages
