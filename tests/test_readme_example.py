"""The README's 20-line example runs as written (W = 3, the test transformer)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from flexshard.testing import TinyTransformer, run_distributed

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    section = README.read_text().split("## In 20 lines", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(rank: int, world: int, code: str) -> dict:
    torch.manual_seed(0)
    scope = {
        "world_size": world,
        "model": TinyTransformer(),
        "other": TinyTransformer(),
        "tokens": torch.randint(0, 17, (2, 8), generator=torch.Generator().manual_seed(rank)),
    }
    exec(compile(code, str(README), "exec"), scope)
    muon_state = sum(len(s) for s in scope["muon"].state.values())
    return {"dtensor": type(next(scope["model"].parameters())).__name__, "muon": muon_state}


def test_readme_example_runs():
    for out in run_distributed(_run, 3, _example(), timeout=240):
        assert out["dtensor"] in ("DTensor", "RegionDTensor")
        assert out["muon"] > 0  # the Muon step ran and made state
