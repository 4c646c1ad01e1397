"""torch's full state-dict load on flexshard's own placements (FlatShard, Owned,
BlockShard, a mixed bucket; W = 3, HSDP 2x2, dp2 x tp2; AdamW, and DistMuon + AdamW on
Muon's Owned buckets): ``set_model_state_dict`` and ``set_optimizer_state_dict`` with
``full_state_dict=True``, with and without ``broadcast_from_rank0``, on a trained model,
restore the source model and optimizer bit for bit, and the next step equals the
source's next step bit for bit. Also ``fs.distribute_tensor`` +
``load_state_dict(assign=True)`` (the DTensor-API load)."""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import flexshard as fs
from flexshard.optim import muon_and_adamw, muon_buckets
from flexshard.testing import run_distributed
from tests.fsdp2.test_fsdp2_dropin import Net, _batch
from tests.helpers import tp_cases as tc

ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it all
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
EVERYWHERE = StateDictOptions(full_state_dict=True)

SPECS = {
    "flat": lambda fqn, p: fs.FlatShard(),
    "owned": lambda fqn, p: fs.Owned(),
    "block": lambda fqn, p: fs.BlockShard((8, 8)),
    "mixed": lambda fqn, p: fs.Owned() if fqn.endswith("up.weight") else fs.BlockShard((8, 8)),
    "muon": None,  # muon_buckets (whole matrices Owned), DistMuon + AdamW
}


def _build(mesh, name: str, meta: bool = False) -> Net:
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = Net()
    else:
        model = Net()
    if name == "muon":
        buckets = muon_buckets(model, mesh.size(mesh.ndim - 1))
    else:
        buckets = [fs.BucketSpec(["layers.*", "head.*"], placement=SPECS[name])]
    fs.flex_shard(model, mesh=mesh, buckets=buckets)
    return model


def _optimizer(model: Net, name: str) -> torch.optim.Optimizer:
    if name == "muon":
        return muon_and_adamw(model, lr=0.02, adamw_lr=1e-2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, step: int, rank: int) -> None:
    model(_batch(step, rank)).pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    opt.step()
    opt.zero_grad()


def _full(value):
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value.full_tensor() if isinstance(value, DTensor) else value


def _saved(state_dict: dict) -> dict:
    """Through ``torch.save``/``torch.load`` as a checkpoint file would go (the two
    optimizers in one process must not share AdamW's step tensors)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _differ(a: dict, b: dict) -> list[str]:
    """Keys whose (full) values are not bitwise equal."""
    a, b = _full(a), _full(b)
    out = []
    for key in a.keys() | b.keys():
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += [f"{key}.{k}" for k in _differ(x, y)]
        elif not (
            isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        ):
            out.append(str(key))
    return sorted(out)


def _load_case(rank: int, world: int, name: str, hsdp: bool, broadcast: bool) -> dict:
    """Source trained 3 steps; destination (the same model) trained 1 step, then loaded
    from the source's full state dicts through torch's API; then both step once more."""
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,))
    pair = []
    for steps in (3, 1):
        model = _build(mesh, name)
        opt = _optimizer(model, name)
        for step in range(steps):
            _step(model, opt, step, rank)
        pair.append((model, opt))
    (src, src_opt), (dst, dst_opt) = pair
    options = BROADCAST if broadcast else EVERYWHERE
    source = ON_RANK0 if broadcast else EVERYWHERE
    model_sd = _saved(get_model_state_dict(src, options=source))
    optim_sd = _saved(get_optimizer_state_dict(src, src_opt, options=source))
    assert (rank == 0 or not broadcast) == bool(model_sd)  # the source of a broadcast
    set_model_state_dict(dst, model_sd, options=options)
    set_optimizer_state_dict(dst, dst_opt, optim_sd, options=options)
    out = {
        "params": _differ(dict(src.named_parameters()), dict(dst.named_parameters())),
        "state": _differ(
            get_optimizer_state_dict(src, src_opt, options=EVERYWHERE)["state"],
            get_optimizer_state_dict(dst, dst_opt, options=EVERYWHERE)["state"],
        ),
        "regional": sorted({type(p).__name__ for p in dst.parameters()}),
        "state_types": sorted(
            {type(v).__name__ for s in dst_opt.state.values() for v in s.values()}
        ),
    }
    for model, opt in pair:  # the loaded values live in the bucket storage the step uses
        _step(model, opt, 3, rank)
    out["next"] = _differ(dict(src.named_parameters()), dict(dst.named_parameters()))
    return out


CASES = [
    pytest.param("mixed", False, True, id="mixed-w3-broadcast"),
    pytest.param("mixed", False, False, id="mixed-w3-everywhere"),
    pytest.param("block", True, True, id="block-hsdp-broadcast"),
    pytest.param("muon", False, False, id="muon-w3-everywhere"),
    pytest.param("flat", False, True, id="flat-w3-broadcast", marks=pytest.mark.slow),
    pytest.param("owned", False, False, id="owned-w3-everywhere", marks=pytest.mark.slow),
    pytest.param("mixed", True, False, id="mixed-hsdp-everywhere", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,hsdp,broadcast", CASES)
def test_torch_full_state_dict_load_restores_model_and_optimizer(name, hsdp, broadcast):
    for out in run_distributed(_load_case, 4 if hsdp else 3, name, hsdp, broadcast):
        assert out["params"] == [] and out["state"] == [] and out["next"] == [], out
        # Muon's buckets keep norms and biases on torch's placements
        assert (
            out["regional"] == ["DTensor", "RegionDTensor"] if name == "muon" else ["RegionDTensor"]
        )
        assert "RegionDTensor" in out["state_types"], out  # not full-shaped plain tensors


def _distribute_case(rank: int, world: int) -> dict:
    """The FSDP2 example's DTensor-API load with flexshard's ``distribute_tensor``: cut a
    full state dict onto a meta-built model's placements, ``load_state_dict(assign=True)``."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    full = Net().state_dict()
    model = _build(mesh, "mixed", meta=True)
    cut = {}
    for key, param in model.named_parameters():
        cut[key] = fs.distribute_tensor(full[key], param.device_mesh, param.placements)
    model.load_state_dict(cut, assign=True)
    # torch's own API on a meta-built model, every rank holding the full state dict
    by_torch = _build(mesh, "mixed", meta=True)
    set_model_state_dict(by_torch, dict(full), options=EVERYWHERE)
    reference = _build(mesh, "mixed")
    fs.load_full_state_dict(reference, full)
    expected = dict(reference.named_parameters())
    return {
        "types": sorted({type(v).__name__ for v in cut.values()}),
        "local": [k for k, v in cut.items() if not torch.equal(v.to_local(), _local(reference, k))],
        "params": _differ(dict(model.named_parameters()), expected),
        "by_torch": _differ(dict(by_torch.named_parameters()), expected),
        "meta": [k for m in (model, by_torch) for k, p in m.named_parameters() if p.is_meta],
    }


def _local(model, key: str) -> torch.Tensor:
    return dict(model.named_parameters())[key].to_local()


def test_distribute_tensor_cuts_flexshard_placements():
    for out in run_distributed(_distribute_case, 3):
        assert out == {
            "types": ["RegionDTensor"],
            "local": [],
            "params": [],
            "by_torch": [],
            "meta": [],
        }


def _tp_case(rank: int, world: int) -> dict:
    """dp2 x tp2, BlockShard (or Shard where blocks do not fit) over tp pieces."""
    mesh = tc.tp_mesh(2, 2)
    cfg = tc.model_config()
    pair = []
    for steps in (2, 1):
        model = tc.build(cfg, mesh, tc.block_or_shard)
        opt = torch.optim.AdamW(model.parameters(), lr=tc.LR)
        tc.train(model, mesh, steps, opt)
        pair.append((model, opt))
    (src, src_opt), (dst, dst_opt) = pair
    model_sd = _saved(get_model_state_dict(src, options=ON_RANK0))
    set_model_state_dict(dst, model_sd, options=BROADCAST)
    optim_sd = _saved(get_optimizer_state_dict(src, src_opt, options=EVERYWHERE))
    set_optimizer_state_dict(dst, dst_opt, optim_sd, options=EVERYWHERE)
    return {
        "params": _differ(dict(src.named_parameters()), dict(dst.named_parameters())),
        "state": _differ(
            get_optimizer_state_dict(src, src_opt, options=EVERYWHERE)["state"],
            get_optimizer_state_dict(dst, dst_opt, options=EVERYWHERE)["state"],
        ),
        "regional": any(type(p).__name__ == "RegionDTensor" for p in dst.parameters()),
    }


def test_torch_full_state_dict_load_under_tensor_parallel():
    for out in run_distributed(_tp_case, 4):
        assert out == {"params": [], "state": [], "regional": True}
