"""MatrixOptimizer's state through torch's state-dict API
(``torch.distributed.checkpoint.state_dict``'s ``get_/set_optimizer_state_dict``).

Sharded (torch's default): each rank's dict holds the :class:`MatrixState` of every
matrix it computes; ``dcp.save`` writes each once, and on load each rank's target (from
``get_optimizer_state_dict`` of the new optimizer) asks for the matrices it computes
now, at any world size and placement.

``full_state_dict=True``: torch gathers DTensors only. A matrix's state is whole on the
rank that computes it, in shapes only that rank knows, so torch's gather would hand
every rank just its own matrices: a partial state. ``state_dict()`` therefore asks
:func:`flexshard.torch_internals.full_state_dict_call` whether torch's full-state code
is calling it (read from the stack: torch gives an optimizer no other sign), and then
gathers every matrix's state onto every rank (one ``all_gather_object``) as plain
dicts, which torch passes through. Loading keeps each rank's own matrices, from
``MatrixState`` or from those plain dicts.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from .matrix_proxies import MatrixState


def plain(state: MatrixState, device: torch.device | None = None) -> dict[str, Any]:
    """One matrix's inner state as a plain dict (what torch's full-state gather takes)."""
    return {k: _to(v, device) for k, v in state.state.items()}


def _to(value: Any, device: torch.device | None) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device) if device is not None else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def gather_matrices(
    mine: dict[int, dict[str, MatrixState]], devices: dict[int, torch.device]
) -> dict[int, dict[str, dict[str, Any]]]:
    """Every rank's matrices (param index -> state key -> inner state) on every rank,
    each tensor on its parameter's device here. Replicas (HSDP) send the same matrix:
    the first is kept."""
    cpu = {i: {k: plain(s, torch.device("cpu")) for k, s in m.items()} for i, m in mine.items()}
    parts: list[Any] = [cpu]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, cpu)
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for part in parts:
        for index, matrices in part.items():
            for key, state in matrices.items():
                out.setdefault(index, {}).setdefault(key, _to(state, devices[index]))
    return out


def saved_matrix(value: Any) -> dict[str, Any] | None:
    """A matrix's saved inner state: a MatrixState (sharded, fs.checkpoint) or the plain
    dict a full state dict holds; None for anything else."""
    if isinstance(value, MatrixState):
        return value.state
    if isinstance(value, dict):
        return value
    return None


def full_state(
    out: dict[str, Any],
    call: Literal["get", "load"],
    names: list[str],
    devices: list[torch.device],
    tag: str,
) -> dict[str, Any]:
    """``out`` (the optimizer's own ``state_dict()``, parameters by index) for torch's
    full-state ``call``: every matrix on every rank for "get"; for "load" an error
    naming the parameters, since torch fills a full dict only into the entries the
    fresh local state has, and a matrix's entries differ by rank and step (SOAP's ``Q``
    is None at first): it would drop some silently or fail on others."""
    if call == "load":
        held = [names[i] for i in out["state"]]
        raise ValueError(
            "MatrixOptimizer: torch's set_optimizer_state_dict(full_state_dict=True) "
            f"cannot load the per-matrix state of {', '.join(held[:3]) or 'any parameter'}"
            f"{' and others' if len(held) > 3 else ''} (it fills only the entries this "
            "rank's fresh state already has); give the full dict to "
            "optimizer.load_state_dict(...) on every rank (each keeps the matrices it "
            "computes), or save and load sharded with torch.distributed.checkpoint"
        )
    mine = {
        index: {k: v for k, v in entries.items() if isinstance(v, MatrixState)}
        for index, entries in out["state"].items()
    }
    gathered = gather_matrices(mine, dict(enumerate(devices)))
    out["state"] = {index: {"inner": tag, **entries} for index, entries in gathered.items()}
    return out
