"""Every code block of README.md and docs/*.md runs as printed (flexshard.testing.docs_run).

A block's glue (ranks, hidden setup, slow, skip) is declared in the markdown above it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flexshard.testing import docs_run
from flexshard.testing.docs_run import Block

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# pages whose blocks do not pass yet, with why (skipped by name, never silently)
NOT_YET: dict[str, str] = {}


def _all_blocks() -> list[Block]:
    return [b for path in DOCS for b in docs_run.blocks(path)]


def _params() -> list:
    params = []
    for block in _all_blocks():
        if block.runner is None:
            continue
        name = block.name(ROOT)
        marks = []
        if block.skip:
            marks.append(pytest.mark.skip(reason=block.skip))
        elif (page := name.rsplit(":", 1)[0]) in NOT_YET:
            marks.append(pytest.mark.skip(reason=f"not yet: {NOT_YET[page]}"))
        if block.slow:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(block, id=name, marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_doc_block_runs(block: Block) -> None:
    before = docs_run.changed_paths(ROOT)
    result = docs_run.run(block, ROOT)
    problem = docs_run.failure(block, ROOT, result)
    assert problem is None, problem
    # a run writes only under ignored folders: no tracked file changed, nothing new
    new = docs_run.changed_paths(ROOT) - before
    # (in a working tree others edit meanwhile, their files show here too: rerun)
    assert not new, f"{block.name(ROOT)} changed files git sees: {sorted(new)}"


def test_every_block_names_its_language() -> None:
    untagged = [b.name(ROOT) for b in _all_blocks() if not b.lang]
    assert not untagged, f"tag these fences (```text for output, ```toml, ...): {untagged}"


def test_skips_say_why_and_are_few() -> None:
    skipped = [b for b in _all_blocks() if b.skip]
    assert all(len(b.skip) > 10 for b in skipped)
    assert len(skipped) <= 6, [b.name(ROOT) for b in skipped]


# --- the runner itself: it must be able to fail ------------------------------------


def _doc(tmp_path: Path, text: str) -> list[Block]:
    page = tmp_path / "page.md"
    page.write_text(text)
    return docs_run.blocks(page)


def test_runner_reports_a_failing_block(tmp_path: Path) -> None:
    (block,) = _doc(tmp_path, "text\n\n```python\nprint(world_size)\n```\n")
    result = docs_run.run(block, tmp_path)
    problem = docs_run.failure(block, tmp_path, result)
    assert problem is not None and "NameError: name 'world_size'" in problem


def test_directives_are_applied(tmp_path: Path) -> None:
    text = (
        "<!-- docs-run: setup: world_size = 3 -->\n"
        "<!-- docs-run: check: assert doubled == 6, doubled -->\n"
        "```python\ndoubled = 2 * world_size\n```\n\n"
        "<!-- docs-run: expect-fail -->\n```bash\nfalse\necho never\n```\n\n"
        "<!-- docs-run: slow -->\n<!-- docs-run: skip: needs eight GPUs -->\n```sh\nexit 1\n```\n"
        "```toml\n[job]\n```\n"
        "```console\n$ echo hi\nhi\n```\n"
    )
    python, fails, skipped, toml, console = _doc(tmp_path, text)
    assert docs_run.failure(python, tmp_path, docs_run.run(python, tmp_path)) is None
    python.check = ["assert doubled == 7, doubled"]
    assert docs_run.failure(python, tmp_path, docs_run.run(python, tmp_path)) is not None
    # bash runs with -e: the first failing command fails the block, as expected here
    assert docs_run.failure(fails, tmp_path, docs_run.run(fails, tmp_path)) is None
    fails.expect_fail = False
    assert docs_run.failure(fails, tmp_path, docs_run.run(fails, tmp_path)) is not None
    assert skipped.slow and skipped.skip == "needs eight GPUs" and skipped.line == 15
    assert toml.runner is None and console.runner == "bash"
    assert docs_run.run(console, tmp_path).stdout == "hi\n"


def test_unknown_directive_and_bare_skip_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown docs-run directive"):
        _doc(tmp_path, "<!-- docs-run: torchrunn 2 -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        _doc(tmp_path, "<!-- docs-run: skip -->\n```python\npass\n```\n")


def test_torchrun_block_runs_on_every_rank(tmp_path: Path) -> None:
    (block,) = _doc(
        tmp_path,
        "<!-- docs-run: torchrun 2 -->\n```python\n"
        # one write per rank: two ranks share the pipe, print's pieces interleave
        "import os\nos.write(1, f\"rank {os.environ['RANK']}\\n\".encode())\n```\n",
    )
    result = docs_run.run(block, tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(ln for ln in result.stdout.splitlines() if ln.startswith("rank")) == [
        "rank 0",
        "rank 1",
    ]


def test_changed_paths_sees_a_written_file(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/outputs/\n")
    (block,) = _doc(
        tmp_path, "```bash\nmkdir -p outputs && echo x > outputs/a\necho y > written.txt\n```\n"
    )
    before = docs_run.changed_paths(tmp_path)
    assert docs_run.run(block, tmp_path).returncode == 0
    assert docs_run.changed_paths(tmp_path) - before == {"?? written.txt"}
