"""Hypothesis strategies and simulated collectives shared by the placement tests."""

from __future__ import annotations

import math

import torch
from hypothesis import settings
from hypothesis import strategies as st

from flexshard.placements import BlockShard, FlatShard, Owned, Region, Replicate, Shard
from flexshard.placements.packing import pack_rank

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
