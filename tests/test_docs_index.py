"""docs/testing.md is checked against the tree: every test file has a row there, and
every test file it names exists."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a test file as docs/testing.md names it: tests/test_x.py, test_x.py (after a
# tests/ mention), a glob (test_fsdp2_state_*.py) or braces (test_x_{a,b}.py)
MENTION = re.compile(r"(?:tests/(?:[\w/]+/)?)?test_[\w*{},]+\.py")


def _expand(name: str) -> list[str]:
    """`test_x_{a,b}.py` -> [`test_x_a.py`, `test_x_b.py`] (one brace group is all we use)."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [name[: m.start()] + part + name[m.end():] for part in m.group(1).split(",")]


def mentions(text: str) -> list[str]:
    return [Path(p).name for m in MENTION.findall(text) for p in _expand(m)]


def uncovered(test_files: list[Path], text: str) -> tuple[list[str], list[str]]:
    """(test files without a row, names in the text that match no test file)."""
    names = mentions(text)
    files = sorted({f.name for f in test_files})
    missing = [f for f in files if not any(fnmatch.fnmatch(f, n) for n in names)]
    stale = sorted({n for n in names if not any(fnmatch.fnmatch(f, n) for f in files)})
    return missing, stale


def test_every_test_file_has_a_row_and_every_row_a_file() -> None:
    test_files = list((ROOT / "tests").rglob("test_*.py"))
    missing, stale = uncovered(test_files, (ROOT / "docs" / "testing.md").read_text())
    assert not missing, f"add a row to docs/testing.md for: {missing}"
    assert not stale, f"docs/testing.md names test files that do not exist: {stale}"


def test_the_check_sees_a_missing_row_and_a_stale_one(tmp_path: Path) -> None:
    files = [tmp_path / "test_a.py", tmp_path / "test_b_x.py", tmp_path / "test_b_y.py"]
    text = "- `tests/test_a.py`: a.\n- `tests/test_b_{x,y}.py`: b.\n"
    assert uncovered(files, text) == ([], [])
    assert uncovered([*files, tmp_path / "test_c.py"], text) == (["test_c.py"], [])
    assert uncovered(files, text + "- `tests/test_gone.py`\n") == ([], ["test_gone.py"])
    assert uncovered(files, "- `tests/test_*.py`: everything\n") == ([], [])
