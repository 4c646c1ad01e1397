"""``fully_shard(..., dp_mesh_dims=...)`` against torch FSDP2's on the same model at
W = 2: parameters are DTensors on the full SPMD mesh (Replicate on the dp dims) before;
after sharding flexshard's are placed as FSDP2's (same mesh, placements, shapes) and a
few steps train bitwise alike. FSDP (one dp dim), HSDP (replicate + shard dims) and a
model-parallel dim beside dp; the combinations flexshard refuses raise naming why.

torch's FSDP2 takes ``dp_mesh_dims`` from 2.13 on. On an older torch flexshard still does
(its own implementation), and its training is compared with torch FSDP2 sharding the
same model's plain parameters over the same data-parallel dims (the model-parallel dim
has size 1 here, so the arithmetic is the same); only the layout has no reference."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import flexshard as fs
from flexshard import DataParallelMeshDims
from flexshard.testing import run_distributed

#: whether this torch's own FSDP2 takes dp_mesh_dims (2.13 and newer)
TORCH_HAS_DP_MESH_DIMS = "dp_mesh_dims" in inspect.signature(torch_fully_shard).parameters

#: name -> (mesh shape, dim names, dp dims, the model-parallel placement of weights)
SETUPS = {
    "fsdp": ((2,), ("dp",), DataParallelMeshDims(shard="dp"), None),
    "hsdp": ((1, 2), ("rep", "dp"), DataParallelMeshDims(shard="dp", replicate="rep"), None),
    "dp_tp": ((2, 1), ("dp", "tp"), DataParallelMeshDims(shard="dp"), Shard(0)),
}


def _model(mesh, tp) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5))
    for module in model:
        for name, p in list(module.named_parameters()):
            placements = [Replicate()] * mesh.ndim
            if tp is not None and name == "weight":
                placements[-1] = tp
            module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, placements)))
    return model


def _train_plain_fsdp2(setup: str) -> dict:
    """torch FSDP2 on the model's plain parameters over the dp dims (no dp_mesh_dims)."""
    shape, names, dims, _ = SETUPS[setup]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_mesh = mesh[(*dims.replicate_names, *dims.shard_names)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5))
    torch_fully_shard(model[0], mesh=dp_mesh)
    torch_fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)  # distribute_tensor's Replicate sends rank 0's
    for _ in range(2):
        model(torch.randn(4, 8, generator=gen)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return {
        "layout": None,
        "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
    }


def _train(setup: str, library: str, rank: int) -> dict:
    if library == "fsdp2" and not TORCH_HAS_DP_MESH_DIMS:
        return _train_plain_fsdp2(setup)
    shape, names, dims, tp = SETUPS[setup]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _model(mesh, tp)
    shard = torch_fully_shard if library == "fsdp2" else fs.fully_shard
    shard(model[0], mesh=mesh, dp_mesh_dims=dims)
    shard(model, mesh=mesh, dp_mesh_dims=dims)
    layout = {
        n: (p.device_mesh == mesh, tuple(p.placements), tuple(p.shape), tuple(p.to_local().shape))
        for n, p in model.named_parameters()
    }
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = distribute_tensor(torch.randn(4, 8, generator=gen), mesh, [Replicate()] * mesh.ndim)
        out = model(x)
        out.to_local().square().sum().backward()
        opt.step()
        opt.zero_grad()
    full = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return {"layout": layout, "params": full}


def _errors(mesh) -> dict[str, str]:
    out = {}
    dims = DataParallelMeshDims(shard="dp")
    plain = nn.Linear(4, 4)
    with pytest.raises(ValueError) as caught:
        fs.fully_shard(plain, mesh=mesh, dp_mesh_dims=dims)
    out["plain"] = str(caught.value)
    sharded = nn.Linear(4, 4)
    sharded.weight = nn.Parameter(distribute_tensor(sharded.weight.detach(), mesh, [Shard(0)]))
    sharded.bias = nn.Parameter(distribute_tensor(sharded.bias.detach(), mesh, [Replicate()]))
    with pytest.raises(ValueError) as caught:
        fs.fully_shard(sharded, mesh=mesh, dp_mesh_dims=dims)
    out["not_replicate"] = str(caught.value)
    with pytest.raises(NotImplementedError) as caught:
        twice = DataParallelMeshDims(shard=("dp", "dp"))
        fs.fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=twice)
    out["flatten"] = str(caught.value)
    return out


def _run(rank: int, world_size: int) -> dict:
    out = {(s, lib): _train(s, lib, rank) for s in SETUPS for lib in ("fsdp2", "flexshard")}
    out["errors"] = _errors(init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",)))
    return out


def test_dp_mesh_dims_places_and_trains_as_fsdp2() -> None:
    for result in run_distributed(_run, 2, timeout=300):
        for setup in SETUPS:
            torch_run, flex = result[(setup, "fsdp2")], result[(setup, "flexshard")]
            if torch_run["layout"] is not None:
                assert flex["layout"] == torch_run["layout"], setup
            assert all(on_mesh for on_mesh, *_ in flex["layout"].values())
            theirs = flex["params"]
            differ = [n for n, p in torch_run["params"].items() if not torch.equal(p, theirs[n])]
            assert differ == [], setup
        errors = result["errors"]
        assert "Got plain tensor for parameter 'weight'" in errors["plain"]
        assert "parameter 'weight' has S(0) on dp dim 'dp'" in errors["not_replicate"]
        assert "several mesh dims" in errors["flatten"]
