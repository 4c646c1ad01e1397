"""Bucket layout: where every region of every parameter sits in each rank's storage."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .base import Placement, Region, Replicate, Shape, check_world_size


@dataclass(frozen=True)
class CopyBlock:
    """Storage elements that map to one strided view of the full parameter: a region,
    or a ``rows x cols`` grid of equal tiles stored tile after tile."""

    offset: int  # first element in the rank's storage
    region: Region  # the region, or the grid's first tile
    grid: tuple[int, int] = (1, 1)

    @property
    def numel(self) -> int:
        return self.region.numel * self.grid[0] * self.grid[1]


def _continues_grid(first: Region, region: Region, row: int, col: int) -> bool:
    """``region`` is tile (row, col) of a grid of tiles the size of ``first``."""
    rows, cols = first.sizes[-2:]
    return (
        not region.flat
        and region.sizes == first.sizes
        and region.offsets[:-2] == first.offsets[:-2]
        and region.offsets[-2] == first.offsets[-2] + row * rows
        and region.offsets[-1] == first.offsets[-1] + col * cols
    )


def merge_regions(regions: Sequence[Region], offset: int) -> list[CopyBlock]:
    """Group consecutive equal tiles into grids, so BlockShard copies a block of whole
    tile rows at once instead of one tile at a time."""
    blocks = []
    i = 0
    while i < len(regions):
        first = regions[i]
        cols = rows = 1
        if not first.flat and len(first.sizes) >= 2 and all(s == 1 for s in first.sizes[:-2]):
            while i + cols < len(regions) and _continues_grid(first, regions[i + cols], 0, cols):
                cols += 1
            while i + (rows + 1) * cols <= len(regions) and all(
                _continues_grid(first, regions[i + rows * cols + c], rows, c) for c in range(cols)
            ):
                rows += 1
        block = CopyBlock(offset, first, (rows, cols))
        blocks.append(block)
        offset += block.numel
        i += rows * cols
    return blocks


@dataclass(frozen=True)
class ParamLayout:
    fqn: str
    shape: Shape
    regions: tuple[tuple[Region, ...], ...]  # per rank, in storage order
    offsets: tuple[int, ...]  # per rank: first element of this parameter in its storage

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, rank: int) -> int:
        return self._local_numels[rank]

    @cached_property
    def _local_numels(self) -> tuple[int, ...]:
        # read per parameter at every gather and reduction: summed once
        return tuple(sum(region.numel for region in regions) for regions in self.regions)

    @cached_property
    def copy_blocks(self) -> tuple[tuple[CopyBlock, ...], ...]:
        """Per rank, the copies that move this parameter in or out of its storage."""
        return tuple(
            tuple(merge_regions(regions, offset))
            for regions, offset in zip(self.regions, self.offsets)
        )

    def local_shape(self, rank: int) -> Shape:
        """Shaped like the region when a rank holds one box, flat otherwise."""
        return self._local_shapes[rank]

    @cached_property
    def _local_shapes(self) -> tuple[Shape, ...]:
        return tuple(
            regions[0].sizes if len(regions) == 1 and not regions[0].flat else (numel,)
            for regions, numel in zip(self.regions, self._local_numels)
        )


@dataclass(frozen=True)
class BucketLayout:
    params: tuple[ParamLayout, ...]
    world_size: int
    shard_numel: int  # every rank's storage, padded to the largest rank
    replicated: bool  # Replicate bucket: all-reduce instead of all-gather/reduce-scatter
    #: each rank stores and sends only its own elements (``extents``): collectives of
    #: per-rank sizes instead of W padded shards, for Owned/BlockShard buckets whose
    #: ranks hold unequal shares (a per-block bucket of whole matrices at W > matrices)
    ragged: bool = False
    #: per rank, the elements of its storage (padding of Shard slots included); empty:
    #: ``shard_numel`` on every rank
    extents: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def dense(self) -> bool:
        """No padding: every storage element of every rank holds a parameter element."""
        return self.replicated or self.world_size * self.shard_numel == self.numel

    def rank_numel(self, rank: int) -> int:
        return sum(p.local_numel(rank) for p in self.params)

    def extent(self, rank: int) -> int:
        """Elements of ``rank``'s storage buffer: its own extent when ragged, else the
        padded shard every rank keeps."""
        return self.extents[rank] if self.ragged else self.shard_numel

    @property
    def wire_numel(self) -> int:
        """Elements of the gathered buffer (and of the reduce-scatter input): the
        ranks' extents summed when ragged, else W padded shards."""
        if self.ragged:
            return sum(self.extents)
        return self.world_size * self.shard_numel

    @cached_property
    def chunked_rows(self) -> bool:
        """Each rank's storage is its dim-0 chunk (``ceil(size[0] / W)`` rows) of every
        parameter, zero-padded, back to back: FSDP2's layout, which ``torch._chunk_cat``
        writes into all ranks' rows at once."""
        if self.replicated or self.ragged:
            return False
        end = 0
        for param in self.params:
            if not param.shape or param.numel == 0:
                return False
            rows = param.shape[0]
            chunk = -(-rows // self.world_size)
            row_numel = param.numel // rows
            for rank, blocks in enumerate(param.copy_blocks):
                held = max(0, min(chunk, rows - rank * chunk))
                expected = (
                    (
                        Region(
                            (rank * chunk,) + (0,) * (len(param.shape) - 1),
                            (held, *param.shape[1:]),
                        ),
                    )
                    if held
                    else ()
                )
                if param.offsets[rank] != end or tuple(b.region for b in blocks) != expected:
                    return False
                if any(b.grid != (1, 1) or b.offset != end for b in blocks):
                    return False
            end += chunk * row_numel
        return end == self.shard_numel

    @cached_property
    def rank_starts(self) -> tuple[int, ...]:
        """Where each rank's storage begins in the gathered buffer."""
        starts, at = [], 0
        for rank in range(self.world_size):
            starts.append(at)
            at += self.extent(rank)
        return tuple(starts)


def _slots(placement: Placement, per_rank: Sequence[Sequence[Region]]) -> list[int]:
    """Elements a parameter reserves in each rank's storage."""
    numels = [sum(r.numel for r in regions) for regions in per_rank]
    return [max(numels)] * len(numels) if placement.uniform_slots else numels


def plan_bucket(
    entries: Sequence[tuple[str, Shape, Placement]],
    world_size: int,
    bucket: str = "bucket",
    first_rank: int = 0,
    ragged: bool = False,
) -> BucketLayout:
    """Assign every parameter's regions to ranks and lay them out in flat storage.

    Parameters keep bucket order in storage. Placements with ``uniform_slots`` (Shard)
    reserve the largest rank's slice on every rank, as FSDP2 pads each parameter;
    the others pack tightly and the bucket pads once at the end, unless ``ragged``:
    then each rank keeps and moves its own extent only.
    """
    check_world_size(world_size)
    kinds = {isinstance(p, Replicate) for _, _, p in entries}
    if len(kinds) > 1:
        fqn = next(f for f, _, p in entries if isinstance(p, Replicate))
        raise ValueError(
            f"bucket '{bucket}': parameter '{fqn}' is Replicate but the bucket also holds "
            "sharded parameters; give Replicate parameters a bucket of their own"
        )
    for fqn, shape, placement in entries:
        if not isinstance(placement, Placement):
            raise TypeError(
                f"bucket '{bucket}': placement for parameter '{fqn}' must be a flexshard "
                f"Placement, got {placement!r}"
            )
        try:
            placement.validate(fqn, tuple(shape), world_size)
        except ValueError as err:
            raise ValueError(f"bucket '{bucket}': {err}") from None

    groups: dict[object, list[int]] = {}
    for i, (_, _, placement) in enumerate(entries):
        groups.setdefault(placement.group_key(), []).append(i)
    regions: list[list[list[Region]]] = [[] for _ in entries]
    loads = [0] * world_size
    # Owned, then BlockShard, fill the ranks the fixed splits left light
    for indices in sorted(groups.values(), key=lambda ix: entries[ix[0]][2].stage):
        members = [(entries[i][2], tuple(entries[i][1])) for i in indices]
        assigned = members[0][0].assign(members, world_size, loads, first_rank)
        for i, per_rank in zip(indices, assigned):
            regions[i] = per_rank
            loads = [a + b for a, b in zip(loads, _slots(entries[i][2], per_rank))]

    cursors = [0] * world_size
    params = []
    for (fqn, shape, placement), per_rank in zip(entries, regions):
        slots = _slots(placement, per_rank)
        params.append(
            ParamLayout(
                fqn=fqn,
                shape=tuple(shape),
                regions=tuple(tuple(r) for r in per_rank),
                offsets=tuple(cursors),
            )
        )
        cursors = [c + s for c, s in zip(cursors, slots)]
    return BucketLayout(
        params=tuple(params),
        world_size=world_size,
        shard_numel=max(cursors, default=0),
        replicated=kinds == {True},
        ragged=ragged and kinds != {True},
        extents=tuple(cursors),
    )


def trainable_layout(
    layout: BucketLayout, trainable: Sequence[bool], uniform: Sequence[bool]
) -> BucketLayout:
    """The gradient layout of a bucket with frozen parameters: each trainable parameter
    keeps its regions, a frozen one holds nothing, so the reduce-scatter carries only
    trainable gradients (as FSDP2's does). ``uniform``: the parameter's placement pads
    every rank to the largest slice (Shard)."""
    cursors = [0] * layout.world_size
    params = []
    for param, keep, pad in zip(layout.params, trainable, uniform):
        regions = param.regions if keep else tuple(() for _ in param.regions)
        numels = [sum(r.numel for r in rank) for rank in regions]
        slots = [max(numels)] * len(numels) if pad else numels
        params.append(ParamLayout(param.fqn, param.shape, regions, tuple(cursors)))
        cursors = [c + s for c, s in zip(cursors, slots)]
    return BucketLayout(
        params=tuple(params),
        world_size=layout.world_size,
        shard_numel=max(cursors, default=0),
        replicated=layout.replicated,
        ragged=layout.ragged,
        extents=tuple(cursors),
    )
