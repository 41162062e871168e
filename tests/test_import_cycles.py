"""No two flowllm modules import each other, directly or through others.

import-linter's layers order packages, not the modules inside one, and a cycle is easy to
hide from it and from Python behind an import inside a function. This walks every module's
source, imports inside functions included (those under `if TYPE_CHECKING:` never run), so
a deferred import is fine only where it defers something heavy, not where it breaks a loop.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import flowllm

PACKAGE_DIR = Path(flowllm.__file__).resolve().parent

Graph = dict[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    """A file's dotted name; a package's `__init__` is the package itself."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import in `node` at any depth, but none that only a type checker runs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and is_type_checking(child.test):
            for other in child.orelse:
                if isinstance(other, (ast.Import, ast.ImportFrom)):
                    yield other
                yield from import_nodes(other)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from import_nodes(child)


def known_module(name: str, modules: set[str]) -> str | None:
    """The module that importing `name` names: itself, or the longest known prefix."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The module a `from ... import` reads from, its dots resolved against `name`."""
    if not node.level:
        return node.module or ""
    anchor = name.split(".")
    package = anchor if is_package else anchor[:-1]
    parts = package[: len(package) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The flowllm modules `name` (the module at `path`) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = absolute(node, name, is_package)
            # `from package import module` names the module; any other name, the package
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        for target in targets:
            module = known_module(target, modules)
            if module is not None and module != name:
                found.add(module)
    return found


def import_graph(root: Path = PACKAGE_DIR) -> Graph:
    files = package_files(root)
    modules = set(files)
    return {name: imported_modules(name, path, modules) for name, path in files.items()}


def tangles(graph: Graph) -> list[set[str]]:
    """The strongly connected components of more than one module: each module of one
    reaches every other (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                elif successor in on_stack:
                    low[node] = min(low[node], index[successor])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle per tangle, as a path of modules back to its first."""
    return [cycle_in(graph, component) for component in tangles(graph)]


def describe(graph: Graph, component: set[str]) -> str:
    cycle = cycle_in(graph, component)
    rest = sorted(component.difference(cycle))
    path = " -> ".join(cycle)
    return path if not rest else f"{path} (and through {', '.join(rest)})"


def cycle_in(graph: Graph, component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    start = min(component)
    paths: dict[str, list[str]] = {start: [start]}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for successor in sorted(graph[node] & component):
                if successor == start:
                    return [*paths[node], start]
                if successor not in paths:
                    paths[successor] = [*paths[node], successor]
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{sorted(component)} is no cycle")


# The cycles left to break, each by its modules (none now): a new cycle fails the test
# unless it is listed here, and so does a listed one once broken, until it leaves the list.
KNOWN_CYCLES: list[set[str]] = []


def test_flowllm_has_no_import_cycle_but_the_known_ones() -> None:
    graph = import_graph()
    found = tangles(graph)
    new = [c for c in found if c not in KNOWN_CYCLES]
    if new:
        pytest.fail("import cycles:\n" + "\n".join(describe(graph, c) for c in new))
    broken = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not broken, f"no longer cycles, so out of KNOWN_CYCLES: {broken}"


def write(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"a.py": "from pkg import b\n", "b.py": "def f():\n    from pkg.a import x\n"},
            [["pkg.a", "pkg.b", "pkg.a"]],
            id="hidden-in-a-function",
        ),
        pytest.param(
            {
                "a.py": "from .sub import c\n",
                "sub/__init__.py": "",
                "sub/c.py": "from ..a import x\n",
            },
            [["pkg.a", "pkg.sub.c", "pkg.a"]],
            id="relative",
        ),
        pytest.param(
            {"__init__.py": "from pkg.a import x\n", "a.py": "import pkg\n"},
            [["pkg", "pkg.a", "pkg"]],
            id="package-init",
        ),
        pytest.param(
            {
                "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.b import y\n",
                "b.py": "from pkg.a import x\n",
            },
            [],
            id="type-checking-only",
        ),
        pytest.param(
            {"a.py": "def f():\n    import pkg.b\n", "b.py": "import json\n"},
            [],
            id="deferred-without-a-cycle",
        ),
    ],
)
def test_the_walk_finds_cycles_a_function_hides(
    tmp_path: Path, files: dict[str, str], expected: list[list[str]]
) -> None:
    root = write(tmp_path, {"pkg/__init__.py": "", **{f"pkg/{k}": v for k, v in files.items()}})
    assert cycles(import_graph(root)) == expected
