"""torch's FSDP2 autograd scenarios (test_fully_shard_autograd.py: unused forward outputs
and modules, non-tensor activations, post-accumulate-grad hooks, optimizer in backward)
and basic training-loop ones (test_fully_shard_training.py: forward inputs, parameter
registration, fp64 after init, a module run twice per forward), run with torch's
``fully_shard`` and flexshard's (harness: tests/helpers/fsdp2_training.py)."""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import (
    FSDPModule,
)

from tests.helpers import fsdp2_training as ts
from tests.helpers.fsdp2_training import (
    MLP,
    Transformer,
    _full,
    _grads,
    _is_dtensor,
    _params,
    _randn,
    _tokens,
    _train,
)


class TwoOut(nn.Module):
    def __init__(self, dim: int = 9) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.relu(self.lin1(x))
        return y, F.relu(self.lin2(y))


def sc_unused_forward_output(rank, world, shard, mesh, raf, reduce_unused=False):
    """Some forward outputs (the root's lin2 path) are not used in later losses
    (``reduce_unused``: ``set_reduce_scatter_unused_params(True)`` gives them zeros)."""
    torch.manual_seed(0)
    model = TwoOut()
    shard(model.lin1, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    if reduce_unused:
        model.set_reduce_scatter_unused_params(True)

    calls = [0]

    def loss_fn(out):
        calls[0] += 1
        return (out[0] * out[1]).sum() if calls[0] <= 3 else out[0].sum()

    return _train(model, 6, lambda i: (_randn(100 * i + rank, 2, 9),), loss_fn)


class SkipsLin2(TwoOut):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin1(x)


def sc_unused_forward_module(rank, world, shard, mesh, raf, reduce_unused=False):
    """A separately wrapped module that never runs forward: its gradient stays None
    (with ``set_reduce_scatter_unused_params(True)`` too: FSDP2 gives zeros only in a
    group unsharded at least once)."""
    torch.manual_seed(0)
    model = SkipsLin2()
    shard(model.lin1, mesh=mesh, reshard_after_forward=raf)
    shard(model.lin2, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    if reduce_unused:
        model.set_reduce_scatter_unused_params(True)
    out = _train(model, 4, lambda i: (_randn(100 * i + rank, 2, 9),))
    out["grad_none"] = [k for k, p in model.named_parameters() if p.grad is None]
    return out


NT = collections.namedtuple("NT", "x y")


@dataclasses.dataclass
class Carrier:
    x: torch.Tensor
    note: str = "meta"


class ToContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        return {
            "list": lambda: [x],
            "namedtuple": lambda: NT(x, torch.ones_like(x)),
            "tuple": lambda: (x,),
            "dict": lambda: {"x": x},
            "dataclass": lambda: Carrier(x),
        }[self.kind]()


class ContainerModule(nn.Module):
    def __init__(self, dim: int = 9) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.lin2(F.relu(self.lin1(x))))

    def forward(self, inp: Any) -> Any:
        if isinstance(inp, list):
            return [self._f(inp[0])]
        if isinstance(inp, NT):
            return NT(self._f(inp.x), inp.y)
        if isinstance(inp, tuple):
            return (self._f(inp[0]),)
        if isinstance(inp, dict):
            return {"x": self._f(inp["x"])}
        return Carrier(self._f(inp.x), inp.note)


class FromContainer(nn.Module):
    def forward(self, inp: Any) -> torch.Tensor:
        if isinstance(inp, (list, tuple)):
            return inp[0]
        return inp["x"] if isinstance(inp, dict) else inp.x


def sc_nontensor_activations(rank, world, shard, mesh, kind):
    """Activations wrapped in lists, namedtuples, tuples, dicts and dataclasses between
    separately wrapped modules (torch collects tensors from all five)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        ToContainer(kind), ContainerModule(), ContainerModule(), ContainerModule(), FromContainer()
    )
    for module in model:
        shard(module, mesh=mesh)
    shard(model, mesh=mesh)
    return _train(model, 4, lambda i: (_randn(100 * i + rank, 2, 9),))


def sc_post_acc_grad_hook(rank, world, shard, mesh):
    """Post-accumulate-grad hooks on the sharded parameters run once per backward."""
    torch.manual_seed(0)
    model = MLP(9)
    for module in (model.in_proj, model.out_proj, model):
        shard(module, mesh=mesh)
    counts: dict = collections.defaultdict(int)
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            functools.partial(lambda n, p: counts.__setitem__(n, counts[n] + 1), name)
        )
    model(_randn(rank, 2, 9)).sum().backward()
    return {"counts": dict(counts), "grads": _grads(model)}


def sc_optim_in_backward(rank, world, shard, mesh):
    """torch's optimizer-in-backward: per-parameter AdamW + StepLR stepped from the
    post-accumulate-grad hook."""
    torch.manual_seed(0)
    model = Transformer(layers=2)
    for module in [*model.layers, model]:
        shard(module, mesh=mesh)
    optims = {p: torch.optim.AdamW([p], lr=1e-2, foreach=False) for p in model.parameters()}
    scheds = {p: torch.optim.lr_scheduler.StepLR(o, step_size=2) for p, o in optims.items()}

    def hook(param):
        optims[param].step()
        optims[param].zero_grad()
        scheds[param].step()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(hook)
    losses = []
    for i in range(4):
        loss = model(_tokens(10 * i + rank)).sum()
        loss.backward()
        losses.append(loss.detach())
    return {"loss": losses, "params": _params(model)}


# ------------------------------------------------------------------ training-loop scenarios


class Paramless(nn.Module):
    def forward(self, x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return x + ys[0] + ys[1] + 1


class ParameterOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 5))

    def forward(self) -> torch.Tensor:
        return self.weight @ self.weight


def sc_forward_inputs(rank, world, shard, mesh):
    """A parameterless root with nested inputs; a root whose forward takes no input."""
    a = Paramless()
    shard(a, mesh=mesh)
    out = {"paramless": a(_randn(1, 3), (_randn(2, 3), _randn(3, 3)))}
    torch.manual_seed(0)
    b = ParameterOnly()
    shard(b, mesh=mesh)
    y = b()
    y.sum().backward()
    out.update(no_inputs=y.detach(), grads=_grads(b), params=_params(b))
    return out


def sc_param_registration(rank, world, shard, mesh, raf, nested):
    """Which parameters are DTensors (sharded) or plain tensors (unsharded) after
    forward, after ``reshard()``, and after backward, for each reshard_after_forward."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(3), MLP(3)) if nested else MLP(3)
    if nested:
        shard(model[0].in_proj, mesh=mesh, reshard_after_forward=raf)
        shard(model[0].out_proj, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    x = _randn(rank, 2, 3)
    out: dict = {"init": _is_dtensor(model), "values0": _params(model)}
    y = model(x)
    out["after_forward"] = _is_dtensor(model)
    values = {k: _full(p) for k, p in model.named_parameters()}  # plain or DTensor
    out["values1"] = values
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    out["after_reshard"] = _is_dtensor(model)
    model(x).sum().backward()
    out["after_backward"] = _is_dtensor(model)
    out["grads"] = _grads(model)
    del y
    return out


def sc_float64_after_init(rank, world, shard, mesh):
    """``model.to(float64)`` after fully_shard: parameters, shards and grads in fp64."""
    torch.manual_seed(0)
    model = MLP(4)
    for module in (model.in_proj, model.out_proj, model):
        shard(module, mesh=mesh)
    model.to(torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    out = _train(model, 4, lambda i: (_randn(100 * i + rank, 2, 4).double(),), opt=opt)
    out["dtypes"] = [
        (str(p.dtype), str(p.to_local().dtype), str(p.grad.dtype), str(p.grad.to_local().dtype))
        for p in model.parameters()
    ]
    return out


class MultiForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


def sc_multi_forward_module(rank, world, shard, mesh, raf):
    """A wrapped module that runs twice in one forward."""
    torch.manual_seed(0)
    model = MultiForward()
    shard(model.inner, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    return _train(model, 4, lambda i: (_randn(rank, 8, 4),))


# ------------------------------------------------------------------ the registry
SCENARIOS: dict[str, tuple] = {}  # id -> (fn, kwargs)


def _add(name: str, fn, **kwargs) -> None:
    SCENARIOS[name] = (fn, kwargs)


for _raf in (True, False, 2):
    _add(f"unused_forward_output[raf={_raf}]", sc_unused_forward_output, raf=_raf)
    _add(f"unused_forward_module[raf={_raf}]", sc_unused_forward_module, raf=_raf)
    _add(f"multi_forward_module[raf={_raf}]", sc_multi_forward_module, raf=_raf)
for _raf in (True, False):
    _name = f"unused_output[raf={_raf},reduce_unused]"
    _add(_name, sc_unused_forward_output, raf=_raf, reduce_unused=True)
_add("unused_forward_module[reduce_unused]", sc_unused_forward_module, raf=True, reduce_unused=True)
for _kind in ("list", "namedtuple", "tuple", "dict", "dataclass"):
    _add(f"nontensor_activations[{_kind}]", sc_nontensor_activations, kind=_kind)
_add("post_acc_grad_hook", sc_post_acc_grad_hook)
_add("optim_in_backward", sc_optim_in_backward)
_add("forward_inputs", sc_forward_inputs)
for _raf in (True, False, 1, 2, None):
    for _nested in (False, True):
        _add(
            f"param_registration[raf={_raf},nested={_nested}]",
            sc_param_registration,
            raf=_raf,
            nested=_nested,
        )
_add("float64_after_init", sc_float64_after_init)

# the fast suite runs these on two ranks; every scenario runs with -m slow on 2 and 3
FAST = [
    "unused_forward_output[raf=True]",
    "unused_forward_output[raf=False]",
    "unused_forward_module[raf=True]",
    "unused_forward_module[reduce_unused]",
    "unused_output[raf=True,reduce_unused]",
    "multi_forward_module[raf=True]",
    "multi_forward_module[raf=False]",
    "nontensor_activations[namedtuple]",
    "nontensor_activations[dict]",
    "nontensor_activations[dataclass]",
    "post_acc_grad_hook",
    "optim_in_backward",
    "forward_inputs",
    "param_registration[raf=True,nested=True]",
    "param_registration[raf=False,nested=True]",
    "param_registration[raf=None,nested=True]",
    "param_registration[raf=1,nested=True]",
    "float64_after_init",
]


@pytest.mark.parametrize("selection,name", ts.cases(__name__))
def test_fsdp2_training_scenario(selection, name):
    ts.check(selection, __name__, name)
