"""torch's FSDP2 state-dict scenarios (test_fully_shard_state_dict.py: save/load
round trips, cached and offloaded state dicts, full state dicts on rank 0, tied and
non-persistent entries, state-dict hooks, load errors, distributed checkpoint (DCP)
save/load, also across implementations),
run with torch's ``fully_shard`` and flexshard's: every visible result must be bitwise
equal, or both must raise (harness: tests/helpers/fsdp2_state.py)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor, distribute_tensor

import flexshard as fs
from tests.helpers import fsdp2_state as st
from tests.helpers.fsdp2_state import (
    MLP,
    _exact,
    _grads,
    _kinds,
    _largest_dim,
    _mesh,
    _mismatch,
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


# ------------------------------------------------------------------ scenarios


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
    gathered = fs.full_state_dict(model)  # on torch's fully_shard too: its DTensors
    return {
        "keys": list(full),
        "ref_keys_equal": list(full) == list(want),
        "values_equal": [torch.equal(full[k], want[k]) for k in want if k in full],
        "full": full if rank == 0 else {},
        "fs_full_state_dict_equal": [
            list(gathered) == list(want),
            *(torch.equal(gathered[k], want[k]) for k in want if k in gathered),
        ],
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


SCENARIOS: dict[str, Callable] = {
    name[2:]: fn for name, fn in globals().items() if name.startswith("s_") and callable(fn)
}


@pytest.mark.parametrize("world,slow,name", st.cases(__name__))
def test_fsdp2_state_scenario(world, slow, name, tmp_path_factory):
    st.check(world, __name__, name, tmp_path_factory, slow)
