"""Run the fenced code blocks of markdown files as a reader would paste them.

A block declares its glue in HTML comments right above its fence, which a rendered
page does not show::

    <!-- docs-run: torchrun 3 -->          python on 3 local gloo ranks (torchrun)
    <!-- docs-run: setup: world_size = 3 --> code run before the block (repeatable)
    <!-- docs-run: check: assert muon.state --> code run after it (repeatable)
    <!-- docs-run: slow -->                 only in the slow suite (a training run)
    <!-- docs-run: timeout: 900 -->         seconds before the run is killed
    <!-- docs-run: skip: <reason> -->       cannot run here (a GPU, several hosts)
    <!-- docs-run: expect-fail -->          shows an error on purpose: must exit nonzero

```python blocks run in a fresh interpreter, ```bash / ```sh blocks with bash -e, and
```console blocks run their ``$ `` lines; every other language (text, toml) is not code.
Everything runs with cwd = the repository root, so a block must write only under
ignored folders (or ``$DOCS_RUN_TMP``, a fresh folder per block).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# language tag -> interpreter; anything else is shown, not run
EXECUTABLE = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "console": "bash"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-run:\s*(.*?)\s*-->\s*$")
DEFAULT_TIMEOUT_S = 300


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    torchrun: int | None = None
    setup: list[str] = field(default_factory=list)
    check: list[str] = field(default_factory=list)
    slow: bool = False
    skip: str | None = None
    expect_fail: bool = False
    timeout_s: int = DEFAULT_TIMEOUT_S

    @property
    def runner(self) -> str | None:
        return EXECUTABLE.get(self.lang)

    def name(self, root: Path) -> str:
        try:
            return f"{self.path.relative_to(root)}:{self.line}"
        except ValueError:
            return f"{self.path}:{self.line}"


def _apply(block: Block, directive: str, where: str) -> None:
    key, _, value = directive.partition(":")
    key, value = key.strip(), value.strip()
    words = key.split()
    if words and words[0] == "torchrun" and len(words) == 2:
        block.torchrun = int(words[1])
    elif key == "setup":
        block.setup.append(value)
    elif key == "check":
        block.check.append(value)
    elif key == "slow":
        block.slow = True
    elif key == "timeout":
        block.timeout_s = int(value)
    elif key == "skip":
        if not value:
            raise ValueError(f"{where}: 'skip' needs a reason")
        block.skip = value
    elif key == "expect-fail":
        block.expect_fail = True
    else:
        raise ValueError(f"{where}: unknown docs-run directive {directive!r}")


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with the directives above it."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            # a fence inside a list item is indented: strip that indent from its body
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: fence never closed")
        i += 1
        block = Block(path, start + 1, lang, "\n".join(body) + "\n")
        j = start - 1
        directives: list[tuple[int, str]] = []
        while j >= 0 and (d := DIRECTIVE.match(lines[j])):
            directives.append((j + 1, d.group(1)))
            j -= 1
        for line, text in reversed(directives):
            _apply(block, text, f"{path}:{line}")
        found.append(block)
    return found


# after a torchrun block, as a training script ends: a gloo process that exits right
# after collectives without this now and then aborts at exit ("terminate called
# without an active exception"), torch's own fully_shard alike (docs/limitations.md)
TORCHRUN_TEARDOWN = (
    "import torch.distributed as _dist\n"
    "if _dist.is_initialized():\n"
    "    _dist.barrier()\n"
    "    _dist.destroy_process_group()"
)


def _this_venv(code: str) -> str:
    """``code`` with the README's venv (``.venv/bin/``) replaced by the one running the
    suite, when that is another (``scripts/test.sh --torch X`` runs in ``.venvs/...``)."""
    venv_bin = Path(sys.executable).parent
    if venv_bin.parent.name == ".venv":
        return code
    return re.sub(r"(?<![\w/.])\.venv/bin/", f"{venv_bin}/", code)


def script(block: Block) -> str:
    """The file that runs: the block's hidden setup, the block as printed, its checks
    (and, on torchrun, the process group's teardown)."""
    code = _this_venv(block.code) if block.runner == "bash" else block.code
    if block.lang == "console":  # commands are the '$ ' lines; the rest is output
        code = "".join(ln[2:] + "\n" for ln in code.splitlines() if ln.startswith("$ "))
    teardown = [TORCHRUN_TEARDOWN] if block.torchrun else []
    return "\n".join([*block.setup, code, *block.check, *teardown]) + "\n"


def run(block: Block, root: Path, timeout_s: int | None = None) -> subprocess.CompletedProcess:
    """Run one block in a fresh process (cwd = root); the caller checks the result."""
    if block.runner is None:
        raise ValueError(f"{block.name(root)}: ```{block.lang} is not an executable block")
    with tempfile.TemporaryDirectory(prefix="docs_run_") as tmp:
        suffix = ".py" if block.runner == "python" else ".sh"
        file = Path(tmp) / f"block{suffix}"
        file.write_text(script(block))
        if block.runner == "bash":
            cmd = ["bash", "-eo", "pipefail", str(file)]
        elif block.torchrun:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={block.torchrun}",
                str(file),
            ]
        else:
            cmd = [sys.executable, str(file)]
        work = Path(tmp) / "work"
        work.mkdir()
        env = dict(os.environ, DOCS_RUN_TMP=str(work), PYTHONPATH=str(root))
        env.pop("PYTEST_CURRENT_TEST", None)
        return subprocess.run(
            cmd,
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s or block.timeout_s,
        )


def failure(block: Block, root: Path, result: subprocess.CompletedProcess) -> str | None:
    """Why the run does not match what the block promises, or None."""
    if block.expect_fail == (result.returncode != 0):
        return None
    tail = (result.stdout[-3000:] + "\n" + result.stderr[-6000:]).strip()
    want = "to fail (expect-fail)" if block.expect_fail else "to succeed"
    return (
        f"{block.name(root)}: ```{block.lang} block expected {want}, "
        f"exit status {result.returncode}\n--- script:\n{script(block)}--- output:\n{tail}"
    )


def changed_paths(root: Path) -> set[str]:
    """`git status --porcelain` lines: tracked files changed, untracked files not ignored."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.splitlines())
