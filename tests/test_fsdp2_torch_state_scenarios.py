"""torch's own FSDP2 unit-test scenarios for initialization, ignored and frozen
parameters, gradient accumulation, module state and state dicts (test_fully_shard_init,
_ignore_params, _frozen, _grad_acc, _pending_grad, _state, _state_dict), re-expressed
for CPU and run with torch's ``fully_shard`` and with flexshard's: every result the user
can see (losses, full gradients, parameters after optimizer steps, state-dict keys,
values and types, which calls raise) must be bitwise equal, or both must raise.

All scenarios of one world size run in one launch (a module-scoped fixture); each test
checks one scenario's comparison.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

import flexshard as fs
from flexshard.testing import run_distributed


# ------------------------------------------------------------------ models
class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int | None = None, buffer: bool = False, bias=True):
        super().__init__()
        hidden = hidden or 3 * dim
        self.in_proj = nn.Linear(dim, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, dim, bias=bias)
        if buffer:
            self.register_buffer("buffer", torch.randn(dim))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(F.relu(self.in_proj(x)))
        return z + self.buffer if self.buffer is not None else z

    def reset_parameters(self) -> None:
        if self.buffer is not None:
            nn.init.normal_(self.buffer)


class C(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class B(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_b = nn.Linear(dim, dim)
        self.module_c = C(dim)
        self.subtrahend = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.module_c(x)) - self.subtrahend


class A(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.module_b = B(dim)
        self.addend = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.module_b(x) + self.addend).sum()


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


class Tied(nn.Module):
    """Embedding tied to the output head, a persistent and a non-persistent buffer."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(MLP(dim), MLP(dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((dim,), 0.5))
        self.register_buffer("cache", torch.arange(dim, dtype=torch.float32), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) * self.scale + self.cache
        return self.head(self.blocks(h))


class MultiForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():
                x += F.relu(self.layer_with_grad(x))
        return x


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


class BuffersOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


# ------------------------------------------------------------------ helpers
def _x(seed: int, rank: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * seed + rank))


def _mesh(world: int) -> DeviceMesh:
    return init_device_mesh("cpu", (world,))


def _value(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor the ranks can compare: a DTensor's full value, a plain tensor's copy."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    return t.detach().clone()


def _params(model: nn.Module) -> dict:
    return {k: _value(p) for k, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict:
    return {k: _value(p.grad) for k, p in model.named_parameters()}


def _kinds(tensors: dict) -> dict:
    return {k: isinstance(v, DTensor) for k, v in tensors.items()}


def _raises(fn: Callable[[], Any]) -> str | None:
    """None if ``fn()`` returns; else the exception's type and first line."""
    try:
        fn()
    except Exception as err:  # any clear exception counts as raising
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        return f"{type(err).__name__}: {first}"
    return None


def _shard_all(shard, model: nn.Module, children, **kwargs) -> None:
    for child in children:
        shard(child, **kwargs)
    shard(model, **kwargs)


def _train(model, opt, steps, rank, dim, *, start=0, set_to_none=None, grads=False) -> dict:
    out: dict = {"loss": []}
    for step in range(start, start + steps):
        loss = model(_x(step, rank, 4, dim)).pow(2).mean()
        loss.backward()
        out["loss"].append(loss.detach().clone())
        if grads:
            out[f"grads{step}"] = _grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True if set_to_none is None else set_to_none(step))
    out["params"] = _params(model)
    return out


# ------------------------------------------------------------------ checks of extensions
# Where FSDP2 raises and flexshard, by design, accepts the input (uneven Shard(1),
# containers, channels_last parameters, ...), flexshard's result is checked against an
# unsharded single-process run of the same scenario instead: every rank trains on the
# same batch, so the data-parallel mean gradient equals the single-process gradient.
def _same_batch(step: int, *shape: int) -> torch.Tensor:
    """Rank 0's batch of ``step``, on every rank."""
    return _x(step, 0, *shape)


def _exact(world: int) -> bool:
    """Whether a sharded run must match the unsharded one bitwise: with 2 ranks the
    mean of equal gradients is exact ((g + g) / 2 == g) and everything else is the same
    arithmetic (full parameters gathered, elementwise Adam on shards); with 3 it rounds
    ((g + g + g) / 3), so ``allclose(rtol=1e-5, atol=1e-6)``."""
    return world == 2


def _mismatch(path: str, got: Any, want: Any, exact: bool) -> list[str]:
    """``exact``: bitwise (``torch.equal``); else ``allclose(rtol=1e-5, atol=1e-6)``."""
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{path}: keys {list(got)} != reference {list(want)}"]
        return [d for k in want for d in _mismatch(f"{path}.{k}", got[k], want[k], exact)]
    if got is None or want is None:
        return [] if got is None and want is None else [f"{path}: {got!r} vs {want!r}"]
    if isinstance(got, DTensor) or isinstance(want, DTensor):
        return [f"{path}: a DTensor where a full tensor was expected"]
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{path}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"]
    if torch.equal(got, want):
        return []
    if not exact and torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return []
    gap = (got.double() - want.double()).abs().max().item()
    return [f"{path}: max |diff| {gap:.3g} ({'bitwise' if exact else 'allclose'})"]


def _vs_reference(
    model: nn.Module,
    ref: nn.Module,
    batch: Callable[[int], torch.Tensor],
    *,
    exact: bool,
    steps: int = 2,
    opts: tuple | None = None,
    start: int = 0,
) -> list[str]:
    """Train the sharded ``model`` and its unsharded copy ``ref`` side by side for
    ``steps`` Adam steps on ``batch(step)``: what differs in the losses, the full
    gradients and the full parameters (empty if nothing)."""
    if opts is None:
        opts = tuple(torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    problems = _mismatch("init", _params(model), _params(ref), exact)
    for step in range(start, start + steps):
        got: dict = {}
        for name, m, opt in (("model", model, opts[0]), ("ref", ref, opts[1])):
            loss = m(batch(step)).pow(2).mean()
            loss.backward()
            got[name] = {"loss": loss.detach().clone(), "grads": _grads(m)}
            opt.step()
            opt.zero_grad()
            got[name]["params"] = _params(m)
        problems += _mismatch(f"step{step}", got["model"], got["ref"], exact)
    return problems


# ------------------------------------------------------------------ init scenarios
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


def s_ignored_params(rank, world, shard, ctx) -> dict:
    """ignored_params: module_b.module_c stays unsharded (and unsynchronized) while
    module_b.lin_b and module_b are sharded; the root A is not wrapped."""
    mesh = _mesh(world)
    torch.manual_seed(42)
    model = A(8)
    ignored = set(model.module_b.module_c.parameters())
    shard(model.module_b.lin_b, mesh=mesh, ignored_params=ignored)
    shard(model.module_b, mesh=mesh, ignored_params=ignored)
    out: dict = {
        "kinds": _kinds(dict(model.named_parameters())),
        "fsdp_modules": [n for n, m in model.named_modules() if isinstance(m, FSDPModule)],
        "loss": [],
    }
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        loss = model(_x(step, rank, 8, 8))
        loss.backward()
        out["loss"].append(loss.detach().clone())
        out[f"grads{step}"] = _grads(model)
        with implicit_replication():
            opt.step()
            opt.zero_grad()
    out["params"] = _params(model)
    out["sd_keys"] = list(model.state_dict())
    out["sd_kinds"] = _kinds(model.state_dict())
    return out


def s_ignored_params_root(rank, world, shard, ctx) -> dict:
    """ignored_params on a single root fully_shard: the ignored parameter stays a plain
    tensor; the rest train."""
    mesh = _mesh(world)
    torch.manual_seed(1)
    model = nn.Sequential(MLP(6), MLP(6))
    shard(model, mesh=mesh, ignored_params={model[1].out_proj.weight})
    out = {"kinds": _kinds(dict(model.named_parameters())), "loss": []}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    for step in range(2):
        loss = model(_x(step, rank, 4, 6)).pow(2).mean()
        loss.backward()
        out["loss"].append(loss.detach())
        out[f"grads{step}"] = _grads(model)
        with implicit_replication():
            opt.step()
        opt.zero_grad()
    out["params"] = _params(model)
    return out


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


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.ndim), key=lambda d: (param.shape[d], -d)))


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


# ------------------------------------------------------------------ frozen
def _frozen_case(rank, world, shard, reshard, checkpoint, freeze_after_init) -> dict:
    from torch.distributed._composable import checkpoint as apply_checkpoint

    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(8) for _ in range(3)])

    def freeze():
        for name, param in model.named_parameters():
            if "bias" not in name:
                param.requires_grad_(False)

    if not freeze_after_init:
        freeze()
    for mlp in model:
        if checkpoint:
            apply_checkpoint(mlp)
        shard(mlp, mesh=_mesh(world), reshard_after_forward=reshard)
    shard(model, mesh=_mesh(world), reshard_after_forward=reshard)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if freeze_after_init:
        freeze()
    out = _train(model, opt, 3, rank, 8, set_to_none=lambda s: s % 2 == 0, grads=True)
    out["grad_none"] = [p.grad is None for p in model.parameters()]
    return out


FROZEN_FAST = [(True, False, False), (False, True, True), (1, False, True)]
FROZEN_SLOW = [
    (r, c, f)
    for r in (True, False, 1)
    for c in (False, True)
    for f in (False, True)
    if (r, c, f) not in FROZEN_FAST
]


def s_frozen_bitfit(rank, world, shard, ctx) -> dict:
    """Only biases train (frozen weights in the same groups), with activation
    checkpointing, freezing before or after fully_shard."""
    cases = FROZEN_SLOW if ctx.get("slow") else FROZEN_FAST
    return {str(c): _frozen_case(rank, world, shard, *c) for c in cases}


def s_frozen_across_groups(rank, world, shard, ctx) -> dict:
    """Every other Linear frozen (each its own fully_shard, no root), a no_grad
    iteration, then everything unfrozen for the last step."""
    out = {}
    for reshard in (True, False):
        torch.manual_seed(42)
        layers: list[nn.Module] = []
        for _ in range(6):
            layers += [nn.Linear(8, 8), nn.ReLU()]
        model = nn.Sequential(*layers)
        for m in model:
            if isinstance(m, nn.Linear):
                shard(m, mesh=_mesh(world), reshard_after_forward=reshard)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        linears = [m for m in model if isinstance(m, nn.Linear)]
        for i, lin in enumerate(linears):
            lin.requires_grad_(i % 2 == 1)
        losses = []
        x = _x(5, rank, 4, 8)
        for it in range(3):
            if it == 2:
                model.requires_grad_(True)
            if it == 1:
                with torch.no_grad():
                    losses.append(model(x).sum())
                continue
            loss = model(x).sum()
            loss.backward()
            losses.append(loss.detach())
            out[f"{reshard}.grads{it}"] = _grads(model)
            opt.step()
            opt.zero_grad(set_to_none=it % 2 == 0)
        out[f"{reshard}.loss"] = losses
        out[f"{reshard}.params"] = _params(model)
    return out


def s_unfreeze_within_group(rank, world, shard, ctx) -> dict:
    """Weights frozen at fully_shard time beside trained biases in the same groups,
    then unfrozen (fine-tuning all of it) for the later steps."""
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(8) for _ in range(2)])
    for name, param in model.named_parameters():
        param.requires_grad_("bias" in name)
    _shard_all(shard, model, list(model), mesh=_mesh(world))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = _train(model, opt, 2, rank, 8, grads=True)
    model.requires_grad_(True)
    out["unfrozen"] = _train(model, opt, 2, rank, 8, start=2, grads=True)
    return out


def s_multi_forward(rank, world, shard, ctx) -> dict:
    """A trainable and a frozen layer each run several times in forward, some of the
    calls under no_grad."""
    out = {}
    for reshard in (True, False, 1):
        torch.manual_seed(42)
        model = MultiForward()
        for m in model.modules():
            if isinstance(m, nn.Linear):
                shard(m, mesh=_mesh(world), reshard_after_forward=reshard)
        shard(model, mesh=_mesh(world), reshard_after_forward=reshard)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        out[str(reshard)] = _train(
            model, opt, 3, rank, 5, set_to_none=lambda s: s % 2 == 0, grads=True
        )
    return out


# ------------------------------------------------------------------ gradient accumulation
def _grad_acc_case(rank, world, shard, reshard, offload, recurse) -> dict:
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    kwargs: dict = {"mesh": _mesh(world), "reshard_after_forward": reshard}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    _shard_all(shard, model, list(model), **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out: dict = {"loss": []}
    for it in range(3):
        for micro in range(3):
            last = micro == 2
            if recurse:
                model.set_requires_gradient_sync(last)
            else:
                for mlp in model[:2]:
                    mlp.set_requires_gradient_sync(last, recurse=False)
            loss = model(_x(10 * it + micro, rank, 2, 8)).sum()
            loss.backward()
            out["loss"].append(loss.detach())
        out[f"grads{it}"] = _grads(model)
        opt.step()
        opt.zero_grad(set_to_none=bool(it % 2))
    out["params"] = _params(model)
    return out


GRAD_ACC_FAST = [(True, False, True), (False, True, False), (1, False, False)]
GRAD_ACC_SLOW = [
    (r, o, c)
    for r in (True, False, 1)
    for o in (False, True)
    for c in (True, False)
    if (r, o, c) not in GRAD_ACC_FAST
]


def s_grad_acc(rank, world, shard, ctx) -> dict:
    """set_requires_gradient_sync(False) on the first microbatches (all modules, or
    only some with recurse=False), mixed with zero_grad(set_to_none=False)."""
    cases = GRAD_ACC_SLOW if ctx.get("slow") else GRAD_ACC_FAST
    return {str(c): _grad_acc_case(rank, world, shard, *c) for c in cases}


def s_divide_factor(rank, world, shard, ctx) -> dict:
    """set_gradient_divide_factor (with set_force_sum_reduction_for_comms: FSDP2's
    default PREMUL_SUM reduction does not exist on gloo) with gradient sync on, then
    off, then on again."""
    out = {}
    for force_sum in (True,):
        model = nn.Linear(1, 2, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        shard(model, mesh=_mesh(world))
        model.set_gradient_divide_factor(3)
        model.set_force_sum_reduction_for_comms(force_sum)
        for i, sync in enumerate((True, False, True)):
            model.set_requires_gradient_sync(sync)
            model(torch.full((1, 1), 3.0 + rank)).sum().backward()
            out[f"{force_sum}.grad{i}"] = _value(model.weight.grad)
    return out


# ------------------------------------------------------------------ state dicts
def _fill_sd_roundtrip(model: nn.Module, rank: int) -> dict:
    """Fill the parameters, take the state dict, load a new one of other values."""
    out: dict = {}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    ptrs = {k: p.to_local().data_ptr() for k, p in model.named_parameters()}
    sd = model.state_dict()
    out["keys"] = list(sd)
    out["kinds"] = _kinds(sd)
    out["placements"] = [str(v.placements) for v in sd.values()]
    out["local"] = {k: v.to_local().clone() for k, v in sd.items()}
    out["shares_storage"] = [
        sd[k].to_local().data_ptr() == ptrs[k] for k in ptrs if sd[k].to_local().numel()
    ]
    new = {k: v.detach().clone().fill_(42.0 + rank) for k, v in sd.items()}
    out["load"] = str(model.load_state_dict(new))
    out["after_load"] = {k: p.to_local().clone() for k, p in model.named_parameters()}
    return out


def _sd_base(dim: int) -> nn.Module:
    torch.manual_seed(42)
    return nn.Sequential(MLP(dim), nn.Sequential(MLP(dim), nn.Linear(dim, dim)), MLP(dim))


def s_sd_save_load(rank, world, shard, ctx) -> dict:
    """state_dict keys, DTensor values sharing the parameters' storage, a load of new
    DTensor values (reshard_after_forward True and False, before any forward); a
    sharded child's own state dict."""
    out, mesh = {}, _mesh(world)
    for dim in (2, 3, 4, 5, 16):
        fn = _largest_dim if dim == 16 else None
        for reshard in (True, False):
            model = _sd_base(dim)
            kwargs = {"mesh": mesh, "shard_placement_fn": fn, "reshard_after_forward": reshard}
            _shard_all(shard, model, list(model), **kwargs)
            child = model[1].state_dict(keep_vars=True)
            out[f"{dim}.{reshard}.child_keys"] = list(child)
            out[f"{dim}.{reshard}.child_is_param"] = [
                child[k] is p for k, p in model[1].named_parameters()
            ]
            out[f"{dim}.{reshard}"] = _fill_sd_roundtrip(model, rank)
    return out


def s_sd_after_forward_no_reshard(rank, world, shard, ctx) -> dict:
    """reshard_after_forward=False: after a forward the parameters stay gathered;
    state_dict() must still give the sharded DTensors (FSDP2's state-dict pre-hook
    reshards), and the parameters are sharded again afterwards."""
    out, mesh = {}, _mesh(world)
    for dim in (3, 4):
        model = _sd_base(dim)
        _shard_all(shard, model, list(model), mesh=mesh, reshard_after_forward=False)
        before = {k: _value(v) for k, v in model.state_dict().items()}
        model(_x(0, rank, 2, dim))
        after = model.state_dict()
        out[f"{dim}.keys"] = list(after)
        out[f"{dim}.kinds"] = _kinds(after)
        out[f"{dim}.shapes"] = [tuple(v.shape) for v in after.values()]
        out[f"{dim}.param_kinds"] = _kinds(dict(model.named_parameters()))
        out[f"{dim}.values"] = {k: _value(v) for k, v in after.items()}
        out[f"{dim}.unchanged"] = [torch.equal(before[k], _value(after[k])) for k in before]
    return out


def s_sd_cached(rank, world, shard, ctx) -> dict:
    """A state dict taken once keeps following the parameters through training."""
    out = {}
    for dim in (2, 5):
        torch.manual_seed(42)
        model = nn.Linear(dim, dim, bias=False)
        shard(model, mesh=_mesh(world), reshard_after_forward=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sd = model.state_dict()
        for step in range(3):
            opt.zero_grad()
            model(_x(step, rank, dim, dim)).sum().backward()
            opt.step()
            out[f"{dim}.sd{step}"] = _value(sd["weight"])
            out[f"{dim}.param{step}"] = _value(model.weight)
    return out


def s_sd_offload_meta_pieces(rank, world, shard, ctx) -> dict:
    """Meta-built model with CPUOffloadPolicy, loaded one parameter at a time with
    assign=True, strict=False; forward; state dict on the CPU."""
    torch.manual_seed(42)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    policy = CPUOffloadPolicy(pin_memory=False)
    _shard_all(shard, model, list(model), mesh=_mesh(world), offload_policy=policy)
    out: dict = {"load": []}
    for name, param in model.named_parameters():
        full = torch.randn(param.size())
        piece = {name: distribute_tensor(full, param.device_mesh, param.placements)}
        out["load"].append(str(model.load_state_dict(piece, assign=True, strict=False)))
    out["meta"] = [p.is_meta for p in model.parameters()]
    out["loss"] = model(_x(0, rank, 4, 4)).sum()
    sd = model.state_dict()
    out["devices"] = [v.device.type for v in sd.values()]
    out["sd"] = {k: _value(v) for k, v in sd.items()}
    out["loss"].backward()
    out["grads"] = _grads(model)
    return out


def s_sd_full_on_rank0(rank, world, shard, ctx) -> dict:
    """A sharded state dict turned into rank 0's full CPU state dict: the reference's
    keys in its order, and its values."""
    torch.manual_seed(42)
    ref = Tied()
    model = copy.deepcopy(ref)
    _shard_all(shard, model, list(model.blocks), mesh=_mesh(world))
    full = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    want = ref.state_dict()
    return {
        "keys": list(full),
        "ref_keys_equal": list(full) == list(want),
        "values_equal": [torch.equal(full[k], want[k]) for k in want if k in full],
        "full": full if rank == 0 else {},
    }


def s_sd_tied_nonpersistent(rank, world, shard, ctx) -> dict:
    """Tied embedding/head and a non-persistent buffer: keys, values, kinds; a
    state_dict -> load_state_dict round trip after the parameters changed."""
    mesh = _mesh(world)
    torch.manual_seed(42)
    model = Tied()
    _shard_all(shard, model, list(model.blocks), mesh=mesh)
    out: dict = {"keys": list(model.state_dict()), "kinds": _kinds(model.state_dict())}
    out["names"] = [k for k, _ in model.named_parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out["loss"] = []
    for step in range(2):
        tokens = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(step + rank))
        loss = model(tokens).pow(2).mean()
        loss.backward()
        out["loss"].append(loss.detach())
        out[f"grads{step}"] = _grads(model)
        opt.step()
        opt.zero_grad()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["saved"] = {k: _value(v) for k, v in saved.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    out["load"] = str(model.load_state_dict(saved))
    out["restored"] = _params(model)
    out["tied_after_load"] = model.head.weight is model.emb.weight
    return out


def s_sd_hooks(rank, world, shard, ctx) -> dict:
    """User state_dict pre/post hooks and load_state_dict pre/post hooks on a sharded
    root and a sharded child: what they see, and a post hook that edits the dict."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(4), MLP(4))
    _shard_all(shard, model, list(model), mesh=_mesh(world))
    seen: list = []

    def pre(module, prefix, keep_vars):
        seen.append(("pre", type(module).__mro__[-2].__name__, prefix, keep_vars))

    def post(module, sd, prefix, meta):
        keys = [k for k in sd if k.startswith(prefix)]
        seen.append(("post", prefix, keys, [isinstance(sd[k], DTensor) for k in keys]))
        if prefix == "":
            sd["extra"] = torch.tensor([float(len(keys))])

    def load_pre(module, sd, prefix, meta, strict, missing, unexpected, errors):
        keys = sorted(k for k in sd if k.startswith(prefix))
        seen.append(("load_pre", prefix, keys, [isinstance(sd[k], DTensor) for k in keys]))
        sd.pop(prefix + "extra", None)

    def load_post(module, incompatible):
        seen.append(("load_post", sorted(incompatible.missing_keys), incompatible.unexpected_keys))

    for m in (model, model[1]):
        m.register_state_dict_pre_hook(pre)
        m.register_state_dict_post_hook(post)
        m.register_load_state_dict_pre_hook(load_pre)
        m.register_load_state_dict_post_hook(load_post)
    sd = model.state_dict()
    out = {"keys": list(sd), "extra": sd["extra"]}
    sd = {k: (v.detach().clone() * 2 if isinstance(v, DTensor) else v) for k, v in sd.items()}
    out["load"] = str(model.load_state_dict(sd))
    out["seen"] = seen
    out["params"] = _params(model)
    return out


def s_sd_load_errors(rank, world, shard, ctx) -> dict:
    """strict loading with a missing or an unexpected key, a wrong shape; non-strict
    loading reports the same keys."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(4), MLP(4))
    _shard_all(shard, model, list(model), mesh=_mesh(world))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    missing = dict(sd)
    missing.pop("1.out_proj.bias")
    unexpected = dict(sd, extra=torch.zeros(1))
    w = model[0].in_proj.weight
    bad = dict(sd)
    bad["0.in_proj.weight"] = distribute_tensor(torch.zeros(12, 5), w.device_mesh, w.placements)
    out = {
        "raise_missing": _raises(lambda: model.load_state_dict(missing)),
        "raise_unexpected": _raises(lambda: model.load_state_dict(unexpected)),
        "raise_shape": _raises(lambda: model.load_state_dict(bad)),
        "lenient": str(model.load_state_dict(missing, strict=False)),
        "lenient_unexpected": str(model.load_state_dict(unexpected, strict=False)),
    }
    out["params"] = _params(model)
    return out


def s_sd_load_wrong_rows(rank, world, shard, ctx) -> dict:
    """A DTensor of the parameter's placements but too few rows (one row per rank):
    FSDP2 raises on the shape mismatch."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(4), MLP(4))
    _shard_all(shard, model, list(model), mesh=_mesh(world))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    w = model[0].in_proj.weight
    sd["0.in_proj.weight"] = distribute_tensor(
        torch.arange(world * 4.0).view(world, 4), w.device_mesh, w.placements
    )
    return {"raise_rows": _raises(lambda: model.load_state_dict(sd))}


def s_sd_load_plain_tensors(rank, world, shard, ctx) -> dict:
    """load_state_dict of plain (full) tensors into DTensor parameters: FSDP2 raises;
    flexshard must load them in place (the parameters stay DTensors, an optimizer made
    before the load keeps training them) and then train like the unsharded model."""
    torch.manual_seed(42)
    ref = nn.Sequential(MLP(4), MLP(4))
    full = {k: v.clone() + 1 for k, v in ref.state_dict().items()}
    model = copy.deepcopy(ref)
    _shard_all(shard, model, list(model), mesh=_mesh(world))
    opts = tuple(torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    err = _raises(lambda: model.load_state_dict(full))
    out: dict = {"fsdp2_raises_plain": err, "vs_reference": None}
    if err is None:
        ref.load_state_dict(full)
        params = dict(model.named_parameters())
        problems = [f"{k}: not a DTensor after the load" for k, p in params.items()]
        problems = [m for m, p in zip(problems, params.values()) if not isinstance(p, DTensor)]
        problems += _mismatch("loaded", _params(model), full, exact=True)  # a copy: bitwise
        batch = lambda step: _same_batch(step, 2, 4)  # noqa: E731
        problems += _vs_reference(model, ref, batch, exact=_exact(world), opts=opts)
        out["vs_reference"] = problems
    return out


def s_dcp_api_sharded(rank, world, shard, ctx) -> dict:
    """torch's state-dict API with its default (sharded) options: model and optimizer
    state out and back in."""
    torch.manual_seed(42)
    model = nn.Sequential(MLP(5), MLP(5))
    _shard_all(shard, model, list(model), mesh=_mesh(world))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = _train(model, opt, 2, rank, 5)
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opt)
    out["msd"] = {k: _value(v) for k, v in msd.items()}
    out["osd"] = {k: {s: _value(t) for s, t in v.items()} for k, v in osd["state"].items()}
    out["osd_groups"] = osd["param_groups"]
    torch.manual_seed(1)
    fresh = nn.Sequential(MLP(5), MLP(5))
    _shard_all(shard, fresh, list(fresh), mesh=_mesh(world))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    set_model_state_dict(fresh, msd)
    set_optimizer_state_dict(fresh, fresh_opt, osd)
    out["resumed"] = _train(fresh, fresh_opt, 2, rank, 5, start=2)
    out["continued"] = _train(model, opt, 2, rank, 5, start=2)
    return out


def _dcp_model(shard, world):
    torch.manual_seed(42)
    model = nn.Sequential(MLP(5, 7), nn.Linear(5, 5), MLP(5, 3))
    _shard_all(shard, model, [model[0], model[2]], mesh=_mesh(world))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def s_dcp_save_load(rank, world, shard, ctx) -> dict:
    """dcp.save of model.state_dict() and the optimizer's state dict, training on,
    then dcp.load into the state dicts and load_state_dict: back where it was."""
    where = os.path.join(ctx["tmp"], f"dcp_w{world}_{ctx['impl']}")
    model, opt = _dcp_model(shard, world)
    out = _train(model, opt, 2, rank, 5)
    dcp.save(
        {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=where,
    )
    out["later"] = _train(model, opt, 2, rank, 5, start=2)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=where)
    out["load"] = str(model.load_state_dict(state["model"]))
    set_optimizer_state_dict(model, opt, state["optim"])
    out["restored"] = _params(model)
    out["replayed"] = _train(model, opt, 2, rank, 5, start=2)
    return out


def s_dcp_cross(rank, world, shard, ctx) -> dict:
    """A checkpoint written by the other implementation (FSDP2 <-> flexshard), read
    into this one's fresh model: the same parameters, the same next steps."""
    where = os.path.join(ctx["tmp"], f"dcp_cross_w{world}_from_{ctx['other_impl']}")
    model, opt = _dcp_model(ctx["other"], world)
    _train(model, opt, 2, rank, 5)
    dcp.save(
        {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=where,
    )
    written = _params(model)
    fresh, fresh_opt = _dcp_model(shard, world)
    state = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=where)
    out: dict = {"load": str(fresh.load_state_dict(state["model"]))}
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    out["restored"] = _params(fresh)
    out["restored_equal"] = [torch.equal(out["restored"][k], written[k]) for k in written]
    out["next"] = _train(fresh, fresh_opt, 2, rank, 5, start=2)
    return out


# ------------------------------------------------------------------ the harness
SCENARIOS: dict[str, Callable] = {
    name[2:]: fn for name, fn in globals().items() if name.startswith("s_") and callable(fn)
}
#: scenarios whose extra sub-cases run with -m slow (the fast ones run a few)
WITH_SLOW_CASES = {"frozen_bitfit", "grad_acc"}


def _diff(a, b, path: str = "") -> list[str]:
    """Where two results differ: ``raise_*`` entries only in whether they raised;
    ``fsdp2_raises_*`` entries must raise with FSDP2 only (a flexshard extension); a
    ``vs_reference`` entry (what differs from an unsharded run, None where not run)
    must be empty for flexshard, and empty or None for FSDP2."""
    last = path.rsplit(".", 1)[-1]
    if last.startswith("raise_"):
        return [] if (a is None) == (b is None) else [f"{path}: fsdp2={a!r} flexshard={b!r}"]
    if last.startswith("fsdp2_raises_"):
        ok = a is not None and b is None
        return [] if ok else [f"{path}: expected fsdp2 only to raise: fsdp2={a!r} flexshard={b!r}"]
    if last == "vs_reference":
        if b is None:
            return [f"{path}: flexshard did not run the reference check"]
        bad = [f"{path} fsdp2: {d}" for d in a or []] + [f"{path} flexshard: {d}" for d in b]
        return bad
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{path}: keys fsdp2={list(a)} flexshard={list(b)}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}" if path else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
            return [
                f"{path}: {type(a).__name__}{tuple(a.shape)} {a.dtype} vs "
                f"{type(b).__name__}{tuple(b.shape)} {b.dtype}"
            ]
        if torch.equal(a, b):
            return []
        if a.is_floating_point():
            gap = (a.double() - b.double()).abs().max().item()
            return [f"{path}: max |diff| {gap:.3g}"]
        return [f"{path}: values differ"]
    if type(a) is not type(b) or a != b:
        return [f"{path}: fsdp2={a!r:.200} flexshard={b!r:.200}"]
    return []


def _one(rank, world, shard, name, ctx) -> Any:
    try:
        return {"ok": SCENARIOS[name](rank, world, shard, ctx)}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:600]}


def _pairs(rank: int, world: int, names: list[str], tmp: str, slow: bool) -> dict:
    """Every scenario in ``names`` with FSDP2 and with flexshard; what differs."""
    results = {}
    impls = {"fsdp2": torch_fully_shard, "flexshard": fs.fully_shard}
    for name in names:
        got = {}
        for impl, shard in impls.items():
            other = next(i for i in impls if i != impl)
            ctx = {
                "tmp": tmp,
                "impl": impl,
                "other": impls[other],
                "other_impl": other,
                "slow": slow,
            }
            got[impl] = _one(rank, world, shard, name, ctx)
            dist.barrier()
        theirs, ours = got["fsdp2"], got["flexshard"]
        if "error" in theirs or "error" in ours:
            results[name] = [f"fsdp2: {theirs.get('error')}", f"flexshard: {ours.get('error')}"]
        else:
            results[name] = _diff(theirs["ok"], ours["ok"])
    return results


FAST = list(SCENARIOS)


@functools.cache
def _launch(world: int, names: tuple[str, ...], tmp: str, slow: bool) -> list[dict]:
    return run_distributed(_pairs, world, list(names), tmp, slow, timeout=600)


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fsdp2_state"))


def _check(world: int, name: str, tmp: str, slow: bool = False) -> None:
    names = tuple(FAST) if not slow else tuple(sorted(WITH_SLOW_CASES))
    per_rank = _launch(world, names, tmp, slow)
    for rank, results in enumerate(per_rank):
        assert results[name] == [], f"rank {rank}: {name}:\n" + "\n".join(results[name][:20])


@pytest.mark.parametrize("name", FAST)
def test_fsdp2_state_scenario_w2(name, tmp_dir):
    _check(2, name, tmp_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_fsdp2_state_scenario_w3(name, tmp_dir):
    _check(3, name, tmp_dir)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WITH_SLOW_CASES))
def test_fsdp2_state_scenario_more_cases_w2(name, tmp_dir):
    _check(2, name, tmp_dir, slow=True)
