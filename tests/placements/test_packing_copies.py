"""pack/unpack issue one foreach copy per call, with a parameter's Shard/FlatShard rank
chunks merged into one strided copy, and move exactly the elements the per-block
copies did (W = 3, 17 rows: the last rank's chunk is short)."""

from __future__ import annotations

import pytest
import torch

from flexshard.placements import BlockShard, FlatShard, Shard
from flexshard.placements.layout import plan_bucket
from flexshard.placements.packing import full_view, pack_all, storage_view, unpack

SHAPES = [(17, 24), (24, 17), (5,), (3, 17, 8)]


def _per_block(layout, fulls, out):
    """The reference: one copy per rank x parameter x block."""
    out.zero_()
    for param, full in zip(layout.params, fulls):
        for rank in range(layout.world_size):
            for block in param.copy_blocks[rank]:
                storage_view(block, out[rank]).copy_(full_view(block, full))


@pytest.mark.parametrize(
    ("placement", "copies"),
    # Shard(0): 17 rows -> 6, 6, 5 (two copies), 24 -> 8 each (one), 5 -> 2, 2, 1 (two),
    # 3 experts (one): 6 copies where per block there are 12; FlatShard: already one
    # region per rank and parameter piece
    [(Shard(0), 6), (FlatShard(), 6), (BlockShard((8, 8)), None)],
)
def test_fused_copies_match_per_block_copies(placement, copies, monkeypatch):
    shapes = SHAPES if not isinstance(placement, BlockShard) else SHAPES[:2]
    layout = plan_bucket([(f"p{i}", s, placement) for i, s in enumerate(shapes)], 3)
    torch.manual_seed(0)
    fulls = [torch.randn(s) for s in shapes]
    calls: list[int] = []
    foreach = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (calls.append(len(d)), foreach(d, s)))
    packed = torch.full((3, layout.shard_numel), float("nan"))
    pack_all(layout, fulls, packed)
    expected = torch.empty_like(packed)
    _per_block(layout, fulls, expected)
    assert torch.equal(packed, expected)
    outs = [torch.full_like(f, float("nan")) for f in fulls]
    unpack(layout, packed, outs)
    assert all(torch.equal(out, full) for out, full in zip(outs, fulls))
    # one foreach per call; Shard(0) packs with one torch._chunk_cat instead
    chunked = isinstance(placement, Shard)
    assert layout.chunked_rows == chunked
    assert len(calls) == (1 if chunked else 2)
    if copies is not None:
        assert calls == [copies] * len(calls)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_cat_packing_matches_per_block_copies(world, dtype):
    """FSDP2's layout (every parameter Shard(0)) packs with one ``torch._chunk_cat``:
    the same bits as the per-block copies, bf16 gradients widened into fp32 too."""
    layout = plan_bucket([(f"p{i}", s, Shard(0)) for i, s in enumerate(SHAPES)], world)
    assert layout.chunked_rows
    torch.manual_seed(world)
    fulls = [torch.randn(s).to(dtype) for s in SHAPES]
    packed = torch.full((world, layout.shard_numel), float("nan"))
    pack_all(layout, fulls, packed)
    expected = torch.empty_like(packed)
    _per_block(layout, fulls, expected)
    assert torch.equal(packed, expected)


def test_layouts_that_are_not_fsdp2_rows_copy_piece_by_piece():
    """Shard(1), or a missing gradient (zeros), take the per-piece copies."""
    assert not plan_bucket([("a", (17, 24), Shard(1))], 3).chunked_rows
    assert not plan_bucket([("a", (17, 24), Shard(0)), ("b", (24, 17), Shard(1))], 3).chunked_rows
    layout = plan_bucket([(f"p{i}", s, Shard(0)) for i, s in enumerate(SHAPES)], 3)
    fulls = [torch.randn(s) for s in SHAPES]
    fulls[1] = None
    packed = torch.full((3, layout.shard_numel), float("nan"))
    pack_all(layout, fulls, packed)
    expected = torch.empty_like(packed)
    _per_block(
        layout, [f if f is not None else torch.zeros(s) for f, s in zip(fulls, SHAPES)], expected
    )
    assert torch.equal(packed, expected)


def test_gradients_of_mixed_dtypes_copy_piece_by_piece(monkeypatch):
    """Gradients of two dtypes in one bucket (some parameters kept in fp32 under bf16
    compute) take the per-piece copies: torch 2.15's ``_chunk_cat`` takes one dtype."""
    layout = plan_bucket([(f"p{i}", s, Shard(0)) for i, s in enumerate(SHAPES)], 3)
    fulls = [torch.randn(s) for s in SHAPES]
    fulls[0] = fulls[0].to(torch.bfloat16)
    chunk_cats = []
    chunk_cat = torch._chunk_cat
    monkeypatch.setattr(
        torch, "_chunk_cat", lambda *a, **k: (chunk_cats.append(1), chunk_cat(*a, **k))[1]
    )
    packed = torch.full((3, layout.shard_numel), float("nan"))
    pack_all(layout, fulls, packed)
    expected = torch.empty_like(packed)
    _per_block(layout, fulls, expected)
    assert torch.equal(packed, expected) and chunk_cats == []
