"""Checkpoints move between torch FSDP2 and flexshard, model and AdamW state, both ways."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import flexshard as fs
from flexshard import checkpoint as ckpt
from flexshard.runtime.dtensor.chunks import RegionTensor, chunks_of
from flexshard.testing import TinyTransformer, make_batches, run_distributed

from ..helpers.reference import train_steps

STEPS = 2


def _train(model, opt, rank: int, world: int, start: int) -> list[float]:
    batches = make_batches(model.cfg, 2 * STEPS * world, batch=2, seed=8)
    return train_steps(model, opt, batches, rank, world, start, STEPS)


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _fsdp2(mesh, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = TinyTransformer()
    for layer in model.layers:
        torch_fully_shard(layer, mesh=mesh)
    return torch_fully_shard(model, mesh=mesh)


def _ours(mesh, seed: int, placement=None) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = TinyTransformer()
    if placement is None:  # the FSDP2 layout: the same arithmetic, bit for bit
        for layer in model.layers:
            fs.fully_shard(layer, mesh=mesh)
        return fs.fully_shard(model, mesh=mesh)
    return fs.flex_shard(model, mesh=mesh, buckets=[fs.BucketSpec("*", placement=placement)])


def _mismatches(ours, our_opt, theirs, their_opt) -> list[str]:
    """Keys where our pieces differ from FSDP2's full tensors (model and optimizer)."""
    full = {k: v.full_tensor() for k, v in get_model_state_dict(theirs).items()}
    optim = get_optimizer_state_dict(theirs, their_opt)["state"]
    checks = [(k, v, full[k]) for k, v in ours.state_dict().items()]
    for fqn, entries in ckpt.optimizer_state_dict(ours, our_opt)["state"].items():
        for name, value in entries.items():
            other = optim[fqn][name]
            other = other.full_tensor() if hasattr(other, "full_tensor") else other
            checks.append((f"{fqn}.{name}", value, other))
    bad = []
    for key, value, other in checks:
        sharded = isinstance(value, (DTensor, RegionTensor))
        pieces = chunks_of(value).pieces if sharded else [(None, value)]
        for box, piece in pieces:
            index = () if box is None else tuple(slice(o, o + s) for o, s in zip(*box))
            if not torch.equal(piece, other[index]):
                bad.append(key)
    return bad


def _both_ways(rank: int, world: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    # FSDP2 trains and saves with plain DCP; flexshard loads with plain DCP
    theirs = _fsdp2(mesh, 0)
    their_opt = _adamw(theirs)
    _train(theirs, their_opt, rank, world, 0)
    state = {
        "model": get_model_state_dict(theirs),
        "optim": get_optimizer_state_dict(theirs, their_opt),
    }
    dcp.save(state, checkpoint_id=f"{root}/fsdp2")
    ours = _ours(mesh, 5)
    our_opt = _adamw(ours)
    state = {"model": ours.state_dict(), "optim": ckpt.optimizer_state_dict(ours, our_opt)}
    dcp.load(state, checkpoint_id=f"{root}/fsdp2")
    ours.load_state_dict(state["model"])
    ckpt.load_optimizer_state_dict(ours, our_opt, state["optim"])
    out["loaded from fsdp2"] = _mismatches(ours, our_opt, theirs, their_opt)
    # both go on training: the same losses, bit for bit
    out["fsdp2 losses"] = _train(theirs, their_opt, rank, world, STEPS)
    out["our losses"] = _train(ours, our_opt, rank, world, STEPS)

    # flexshard (Owned: whole parameters) saves with fs.checkpoint.save; FSDP2 loads
    ours = _ours(mesh, 6, fs.Owned())
    our_opt = _adamw(ours)
    _train(ours, our_opt, rank, world, 0)
    ckpt.save(f"{root}/flexshard", ours, our_opt)
    theirs = _fsdp2(mesh, 7)
    their_opt = _adamw(theirs)
    state = {
        "model": get_model_state_dict(theirs),
        "optim": get_optimizer_state_dict(theirs, their_opt),
    }
    dcp.load(state, checkpoint_id=f"{root}/flexshard")
    set_model_state_dict(theirs, state["model"])
    set_optimizer_state_dict(theirs, their_opt, state["optim"])
    out["loaded into fsdp2"] = _mismatches(ours, our_opt, theirs, their_opt)
    return out


def test_fsdp2_checkpoints_both_ways(tmp_path):
    for rank, out in enumerate(run_distributed(_both_ways, 3, os.fspath(tmp_path))):
        assert out["loaded from fsdp2"] == [], f"rank {rank}"
        assert out["loaded into fsdp2"] == [], f"rank {rank}"
        assert out["our losses"] == out["fsdp2 losses"], f"rank {rank}"
