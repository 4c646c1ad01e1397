"""Bucket layout: where every region of every parameter sits in each rank's storage."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .base import Placement, Region, Shape, check_world_size
from .replicate import Replicate


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
        return sum(region.numel for region in self.regions[rank])

    def local_shape(self, rank: int) -> Shape:
        """Shaped like the region when a rank holds one box, flat otherwise."""
        regions = self.regions[rank]
        if len(regions) == 1 and not regions[0].flat:
            return regions[0].sizes
        return (self.local_numel(rank),)


@dataclass(frozen=True)
class BucketLayout:
    params: tuple[ParamLayout, ...]
    world_size: int
    shard_numel: int  # every rank's storage, padded to the largest rank
    replicated: bool  # Replicate bucket: all-reduce instead of all-gather/reduce-scatter

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def rank_numel(self, rank: int) -> int:
        return sum(p.local_numel(rank) for p in self.params)


def _slots(placement: Placement, per_rank: Sequence[Sequence[Region]]) -> list[int]:
    """Elements a parameter reserves in each rank's storage."""
    numels = [sum(r.numel for r in regions) for regions in per_rank]
    return [max(numels)] * len(numels) if placement.uniform_slots else numels


def plan_bucket(
    entries: Sequence[tuple[str, Shape, Placement]],
    world_size: int,
    bucket: str = "bucket",
    first_rank: int = 0,
) -> BucketLayout:
    """Assign every parameter's regions to ranks and lay them out in flat storage.

    Parameters keep bucket order in storage. Placements with ``uniform_slots`` (Shard)
    reserve the largest rank's slice on every rank, as FSDP2 pads each parameter;
    the others pack tightly and the bucket pads once at the end.
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
    # Owned goes last so that it can fill the ranks the other placements left light
    for indices in sorted(groups.values(), key=lambda ix: entries[ix[0]][2].balances_loads):
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
    )
