"""MatrixOptimizer with pytorch-optimizer 4.1.0's Muon family given as the plain class
(``AdaMuon``, ``Muon``, ``NorMuon``, ``AdaGO``). Those classes fill each ``use_muon``
group in their ``__init__`` with keys that are not in ``.defaults``; the adapter's
groups must start from what the class set, or ``step()`` raises ``KeyError``. Against
the same class on one process over the full matrices, bit for bit, on Owned (no
collective) and Shard placements at W = 2."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.optim import MatrixOptimizer
from flexshard.testing import run_distributed

from ..helpers.muon_cases import SHAPES, Mats, checked_step, full_grads, set_grads

pytorch_optimizer = pytest.importorskip("pytorch_optimizer")

NAMES = tuple(SHAPES)
STEPS = 3
FAMILY = ("AdaMuon", "Muon", "NorMuon", "AdaGO")
#: one Muon group and one AdamW group (the family's ``use_muon=False`` branch), the
#: second with its own lr: both branches and per-group options pass through
GROUPS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("a", "qkv", "e"), {"use_muon": True}),
    (("b", "c", "t"), {"use_muon": False, "lr": 3e-3}),
)
PLACEMENTS = {"owned": (fs.Owned(), True), "shard0": (fs.Shard(0), False)}


def _groups(params: dict[str, list[torch.nn.Parameter]]) -> list[dict[str, Any]]:
    return [{"params": [p for n in names for p in params[n]], **opts} for names, opts in GROUPS]


def reference(name: str) -> dict[str, torch.Tensor]:
    """The class itself on one process, each expert of the stack a matrix of its own."""
    model = Mats()
    parts = {
        n: [torch.nn.Parameter(x.clone()) for x in (p.detach().unbind(0) if p.ndim == 3 else [p])]
        for n, p in model.named_parameters()
    }
    opt = getattr(pytorch_optimizer, name)(_groups(parts), lr=0.02)
    for step in range(STEPS):
        grads = full_grads(NAMES, step)
        for n, ps in parts.items():
            for p, g in zip(ps, grads[n].unbind(0) if grads[n].ndim == 3 else [grads[n]]):
                p.grad = g.clone()
        opt.step()
    return {
        n: torch.stack([p.detach() for p in ps]) if len(SHAPES[n]) == 3 else ps[0].detach()
        for n, ps in parts.items()
    }


def _run(rank: int, world_size: int) -> dict[tuple[str, str], list[str]]:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name in FAMILY:
        expected = reference(name)
        for case, (placement, comm_free) in PLACEMENTS.items():
            model = fs.flex_shard(
                Mats(), mesh=mesh, buckets=[fs.BucketSpec(list(NAMES), placement)]
            )
            named = {n: [p] for n, p in model.named_parameters()}
            opt = MatrixOptimizer(_groups(named), getattr(pytorch_optimizer, name), lr=0.02)
            for step in range(STEPS):
                set_grads(model, full_grads(NAMES, step))
                checked_step(opt, comm_free)  # Owned: any collective raises
            full = fs.full_state_dict(model)
            out[(name, case)] = [n for n in NAMES if not torch.equal(full[n], expected[n])]
    return out


def test_muon_family_as_the_plain_class_matches_one_process() -> None:
    results = run_distributed(_run, 2, timeout=240)
    assert len(results[0]) == len(FAMILY) * len(PLACEMENTS)
    for result in results:
        assert all(differ == [] for differ in result.values()), result


def test_the_class_keeps_its_own_checks() -> None:
    """A group without ``use_muon`` is the class's own error, at construction, as
    without the adapter (not a ``KeyError`` at the first step)."""
    with pytest.raises(ValueError, match="use_muon"):
        MatrixOptimizer(Mats().parameters(), pytorch_optimizer.Muon, lr=0.02)


def test_the_steps_change_the_parameters() -> None:
    """The comparison above is not between two untouched models: one process moves
    every parameter of both groups."""
    start, stepped = dict(Mats().named_parameters()), reference("Muon")
    assert all(not torch.equal(start[n], stepped[n]) for n in NAMES)
