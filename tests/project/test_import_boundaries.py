"""Import boundaries that import-linter (the layers of flexshard's packages) and
``test_import_cycles.py`` do not check, read from every ``import`` statement with
``ast`` wherever it sits (module level, inside functions, under ``TYPE_CHECKING``):

- no file under tests/ imports ``benchmarks``: dependencies run one way, benchmarks ->
  flexshard; what a test needs of a benchmark lives in flexshard (the planner's op
  recording in ``flexshard.plan``, shared measurements in ``flexshard.testing``);
- no flexshard module but ``flexshard/torch_internals.py`` imports a private torch
  module or name (a leading underscore anywhere in the dotted path), so that module
  stays the single place for torch's internals (docs/architecture.md, "torch
  internals"), ``flexshard/plan/`` included.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCH_INTERNALS = "flexshard/torch_internals.py"
#: flexshard modules that still import torch's privates themselves, each with what
#: torch_internals already offers for it (remove the entry once the module uses it)
NOT_YET_ROUTED: dict[str, str] = {}


def imported_names(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every module and name ``path`` imports by absolute path:
    ``import a.b`` gives ``a.b``; ``from a.b import c`` gives ``a.b`` and ``a.b.c``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def is_benchmarks(name: str) -> bool:
    return name.split(".")[0] == "benchmarks"


def is_private_torch(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "torch" and any(part.startswith("_") for part in parts[1:])


def violations(files: list[Path], forbidden: Callable[[str], bool]) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in files
        for line, name in imported_names(path)
        if forbidden(name)
    ]


def test_no_test_imports_benchmarks() -> None:
    found = violations(sorted((REPO / "tests").rglob("*.py")), is_benchmarks)
    assert not found, f"tests import benchmarks (move what they need into flexshard): {found}"


def test_torch_privates_only_through_torch_internals() -> None:
    skipped = {TORCH_INTERNALS, *NOT_YET_ROUTED}
    files = [
        path
        for path in sorted((REPO / "flexshard").rglob("*.py"))
        if path.relative_to(REPO).as_posix() not in skipped
    ]
    found = violations(files, is_private_torch)
    assert not found, f"import these from flexshard.torch_internals: {found}"
    for name in NOT_YET_ROUTED:  # the list only shrinks
        assert violations([REPO / name], is_private_torch), f"{name} is routed: drop its entry"


def test_the_checks_see_what_they_forbid(tmp_path: Path) -> None:
    """Positive control: each kind of import the checks look for is found."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import benchmarks.plan_ops\n"
        "from torch.utils._pytree import tree_map\n"
        "def f():\n"
        "    from torch.distributed import _functional_collectives\n"
        "    from benchmarks import plan_docs\n"
        "from torch.distributed import fsdp as _fsdp\n"  # an alias is no private name
    )
    names = [name for _, name in imported_names(sample)]
    assert [n for n in names if is_benchmarks(n)] == [
        "benchmarks.plan_ops",
        "benchmarks",
        "benchmarks.plan_docs",
    ]
    assert [n for n in names if is_private_torch(n)] == [
        "torch.utils._pytree",
        "torch.utils._pytree.tree_map",
        "torch.distributed._functional_collectives",
    ]
