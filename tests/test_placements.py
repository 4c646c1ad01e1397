"""Property tests for flexshard.placements: pure layout math, simulated on CPU.

Every collective is simulated on one process: an all-gather is the [W, S] buffer whose
row r is rank r's storage, a reduce-scatter is the sum of W such buffers.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
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
    pack_all,
    pack_rank,
    plan_bucket,
    tile_grid,
    unpack,
)
from flexshard.placements.base import contiguous_cuts
from flexshard.placements.bytes import ALIGN, as_bytes, byte_view

PROPERTY = settings(max_examples=80, deadline=None)
CHEAP = settings(max_examples=200, deadline=None)

# ---------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------

# sizes that hit the edge cases: empty, one row, primes that never divide W, 17 rows
dim_sizes = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 8, 17]), st.integers(0, 12))
world_sizes = st.integers(1, 8)


def shapes(min_dims: int = 0, max_dims: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """Scalars, 1-D, 2-D and 3-D (expert-batch) shapes, kept small."""
    return (
        st.lists(dim_sizes, min_size=min_dims, max_size=max_dims)
        .map(tuple)
        .filter(lambda s: math.prod(s) <= 600)
    )


blocks = st.tuples(st.sampled_from([1, 2, 3, 4, 16, 128]), st.sampled_from([1, 2, 3, 5, 128]))


@st.composite
def shard_placements(draw, shape):
    ndim = len(shape)
    dim = draw(st.integers(-ndim, ndim - 1))
    return Shard(dim)


@st.composite
def placement_for(draw, shape, world_size, kinds):
    """A valid placement for ``shape`` drawn among ``kinds``."""
    choices = [k for k in kinds if not (k == "shard" and len(shape) == 0)]
    kind = draw(st.sampled_from(choices))
    if kind == "shard":
        return draw(shard_placements(shape))
    if kind == "flat":
        return FlatShard()
    if kind == "owned":
        return Owned(rank=draw(st.one_of(st.none(), st.integers(0, world_size - 1))))
    if kind == "block":
        return BlockShard(block=draw(blocks))
    if kind == "replicate":
        return Replicate()
    raise AssertionError(kind)


SHARDED_KINDS = ("shard", "flat", "owned", "block")


@st.composite
def buckets(draw, kinds=SHARDED_KINDS, max_params=5):
    """(entries, world_size, first_rank): a bucket whose placements are all drawn
    among ``kinds``."""
    world_size = draw(world_sizes)
    n = draw(st.integers(1, max_params))
    entries = []
    for i in range(n):
        # Shard cannot hold a scalar: a Shard-only bucket draws 1-D to 3-D shapes
        shape = draw(shapes(min_dims=1 if kinds == ("shard",) else 0))
        placement = draw(placement_for(shape, world_size, kinds))
        entries.append((f"layer{i}.weight", shape, placement))
    # the rank where LPT starts breaking ties between equally loaded ranks
    first_rank = draw(st.integers(0, world_size - 1))
    return entries, world_size, first_rank


# one strategy per placement alone, mixed buckets, and Replicate alone
ALL_BUCKETS = st.one_of(
    buckets(("shard",)),
    buckets(("flat",)),
    buckets(("owned",)),
    buckets(("block",)),
    buckets(("replicate",)),
    buckets(SHARDED_KINDS, max_params=6),
)

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def distinct_fulls(entries, dtype=torch.float64):
    """Full tensors whose elements are distinct across the whole bucket."""
    fulls, start = [], 1
    for _, shape, _ in entries:
        numel = math.prod(shape)
        fulls.append(torch.arange(start, start + numel, dtype=dtype).reshape(shape))
        start += numel
    return fulls


def random_fulls(entries, generator):
    return [
        torch.randint(-1000, 1000, shape, generator=generator, dtype=torch.int64)
        for _, shape, _ in entries
    ]


def coverage(param, rank: int) -> torch.Tensor:
    """How many times ``rank``'s regions cover each element of the parameter."""
    count = torch.zeros(param.shape, dtype=torch.int64)
    for region in param.regions[rank]:
        region.view_of(count).add_(1)
    return count


def storage_use(layout, rank: int) -> torch.Tensor:
    """How many regions of the bucket use each element of ``rank``'s storage."""
    use = torch.zeros(layout.shard_numel, dtype=torch.int64)
    for param in layout.params:
        offset = param.offsets[rank]
        for region in param.regions[rank]:
            use[offset : offset + region.numel] += 1
            offset += region.numel
    return use


def gather(layout, fulls, dtype) -> torch.Tensor:
    """Simulated all-gather: row r is rank r's storage, packed with pack_rank."""
    gathered = torch.zeros(layout.world_size, layout.shard_numel, dtype=dtype)
    for rank in range(layout.world_size):
        pack_rank(layout, rank, fulls, gathered[rank])
    return gathered


def box_key(region: Region) -> tuple:
    return (region.offsets, region.sizes, region.flat)


# ---------------------------------------------------------------------------------------
# 1. regions partition the tensor
# ---------------------------------------------------------------------------------------


@PROPERTY
@given(ALL_BUCKETS)
def test_regions_partition_every_parameter(bucket):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    assert layout.world_size == world_size
    assert [p.fqn for p in layout.params] == [fqn for fqn, _, _ in entries]
    assert [p.shape for p in layout.params] == [shape for _, shape, _ in entries]
    for param, (_, shape, placement) in zip(layout.params, entries):
        assert len(param.regions) == world_size
        assert len(param.offsets) == world_size
        for rank in range(world_size):
            for region in param.regions[rank]:
                if region.flat:
                    assert len(region.offsets) == len(region.sizes) == 1
                    assert 0 <= region.offsets[0]
                    assert region.offsets[0] + region.sizes[0] <= param.numel
                else:
                    assert len(region.offsets) == len(region.sizes) == len(shape)
                    for o, s, n in zip(region.offsets, region.sizes, shape):
                        assert 0 <= o and 0 <= s and o + s <= n
        if isinstance(placement, Replicate):
            for rank in range(world_size):
                assert torch.equal(coverage(param, rank), torch.ones(shape, dtype=torch.int64))
        else:
            total = sum(coverage(param, rank) for rank in range(world_size))
            assert torch.equal(total, torch.ones(shape, dtype=torch.int64))
            assert sum(param.local_numel(r) for r in range(world_size)) == param.numel


# ---------------------------------------------------------------------------------------
# 2. pack -> all-gather -> unpack is the identity
# ---------------------------------------------------------------------------------------


@PROPERTY
@given(ALL_BUCKETS)
def test_pack_gather_unpack_roundtrip(bucket):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    fulls = distinct_fulls(entries)
    gathered = gather(layout, fulls, torch.float64)

    # pack_all writes the same rows as pack_rank, and zeroes the padding
    packed = torch.full_like(gathered, float("nan"))
    pack_all(layout, fulls, packed)
    assert torch.equal(packed, gathered)

    outs = [torch.full(shape, float("nan"), dtype=torch.float64) for _, shape, _ in entries]
    unpack(layout, gathered, outs)
    for out, full in zip(outs, fulls):
        assert torch.equal(out, full)

    # None entries are skipped
    skipped = [None] * len(entries)
    unpack(layout, gathered, skipped)
    assert skipped == [None] * len(entries)

    for i, full in enumerate(fulls):
        alias = gathered_alias(layout, i, gathered)
        if alias is None:
            continue
        assert alias.shape == full.shape
        assert torch.equal(alias, full)
        # really a view into the gathered buffer
        assert alias.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()

    # the cases the docstring promises alias: FlatShard-only, Owned-only buckets, W = 1
    kinds = {type(p) for _, _, p in entries}
    promised = kinds in ({FlatShard}, {Owned}) or (world_size == 1 and not kinds & {BlockShard})
    if promised:
        for i, full in enumerate(fulls):
            if full.numel():
                assert gathered_alias(layout, i, gathered) is not None, entries[i]


@PROPERTY
@given(ALL_BUCKETS)
def test_unpack_with_aliases_skipped(bucket):
    """Params that alias the gathered buffer are passed as None; the rest still unpack."""
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    fulls = distinct_fulls(entries)
    gathered = gather(layout, fulls, torch.float64)
    aliases = [gathered_alias(layout, i, gathered) for i in range(len(entries))]
    outs = [
        None if alias is not None else torch.full(shape, float("nan"), dtype=torch.float64)
        for alias, (_, shape, _) in zip(aliases, entries)
    ]
    unpack(layout, gathered, outs)
    for alias, out, full in zip(aliases, outs, fulls):
        assert torch.equal(alias if alias is not None else out, full)


@PROPERTY
@given(ALL_BUCKETS)
def test_storage_holds_regions_in_order(bucket):
    """Independent reference for the storage layout: rank r's storage holds, for each
    parameter from its offset on, its regions one after another, each region's elements
    in row-major order (so a BlockShard tile is contiguous: tile-major storage)."""
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    fulls = distinct_fulls(entries)
    gathered = gather(layout, fulls, torch.float64)
    for rank in range(world_size):
        expected = torch.zeros(layout.shard_numel, dtype=torch.float64)
        for param, full in zip(layout.params, fulls):
            pieces = [region.view_of(full).reshape(-1) for region in param.regions[rank]]
            local = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
            offset = param.offsets[rank]
            expected[offset : offset + local.numel()] = local
        assert torch.equal(gathered[rank], expected)


@PROPERTY
@given(ALL_BUCKETS, st.data())
def test_pack_skips_none_entries(bucket, data):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    fulls = distinct_fulls(entries)
    keep = data.draw(st.lists(st.booleans(), min_size=len(entries), max_size=len(entries)))
    partial = [full if k else None for full, k in zip(fulls, keep)]
    zeros = [full if k else torch.zeros_like(full) for full, k in zip(fulls, keep)]
    out = torch.full((world_size, layout.shard_numel), float("nan"), dtype=torch.float64)
    pack_all(layout, partial, out)
    expected = torch.empty_like(out)
    pack_all(layout, zeros, expected)
    assert torch.equal(out, expected)


def strided(full: torch.Tensor) -> torch.Tensor:
    """The same values with column-major strides (non-contiguous for 2-D and up)."""
    return full.mT.contiguous().mT if full.dim() >= 2 else full


@PROPERTY
@given(ALL_BUCKETS)
def test_pack_unpack_strided_tensors(bucket):
    """Parameters and gradients need not be contiguous (transposed weights)."""
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    fulls = distinct_fulls(entries)
    gathered = gather(layout, fulls, torch.float64)
    assert torch.equal(gather(layout, [strided(f) for f in fulls], torch.float64), gathered)
    outs = [strided(torch.full(f.shape, float("nan"), dtype=torch.float64)) for f in fulls]
    unpack(layout, gathered, outs)
    for out, full in zip(outs, fulls):
        assert torch.equal(out, full)


# ---------------------------------------------------------------------------------------
# 3. reduce-scatter restricted to a rank is the sum over ranks of that region
# ---------------------------------------------------------------------------------------


@PROPERTY
@given(ALL_BUCKETS, st.integers(0, 2**31 - 1))
def test_reduce_scatter_is_sum_of_regions(bucket, seed):
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    generator = torch.Generator().manual_seed(seed)
    S = layout.shard_numel

    # each simulated rank has its own full gradients, packed into a [W, S] buffer
    per_rank_grads = [random_fulls(entries, generator) for _ in range(world_size)]
    buffers = []
    for grads in per_rank_grads:
        buffer = torch.full((world_size, S), 12345, dtype=torch.int64)
        pack_all(layout, grads, buffer)
        buffers.append(buffer)
    reduced = torch.stack(buffers).sum(0)

    summed = [torch.stack(gs).sum(0) for gs in zip(*per_rank_grads)]
    for rank in range(world_size):
        expected = torch.zeros(S, dtype=torch.int64)
        pack_rank(layout, rank, summed, expected)
        assert torch.equal(reduced[rank], expected)
        # padding (storage that no region uses) stays zero
        unused = storage_use(layout, rank) == 0
        assert torch.all(reduced[rank][unused] == 0)
        if layout.replicated:  # all-reduce: every rank holds the whole summed tensors
            out = [torch.zeros(shape, dtype=torch.int64) for _, shape, _ in entries]
            gathered_one = reduced[rank].expand(world_size, S)
            unpack(layout, gathered_one, out)
            for o, s in zip(out, summed):
                assert torch.equal(o, s)


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
    # no needless padding: the largest rank fills its storage
    assert S == max(
        (p.offsets[r] + p.local_numel(r) for p in layout.params for r in range(world_size)),
        default=0,
    ) or any(isinstance(p, Shard) for _, _, p in entries)
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


@PROPERTY
@given(buckets(SHARDED_KINDS, max_params=6))
def test_mixed_bucket_is_levelled_by_owned_and_blocks(bucket):
    """Owned, then BlockShard, plan after the fixed splits and fill the light ranks:
    the fullest rank holds at most the mean plus the largest Owned item or tile."""
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    loads = [layout.rank_numel(r) for r in range(world_size)]
    # storage each rank reserves (Shard pads its slot on every rank)
    reserved = [
        sum(
            max(p.local_numel(q) for q in range(world_size))
            if isinstance(e[2], Shard)
            else p.local_numel(r)
            for p, e in zip(layout.params, entries)
        )
        for r in range(world_size)
    ]
    assert max(reserved, default=0) == layout.shard_numel
    assert all(n <= s for n, s in zip(loads, reserved))
    if any(isinstance(p, Owned) and p.rank is not None for _, _, p in entries):
        return  # a pinned owner may unbalance the ranks at will
    items = [0]
    for _, shape, placement in entries:
        if isinstance(placement, Owned):
            items.append(math.prod(shape))
        elif isinstance(placement, BlockShard):
            items.extend(t.numel for t in tile_grid(shape, placement.block))
    uneven_fixed = any(isinstance(p, (Shard, FlatShard)) for _, _, p in entries)
    if not uneven_fixed:
        assert max(reserved) * world_size <= sum(reserved) + world_size * max(items)


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


# ---------------------------------------------------------------------------------------
# unpack into a strided tensor (flat regions are no views of it)
# ---------------------------------------------------------------------------------------


def test_unpack_into_non_contiguous_full():
    layout = plan_bucket([("w", (3, 4), FlatShard())], 2)
    full = torch.arange(12.0).reshape(3, 4)
    gathered = torch.zeros(2, layout.shard_numel)
    pack_all(layout, [full], gathered)
    out = torch.zeros(4, 3).t()  # a (3, 4) non-contiguous tensor
    unpack(layout, gathered, [out])
    assert torch.equal(out, full)


# ---------------------------------------------------------------------------------------
# buckets of several dtypes, packed as bytes
# ---------------------------------------------------------------------------------------

BYTE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.int16, torch.uint8)


@PROPERTY
@given(ALL_BUCKETS, st.data())
def test_bytes_layout_round_trips_every_dtype(bucket, data):
    """Each rank's bytes decode to exactly its elements, whatever the dtypes."""
    entries, world_size, first_rank = bucket
    layout = plan_bucket(entries, world_size, bucket="b", first_rank=first_rank)
    dtypes = [data.draw(st.sampled_from(BYTE_DTYPES)) for _ in entries]
    fulls = [f.to(d) for f, d in zip(distinct_fulls(entries), dtypes)]
    packed = as_bytes(layout, [f.element_size() for f in fulls])
    gathered = torch.zeros(world_size, packed.shard_numel, dtype=torch.uint8)
    for rank in range(world_size):
        pack_rank(packed, rank, [byte_view(f) for f in fulls], gathered[rank])
        for p, b, f in zip(layout.params, packed.params, fulls):
            assert b.offsets[rank] % ALIGN == 0
            assert b.local_numel(rank) == p.local_numel(rank) * f.element_size()
    outs = [torch.zeros_like(f) for f in fulls]
    unpack(packed, gathered, [byte_view(o) for o in outs])
    assert all(torch.equal(o, f) for o, f in zip(outs, fulls))
