"""Parameters collected before sharding: flex_shard and fully_shard set new parameter
objects on the modules (as FSDP2 does), so an optimizer over the old ones would
silently never train the model. flexshard's optimizers refuse them at construction,
naming the parameter; the same optimizers over the parameters after sharding train."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.optim import DistMuon, MatrixOptimizer, MuonAdamW
from flexshard.testing import run_distributed


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))


def _shard(how: str, model: nn.Sequential, mesh) -> None:
    if how == "flex_shard":
        fs.flex_shard(model, mesh=mesh, buckets=[fs.BucketSpec("*", placement=fs.Shard(0))])
    else:
        fs.fully_shard(model[0], mesh=mesh)
        fs.fully_shard(model, mesh=mesh)


def _builders():
    return {
        "MatrixOptimizer": lambda ps: MatrixOptimizer(ps, torch.optim.SGD, lr=0.1),
        "DistMuon": lambda ps: DistMuon([p for p in ps if p.ndim == 2], lr=0.1),
        "MuonAdamW": lambda ps: MuonAdamW(
            [{"params": [p for p in ps if p.ndim == 1], "use_muon": False}], lr=0.1
        ),
    }


def _run(rank: int, world_size: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for how in ("flex_shard", "fully_shard"):
        for name, build in _builders().items():
            model = _model()
            before = list(model.parameters())
            _shard(how, model, mesh)
            with pytest.raises(ValueError) as caught:
                build(before)
            out[(how, name)] = str(caught.value)
            # the parameters after sharding: accepted, and a step moves them
            after = list(model.parameters())
            opt = build(after)
            model(torch.randn(3, 8)).sum().backward()
            start = [p.detach().full_tensor().clone() for p in after]
            opt.step()
            moved = [not torch.equal(s, p.detach().full_tensor()) for s, p in zip(start, after)]
            stepped = [p for g in opt.param_groups for p in g["params"]]
            assert all(m for m, p in zip(moved, after) if any(p is q for q in stepped)), name
    return out


def test_optimizers_refuse_parameters_collected_before_sharding() -> None:
    results = run_distributed(_run, 2, timeout=180)
    for messages in results:
        assert len(messages) == 6
        for (how, name), message in messages.items():
            assert message.startswith(f"{name}: parameter '"), message
            assert f"replaced by {how}" in message and "before sharding" in message
    # the name of the parameter: flex_shard's are the model's FQNs
    assert "'0.weight'" in results[0][("flex_shard", "DistMuon")]
    assert "'0.bias'" in results[0][("flex_shard", "MuonAdamW")]


def test_plain_tensors_are_still_taken() -> None:
    """An unsharded model's parameters (one process, no flexshard) stay accepted."""
    model = _model()
    for build in _builders().values():
        build(list(model.parameters()))
