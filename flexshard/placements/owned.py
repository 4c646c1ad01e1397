"""Owned(rank=None): each parameter whole on one rank, owners balanced by LPT."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .base import Placement, Region, Shape, check_world_size, whole


def numel_cost(shape: Shape) -> float:
    return float(math.prod(shape))


def lpt_owners(
    costs: Sequence[float],
    world_size: int,
    pinned: Sequence[int | None] = (),
    loads: Sequence[float] = (),
    first_rank: int = 0,
) -> list[int]:
    """Longest-processing-time assignment: largest item first to the least-loaded rank.

    Deterministic: ties break by item index, then by lowest rank. Pinned items keep
    their rank and count toward its load before the free items are placed; ``loads``
    are what each rank carries already.
    """
    check_world_size(world_size)
    pinned = list(pinned) + [None] * (len(costs) - len(pinned))
    loads = [float(x) for x in loads] or [0.0] * world_size
    owners: list[int] = [-1] * len(costs)
    for i, rank in enumerate(pinned):
        if rank is not None:
            owners[i] = rank
            loads[rank] += costs[i]

    def tie(rank: int) -> int:
        return (rank - first_rank) % world_size

    heap = [(load, tie(rank), rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    free = sorted((i for i, r in enumerate(pinned) if r is None), key=lambda i: (-costs[i], i))
    for i in free:
        load, _, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + costs[i], tie(rank), rank))
    return owners


@dataclass(frozen=True)
class Owned(Placement):
    """The whole parameter lives on ``rank`` (or on the rank LPT picks by ``cost``)."""

    rank: int | None = None
    cost: Callable[[Shape], float] = field(default=numel_cost, compare=False, repr=False)

    stage = 1

    def __post_init__(self) -> None:
        rank = self.rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
            raise TypeError(f"Owned(rank): rank must be an int or None, got {rank!r}")
        if not callable(self.cost):
            raise TypeError(f"Owned(cost): cost must be callable, got {self.cost!r}")

    def group_key(self) -> object:
        return Owned

    def validate(self, fqn: str, shape: Shape, world_size: int) -> None:
        if self.rank is not None and not 0 <= self.rank < world_size:
            raise ValueError(
                f"Owned(rank={self.rank}) for parameter '{fqn}' is outside the shard "
                f"group of size {world_size}"
            )

    def assign(
        self,
        members: Sequence[tuple[Placement, Shape]],
        world_size: int,
        loads: Sequence[int] = (),
        first_rank: int = 0,
    ) -> list[list[list[Region]]]:
        pins = [p.rank for p, _ in members]  # type: ignore[attr-defined]
        costs = [p.cost(shape) for p, shape in members]  # type: ignore[attr-defined]
        # balance against what the bucket's other placements already put on each rank,
        # in their units (numel) only when the cost is numel too
        base = loads if all(p.cost is numel_cost for p, _ in members) else ()  # type: ignore[attr-defined]
        owners = lpt_owners(costs, world_size, pins, base, first_rank)
        return [
            [[whole(shape)] if rank == owner else [] for rank in range(world_size)]
            for (_, shape), owner in zip(members, owners)
        ]
