"""One function for each job that the library and the trainer share, found by the calls
that do the job (read with ``ast``: docstrings and comments do not count). A second
full-state gather, safetensors writer or local process spawner fails here naming its
file: extend the one function instead.

- the full-state gather: ``fs.full_state_dict`` (a bucket's ``gather_full``, or torch's
  full ``StateDictOptions``), the trainer adding its expert and pipeline assembly
  through its ``assemble`` hook;
- the safetensors writer: ``flexshard.checkpoint.export_safetensors`` (a safetensors
  ``save_file`` / ``save_model``, or DCP's ``HuggingFaceStorageWriter``);
- the local process spawner: ``flexshard.trainer.launch.spawn_local`` (torch's
  ``spawn`` / ``start_processes``, or a ``Process``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flexshard"

#: job -> (the one file allowed to do it, the names whose use does it)
JOBS: dict[str, tuple[str, set[str]]] = {
    "full-state gather": ("fsdp/state_dict.py", {"gather_full"}),
    "safetensors writer": (
        "checkpoint/hf_safetensors.py",
        {"save_file", "save_model", "HuggingFaceStorageWriter"},
    ),
    "local process spawner": ("trainer/launch.py", {"start_processes", "Process"}),
}


def used_names(tree: ast.AST) -> set[str]:
    """Every name ``tree`` uses or calls (``a.b.c`` gives ``c``), and ``"full
    StateDictOptions"`` where it builds one with ``full_state_dict=True``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        if isinstance(node, ast.Call) and any(
            k.arg == "full_state_dict" and isinstance(k.value, ast.Constant) and k.value.value
            for k in node.keywords
        ):
            names.add("gather_full")
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "spawn":
            names.add("start_processes")  # torch.multiprocessing.spawn
    return names


@pytest.mark.parametrize("job", sorted(JOBS))
def test_one_function_per_job(job: str) -> None:
    home, names = JOBS[job]
    doers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if used_names(ast.parse(path.read_text(), str(path))) & names
    )
    assert doers == [home], f"{job}: done in {doers}, the one place is flexshard/{home}"
