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
    assert len(calls) == 2  # one foreach per call
    if copies is not None:
        assert calls == [copies, copies]
