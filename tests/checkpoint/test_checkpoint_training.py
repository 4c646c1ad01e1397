"""Checkpoints of training state: exact resume in new processes (AdamW and Muon+AdamW),
optimizer state resharded across world sizes and placements and into one process
(and back), and a safetensors export of the full model."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import flexshard as fs
from flexshard import checkpoint as ckpt
from flexshard.checkpoint import RegionTensor
from flexshard.optim import muon_and_adamw
from flexshard.runtime.dtensor.chunks import chunks_of
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

from ..helpers.reference import mixed_placement, train_steps

CFG = TransformerConfig()
FIRST, REST = 3, 3  # steps before and after the checkpoint
#: the checkpointed state against torch's single-process reference: DP's reduce-scatter
#: averages gradients in another order than sum / W (measured after FIRST steps: AdamW
#: moments 1.9e-7 of each tensor's largest entry, parameters 3.8e-6, step counts exact)
OPTIM_RTOL = 1e-5
PARAM_ATOL = 1e-4


def _model(group, placement, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    buckets = [
        fs.BucketSpec("layers.0.*", placement=placement, name="layer0"),
        fs.BucketSpec("layers.1.*", placement=placement, name="layer1"),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], placement=placement, name="outer"),
    ]
    return fs.flex_shard(TinyTransformer(CFG), mesh=group, buckets=buckets)


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return muon_and_adamw(model, lr=2e-2)


def _train(model, opt, rank: int, world: int, start: int, steps: int) -> list[float]:
    batches = make_batches(CFG, (FIRST + REST) * world, batch=2, seed=5)
    return train_steps(model, opt, batches, rank, world, start, steps)


def _numpy(state: dict) -> dict:
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def _first_run(rank: int, world: int, root: str) -> dict:
    """Uninterrupted runs, then runs that stop after FIRST steps and save."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind in ("adamw", "muon"):
        model = _model(mesh, mixed_placement, 0)
        out[f"{kind} uninterrupted"] = _train(model, _optimizer(model, kind), rank, world, 0, 6)
        model = _model(mesh, mixed_placement, 0)
        opt = _optimizer(model, kind)
        out[f"{kind} first"] = _train(model, opt, rank, world, 0, FIRST)
        torch.manual_seed(100 + rank)  # a per-rank RNG state the resume must restore
        extra = {"step": FIRST, "rng": torch.get_rng_state(), "loader": {"epoch": 0, "index": 9}}
        ckpt.save(f"{root}/{kind}", model, opt, extra=extra)
        out[f"{kind} rng draw"] = torch.rand(3).tolist()
        if kind == "adamw":
            ckpt.export_safetensors(model, f"{root}/export")  # one file: model.safetensors
            out["full"] = _numpy(fs.full_state_dict(model))
    return out


def _state_pieces_match(model, opt, full_model: dict, full_optim: dict) -> list[str]:
    """Keys where this rank's pieces differ from the full tensors (model and optimizer)."""
    bad = []
    checks = [(k, v, full_model[k]) for k, v in model.state_dict().items()]
    for fqn, entries in ckpt.optimizer_state_dict(model, opt)["state"].items():
        checks += [(f"{fqn}.{n}", v, full_optim[fqn][n]) for n, v in entries.items()]
    for key, value, full in checks:
        full = torch.as_tensor(full)
        if isinstance(value, (RegionTensor, DTensor)):
            for (offsets, sizes), piece in chunks_of(value).pieces:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                if not torch.equal(piece, full[index]):
                    bad.append(key)
        elif not torch.equal(torch.as_tensor(value), full):
            bad.append(key)
    return bad


def _packed_full() -> dict:
    torch.manual_seed(3)
    model = TinyTransformer(CFG)
    model.layers[0].to(torch.bfloat16)
    return model.state_dict()


def _packed(group, placement, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = TinyTransformer(CFG)
    model.layers[0].to(torch.bfloat16)
    spec = fs.BucketSpec("*", placement=placement, pack_as_bytes=True)
    return fs.flex_shard(model, mesh=group, buckets=[spec])


def _pieces_differ(model, full: dict) -> list[str]:
    bad = []
    for key, value in model.state_dict().items():
        for (offsets, sizes), piece in chunks_of(value).pieces:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            if not torch.equal(piece, torch.as_tensor(full[key])[index]):
                bad.append(key)
    return bad


def _resume(rank: int, world: int, root: str, full_model: dict, full_optim: dict) -> dict:
    """New processes: load, check the extra state, train the remaining steps; then
    load the optimizer state at another world size and placements, and the
    one-process re-save at world 3."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind in ("adamw", "muon"):
        model = _model(mesh, mixed_placement, 99)  # other values: the load must replace them all
        opt = _optimizer(model, kind)
        extra = ckpt.load(f"{root}/{kind}", model, opt)
        torch.set_rng_state(extra["rng"])
        out[f"{kind} rng draw"] = torch.rand(3).tolist()
        out[f"{kind} extra"] = (extra["step"], extra["loader"])
        out[f"{kind} rest"] = _train(model, opt, rank, world, extra["step"], REST)

    pair = dist.new_group([0, 1])
    if rank < 2:  # world 2, other placements
        for name, placement in (("shard0", fs.Shard(0)), ("owned", fs.Owned())):
            model = _model(pair, placement, 99)
            opt = _optimizer(model, "adamw")
            ckpt.load(f"{root}/adamw", model, opt, process_group=pair)
            out[f"w2 {name}"] = _state_pieces_match(model, opt, full_model, full_optim)
    # a full (unsharded) state dict through module.load_state_dict
    model = _model(mesh, mixed_placement, 99)
    model.load_state_dict(full_model)
    out["load_state_dict of full tensors"] = _pieces_differ(model, full_model)
    # a bucket of bf16 and fp32 parameters packed as bytes, resharded
    for group, placement in ((mesh, fs.Shard(0)), (pair, fs.Owned())):
        if group is pair and rank >= 2:
            continue
        model = _packed(group, placement, 3 if group is mesh else 4)
        if group is mesh:
            ckpt.save(f"{root}/packed", model)
        else:
            ckpt.load(f"{root}/packed", model, process_group=pair)
            out["packed"] = _pieces_differ(model, _packed_full())
    model = _model(mesh, fs.Shard(0), 99)  # the one-process re-save, at world 3
    opt = _optimizer(model, "adamw")
    ckpt.load(f"{root}/plain", model, opt)
    out["from one process"] = _state_pieces_match(model, opt, full_model, full_optim)
    return out


def _one_process(root: str) -> tuple[dict, dict]:
    """Load the world-3 checkpoint into an unsharded model and optimizer, without
    torch.distributed, and save it again from there."""
    assert not dist.is_initialized()
    model = TinyTransformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ckpt.load(f"{root}/adamw", model, opt)
    ckpt.save(f"{root}/plain", model, opt)
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, optim


def _torch_reference(world: int = 3) -> tuple[dict, dict]:
    """An unsharded copy trained identically in one process (each step's gradient the
    average over the ``world`` ranks' batches, as data parallelism defines it), read
    back through torch's own ``get_optimizer_state_dict``: no flexshard code involved."""
    torch.manual_seed(0)  # _model's seed: the same initial weights
    model = TinyTransformer(CFG)
    opt = _optimizer(model, "adamw")
    batches = make_batches(CFG, (FIRST + REST) * world, batch=2, seed=5)
    for step in range(FIRST):
        grads = None
        for rank in range(world):
            model.zero_grad()
            model.loss(*batches[step * world + rank]).backward()
            current = [p.grad.clone() for p in model.parameters()]
            grads = current if grads is None else [g + c for g, c in zip(grads, current)]
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad / world
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, get_optimizer_state_dict(model, opt)["state"]


def _close_to_torch(full_model: dict, full_optim: dict) -> None:
    ref_model, ref_optim = _torch_reference()
    assert full_optim.keys() == ref_optim.keys()
    for fqn, entries in ref_optim.items():
        assert full_optim[fqn].keys() == entries.keys(), fqn
        for name, want in entries.items():
            atol = 0.0 if name == "step" else OPTIM_RTOL * want.abs().max().item()
            got = full_optim[fqn][name]
            torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=f"{fqn} {name}")
    assert full_model.keys() == ref_model.keys()
    for key, want in ref_model.items():
        torch.testing.assert_close(full_model[key], want, rtol=0, atol=PARAM_ATOL, msg=key)


def test_resume_reshard_and_export(tmp_path):
    root = os.fspath(tmp_path)
    first = run_distributed(_first_run, 3, root)
    full_model, full_optim = _one_process(root)
    # the hub of the resharding checks below (each resharded piece must equal it bit for
    # bit) against an independent reference: torch's optimizer state of the same training
    _close_to_torch(full_model, full_optim)
    for key, value in first[0]["full"].items():
        assert np.array_equal(full_model[key].numpy(), value), key
    resumed = run_distributed(_resume, 3, root, full_model, full_optim)
    for rank, (a, b) in enumerate(zip(first, resumed)):
        for kind in ("adamw", "muon"):
            assert a[f"{kind} first"] + b[f"{kind} rest"] == a[f"{kind} uninterrupted"], (
                f"rank {rank} {kind}"
            )
            assert b[f"{kind} rng draw"] == a[f"{kind} rng draw"]
            assert b[f"{kind} extra"] == (FIRST, {"epoch": 0, "index": 9})
        assert b["from one process"] == []
        assert b["load_state_dict of full tensors"] == []
        if rank < 2:
            assert b["packed"] == []
            assert b["w2 shard0"] == [] and b["w2 owned"] == []
    # the exported file is the full model, read by safetensors itself
    from safetensors.torch import load_file

    exported = load_file(f"{root}/export/model.safetensors")
    assert exported.keys() == first[0]["full"].keys()
    for key, value in exported.items():
        assert np.array_equal(value.numpy(), first[0]["full"][key]), key
