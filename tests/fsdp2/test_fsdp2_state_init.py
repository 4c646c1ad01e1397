"""torch's FSDP2 initialization scenarios (test_fully_shard_init.py: meta-device and
rank-0 broadcast initialization, mixed and frozen dtypes, shard placement functions,
buffers, modules without parameters),
run with torch's ``fully_shard`` and flexshard's: every visible result must be bitwise
equal, or both must raise (harness: tests/helpers/fsdp2_state.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard, distribute_tensor

from tests.helpers import fsdp2_state as st
from tests.helpers.fsdp2_state import (
    MLP,
    _exact,
    _grads,
    _kinds,
    _largest_dim,
    _mesh,
    _params,
    _raises,
    _same_batch,
    _shard_all,
    _train,
    _value,
    _vs_reference,
    _x,
)

# ------------------------------------------------------------------ models


class WeightNorm(nn.Module):
    """A root parameter replaced after sharding, from the children's values."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def init_weight_norm(self) -> None:
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(
                self.layer2.weight, dim=1
            )
        self.weight_norm = nn.Parameter(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


class TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 7)
        self.w64 = nn.Parameter(torch.randn(5, 7, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x).double() @ self.w64.T).float()


class Fp8Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_fp8 = nn.Parameter(torch.zeros(6, 4).to(torch.float8_e4m3fn), requires_grad=False)
        self.w_fp32 = nn.Parameter(torch.randn(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w_fp32.T + self.w_fp8.float().sum()


class BuffersOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


# ------------------------------------------------------------------ scenarios


def s_meta_init(rank, world, shard, ctx) -> dict:
    """Meta-device build, fully_shard per MLP and root, to_empty, fill, reset_parameters,
    one step (even, uneven and empty local shards)."""
    mesh, out = _mesh(world), {}
    for dim in (8, 3, 1):
        with torch.device("meta"):
            model = nn.Sequential(MLP(dim, 1, buffer=True, bias=False), MLP(dim, 1, bias=False))
        _shard_all(shard, model, list(model), mesh=mesh)
        out[f"{dim}.meta"] = [p.is_meta for p in model.parameters()]
        model.to_empty(device="cpu")
        out[f"{dim}.devices"] = [str(p.device) for p in model.parameters()]
        out[f"{dim}.kinds"] = _kinds(dict(model.named_parameters()))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for t in [*model.parameters(), *model.buffers()]:
            t.detach().fill_(1337.0)
        out[f"{dim}.filled"] = _params(model)
        torch.manual_seed(7)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        out[f"{dim}.buffers"] = [b.clone() for b in model.buffers()]
        out[f"{dim}.reset_changed"] = [
            bool((p.to_local() != 1337.0).all()) for p in model.parameters()
        ]
        model(_x(0, rank, 4, dim)).sum().backward()
        opt.step()
        out[f"{dim}.stepped"] = [p.to_local().clone() for p in model.parameters()]
    return out


def s_meta_init_default_mesh(rank, world, shard, ctx) -> dict:
    """fully_shard with no mesh, called inside the meta-device context."""
    with torch.device("meta"):
        model = nn.Sequential(MLP(8, buffer=True), MLP(8))
        _shard_all(shard, model, list(model))
    out = {"meta": [p.is_meta for p in model.parameters()]}
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    for m in model.modules():
        if isinstance(m, (nn.Linear, MLP)):
            m.reset_parameters()
    out["mesh"] = [tuple(p.device_mesh.mesh.tolist()) for p in model.parameters()]
    out["placements"] = [str(p.placements) for p in model.parameters()]
    out.update(_train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 2, rank, 8))
    return out


def s_meta_forward_unmaterialized(rank, world, shard, ctx) -> dict:
    """Forward on a meta-built model never moved off meta: FSDP2 raises."""
    with torch.device("meta"):
        model = nn.Sequential(MLP(8, buffer=True), MLP(8))
    _shard_all(shard, model, list(model), mesh=_mesh(world))
    return {"raise_forward": _raises(lambda: model(torch.randn(4, 8)))}


def s_meta_partial_materialize(rank, world, shard, ctx) -> dict:
    """to_empty on the children only, then the root's parameter replaced by a new one
    computed from the children's sharded weights (a DTensor); forward/backward/step."""
    with torch.device("meta"):
        model = WeightNorm()
    mesh = _mesh(world)
    _shard_all(shard, model, [model.layer1, model.layer2], mesh=mesh)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    torch.manual_seed(11)
    model.layer1.reset_parameters()
    model.layer2.reset_parameters()
    model.init_weight_norm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"loss": [], "kinds": _kinds(dict(model.named_parameters()))}
    for step in range(2):
        loss = model(_x(step, rank, 3, 3))
        loss.backward()
        out["loss"].append(loss.detach().clone())
        out[f"grads{step}"] = _grads(model)
        opt.step()
        opt.zero_grad()
    out["params"] = _params(model)
    return out


def s_rank0_broadcast_meta(rank, world, shard, ctx) -> dict:
    """Meta-built model; a sharded state dict from rank 0's full one (broadcast, then
    distribute_tensor like the meta state dict), loaded with assign=True; one step."""
    torch.manual_seed(42)
    ref = nn.Sequential(MLP(8, 5), nn.Sequential(MLP(8, 7), nn.Linear(8, 8)), MLP(8, 3))
    full = {k: v.clone() for k, v in ref.state_dict().items()}
    mesh = _mesh(world)
    with torch.device("meta"):
        model = copy.deepcopy(ref)
    _shard_all(shard, model, [model[0], model[1], model[2]], mesh=mesh)
    meta_sd = model.state_dict()
    out = {
        "keys": list(meta_sd),
        "meta_placements": [str(v.placements) for v in meta_sd.values()],
        "meta_shapes": [tuple(v.shape) for v in meta_sd.values()],
    }
    sharded = {}
    for key, meta in meta_sd.items():
        value = full[key].clone() if rank == 0 else torch.empty(meta.shape, dtype=meta.dtype)
        dist.broadcast(value, src=0)
        sharded[key] = nn.Parameter(distribute_tensor(value, meta.device_mesh, meta.placements))
    model.load_state_dict(sharded, assign=True)
    out["kinds"] = _kinds(dict(model.named_parameters()))
    out["devices"] = [p.device.type for p in model.parameters()]
    out["loaded"] = _params(model)
    out.update(_train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 2, rank, 8))
    return out


def s_dtypes_mixed_trainable(rank, world, shard, ctx) -> dict:
    """Trainable fp32 and fp64 parameters in one fully_shard call: FSDP2 refuses them
    (at the first forward; flexshard may refuse earlier)."""
    torch.manual_seed(0)
    model = TwoDtypes()

    def run():
        shard(model, mesh=_mesh(world))
        model(_x(0, rank, 2, 8)).sum().backward()

    return {"raise_mixed": _raises(run)}


def s_dtypes_frozen_other_dtype(rank, world, shard, ctx) -> dict:
    """A frozen fp64 parameter beside trained fp32 ones in one group (FSDP2 checks the
    dtype of trainable parameters only)."""
    torch.manual_seed(0)
    model = MLP(4)
    model.scale = nn.Parameter(torch.randn(3, 4, dtype=torch.float64), requires_grad=False)
    inner = model.forward
    model.forward = lambda x: inner(x) + model.scale.sum().float()  # type: ignore[method-assign]
    shard(model, mesh=_mesh(world))
    out: dict = {"dtypes": {k: p.dtype for k, p in model.named_parameters()}}
    out.update(_train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 2, rank, 4))
    return out


def s_dtypes_frozen_fp8(rank, world, shard, ctx) -> dict:
    """A frozen fp8 parameter beside a trained fp32 one in one group."""
    torch.manual_seed(0)
    model = Fp8Frozen()
    shard(model, mesh=_mesh(world))
    out: dict = {"dtypes": {k: p.dtype for k, p in model.named_parameters()}}
    for step in range(2):
        loss = model(_x(step, rank, 2, 4)).sum()
        loss.backward()
        out[f"loss{step}"] = loss.detach()
        out[f"grad{step}"] = _value(model.w_fp32.grad)
        out[f"frozen_grad{step}"] = model.w_fp8.grad is None
    return out


def s_shard_placement_fn(rank, world, shard, ctx) -> dict:
    """shard_placement_fn: the largest dim (Shard(1) for some weights) and Shard(-1)."""
    mesh, out = _mesh(world), {}
    fns = {"largest": _largest_dim, "neg1": lambda p: Shard(-1), "none": lambda p: None}
    for name, fn in fns.items():
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(12, 18), nn.ReLU(), nn.Linear(18, 12), nn.Linear(12, 18))
        ref = copy.deepcopy(model)
        _shard_all(shard, model, [model[0], model[2]], mesh=mesh, shard_placement_fn=fn)
        out[f"{name}.placements"] = [str(p.placements) for p in model.parameters()]
        out[f"{name}.local_shapes"] = [tuple(p.to_local().shape) for p in model.parameters()]
        out[f"{name}.init_equal"] = [
            torch.equal(p.full_tensor(), r) for p, r in zip(model.parameters(), ref.parameters())
        ]
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        out[name] = _train(model, opt, 2, rank, 12, grads=True)
        out[f"{name}.sd"] = {k: _value(v) for k, v in model.state_dict().items()}
    return out


def s_shard_placement_bias_dim1(rank, world, shard, ctx) -> dict:
    """Shard(1) for a 1-D bias: FSDP2 raises."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    fn = lambda p: Shard(1)  # noqa: E731
    return {
        "raise_bias_dim1": _raises(lambda: shard(model, mesh=_mesh(world), shard_placement_fn=fn))
    }


def s_shard_placement_uneven_dim1(rank, world, shard, ctx) -> dict:
    """Shard on dim 1 of 17 columns: FSDP2 refuses uneven sharding on a dim other than 0;
    flexshard accepts it and must train like the unsharded model."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(16, 17), nn.Linear(17, 8))
    ref = copy.deepcopy(model)
    fn = _largest_dim
    err = _raises(lambda: shard(model, mesh=_mesh(world), shard_placement_fn=fn))
    out: dict = {"fsdp2_raises_uneven_dim1": err, "vs_reference": None}
    if err is None:
        w = model[1].weight
        problems = [] if w.to_local().shape[1] < 17 else [f"1.weight not split: {w.placements}"]
        batch = lambda step: _same_batch(step, 4, 16)  # noqa: E731
        out["vs_reference"] = problems + _vs_reference(model, ref, batch, exact=_exact(world))
    return out


def s_buffers(rank, world, shard, ctx) -> dict:
    """Buffers stay plain tensors, train along, appear in the state dict (persistent
    ones only)."""
    mesh = _mesh(world)
    torch.manual_seed(0)
    model = nn.Sequential(MLP(6, buffer=True), MLP(6, buffer=True))
    model[1].register_buffer("counter", torch.zeros(3), persistent=False)
    _shard_all(shard, model, list(model), mesh=mesh)
    out = {
        "buffer_types": [type(b).__name__ for b in model.buffers()],
        "buffer_names": [k for k, _ in model.named_buffers()],
        "sd_keys": list(model.state_dict()),
        "sd_kinds": _kinds(model.state_dict()),
    }
    out.update(_train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 2, rank, 6))
    out["buffers"] = [b.clone() for b in model.buffers()]
    return out


def s_no_params(rank, world, shard, ctx) -> dict:
    """fully_shard on modules without parameters (a ReLU child, a buffers-only root)."""
    mesh = _mesh(world)
    torch.manual_seed(0)
    model = nn.Sequential(MLP(6), nn.ReLU(), MLP(6))
    _shard_all(shard, model, [model[1], model[0]], mesh=mesh)
    out = _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 2, rank, 6, grads=True)
    out["fsdp"] = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    only = BuffersOnly()
    shard(only, mesh=mesh)
    out["buffers_only"] = only(torch.ones(2, 4))
    out["buffers_only_sd"] = {k: _value(v) for k, v in only.state_dict().items()}
    return out


SCENARIOS: dict[str, Callable] = {
    name[2:]: fn for name, fn in globals().items() if name.startswith("s_") and callable(fn)
}


@pytest.mark.parametrize("world,slow,name", st.cases(__name__))
def test_fsdp2_state_scenario(world, slow, name, tmp_path_factory):
    st.check(world, __name__, name, tmp_path_factory, slow)
