"""Property tests for flexshard.placements: balance (owners, blocks, flat and Shard
splits against torch.chunk, contiguous cuts)."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from flexshard.placements import Region
from flexshard.placements.base import contiguous_cuts
from flexshard.placements.block import tile_grid
from flexshard.placements.layout import plan_bucket
from flexshard.placements.owned import lpt_owners
from flexshard.placements.shard import chunk_bounds

from ..helpers.placement_cases import CHEAP, PROPERTY, buckets, distinct_fulls, gather, world_sizes

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
