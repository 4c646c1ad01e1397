"""Whether an optimizer may be stepped in several ``step()`` calls per training step
(MatrixOptimizer's ``overlap``: one call per bucket). It may if a call changes nothing
on the optimizer object but its state and param groups (which the adapter refreshes
before every call, so each call of a step sees the same counters): torch's and
pytorch-optimizer's optimizers. heavyball's keep schedules on the object
(``inner_group``) that would advance once per call, not once per step."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

#: what the adapter manages itself
_MANAGED = ("state", "param_groups", "defaults")


def _attributes(optimizer: Optimizer) -> dict[str, str]:
    return {k: repr(v) for k, v in vars(optimizer).items() if k not in _MANAGED}


def check_steps_per_call(optimizer: Optimizer, tag: str) -> None:
    """One probe ``step()`` on ``optimizer`` (its placeholder matrix, zero gradient);
    ValueError naming the attributes it changed, if any. Leaves no state behind."""
    before = _attributes(optimizer)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    saved: list[dict[str, Any]] = [dict(g) for g in optimizer.param_groups]
    optimizer.step()
    after = _attributes(optimizer)
    optimizer.state.clear()
    for group, kept in zip(optimizer.param_groups, saved):
        group.clear()
        group.update(kept)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        raise ValueError(
            f"MatrixOptimizer(overlap=True): {tag}.step() changes {', '.join(changed)} on "
            "the optimizer itself, so one step in several calls (one per bucket) would "
            "count as several; use overlap=False (one inner step() per step)"
        )
