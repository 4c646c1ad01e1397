"""No import cycles between the files of the flexshard package, counting every import.

import-linter (scripts/test.sh) checks the one-way layers between packages; it skips
imports under ``if TYPE_CHECKING:`` and says nothing about cycles inside one package.
This checker reads every ``import`` / ``from ... import`` statement with ``ast`` wherever
it sits (module level, inside functions, under ``TYPE_CHECKING``), so a cycle hidden by
a function-level import still fails, as torch's FSDP2 package has none even counting those.

How names resolve to files (one edge per statement and imported module):

- ``import a.b.c`` is an edge to ``a.b.c`` alone. Python also runs ``a/__init__`` and
  ``a/b/__init__``, but counting those would make every package that re-exports its
  submodules a cycle with each of them; the parents' own imports are edges of their own.
- ``from pkg import name`` is an edge to ``pkg.name`` when that is a module (a submodule
  imported through its package: ``from . import x`` points at x, not at ``__init__``),
  else to ``pkg`` itself (a name defined or re-exported by ``pkg/__init__.py``).
- A package ``__init__.py`` that imports its submodules for re-export is an edge
  ``__init__ -> submodule``; a submodule importing a re-exported name back through the
  package is then a cycle, and counts.
- Relative imports resolve against the file's package; imports from outside flexshard
  are no edges.

Run ``.venv/bin/python tests/project/test_import_cycles.py`` to print the cycles.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT_PACKAGE = "flexshard"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module
    line: int


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module of the package under ``package_dir`` by dotted name."""
    root = package_dir.name
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((root, *parts))] = path
    return modules


def _package_of(module: str, path: Path) -> str:
    # A package's __init__ is its own package; any other file's package is its parent.
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _import_targets(node: ast.AST, module: str, path: Path, modules: set[str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in modules:
                yield alias.name
        return
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = _package_of(module, path)
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    if base != ROOT_PACKAGE and not base.startswith(ROOT_PACKAGE + ".") and base not in modules:
        return
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            yield sub
        elif base in modules:
            yield base


def import_edges(modules: dict[str, Path]) -> list[Edge]:
    """Every import between the modules, wherever the statement sits in the file."""
    names = set(modules)
    edges: list[Edge] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # walks function bodies and TYPE_CHECKING blocks too
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in dict.fromkeys(_import_targets(node, module, path, names)):
                if target != module:
                    edges.append(Edge(module, target, node.lineno))
    return edges


def strongly_connected(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative: no recursion limit)."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        if e.target not in succ[e.source]:
            succ[e.source].append(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(succ[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def one_cycle(component: list[str], edges: list[Edge]) -> list[Edge]:
    """A shortest cycle through the component's first module, as the edges in order."""
    members = set(component)
    start = component[0]
    first: dict[tuple[str, str], Edge] = {}
    for e in edges:
        if e.source in members and e.target in members:
            first.setdefault((e.source, e.target), e)
    came_from: dict[str, Edge] = {}
    frontier = [start]
    while frontier:  # breadth-first from start until an edge closes back on it
        nxt: list[str] = []
        for node in frontier:
            for (src, dst), e in first.items():
                if src != node:
                    continue
                if dst == start:
                    path = [e]
                    while path[0].source != start:
                        path.insert(0, came_from[path[0].source])
                    return path
                if dst not in came_from:
                    came_from[dst] = e
                    nxt.append(dst)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def describe(
    components: list[list[str]], edges: list[Edge], modules: dict[str, Path], base: Path
) -> str:
    lines = []
    for component in components:
        files = ", ".join(str(modules[m].relative_to(base)) for m in component)
        lines.append(f"{len(component)} files in a cycle: {files}; one cycle:")
        for e in one_cycle(component, edges):
            src = modules[e.source].relative_to(base)
            lines.append(f"  {src}:{e.line} -> {modules[e.target].relative_to(base)}")
    return "\n".join(lines)


def find_cycles(package_dir: Path) -> tuple[list[list[str]], str]:
    modules = module_files(package_dir)
    edges = import_edges(modules)
    components = strongly_connected(list(modules), edges)
    return components, describe(components, edges, modules, package_dir.parent)


def test_flexshard_has_no_import_cycles() -> None:
    components, report = find_cycles(REPO / ROOT_PACKAGE)
    assert not components, "import cycles between files (imports in functions count):\n" + report


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_checker_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / ROOT_PACKAGE
    _write(pkg / "__init__.py", "from .a import f\n")
    _write(pkg / "a.py", "from flexshard.b import g\n\ndef f():\n    return g()\n")
    # the back edge hides inside a function, as the trainer's did
    _write(pkg / "b.py", "def g():\n    from . import a\n    return a\n")
    _write(
        pkg / "c.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.d import D\n",
    )
    _write(pkg / "sub" / "__init__.py", "")
    _write(pkg / "sub" / "d.py", "from ..c import x\nD = 1\n")
    components, report = find_cycles(pkg)
    assert components == [["flexshard.a", "flexshard.b"], ["flexshard.c", "flexshard.sub.d"]]
    assert "flexshard/a.py:1 -> flexshard/b.py" in report
    assert "flexshard/b.py:2 -> flexshard/a.py" in report
    assert "flexshard/c.py:3 -> flexshard/sub/d.py" in report


def test_package_reexports_are_edges_from_init(tmp_path: Path) -> None:
    pkg = tmp_path / ROOT_PACKAGE
    _write(pkg / "__init__.py", "from .a import A\n")
    _write(pkg / "a.py", "A = 1\n")
    # `from . import a` names the submodule: an edge to a, not to __init__ (no cycle)
    _write(pkg / "b.py", "from . import a\n")
    assert find_cycles(pkg)[0] == []
    # a name re-exported by __init__ imported back through the package: a cycle
    _write(pkg / "a.py", "A = 1\n\ndef f():\n    from flexshard import A\n    return A\n")
    assert find_cycles(pkg)[0] == [["flexshard", "flexshard.a"]]


if __name__ == "__main__":
    found, text = find_cycles(REPO / ROOT_PACKAGE)
    print(text or "no import cycles")
    sys.exit(1 if found else 0)
