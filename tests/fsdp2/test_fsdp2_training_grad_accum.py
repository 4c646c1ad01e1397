"""torch's FSDP2 gradient-accumulation scenarios (test_fully_shard_training.py:
accumulation with and without reduce-scatter / all-reduce per microbatch, CPU offload,
1F1B-style microbatches, HSDP on four ranks), run with torch's ``fully_shard`` and
flexshard's (harness: tests/helpers/fsdp2_training.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    OffloadPolicy,
)

from tests.helpers import fsdp2_training as ts
from tests.helpers.fsdp2_training import (
    MLP,
    Transformer,
    _grads,
    _params,
    _randn,
    _tokens,
)


def sc_grad_accum(rank, world, shard, mesh, raf, mode, rab, offload, hsdp=False, rs_only=False):
    """torch's gradient accumulation: no reduction (and optionally no reshard after
    backward) for all / the root only / some MLPs until the last microbatch; the
    optimizer zeroes grads to None or to zeros alternately."""
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 9), MLP(9), MLP(9), MLP(9))
    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    kw = {"mesh": mesh, "reshard_after_forward": raf, "offload_policy": policy}
    for mlp in model[1:]:
        shard(mlp, **kw)
    shard(model, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def sync(module, last, recurse=True):
        if rs_only:
            module.set_requires_all_reduce(last, recurse=recurse)
        else:
            module.set_requires_gradient_sync(last, recurse=recurse)

    out: dict = {"loss": [], "grads": []}
    for it in range(3):
        for mb in range(3):
            last = mb == 2
            if mode == "all":
                sync(model, last)
                if not rab:
                    model.set_reshard_after_backward(last)
            elif mode == "some_mlps":
                for mlp in model[1:3]:
                    sync(mlp, last)
                    if not rab:
                        mlp.set_reshard_after_backward(last)
            else:  # root_only
                sync(model, last, recurse=False)
                if not rab:
                    model.set_reshard_after_backward(last, recurse=False)
            loss = model(_randn(100 * it + 10 * mb + rank, 2, 9)).sum()
            loss.backward()
            out["loss"].append(loss.detach())
        out["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=(it % 2 == 1))
    out["params"] = _params(model)
    return out


def _grad_accum_cases() -> list[dict]:
    """torch's sub-cases, minus the ones its own test skips."""
    cases = []
    for raf in (True, False, 2):
        for mode in ("all", "root_only", "some_mlps"):
            for rab in (False, True):
                for offload in (False, True):
                    if not rab and (raf is not False or mode == "some_mlps"):
                        continue
                    if offload and raf is not True:
                        continue
                    cases.append({"raf": raf, "mode": mode, "rab": rab, "offload": offload})
    return cases


def sc_1f1b(rank, world, shard, mesh, explicit_unshard, rab):
    """1F1B microbatching: reshard_after_forward=False, optional explicit async
    unshard of every module up front, sync and reshard only on the last microbatch."""
    torch.manual_seed(0)
    model = Transformer(layers=2)
    for layer in model.layers:
        shard(layer, mesh=mesh, reshard_after_forward=False)
    shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if explicit_unshard:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard(async_op=True)
    losses = []
    for i in range(3):
        last = i == 2
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        if not rab:
            model.set_reshard_after_backward(last)
        loss = model(_tokens(10 * i + rank)).sum()
        loss.backward()
        losses.append(loss.detach())
    grads = _grads(model)
    opt.step()
    return {"loss": losses, "grads": grads, "params": _params(model)}


def sc_hsdp(rank, world, shard, mesh, raf, ac, dim, sync_last, offload):
    """HSDP (2 replicas x 2 shards) train parity with microbatches."""
    from torch.distributed._composable import checkpoint

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(dim, bias=False), MLP(dim, 3), MLP(dim), MLP(dim, 3))
    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    kw = {"mesh": mesh, "reshard_after_forward": raf, "offload_policy": policy}
    for sub in model:
        if ac:
            checkpoint(sub)
        shard(sub, **kw)
    shard(model, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out: dict = {"loss": [], "grads": []}
    for it in range(2):
        for mb in range(3):
            if sync_last:
                model.set_requires_gradient_sync(mb == 2)
            loss = model(_randn(10 * it + mb + 100 * rank, 8, dim)).sum()
            loss.backward()
            out["loss"].append(loss.detach())
        out["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=(it % 2 == 0))
    out["params"] = _params(model)
    return out


# ------------------------------------------------------------------ the registry
SCENARIOS: dict[str, tuple] = {}  # id -> (fn, kwargs)


def _add(name: str, fn, **kwargs) -> None:
    SCENARIOS[name] = (fn, kwargs)


for _c in _grad_accum_cases():
    _add(
        "grad_accum[raf={raf},{mode},rab={rab},offload={offload}]".format(**_c),
        sc_grad_accum,
        **_c,
    )
for _explicit in (False, True):
    for _rab in (False, True):
        _add(f"1f1b[unshard={_explicit},rab={_rab}]", sc_1f1b, explicit_unshard=_explicit, rab=_rab)

# HSDP: four ranks (2 replicas x 2 shards)
HSDP: dict[str, tuple] = {}
for _raf in (True, False, 2):
    for _mode in ("all", "root_only", "some_mlps"):
        for _rs_only in (False, True):
            HSDP[f"hsdp_grad_accum[raf={_raf},{_mode},rs_only={_rs_only}]"] = (
                sc_grad_accum,
                {"raf": _raf, "mode": _mode, "rab": True, "offload": False, "hsdp": True,
                 "rs_only": _rs_only},
            )  # fmt: skip
for _raf in (False, True):
    for _ac in (False, True):
        for _dim in (3, 17):
            for _sync in (True, False):
                HSDP[f"hsdp_train[raf={_raf},ac={_ac},dim={_dim},sync_last={_sync}]"] = (
                    sc_hsdp,
                    {"raf": _raf, "ac": _ac, "dim": _dim, "sync_last": _sync, "offload": False},
                )
HSDP["hsdp_train[offload]"] = (
    sc_hsdp,
    {"raf": True, "ac": False, "dim": 17, "sync_last": True, "offload": True},
)
SCENARIOS_W4 = {**HSDP}

# the fast suite runs these on two ranks; every scenario runs with -m slow on 2 and 3
FAST = [
    "grad_accum[raf=True,all,rab=True,offload=False]",
    "grad_accum[raf=False,all,rab=False,offload=False]",
    "grad_accum[raf=False,root_only,rab=False,offload=False]",
    "grad_accum[raf=2,some_mlps,rab=True,offload=False]",
    "1f1b[unshard=True,rab=False]",
]


@pytest.mark.parametrize("selection,name", ts.cases(__name__))
def test_fsdp2_training_scenario(selection, name):
    ts.check(selection, __name__, name)
