"""The batch-invariant kernels' own cost, per swapped op: every call of each op during
RL steps is recorded (its arguments), then replayed through aten's native kernel and
through the batch-invariant one, alternating, timed in thread CPU time (the machine's
load moves wall time, not the CPU time of a single-threaded replay).

``scaled_dot_product_attention``'s row is the routing's own cost: its replay outside
the mode reaches the native flash kernel, whose own row holds the attention's cost."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from flexshard.testing.stats import alternating, paired_ratios, spread, summary
from flexshard.trainer.rl.batch_invariant import OPS

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _kept(value: Any) -> Any:
    """A copy of a tensor argument: the sharding frees a gathered weight's storage
    after its forward."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


@contextmanager
def recording(calls: dict[str, list[Call]]) -> Iterator[None]:
    """Inside, every ``batch_invariant()`` entered records each swapped op's calls
    into ``calls[name]`` (and runs the batch-invariant kernel)."""
    saved = dict(OPS)

    def recorder(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            calls[name].append((tuple(map(_kept, args)), {k: _kept(v) for k, v in kwargs.items()}))
            return kernel(*args, **kwargs)

        return record

    for name, kernel in saved.items():
        OPS[name] = recorder(name, kernel)
    try:
        yield
    finally:
        OPS.update(saved)


def _seconds(kernel: Callable[..., Any], calls: list[Call]) -> float:
    begin = time.thread_time()
    for args, kwargs in calls:
        kernel(*args, **kwargs)
    return time.thread_time() - begin


@torch.no_grad()
def replay(calls: dict[str, list[Call]], steps: int, reps: int) -> list[dict[str, Any]]:
    """Per op: calls per step, native and batch-invariant CPU ms per step (medians over
    ``reps``), their ratio per repetition and the extra ms per step (median [IQR])."""
    rows = []
    for name, recorded in sorted(calls.items()):
        kernels = {"native": getattr(torch.ops.aten, name).default, "invariant": OPS[name]}
        _seconds(kernels["invariant"], recorded[:8])  # first calls: allocator, caches
        seconds: dict[str, list[float]] = defaultdict(list)
        for rep in range(reps):
            for side in alternating(("native", "invariant"), rep):
                seconds[side].append(_seconds(kernels[side], recorded) * 1e3 / steps)
        rows.append(
            {
                "op": name,
                "calls_per_step": len(recorded) / steps,
                "native_ms": statistics.median(seconds["native"]),
                "invariant_ms": statistics.median(seconds["invariant"]),
                "ratio": summary(paired_ratios(seconds["invariant"], seconds["native"])),
                "extra_ms": spread(
                    [i - n for i, n in zip(seconds["invariant"], seconds["native"])]
                ).as_dict(),
            }
        )
    return rows
