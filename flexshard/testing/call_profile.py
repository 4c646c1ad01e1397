"""Python calls per training step, counted with cProfile: a measure of host work that a
loaded machine cannot change (the same code path makes the same calls however busy the
cores are). ``CallProfile.step()`` profiles one step at a time, so a client's own loop
(data loading, Lightning's ``fit`` set-up) between the steps stays out of the count.

Calls are also split by where the called function lives (``AREAS``): the benchmark's
own harness, flexshard's runtime, the rest of flexshard, torch's FSDP2, DTensor,
autograd, ``nn.Module``'s call machinery, the client (torchtitan, accelerate, Lightning,
transformers), the rest of torch, the rest of Python. Two libraries compared through
one loop differ in their own areas and in what they make the shared code do (DTensor
dispatch, autograd hooks).
"""

from __future__ import annotations

import cProfile
import pstats
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_REPO = f"{Path(__file__).resolve().parents[2]}/"

#: (area, a fragment of the file path that puts a function there), first match wins
AREAS = (
    ("harness", "flexshard/testing/"),
    ("flexshard runtime", "flexshard/runtime/"),
    ("flexshard", "flexshard/"),
    ("torch fsdp", "torch/distributed/fsdp/"),
    ("torch dtensor", "torch/distributed/tensor/"),
    ("torch distributed", "torch/distributed/"),
    ("torch autograd", "torch/autograd/"),
    ("torch nn.Module", "torch/nn/modules/module.py"),
    ("torch utils", "torch/utils/"),
    ("torchtitan", "torchtitan/"),
    ("accelerate", "accelerate/"),
    ("lightning", "lightning/"),
    ("transformers", "transformers/"),
    ("torch other", "torch/"),
)
OTHER = "other"


def area_of(filename: str) -> str:
    """The area a function defined in ``filename`` counts in (``OTHER``: builtins,
    the standard library, anything else)."""
    return next((area for area, fragment in AREAS if fragment in filename), OTHER)


def short_name(key: tuple[str, int, str]) -> str:
    """``file:line(function)``, the file relative to site-packages or the repository."""
    filename, line, name = key
    return f"{filename.split('site-packages/')[-1].removeprefix(_REPO)}:{line}({name})"


class CallProfile:
    """One profiler for many steps: ``with profile.step(): ...`` around each."""

    def __init__(self) -> None:
        self._profile = cProfile.Profile()
        self.steps = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        self._profile.enable()
        try:
            yield
        finally:
            self._profile.disable()
            self.steps += 1

    def summary(self, top: int = 0) -> dict[str, Any]:
        """Calls per step: ``calls`` in all, ``by_area`` (``AREAS``, ``OTHER``) and the
        ``top`` most-called functions as ``[name, calls per step]``."""
        if not self.steps:
            raise ValueError("CallProfile.summary: no step was profiled")
        stats = pstats.Stats(self._profile).stats  # key -> (cc, nc, tt, ct, callers)
        by_area: Counter = Counter()
        for key, value in stats.items():
            by_area[area_of(key[0])] += value[1]
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]
        return {
            "calls": sum(by_area.values()) / self.steps,
            "by_area": {area: n / self.steps for area, n in sorted(by_area.items())},
            "top": [[short_name(k), v[1] / self.steps] for k, v in ranked],
        }
