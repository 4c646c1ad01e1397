"""FlatShard(): FSDP1 semantics, the bucket flattened and split into W equal ranges."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .base import Placement, Region, Shape, check_world_size


@dataclass(frozen=True)
class FlatShard(Placement):
    """The bucket's FlatShard parameters, concatenated in bucket order and split into
    W ranges of ``ceil(total / W)`` elements; a parameter may straddle ranks."""

    def group_key(self) -> object:
        return FlatShard

    def assign(
        self,
        members: Sequence[tuple[Placement, Shape]],
        world_size: int,
        loads: Sequence[int] = (),
        first_rank: int = 0,
    ) -> list[list[list[Region]]]:
        check_world_size(world_size)
        numels = [math.prod(shape) for _, shape in members]
        per_rank = -(-sum(numels) // world_size)
        out = []
        start = 0  # the parameter's first element in the flat bucket
        for numel in numels:
            regions: list[list[Region]] = []
            for rank in range(world_size):
                lo = max(rank * per_rank, start)
                hi = min((rank + 1) * per_rank, start + numel)
                regions.append([Region((lo - start,), (hi - lo,), flat=True)] if hi > lo else [])
            out.append(regions)
            start += numel
        return out
