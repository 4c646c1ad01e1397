"""FSDP2 client code with one import changed: parameters are DTensors, so torch's own
tools (clip_grad_norm_, full_tensor, distribute_tensor, the DCP state-dict API) work
on flexshard models, for every placement; against torch FSDP2 and one process."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, UnshardHandle
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import flexshard as fs
from flexshard.testing import run_distributed

#: comm_stats entries that are no bucket (the unused-parameter agreement, the sum)
NOT_BUCKETS = ("total", "grad_agreement")

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
EVERYWHERE = StateDictOptions(full_state_dict=True)


class Block(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 17) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * step + rank))


# ------------------------------------------------------------------ the example's flow
def _example_flow(rank: int, world: int, shard) -> dict:
    """pytorch/examples' FSDP2 flow: meta init, per-layer + root fully_shard, explicit
    prefetching, the DTensor-API load, torch's clip_grad_norm_, DCP-API save/resume."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = Net().state_dict()
    with torch.device("meta"):
        model = Net()
    for layer in model.layers:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule) and isinstance(model.layers[0], FSDPModule)
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[i - 1 : i] if i else [])
    # DTensor-API checkpointer: distribute each full tensor like the meta parameter
    meta = dict(model.named_parameters())
    sharded = {
        k: nn.Parameter(distribute_tensor(v, meta[k].device_mesh, meta[k].placements))
        for k, v in full.items()
    }
    model.load_state_dict(sharded, assign=True, strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict = {"loss": [], "norm": []}

    def train(steps: range) -> None:
        for step in steps:
            loss = model(_batch(step, rank)).pow(2).mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            opt.step()
            opt.zero_grad()
            out["loss"].append(loss.detach().clone())
            out["norm"].append(norm.full_tensor())

    train(range(3))
    out["params"] = {k: v.full_tensor() for k, v in model.named_parameters()}
    out["model_sd"] = get_model_state_dict(model, options=FULL)
    # every rank gets the whole optimizer state (cpu_offload would keep it on rank 0)
    out["optim_sd"] = get_optimizer_state_dict(model, opt, options=EVERYWHERE)
    handle = model.layers[0].unshard(async_op=True)
    assert isinstance(handle, UnshardHandle)
    handle.wait()
    model.layers[0].reshard()
    # resume into a fresh meta-built model from the full state dicts, broadcast from rank 0
    with torch.device("meta"):
        model = Net()
    for layer in model.layers:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    # torch updates the dict it is given in place: hand it a copy
    set_model_state_dict(model, dict(out["model_sd"]) if rank == 0 else {}, options=BROADCAST)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_optimizer_state_dict(model, opt, out["optim_sd"], options=EVERYWHERE)
    train(range(3, 5))
    out["resumed"] = {k: v.full_tensor() for k, v in model.named_parameters()}
    return out


def _both(rank: int, world: int) -> dict:
    """Which results differ between torch FSDP2 and flexshard (compared in the child)."""
    theirs, ours = (_example_flow(rank, world, s) for s in (torch_fully_shard, fs.fully_shard))
    # the resumed steps use the optimizer state that went through the full state dict
    keys = ("loss", "norm", "params", "model_sd", "resumed")
    return {
        "differ": [k for k in keys if not _equal(theirs[k], ours[k])],
        "losses": len(ours["loss"]),
    }


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, DTensor) and isinstance(b, DTensor):  # compared here, no collective
        return a.placements == b.placements and _equal(a.to_local(), b.to_local())
    if isinstance(a, torch.Tensor):
        return type(a) is type(b) and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fsdp2_example_flow_bitwise_equal_to_fsdp2(world):
    for result in run_distributed(_both, world):
        assert result["differ"] == [] and result["losses"] == 5


# ------------------------------------------------------------------ every placement
PLACEMENTS = {
    "shard0": fs.Shard(0),
    "shard1": lambda fqn, p: fs.Shard(p.ndim - 1),
    "flat": fs.FlatShard(),
    "owned": fs.Owned(),
    "block": fs.BlockShard((8, 8)),
    "replicate": fs.Replicate(),
    "mixed": lambda fqn, p: fs.Owned() if fqn.endswith("up.weight") else fs.FlatShard(),
}


def _reference(world: int) -> tuple[dict, dict, torch.Tensor, dict]:
    """One process: the same model, the gradient of the mean of every rank's loss,
    clipped, then one AdamW step: (grads, params after, norm, AdamW state)."""
    torch.manual_seed(0)
    model = Net()
    loss = sum(model(_batch(0, r)).pow(2).mean() for r in range(world)) / world
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    state = {k: opt.state[p] for k, p in model.named_parameters()}
    return grads, {k: p.detach() for k, p in model.named_parameters()}, norm, state


def _plain(tree):
    """Full state as plain tensors (a full state dict may hold replicated DTensors)."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    return tree.full_tensor() if isinstance(tree, DTensor) else tree


def _placement_case(rank: int, world: int, name: str, hsdp: bool) -> dict:
    """torch's tools on a flexshard model, checked here against one process (results
    travel back as plain values: tensors would need the child alive)."""
    grads, params, norm, state = _reference(world)  # every rank has its own data
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,))
    torch.manual_seed(0)
    model = Net()
    spec = fs.BucketSpec(["layers.*", "head.*"], placement=PLACEMENTS[name])
    fs.flex_shard(model, mesh=mesh, buckets=[spec])
    model(_batch(0, rank)).pow(2).mean().backward()
    bad: list[str] = []

    def close(key: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
        if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
            bad.append(key)

    got_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).full_tensor()
    close("norm", got_norm, norm, 1e-6, 0)
    for key, p in model.named_parameters():
        close(f"grad {key}", p.grad.full_tensor(), grads[key], 1e-5, 1e-7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of ours: no deprecated collective on the way
        full = {k: p.full_tensor() for k, p in model.named_parameters()}
    model_sd = _plain(get_model_state_dict(model, options=EVERYWHERE))
    optim_sd = _plain(get_optimizer_state_dict(model, opt, options=EVERYWHERE)["state"])
    for key, p in model.named_parameters():
        close(f"param {key}", full[key], params[key], 1e-5, 1e-6)
        replicated = p.redistribute(placements=[Replicate()] * mesh.ndim).to_local()
        close(f"redistribute {key}", replicated, full[key], 0, 0)
        close(f"state dict {key}", model_sd[key], full[key], 0, 0)
        for entry in ("exp_avg", "exp_avg_sq"):
            close(f"{entry} {key}", optim_sd[key][entry], state[key][entry], 1e-5, 1e-8)
    # distribute_tensor works for torch's placements; flexshard's own raise naming the
    # parameter
    errors = []
    for key, param in model.named_parameters():
        try:
            value = distribute_tensor(full[key].detach(), param.device_mesh, param.placements)
            if not torch.equal(value.to_local(), param.to_local()):
                bad.append(f"distribute {key}")
        except RuntimeError as err:
            errors.append(str(err))
    return {
        "bad": bad,
        "types": sorted({type(p.grad).__name__ for p in model.parameters()}),
        "regional": any(type(p).__name__ == "RegionDTensor" for p in model.parameters()),
        "errors": errors,
    }


# the fast suite keeps one case per kind of placement; the rest run with -m slow
SLOW = {("shard1", False), ("replicate", False), ("mixed", False), ("shard0", True)}
CASES = [
    pytest.param(name, hsdp, id=f"{name}{'-hsdp' if hsdp else ''}", marks=[pytest.mark.slow])
    if (name, hsdp) in SLOW
    else pytest.param(name, hsdp, id=f"{name}{'-hsdp' if hsdp else ''}")
    for name, hsdp in [(name, False) for name in PLACEMENTS] + [("shard0", True), ("mixed", True)]
]


@pytest.mark.parametrize("name,hsdp", CASES)
def test_torch_tools_on_every_placement(name, hsdp):
    for out in run_distributed(_placement_case, 4 if hsdp else 3, name, hsdp):
        assert out["bad"] == []
        assert set(out["types"]) <= {"DTensor", "RegionDTensor"}
        if out["regional"]:
            assert out["errors"], "distribute_tensor must refuse flexshard placements"
            assert all("param='" in e for e in out["errors"]), out["errors"]
        else:
            assert out["errors"] == []


# ------------------------------------------------------------------ FSDP2's scenarios
class WithMethod(Net):
    def score(self, x: torch.Tensor) -> torch.Tensor:  # a forward method besides forward
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum(-1)  # the root's own parameters: gathered for this method


def _scenario(rank: int, world: int, shard, name: str) -> dict:
    """One of torch's FSDP2 unit-test scenarios that apply on CPU, run with ``shard``
    (torch's fully_shard or flexshard's); returns what the test compares."""
    from torch.distributed.fsdp import CPUOffloadPolicy, register_fsdp_forward_method

    hsdp = name == "hsdp_no_all_reduce"
    shape, names = ((2, world // 2), ("replicate", "shard")) if hsdp else ((world,), ("dp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = WithMethod()
    kwargs: dict = {}
    if name == "frozen":
        model.layers[1].up.weight.requires_grad_(False)
        model.head.bias.requires_grad_(False)
    if name == "reshard_int":
        kwargs["reshard_after_forward"] = 1
    if name == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if name == "list":  # two layers gathered together by one call
        shard([model.layers[0], model.layers[1]], mesh=mesh, **kwargs)
        shard(model.layers[2], mesh=mesh, **kwargs)
    else:
        for layer in model.layers:
            shard(layer, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    if name == "float64":
        model.to(torch.float64)
    if name == "method":
        register_fsdp_forward_method(model, "score")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    dtype = torch.float64 if name == "float64" else torch.float32
    losses = []
    for step in range(3):
        micro = 2 if hsdp else 1
        for m in range(micro):
            if hsdp:
                model.set_requires_all_reduce(m == micro - 1)
            x = _batch(10 * step + m, rank).to(dtype)
            loss = model.score(x).pow(2).mean() if name == "method" else model(x).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    out = {"losses": losses, "params": {k: v.full_tensor() for k, v in model.named_parameters()}}
    params = model.named_parameters()
    out["frozen_grads"] = [k for k, p in params if not p.requires_grad and p.grad is not None]
    return out


SCENARIOS = ["frozen", "float64", "method", "list", "reshard_int", "offload", "hsdp_no_all_reduce"]


def _scenario_pair(rank: int, world: int, name: str) -> dict:
    theirs = _scenario(rank, world, torch_fully_shard, name)
    ours = _scenario(rank, world, fs.fully_shard, name)
    return {
        "differ": [k for k in ("losses", "params") if not _equal(theirs[k], ours[k])],
        "frozen_grads": ours["frozen_grads"],
    }


@pytest.mark.parametrize("name", SCENARIOS)
def test_fsdp2_scenarios_bitwise_equal(name):
    world = 4 if name == "hsdp_no_all_reduce" else 2
    for result in run_distributed(_scenario_pair, world, name):
        assert result == {"differ": [], "frozen_grads": []}, name


def _frozen_traffic(rank: int, world: int) -> dict:
    """Frozen parameters stay out of the reduce-scatter, as in FSDP2."""
    torch.manual_seed(0)
    model = Net(layers=1)
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    fs.fully_shard(model.layers[0])
    fs.fully_shard(model)
    model(_batch(0, rank)).pow(2).mean().backward()
    return {k: v["reduce_scatter"] for k, v in model.comm_stats().items() if k not in NOT_BUCKETS}


def test_frozen_parameters_are_not_reduced():
    for stats in run_distributed(_frozen_traffic, 3):
        assert stats == {"layers.0": 0, "root": 1}


# ----------------------------------------- the example's meta-device load, own placements
def _broadcast_meta_load(rank: int, world: int, hsdp: bool) -> dict:
    """The FSDP2 example's load on a meta-built model (``set_model_state_dict(...,
    broadcast_from_rank0=True)``, no ``to_empty``) with FlatShard, Owned and BlockShard
    buckets: the same parameters, and the same training step, as ``fs.load_full_state_dict``."""
    torch.manual_seed(0)
    full = Net().state_dict()
    specs = [
        fs.BucketSpec(["layers.0.*"], placement=fs.FlatShard()),
        fs.BucketSpec(["layers.1.*"], placement=fs.Owned()),
        fs.BucketSpec(["layers.2.*", "head.*"], placement=fs.BlockShard((8, 8))),
    ]
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,))
    models = []
    for via_torch in (True, False):
        with torch.device("meta"):
            model = Net()
        fs.flex_shard(model, mesh=mesh, buckets=specs)
        if via_torch:
            set_model_state_dict(model, dict(full) if rank == 0 else {}, options=BROADCAST)
        else:
            model.to_empty(device="cpu")
            fs.load_full_state_dict(model, full)
        models.append(model)
    out: dict = {
        "loaded": [
            k for k, p in models[0].named_parameters() if not torch.equal(p.full_tensor(), full[k])
        ]
    }
    for model in models:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(_batch(0, rank)).pow(2).mean().backward()
        opt.step()
    params = [dict(m.named_parameters()) for m in models]
    out["trained"] = [
        k
        for k in params[0]
        if not torch.equal(params[0][k].full_tensor(), params[1][k].full_tensor())
    ]
    out["meta"] = [k for k, p in models[0].named_parameters() if p.is_meta]
    return out


@pytest.mark.parametrize("hsdp", [False, True], ids=["w3", "hsdp2x2"])
def test_broadcast_load_of_a_meta_model_with_flexshard_placements(hsdp):
    for out in run_distributed(_broadcast_meta_load, 4 if hsdp else 3, hsdp):
        assert out == {"loaded": [], "trained": [], "meta": []}
