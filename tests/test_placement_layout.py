"""Property tests for flexshard.placements: balance, layout sanity, and errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexshard.placements import (
    BlockShard,
    FlatShard,
    Owned,
    Placement,
    Region,
    Replicate,
    Shard,
    chunk_bounds,
    gathered_alias,
    lpt_owners,
    plan_bucket,
    tile_grid,
)
from flexshard.placements.base import contiguous_cuts

from .placement_cases import (
    ALL_BUCKETS,
    CHEAP,
    PROPERTY,
    SHARDED_KINDS,
    blocks,
    box_key,
    buckets,
    distinct_fulls,
    gather,
    shapes,
    storage_use,
    world_sizes,
)

# ---------------------------------------------------------------------------------------
# 4. balance
# ---------------------------------------------------------------------------------------


@PROPERTY
@given(buckets(("owned",), max_params=8))
def test_owned_balance_numel(bucket):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    numels = [math.prod(shape) for _, shape, _ in entries]
    total = sum(numels)
    pinned_ranks = {p.rank for _, _, p in entries if p.rank is not None}
    free = [n for n, (_, _, p) in zip(numels, entries) if p.rank is None]
    largest_free = max(free, default=0)
    for param, (_, _, placement) in zip(layout.params, entries):
        holders = [r for r in range(world_size) if param.regions[r]]
        assert len(holders) == 1  # whole, on exactly one rank
        (owner,) = holders
        assert param.regions[owner] == (Region(tuple(0 for _ in param.shape), param.shape),)
        if placement.rank is not None:
            assert owner == placement.rank
    free_holders = {
        r
        for param, (_, _, p) in zip(layout.params, entries)
        if p.rank is None
        for r in range(world_size)
        if param.regions[r]
    }
    for rank in range(world_size):
        load = layout.rank_numel(rank)
        assert layout.shard_numel >= load
        if rank not in pinned_ranks or rank in free_holders:
            # LPT: max load <= mean + largest item (only free items can be moved)
            assert load * world_size <= total + world_size * largest_free
        else:  # a rank LPT gave nothing holds exactly what was pinned to it
            pinned_here = [n for n, (_, _, p) in zip(numels, entries) if p.rank == rank]
            assert load == sum(pinned_here)
    assert layout.shard_numel == max(layout.rank_numel(r) for r in range(world_size))


@CHEAP
@given(
    st.lists(st.integers(0, 1000), max_size=20),
    world_sizes,
    st.data(),
)
def test_lpt_owners_bound_and_determinism(costs, world_size, data):
    pinned = data.draw(
        st.lists(st.one_of(st.none(), st.integers(0, world_size - 1)), max_size=len(costs))
    )
    loads = data.draw(
        st.one_of(
            st.just(()),
            st.lists(st.integers(0, 500), min_size=world_size, max_size=world_size),
        )
    )
    owners = lpt_owners(costs, world_size, pinned, loads)
    assert owners == lpt_owners(list(costs), world_size, list(pinned), list(loads))
    assert len(owners) == len(costs)
    assert all(0 <= o < world_size for o in owners)
    pins = list(pinned) + [None] * (len(costs) - len(pinned))
    for owner, pin in zip(owners, pins):
        if pin is not None:
            assert owner == pin
    final = list(loads) or [0] * world_size
    for cost, owner in zip(costs, owners):
        final[owner] += cost
    free_costs = [c for c, p in zip(costs, pins) if p is None]
    largest = max(free_costs, default=0)
    total = sum(final)
    for rank in range(world_size):
        if any(o == rank and p is None for o, p in zip(owners, pins)):
            assert final[rank] * world_size <= total + world_size * largest


def test_lpt_owners_tie_breaks():
    # equal costs: largest first by index, to the lowest rank of equal load
    assert lpt_owners([1, 1, 1, 1], 2) == [0, 1, 0, 1]
    assert lpt_owners([1, 5, 3], 3) == [2, 0, 1]
    assert lpt_owners([4, 4], 2, pinned=[None, 0]) == [1, 0]
    assert lpt_owners([2, 2], 2, loads=[10, 0]) == [1, 1]


@CHEAP
@given(st.lists(st.integers(0, 100), max_size=16), world_sizes, st.data())
def test_lpt_owners_first_rank_rotates_ties(costs, world_size, data):
    """Shifting first_rank by k is the same assignment with every rank shifted by k."""
    k = data.draw(st.integers(0, world_size - 1))
    pinned = data.draw(
        st.lists(st.one_of(st.none(), st.integers(0, world_size - 1)), max_size=len(costs))
    )
    loads = data.draw(st.lists(st.integers(0, 50), min_size=world_size, max_size=world_size))

    def rot(rank):
        return (rank + k) % world_size

    base = lpt_owners(costs, world_size, pinned, loads)
    rotated_loads = [0] * world_size
    for rank, load in enumerate(loads):
        rotated_loads[rot(rank)] = load
    rotated_pins = [None if p is None else rot(p) for p in pinned]
    shifted = lpt_owners(costs, world_size, rotated_pins, rotated_loads, first_rank=k)
    assert shifted == [rot(o) for o in base]
    # with nothing loaded, the largest item goes to first_rank
    if costs:
        owners = lpt_owners(costs, world_size, first_rank=k)
        largest = min(range(len(costs)), key=lambda i: (-costs[i], i))
        assert owners[largest] == k


@PROPERTY
@given(buckets(("block",), max_params=5))
def test_block_balance(bucket):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    tiles = [t for _, shape, p in entries for t in tile_grid(shape, p.block)]
    total = sum(t.numel for t in tiles)
    largest = max((t.numel for t in tiles), default=0)
    for rank in range(world_size):
        assert layout.rank_numel(rank) * world_size <= total + world_size * largest
    assert layout.shard_numel == max(layout.rank_numel(r) for r in range(world_size))


@PROPERTY
@given(buckets(("flat",), max_params=5))
def test_flat_balance(bucket):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    total = sum(math.prod(shape) for _, shape, _ in entries)
    per_rank = -(-total // world_size)
    numels = [layout.rank_numel(r) for r in range(world_size)]
    assert all(n <= per_rank for n in numels)
    assert sum(numels) == total
    # FSDP1: ranks fill in order, only the tail is short
    assert layout.shard_numel == per_rank
    for rank in range(world_size):
        expected = min(per_rank, max(0, total - rank * per_rank))
        assert numels[rank] == expected
    # the bucket, concatenated in order, is the gathered buffer read flat
    fulls = distinct_fulls(entries)
    gathered = gather(layout, fulls, torch.float64)
    flat = torch.cat([f.reshape(-1) for f in fulls]) if fulls else torch.zeros(0)
    assert torch.equal(gathered.reshape(-1)[:total], flat)


@PROPERTY
@given(buckets(("shard",), max_params=4))
def test_shard_matches_torch_chunk(bucket):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    fulls = distinct_fulls(entries)
    for index, (param, full, (_, shape, placement)) in enumerate(
        zip(layout.params, fulls, entries)
    ):
        dim = placement.dim % len(shape)
        chunks = torch.chunk(full, world_size, dim=dim)
        assert len(chunks) <= world_size
        slot = max(param.local_numel(r) for r in range(world_size))
        for rank in range(world_size):
            (region,) = param.regions[rank]
            assert not region.flat
            if rank < len(chunks):
                assert region.sizes == tuple(chunks[rank].shape)
                assert torch.equal(region.view_of(full), chunks[rank])
            else:
                assert region.sizes[dim] == 0
            assert param.local_shape(rank) == region.sizes
            # uniform slots: FSDP2 pads every rank to the largest chunk
            if index + 1 < len(layout.params):
                assert layout.params[index + 1].offsets[rank] - param.offsets[rank] == slot
            else:
                assert layout.shard_numel - param.offsets[rank] == slot


@CHEAP
@given(st.integers(0, 60), world_sizes)
def test_chunk_bounds_matches_torch_chunk(size, world_size):
    bounds = chunk_bounds(size, world_size)
    assert len(bounds) == world_size
    chunks = torch.chunk(torch.arange(size), world_size)
    for rank, (start, length) in enumerate(bounds):
        assert 0 <= start <= size and length >= 0 and start + length <= size
        if rank < len(chunks):
            assert torch.equal(torch.arange(size)[start : start + length], chunks[rank])
        else:
            assert length == 0
    assert sum(length for _, length in bounds) == size


@CHEAP
@given(st.lists(st.integers(0, 50), max_size=30), world_sizes)
def test_contiguous_cuts_bound(loads, world_size):
    cuts = contiguous_cuts(loads, world_size)
    assert len(cuts) == world_size + 1
    assert cuts[0] == 0 and cuts[-1] == len(loads)
    assert all(a <= b for a, b in itertools.pairwise(cuts))
    total, largest = sum(loads), max(loads, default=0)
    for a, b in itertools.pairwise(cuts):
        assert sum(loads[a:b]) * world_size <= total + world_size * largest
    # each cut is an item boundary nearest k * total / W (exact: scaled by W)
    prefix = list(itertools.accumulate(loads, initial=0))
    for k in range(1, world_size):
        best = min(abs(p * world_size - k * total) for p in prefix)
        assert abs(prefix[cuts[k]] * world_size - k * total) == best


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
