"""Property tests for flexshard.placements: layout sanity and errors (balance:
test_placement_balance.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given

from flexshard.placements import BlockShard, FlatShard, Owned, Placement, Replicate, Shard
from flexshard.placements.block import tile_grid
from flexshard.placements.layout import plan_bucket
from flexshard.placements.owned import lpt_owners
from flexshard.placements.packing import gathered_alias
from flexshard.placements.shard import chunk_bounds

from ..helpers.placement_cases import (
    ALL_BUCKETS,
    CHEAP,
    PROPERTY,
    SHARDED_KINDS,
    blocks,
    box_key,
    buckets,
    gather,
    shapes,
    storage_use,
)

# ---------------------------------------------------------------------------------------
# 5. layout sanity
# ---------------------------------------------------------------------------------------


@PROPERTY
@given(ALL_BUCKETS)
def test_layout_sanity(bucket):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    S = layout.shard_numel
    assert layout.replicated == all(isinstance(p, Replicate) for _, _, p in entries)
    for rank in range(world_size):
        for param in layout.params:
            assert 0 <= param.offsets[rank]
            assert param.offsets[rank] + param.local_numel(rank) <= S
            assert math.prod(param.local_shape(rank)) == param.local_numel(rank)
        # no two regions share storage
        assert bool(torch.all(storage_use(layout, rank) <= 1))
        assert layout.rank_numel(rank) <= S
    # storage keeps bucket order
    for rank in range(world_size):
        offsets = [p.offsets[rank] for p in layout.params]
        assert offsets == sorted(offsets)
    # no needless padding, Shard in the bucket or not: each parameter starts where the
    # previous one's slot ends (a Shard slot is its largest chunk on every rank, FSDP2's
    # padding; any other slot is exactly the rank's regions), and the storage is the
    # largest rank's slots, so the largest rank fills it
    slots = _slots(layout, entries)
    for rank in range(world_size):
        assert [p.offsets[rank] for p in layout.params] == list(
            itertools.accumulate((row[rank] for row in slots[:-1]), initial=0)
        )[: len(layout.params)]
    assert S == max((sum(row[r] for row in slots) for r in range(world_size)), default=0)
    # the plan is deterministic
    assert plan_bucket(entries, world_size, bucket="b", first_rank=first_rank) == layout


@PROPERTY
@given(buckets(("block",), max_params=5) | buckets(SHARDED_KINDS, max_params=6))
def test_block_regions_are_whole_contiguous_tiles(bucket):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    sequence = [
        (i, box_key(tile))
        for i, (_, shape, p) in enumerate(entries)
        if isinstance(p, BlockShard)
        for tile in tile_grid(shape, p.block)
    ]
    walked = []
    for rank in range(world_size):
        held = [
            (i, box_key(region))
            for i, (param, (_, _, p)) in enumerate(zip(layout.params, entries))
            if isinstance(p, BlockShard)
            for region in param.regions[rank]
        ]
        # each region is exactly a tile, and a rank's tiles are one contiguous run
        start = len(walked)
        assert held == sequence[start : start + len(held)]
        walked.extend(held)
    assert walked == sequence


@CHEAP
@given(shapes(), blocks)
def test_tile_grid_partitions(shape, block):
    tiles = tile_grid(shape, block)
    count = torch.zeros(shape, dtype=torch.int64)
    for tile in tiles:
        assert not tile.flat
        assert 0 < tile.numel
        # a tile's 2-D extent never exceeds the block
        if len(shape) >= 2:
            assert tile.sizes[-2] <= block[0] and tile.sizes[-1] <= block[1]
            assert all(s == 1 for s in tile.sizes[:-2])
            assert tile.offsets[-2] % block[0] == 0 and tile.offsets[-1] % block[1] == 0
        elif len(shape) == 1:
            assert tile.sizes[0] <= block[1] and tile.offsets[0] % block[1] == 0
        tile.view_of(count).add_(1)
    assert torch.equal(count, torch.ones(shape, dtype=torch.int64))
    assert tiles == sorted(tiles, key=lambda t: t.offsets)  # row-major tile order


def _slots(layout, entries) -> list[list[int]]:
    """Per parameter, per rank, the storage it reserves: a Shard slot is padded to the
    largest chunk on every rank (as FSDP2), any other slot is the rank's regions."""
    world_size = layout.world_size
    return [
        [max(p.local_numel(q) for q in range(world_size))] * world_size
        if isinstance(placement, Shard)
        else [p.local_numel(r) for r in range(world_size)]
        for p, (_, _, placement) in zip(layout.params, entries)
    ]


@PROPERTY
@given(buckets(SHARDED_KINDS, max_params=6))
def test_mixed_bucket_is_levelled_by_owned_and_blocks(bucket):
    """Owned, then BlockShard, plan after the fixed splits and fill the light ranks.

    The bound, derived for any mix: the fixed parts of a rank (its Shard slots, its
    FlatShard range, the Owned parameters pinned to it) are the user's to choose, and
    LPT (Owned) and the water-filling cuts (BlockShard) never raise a rank above the
    others' level by more than one movable item. So the fullest rank holds at most
    ``max(mean + largest movable item, largest fixed part)``, where the movable items
    are free Owned parameters and tiles. Without fixed parts this is the plain
    ``mean + largest item`` bound of LPT and of the cuts."""
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    loads = [layout.rank_numel(r) for r in range(world_size)]
    slots = _slots(layout, entries)
    reserved = [sum(row[r] for row in slots) for r in range(world_size)]
    assert max(reserved, default=0) == layout.shard_numel
    assert all(n <= s for n, s in zip(loads, reserved))
    assert max(reserved) * world_size <= _level_bound(layout, entries), reserved


def _level_bound(layout, entries) -> int:
    """W times the most a rank may hold: max(sum + W * largest movable item, W * the
    largest fixed part), in integers."""
    world_size = layout.world_size
    slots = _slots(layout, entries)
    fixed = [0] * world_size
    movable = [0]
    for row, (_, shape, placement) in zip(slots, entries):
        if isinstance(placement, (Shard, FlatShard)):
            fixed = [f + n for f, n in zip(fixed, row)]
        elif isinstance(placement, Owned) and placement.rank is not None:
            fixed[placement.rank] += math.prod(shape)
        elif isinstance(placement, Owned):
            movable.append(math.prod(shape))
        else:
            movable.extend(t.numel for t in tile_grid(shape, placement.block))
    total = sum(sum(row) for row in slots)
    return max(total + world_size * max(movable), world_size * max(fixed))


def test_mixed_bound_is_not_vacuous():
    """FlatShard [2, 1] and 8 elements pinned to rank 0 leave rank 0 heavy: both free
    Owned items must go to rank 1. A planner that ignored the fixed loads (one item per
    rank) would break the bound."""
    entries = [
        ("flat", (3,), FlatShard()),
        ("pinned", (8,), Owned(rank=0)),
        ("a", (4,), Owned()),
        ("b", (4,), Owned()),
    ]
    layout = plan_bucket(entries, 2)
    assert [next(r for r in range(2) if p.regions[r]) for p in layout.params[2:]] == [1, 1]
    assert [layout.rank_numel(r) for r in range(2)] == [10, 9]
    bound = _level_bound(layout, entries)
    assert 2 * 10 <= bound < 2 * (10 + 4)  # [14, 5], one item each, is out of bounds


def test_owned_custom_cost_balances_by_cost():
    # the cost, not the numel, decides: two cheap big params vs one costly small one
    costly = Owned(cost=lambda shape: 100.0)
    cheap = Owned(cost=lambda shape: 1.0)
    entries = [("a", (64, 64), cheap), ("b", (2,), costly), ("c", (64, 64), cheap)]
    layout = plan_bucket(entries, 2)
    owners = [next(r for r in range(2) if p.regions[r]) for p in layout.params]
    assert owners == [1, 0, 1]


def test_lpt_is_deterministic_across_calls():
    entries = [(f"p{i}", (i % 5 + 1, 3), Owned()) for i in range(12)]
    first = plan_bucket(entries, 4)
    for _ in range(3):
        assert plan_bucket(list(entries), 4) == first


def test_some_ranks_get_nothing():
    # 1-row param, W = 8: only rank 0 holds it, everywhere else it is empty
    layout = plan_bucket([("w", (1, 17), Shard(0))], 8)
    (param,) = layout.params
    assert param.local_numel(0) == 17
    assert all(param.local_numel(r) == 0 for r in range(1, 8))
    assert param.local_shape(3) == (0, 17)
    assert layout.shard_numel == 17
    full = torch.arange(17.0).reshape(1, 17)
    gathered = gather(layout, [full], torch.float64)
    assert torch.equal(gathered_alias(layout, 0, gathered), full)

    layout = plan_bucket([("w", (3,), FlatShard())], 8)
    assert [layout.rank_numel(r) for r in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]


def test_empty_bucket():
    layout = plan_bucket([], 4)
    assert layout.params == () and layout.shard_numel == 0 and not layout.replicated


# ---------------------------------------------------------------------------------------
# 6. errors
# ---------------------------------------------------------------------------------------


def test_shard_dim_out_of_range():
    with pytest.raises(ValueError, match=r"(?s)bucket 'blk3'.*'layers\.3\.w'"):
        plan_bucket([("layers.3.w", (4, 4), Shard(2))], 2, bucket="blk3")
    with pytest.raises(ValueError, match=r"(?s)bucket 'blk3'.*'layers\.3\.w'"):
        plan_bucket([("layers.3.w", (4, 4), Shard(-3))], 2, bucket="blk3")


def test_shard_scalar():
    with pytest.raises(ValueError, match=r"(?s)bucket 'norms'.*'scale'"):
        plan_bucket([("ok", (3,), Shard(0)), ("scale", (), Shard(0))], 2, bucket="norms")


@pytest.mark.parametrize("block", [(0, 4), (4, -1), (4,), (4, 4, 4), (2.0, 2)])
def test_block_shard_bad_block(block):
    with pytest.raises(ValueError, match="BlockShard"):
        BlockShard(block=block)


def test_replicate_mixed_with_shard():
    entries = [("w", (4, 4), Shard(0)), ("bias", (4,), Replicate())]
    with pytest.raises(ValueError, match=r"(?s)bucket 'mix'.*'bias'"):
        plan_bucket(entries, 2, bucket="mix")
    with pytest.raises(ValueError, match="'bias'"):
        plan_bucket(entries[::-1], 2, bucket="mix")


def test_owned_rank_out_of_range():
    with pytest.raises(ValueError, match=r"(?s)bucket 'own'.*'emb\.weight'"):
        plan_bucket([("emb.weight", (8, 4), Owned(rank=5))], 3, bucket="own")
    with pytest.raises(ValueError, match=r"'emb\.weight'"):
        plan_bucket([("emb.weight", (8, 4), Owned(rank=-1))], 3, bucket="own")
    plan_bucket([("emb.weight", (8, 4), Owned(rank=2))], 3, bucket="own")  # in range: fine


def test_not_a_placement():
    with pytest.raises(TypeError, match="'w'"):
        plan_bucket([("w", (4,), "shard")], 2, bucket="b")
    with pytest.raises(TypeError, match="'w'"):
        plan_bucket([("w", (4,), Shard)], 2, bucket="b")  # the class, not an instance


def test_bad_world_size():
    with pytest.raises(ValueError):
        plan_bucket([("w", (4,), FlatShard())], 0)
    with pytest.raises(ValueError):
        chunk_bounds(4, 0)
    with pytest.raises(ValueError):
        lpt_owners([1.0], 0)


def test_placement_is_abstract():
    with pytest.raises(NotImplementedError):
        Placement().assign([], 2, [0, 0])
