"""Single-process checks of flexshard.optim: Newton–Schulz and DistMuon on plain tensors
against torch.optim.Muon, Muon + AdamW against torch's two optimizers, the parameter
split, the planner's buckets and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz

import flexshard as fs
from flexshard.optim import (
    DistMuon,
    muon_and_adamw,
    muon_buckets,
    split_muon_params,
    zeropower,
    zeropower_batched,
)
from flexshard.optim.muon_adamw import split_named_params
from flexshard.testing import TinyTransformer, make_batches

COEFFS = (3.4445, -4.7750, 2.0315)


@pytest.mark.parametrize("shape", [(17, 29), (29, 17), (18, 18), (1, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_is_torchs_bit_for_bit(shape, dtype) -> None:
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = g.clone()
    ours = zeropower(g, COEFFS, 5, 1e-7)
    assert torch.equal(ours, _zeropower_via_newtonschulz(g.clone(), COEFFS, 5, 1e-7))
    assert torch.equal(g, before)  # a bf16 input is not changed in place


def test_batched_newton_schulz_within_one_bf16_rounding() -> None:
    stack = torch.randn(5, 17, 10, generator=torch.Generator().manual_seed(1))
    batched = zeropower_batched(stack, COEFFS, 5, 1e-7).float()
    single = torch.stack([zeropower(m, COEFFS, 5, 1e-7) for m in stack]).float()
    # bf16 has 8 significant bits; entries are below 1.5
    torch.testing.assert_close(batched, single, rtol=0, atol=2.0**-7)


def _muon_pair(shapes, steps: int, **kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    ours = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    a, b = DistMuon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    return ours, theirs


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.02},
        {"lr": 0.01, "nesterov": False, "momentum": 0.9, "weight_decay": 0.0},
        {"lr": 3e-3, "adjust_lr_fn": "match_rms_adamw", "ns_steps": 3},
    ],
)
def test_plain_tensors_match_torch_muon_bitwise(kwargs) -> None:
    ours, theirs = _muon_pair([(17, 29), (29, 18), (18, 18)], 4, **kwargs)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


def test_plain_row_blocks_and_expert_stacks() -> None:
    gen = torch.Generator().manual_seed(2)
    qkv = nn.Parameter(torch.randn(54, 18, generator=gen))
    experts = nn.Parameter(torch.randn(3, 17, 10, generator=gen))
    heads = [nn.Parameter(h.clone()) for h in qkv.detach().split(6)]
    per_expert = [nn.Parameter(e.clone()) for e in experts.detach()]
    ours = DistMuon([{"params": [qkv], "row_blocks": 6}, {"params": [experts]}], lr=0.02)
    ref = torch.optim.Muon(heads + per_expert, lr=0.02)
    for _ in range(3):
        qkv.grad = torch.randn(54, 18, generator=gen)
        experts.grad = torch.randn(3, 17, 10, generator=gen)
        for h, g in zip(heads, qkv.grad.split(6)):
            h.grad = g.clone()
        for e, g in zip(per_expert, experts.grad):
            e.grad = g.clone()
        ours.step()
        ref.step()
    assert torch.equal(qkv, torch.cat([h.detach() for h in heads]))
    reference = torch.stack([e.detach() for e in per_expert])
    torch.testing.assert_close(experts.detach(), reference, rtol=0, atol=3 * 0.02 * 2.0**-8)


def _tied() -> nn.Module:
    model = TinyTransformer()
    model.head.weight = model.embed.weight  # a tied LM head
    model.experts = nn.Parameter(torch.zeros(4, 18, 29))  # an MoE stack
    return model


def test_split_follows_practice() -> None:
    muon, adamw = split_named_params(TinyTransformer())
    assert {n for n, _ in muon} == {
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "up", "down")
    }
    assert {"embed.weight", "head.weight", "norm.weight", "layers.0.up.bias"} <= {
        n for n, _ in adamw
    }
    muon, adamw = split_named_params(_tied())
    assert "experts" in {n for n, _ in muon} and "embed.weight" in {n for n, _ in adamw}
    names = {n for n, _ in split_named_params(_tied(), adamw_patterns=["*.proj.*"])[1]}
    assert "layers.0.proj.weight" in names
    names = {n for n, _ in split_named_params(TinyTransformer(), detect_head=False)[0]}
    assert "head.weight" in names
    muon_p, adamw_p = split_muon_params(TinyTransformer())
    assert all(isinstance(p, nn.Parameter) for p in muon_p + adamw_p)


def test_muon_and_adamw_is_torch_muon_plus_adamw_and_resumes() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    twin = copy.deepcopy(model)
    opt = muon_and_adamw(model, lr=0.02, adamw_lr=3e-3, adamw_betas=(0.9, 0.95))
    muon, adamw = split_muon_params(twin)
    refs = [
        torch.optim.Muon(muon, lr=0.02),
        torch.optim.AdamW(adamw, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
    ]
    batches = make_batches(model.cfg, 4, batch=2)
    saved = None
    for step, batch in enumerate(batches):
        if step == 2:  # save mid-run, resume in a fresh optimizer
            saved = (copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict()))
        model.loss(*batch).backward()
        twin.loss(*batch).backward()
        opt.step()
        opt.zero_grad()
        for ref in refs:
            ref.step()
            ref.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert p.grad is None
    assert all(
        v.shape == p.shape for p in model.parameters() for v in opt.state[p].values() if v.ndim
    )
    end = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(saved[1])
    fresh = muon_and_adamw(model, lr=0.02, adamw_lr=3e-3, adamw_betas=(0.9, 0.95))
    fresh.load_state_dict(saved[0])
    for batch in batches[2:]:
        model.loss(*batch).backward()
        fresh.step()
        fresh.zero_grad()
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), end))


def test_planner_buckets() -> None:
    buckets = muon_buckets(_tied(), 3, row_blocks={"*.qkv.weight": 6})
    by_name = {b.name: b for b in buckets}
    assert list(by_name) == ["layers.0", "layers.1", "outer"]
    assert all(b.ragged for b in buckets)
    block = by_name["layers.0"]
    assert block.pattern_list == ["layers.0.*"]
    qkv = block.placement("layers.0.qkv.weight", None)
    assert isinstance(qkv, fs.Owned) and qkv.rank is not None  # whole, per head locally
    outer = by_name["outer"]
    experts = outer.placement("experts", None)  # one tile per expert, each pinned
    assert experts.block == (18, 29) and len(experts.owners) == _tied().experts.shape[0]
    assert outer.placement("embed.weight", None) == fs.Shard(0)
    assert "embed.weight" in outer.pattern_list  # the tied head: one parameter, by name
    assert block.placement("layers.0.up.bias", None) == fs.Shard(0)
    owned = {
        n: b.placement(n, None)
        for b in buckets
        for n in b.placement.table  # type: ignore[union-attr]
        if isinstance(b.placement(n, None), fs.Owned)
    }
    assert {p.rank for p in owned.values()} == {0, 1, 2}
    # the repr says who owns which matrix and how each block is cut, not "<lambda>"
    for name, placement in owned.items():
        bucket = by_name[name.rsplit(".", 2)[0]] if name.startswith("layers.") else outer
        assert f"'{name}': Owned(rank={placement.rank})" in repr(bucket), name
    assert f"'experts': BlockShard(block=(18, 29), owners={experts.owners})" in repr(outer)
    with pytest.raises(KeyError, match="'embed.weight'"):
        block.placement("embed.weight", None)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ns_steps": 100}, "ns_steps"),
        ({"ns_steps": 2.5}, "ns_steps"),
        ({"lr": -0.1}, "lr"),
        ({"momentum": -0.5}, "momentum"),
        ({"momentum": 1.0}, "momentum"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"adjust_lr_fn": "sqrt"}, "adjust_lr_fn"),
        ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients"),
    ],
)
def test_bad_hyperparameters(kwargs, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        DistMuon([nn.Parameter(torch.zeros(3, 4))], **kwargs)


def test_bad_adamw_hyperparameters() -> None:
    with pytest.raises(ValueError, match="beta"):
        muon_and_adamw(TinyTransformer(), lr=0.02, adamw_betas=(0.9, 1.5))


def test_bad_parameters_named() -> None:
    model = TinyTransformer()
    with pytest.raises(ValueError, match="'layers.0.attn_norm.weight' has shape \\(18,\\)"):
        DistMuon(model.named_parameters())
    with pytest.raises(ValueError, match="parameter 0 of param group 0 has shape"):
        DistMuon([nn.Parameter(torch.zeros(2, 3, 4, 5))])
    with pytest.raises(ValueError, match="row_blocks takes 2-D"):
        DistMuon([{"params": [nn.Parameter(torch.zeros(2, 3, 4))], "row_blocks": 2}])
    with pytest.raises(ValueError, match="row_blocks"):
        DistMuon([{"params": [nn.Parameter(torch.zeros(4, 3))], "row_blocks": -2}])
    with pytest.raises(ValueError, match="ns_steps"):  # per-group overrides are checked too
        DistMuon([{"params": [nn.Parameter(torch.zeros(4, 3))], "ns_steps": 200}])


@pytest.mark.parametrize(
    "placement", [fs.FlatShard(), fs.Shard(1), fs.Shard(2), fs.BlockShard((8, 8)), fs.Shard(0)]
)
def test_expert_pieces_rebuild_every_expert(placement) -> None:
    """Cut experts are redistributed one by one: the pieces every rank holds of each
    expert, read from its local shard, rebuild that expert exactly."""
    from flexshard.optim.matrices import pieces, units_of
    from flexshard.placements.layout import plan_bucket

    shape = (3, 17, 10)
    full = torch.arange(510.0).view(shape)
    for world_size in (2, 3, 4):
        layout = plan_bucket([("e", shape, placement)], world_size).params[0]
        locals_ = [
            torch.cat([r.view_of(full).reshape(-1) for r in regions] or [full.new_empty(0)])
            for regions in layout.regions
        ]
        for expert, matrix_shape in units_of(shape):
            rebuilt = torch.full(matrix_shape, -1.0)
            for local, regions in zip(locals_, layout.regions):
                for piece in pieces(regions, shape, expert):
                    view = piece.region.view_of(rebuilt)
                    data = local[piece.local : piece.local + piece.region.numel]
                    view.copy_(data.view(view.shape))
            assert torch.equal(rebuilt, full[expert]), (placement, world_size, expert)
