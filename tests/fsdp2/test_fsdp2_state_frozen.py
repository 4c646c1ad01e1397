"""torch's FSDP2 ignored/frozen-parameter and gradient-accumulation scenarios
(test_fully_shard_ignore_params.py, test_fully_shard_frozen.py, test_fully_shard_grad_acc.py /
_pending_grad: ignored parameters, frozen layers, unfreezing, multi-forward, gradient
accumulation with and without resharding, gradient divide factors),
run with torch's ``fully_shard`` and flexshard's: every visible result must be bitwise
equal, or both must raise (harness: tests/helpers/fsdp2_state.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor.experimental import implicit_replication

from tests.helpers import fsdp2_state as st
from tests.helpers.fsdp2_state import (
    MLP,
    B,
    _grads,
    _kinds,
    _mesh,
    _params,
    _shard_all,
    _train,
    _value,
    _x,
)

# ------------------------------------------------------------------ models


class A(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.module_b = B(dim)
        self.addend = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.module_b(x) + self.addend).sum()


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


# ------------------------------------------------------------------ scenarios


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


SCENARIOS: dict[str, Callable] = {
    name[2:]: fn for name, fn in globals().items() if name.startswith("s_") and callable(fn)
}
#: scenarios whose extra sub-cases run with -m slow (the fast ones run a few)
WITH_SLOW_CASES = {"frozen_bitfit", "grad_acc"}


@pytest.mark.parametrize("world,slow,name", st.cases(__name__))
def test_fsdp2_state_scenario(world, slow, name, tmp_path_factory):
    st.check(world, __name__, name, tmp_path_factory, slow)
