"""Regions as DCP chunks: pure layout math, no processes.

A rank's boxes must hold exactly its elements, in the order its local tensor stores
them, so that each chunk is a plain view of the local data; and the ranks' chunks
must tile each parameter exactly once.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from flexshard.placements import BlockShard
from flexshard.placements.layout import plan_bucket
from flexshard.runtime.dtensor.chunks import (
    RegionTensor,
    flat_range_boxes,
    local_boxes,
    region_tensor,
)

from ..helpers.placement_cases import ALL_BUCKETS, PROPERTY, distinct_fulls, shapes


def _take(full: torch.Tensor, box) -> torch.Tensor:
    offsets, sizes = box
    return full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


@PROPERTY
@given(st.data())
def test_flat_range_is_a_few_boxes_in_order(data):
    shape = data.draw(shapes(min_dims=0, max_dims=4))
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    full = torch.arange(numel).reshape(shape)
    boxes = flat_range_boxes(start, stop, shape)
    got = torch.cat([_take(full, b).reshape(-1) for b in boxes]) if boxes else torch.zeros(0)
    assert torch.equal(got, torch.arange(start, stop).to(got.dtype))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


@PROPERTY
@given(ALL_BUCKETS)
def test_boxes_hold_each_rank_local_data_and_tile_each_parameter(case):
    entries, world_size, first_rank = case
    layout = plan_bucket(entries, world_size, first_rank=first_rank)
    for param, full in zip(layout.params, distinct_fulls(entries)):
        covered = torch.zeros(param.shape, dtype=torch.int64)
        for rank in range(world_size):
            local = torch.cat(
                [r.view_of(full).reshape(-1) for r in param.regions[rank]] or [torch.zeros(0)]
            )
            chunks = region_tensor(param, rank, local.to(full.dtype), writer=True)
            for box, piece in chunks.pieces:
                assert piece.shape == box[1]
                assert torch.equal(piece, _take(full, box))  # the view holds those elements
                assert piece.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
                _take(covered, box).add_(1)
        expected = 1 if not layout.replicated else world_size
        assert bool((covered == expected).all())


def test_full_width_tiles_join_into_one_chunk():
    # 5-row tiles of a 17 x 6 matrix at W = 2: each rank's run of tiles is one box
    layout = plan_bucket([("w", (17, 6), BlockShard((5, 6)))], 2)
    param = layout.params[0]
    assert [local_boxes(param, r) for r in range(2)] == [
        [((0, 0), (10, 6))],
        [((10, 0), (7, 6))],
    ]
    # 2 x 2 tiles do not join across a row: one chunk per tile
    layout = plan_bucket([("w", (4, 4), BlockShard((2, 2)))], 1)
    assert len(local_boxes(layout.params[0], 0)) == 4


def test_region_tensor_speaks_dcp():
    layout = plan_bucket([("w", (17, 6), BlockShard((5, 6)))], 2)
    local = torch.arange(42.0)
    chunks = region_tensor(layout.params[0], 1, local, writer=True)
    assert isinstance(chunks, RegionTensor) and chunks.shape == (17, 6)
    (item,) = chunks.__create_write_items__("w", chunks)
    assert tuple(item.index.offset) == (10, 0) and tuple(item.tensor_data.chunk.sizes) == (7, 6)
    assert tuple(item.tensor_data.size) == (17, 6)
    assert [tuple(c.offsets) for c in chunks.__create_chunk_list__()] == [(10, 0)]
    assert torch.equal(chunks.__get_tensor_shard__(item.index), local.view(7, 6))
    assert torch.equal(chunks.local(), local)
    # a replica that does not write still reads its chunks
    reader = region_tensor(layout.params[0], 1, local, writer=False)
    assert reader.__create_write_items__("w", reader) == []
    assert len(reader.__create_chunk_list__()) == 1
    fresh = chunks.fresh()
    assert torch.equal(fresh.local(), torch.zeros(42)) and torch.equal(chunks.local(), local)
