"""docs/testing.md is checked against the tree: every test file has a row there, and
every test file it names exists."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a test file as docs/testing.md names it: tests/<area>/test_x.py (its path in the tree),
# test_x.py (after a tests/<area>/ mention), a glob (tests/fsdp2/test_fsdp2_state_*.py)
# or braces (test_x_{a,b}.py)
MENTION = re.compile(r"(?:tests/(?:[\w/]+/)?)?test_[\w*{},]+\.py")


def _expand(name: str) -> list[str]:
    """`test_x_{a,b}.py` -> [`test_x_a.py`, `test_x_b.py`] (one brace group is all we use)."""
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [name[: m.start()] + part + name[m.end() :] for part in m.group(1).split(",")]


def mentions(text: str) -> list[str]:
    """Each mention as a pattern over paths under tests/: `tests/a/test_x.py` -> `a/test_x.py`
    (the folder must be right), a bare `test_x.py` -> `*test_x.py` (any folder)."""
    return [
        p.removeprefix("tests/") if p.startswith("tests/") else "*" + p
        for m in MENTION.findall(text)
        for p in _expand(m)
    ]


def _match(rel: str, pattern: str) -> bool:
    return fnmatch.fnmatch(rel, pattern) and (
        pattern.startswith("*") or rel.count("/") == pattern.count("/")
    )


def uncovered(test_files: list[str], text: str) -> tuple[list[str], list[str]]:
    """(test files, as paths under tests/, without a row; names in the text that match no
    test file)."""
    names = mentions(text)
    files = sorted(set(test_files))
    missing = [f for f in files if not any(_match(f, n) for n in names)]
    stale = sorted({n for n in names if not any(_match(f, n) for f in files)})
    return missing, stale


def test_every_test_file_has_a_row_and_every_row_a_file() -> None:
    tests = ROOT / "tests"
    test_files = [f.relative_to(tests).as_posix() for f in tests.rglob("test_*.py")]
    missing, stale = uncovered(test_files, (ROOT / "docs" / "testing.md").read_text())
    assert not missing, f"add a row to docs/testing.md for: {missing}"
    assert not stale, f"docs/testing.md names test files that do not exist: {stale}"


def test_every_test_file_is_in_an_area_folder() -> None:
    tests = ROOT / "tests"
    flat = sorted(f.name for f in tests.glob("test_*.py"))
    assert not flat, f"move into an area folder under tests/: {flat}"


def test_the_check_sees_a_missing_row_and_a_stale_one() -> None:
    files = ["a/test_a.py", "b/test_b_x.py", "b/test_b_y.py"]
    text = "- `tests/a/test_a.py`: a.\n- `tests/b/test_b_{x,y}.py`: b.\n"
    assert uncovered(files, text) == ([], [])
    assert uncovered([*files, "a/test_c.py"], text) == (["a/test_c.py"], [])
    assert uncovered(files, text + "- `tests/a/test_gone.py`\n") == ([], ["a/test_gone.py"])
    # the right name in the wrong folder is stale, and leaves the file without a row
    assert uncovered(files, "- `tests/b/test_a.py`, `tests/b/test_b_{x,y}.py`\n") == (
        ["a/test_a.py"],
        ["b/test_a.py"],
    )
    assert uncovered(files, "- `tests/*/test_*.py`: everything\n") == ([], [])
    assert uncovered(files, "`tests/a/`: `test_a.py`; `tests/b/test_b_x.py`, `test_b_y.py`\n") == (
        [],
        [],
    )
