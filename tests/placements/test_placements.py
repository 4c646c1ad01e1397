"""Property tests for flexshard.placements: regions partition every parameter, and packing
round-trips through simulated collectives (one process: an all-gather is the [W, S] buffer
whose row r is rank r's storage, a reduce-scatter the sum of W such buffers)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from flexshard.placements import BlockShard, FlatShard, Owned, Replicate
from flexshard.placements.bytes import ALIGN, as_bytes, byte_view
from flexshard.placements.layout import plan_bucket
from flexshard.placements.packing import gathered_alias, pack_all, pack_rank, unpack

from ..helpers.placement_cases import (
    ALL_BUCKETS,
    PROPERTY,
    coverage,
    distinct_fulls,
    gather,
    random_fulls,
    storage_use,
)

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
