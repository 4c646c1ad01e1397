"""torch's FSDP2 module-state and misuse scenarios (test_fully_shard_init.py /
test_fully_shard_state.py: shared parameters, nesting orders, misuse errors, containers
without a forward, non-contiguous parameters, module classes, a child run before its root,
module lists without a common root, meshes from process groups); where FSDP2 raises and
flexshard accepts by design, flexshard is checked against an unsharded run,
run with torch's ``fully_shard`` and flexshard's: every visible result must be bitwise
equal, or both must raise (harness: tests/helpers/fsdp2_state.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from tests.helpers import fsdp2_state as st
from tests.helpers.fsdp2_state import (
    MLP,
    _exact,
    _grads,
    _mesh,
    _mismatch,
    _raises,
    _same_batch,
    _shard_all,
    _train,
    _value,
    _vs_reference,
)

# ------------------------------------------------------------------ models


class Containers(nn.Module):
    """Two MLPs held in a ModuleList or a ModuleDict (containers without a forward of
    their own), and a root parameter."""

    def __init__(self, dim: int, kind: str) -> None:
        super().__init__()
        blocks = [MLP(dim), MLP(dim)]
        if kind == "list":
            self.blocks: nn.Module = nn.ModuleList(blocks)
        else:
            self.blocks = nn.ModuleDict({"a": blocks[0], "b": blocks[1]})
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks
        for block in blocks:
            x = block(x)
        return x * self.scale


# ------------------------------------------------------------------ scenarios


def s_shared_params(rank, world, shard, ctx) -> dict:
    """Parameters shared across modules (and a whole module shared twice)."""
    mesh, out = _mesh(world), {}
    # (a) one weight shared by three MLPs, a buffer shared by two; root only
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(5, buffer=True) for _ in range(3)])
    model[0].in_proj.weight = model[1].in_proj.weight
    model[2].in_proj.weight = model[1].in_proj.weight
    model[1].buffer = model[2].buffer
    shard(model, mesh=mesh)
    out["a.names"] = [k for k, _ in model.named_parameters()]
    out["a.sd_keys"] = list(model.state_dict())
    out["a.tied"] = model[0].in_proj.weight is model[2].in_proj.weight
    out["a"] = _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 3, rank, 5, grads=True)
    out["a.sd"] = {k: _value(v) for k, v in model.state_dict().items()}
    # (b) shared between two children of the root, a third child wrapped on its own
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(5) for _ in range(3)])
    model[0].out_proj.weight = model[1].out_proj.weight
    shard(model[2], mesh=mesh)
    shard(model, mesh=mesh)
    out["b"] = _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 3, rank, 5, grads=True)
    # (c) the same MLP twice
    torch.manual_seed(0)
    mlp = MLP(5)
    model = nn.Sequential(mlp, mlp)
    shard(model, mesh=mesh)
    out["c.names"] = [k for k, _ in model.named_parameters()]
    out["c"] = _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 2, rank, 5, grads=True)
    return out


def s_nested_orders(rank, world, shard, ctx) -> dict:
    """Leaves wrapped below an unwrapped child, children wrapped in reverse order, and a
    list of modules wrapped together; the root takes the rest."""
    mesh, out = _mesh(world), {}
    for order in ("leaves", "reverse", "list"):
        torch.manual_seed(0)
        model = nn.Sequential(MLP(6), MLP(6), MLP(6))
        if order == "leaves":
            shard(model[0].in_proj, mesh=mesh)
            shard(model[0].out_proj, mesh=mesh)
        elif order == "reverse":
            for mlp in reversed(model):
                shard(mlp, mesh=mesh)
        else:
            shard([model[0], model[2]], mesh=mesh)
        shard(model, mesh=mesh)
        out[f"{order}.names"] = [k for k, _ in model.named_parameters()]
        out[f"{order}.fsdp"] = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out[order] = _train(model, opt, 3, rank, 6, grads=True)
    return out


def s_misuse_errors(rank, world, shard, ctx) -> dict:
    """What FSDP2 refuses: wrapping twice, deepcopy, a scalar parameter, a 3-D mesh."""
    out = {}
    mesh = _mesh(world)
    twice = MLP(4)
    shard(twice, mesh=mesh)
    out["raise_twice"] = _raises(lambda: shard(twice, mesh=mesh))
    out["raise_deepcopy"] = _raises(lambda: copy.deepcopy(twice))
    scalar = nn.Sequential(MLP(4))
    scalar.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    out["raise_scalar"] = _raises(lambda: shard(scalar, mesh=mesh))
    mesh3 = init_device_mesh("cpu", (world, 1, 1))
    out["raise_mesh_3d"] = _raises(lambda: shard(MLP(4), mesh=mesh3))
    return out


def _container_vs_reference(world, shard, kind: str) -> dict:
    """Containers(kind) sharded (the container, with and without the root) against its
    unsharded copy."""
    out, mesh = {}, _mesh(world)
    for root in (True, False):
        torch.manual_seed(42)
        model = Containers(4, kind)
        ref = copy.deepcopy(model)
        mods = [model.blocks, model][: 1 + root]
        err = _raises(lambda ms=mods: [shard(m, mesh=mesh) for m in ms])
        batch = lambda step: _same_batch(step, 3, 4)  # noqa: E731
        check = None if err else _vs_reference(model, ref, batch, exact=_exact(world))
        out[f"root={root}"] = {"vs_reference": check}
    return out


def s_container_without_forward(rank, world, shard, ctx) -> dict:
    """fully_shard on a ModuleList: FSDP2 raises (no forward to hook); flexshard takes it
    as a list of modules (one group) and must train like the unsharded model, with and
    without fully_shard on the root."""
    mesh = _mesh(world)
    out: dict = {
        "fsdp2_raises_module_list": _raises(
            lambda: shard(nn.ModuleList([MLP(4), MLP(4)]), mesh=mesh)
        )
    }
    out.update(_container_vs_reference(world, shard, "list"))
    return out


def s_module_dict_without_forward(rank, world, shard, ctx) -> dict:
    """fully_shard on a ModuleDict: FSDP2 raises (no forward to hook); flexshard accepts
    it and must then train like the unsharded model, with and without fully_shard on
    the root."""
    mesh = _mesh(world)
    out: dict = {
        "fsdp2_raises_module_dict": _raises(lambda: shard(nn.ModuleDict({"a": MLP(4)}), mesh=mesh))
    }
    out.update(_container_vs_reference(world, shard, "dict"))
    return out


def s_noncontiguous_param(rank, world, shard, ctx) -> dict:
    """A channels_last Conv2d weight (non-contiguous): FSDP2 raises; flexshard accepts
    it and must train like the unsharded conv."""
    torch.manual_seed(42)
    conv = nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    err = _raises(lambda: shard(conv, mesh=_mesh(world)))
    out: dict = {"fsdp2_raises_noncontiguous": err, "vs_reference": None}
    if err is None:

        def batch(step: int) -> torch.Tensor:
            return _same_batch(step, 2, 4, 6, 6).to(memory_format=torch.channels_last)

        out["vs_reference"] = _vs_reference(conv, ref, batch, exact=_exact(world))
    return out


def s_module_classes(rank, world, shard, ctx) -> dict:
    """Only the wrapped module becomes an FSDPModule; it keeps its class; slicing a
    wrapped Sequential gives a plain one."""
    mesh = _mesh(world)
    model = MLP(4)
    shard(model, mesh=mesh)
    seq = nn.Sequential(MLP(4), MLP(4), MLP(4))
    shard(seq, mesh=mesh)
    sliced = seq[:2]
    return {
        "mlp": [isinstance(model, MLP), isinstance(model, FSDPModule)],
        "children": [isinstance(m, FSDPModule) for m in model.modules() if m is not model],
        "seq": [isinstance(seq, nn.Sequential), isinstance(seq, FSDPModule)],
        "sliced": [isinstance(sliced, nn.Sequential), isinstance(sliced, FSDPModule)],
        "sliced_types": [type(m).__name__ for m in sliced],
    }


def s_child_run_before_root(rank, world, shard, ctx) -> dict:
    """A wrapped child run on its own first (forward only, or forward and backward):
    FSDP2 then raises when the root runs; flexshard must give the child's output and
    gradients, then train like the unsharded model.

    The optimizers are made right after fully_shard, as FSDP2 asks: a child's forward
    without backward leaves its parameters unsharded (plain tensors registered on the
    module, as FSDP2 does for a root), and an optimizer made then would hold those."""
    mesh, x = _mesh(world), _same_batch(0, 2, 4)
    out: dict = {}
    for backward in (False, True):
        torch.manual_seed(42)
        model = nn.Sequential(MLP(4), MLP(4))
        ref = copy.deepcopy(model)
        shard(model[0].in_proj, mesh=mesh)
        shard(model[0].out_proj, mesh=mesh)
        shard(model, mesh=mesh)
        opts = tuple(torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
        outs = [m[0].in_proj(x) for m in (model, ref)]
        if backward:  # the child alone through backward: its own gradients
            for y in outs:
                y.pow(2).mean().backward()
        # bitwise: the same matmul on the gathered weight
        problems = _mismatch("child_out", _value(outs[0]), _value(outs[1]), exact=True)
        if backward:
            problems += _mismatch("child_grads", _grads(model), _grads(ref), _exact(world))
            for opt in opts:
                opt.zero_grad()
        with torch.no_grad():  # FSDP2 raises here (at the root's lazy init)
            err = _raises(lambda m=model, o=outs: o.append(m(x)))
        if err is None:
            with torch.no_grad():
                problems += _mismatch("root_out", _value(outs[-1]), ref(x), exact=True)
            batch = lambda step: _same_batch(step, 2, 4)  # noqa: E731
            problems += _vs_reference(model, ref, batch, exact=_exact(world), opts=opts)
        out[f"backward={backward}"] = {
            "fsdp2_raises_root_after_child": err,
            "vs_reference": None if err else problems,
        }
    return out


def s_list_without_common_root(rank, world, shard, ctx) -> dict:
    """fully_shard([a, b]) with no fully_shard on their parent: FSDP2 raises at the
    first forward (one root module required); flexshard must train like the unsharded
    model."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(4), MLP(4))
    ref = copy.deepcopy(model)
    shard([model[0], model[1]], mesh=_mesh(world))
    opts = tuple(torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    batch = lambda step: _same_batch(step, 2, 4)  # noqa: E731
    err = _raises(lambda: model(batch(0)).sum().backward())
    out: dict = {"fsdp2_raises_multi_module_root": err, "vs_reference": None}
    if err is None:
        ref(batch(0)).sum().backward()
        problems = _mismatch("first_grads", _grads(model), _grads(ref), _exact(world))
        for opt in opts:
            opt.zero_grad()
        check = _vs_reference(model, ref, batch, exact=_exact(world), opts=opts, start=1)
        out["vs_reference"] = problems + check
    return out


def s_mesh_from_group(rank, world, shard, ctx) -> dict:
    """A mesh built with DeviceMesh.from_group trains like init_device_mesh's."""
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))
    torch.manual_seed(42)
    model = MLP(8)
    _shard_all(shard, model, [model.in_proj, model.out_proj], mesh=mesh)
    out = _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), 2, rank, 8, grads=True)
    out["mesh"] = model.in_proj.weight.device_mesh.mesh.tolist()
    return out


SCENARIOS: dict[str, Callable] = {
    name[2:]: fn for name, fn in globals().items() if name.startswith("s_") and callable(fn)
}


@pytest.mark.parametrize("world,slow,name", st.cases(__name__))
def test_fsdp2_state_scenario(world, slow, name, tmp_path_factory):
    st.check(world, __name__, name, tmp_path_factory, slow)
