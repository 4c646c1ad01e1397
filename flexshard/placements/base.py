"""Regions and the placement protocol: pure layout math, no process group.

Replicate(): DDP semantics, every rank stores all of it; gradients are all-reduced."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Region:
    """A piece of a parameter that one rank stores, kept contiguous in row-major order.

    A box of the parameter (``offsets``/``sizes`` per dim) or, when ``flat``, a range
    ``[offsets[0], offsets[0] + sizes[0])`` of the parameter flattened in row-major order.
    """

    offsets: Shape
    sizes: Shape
    flat: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def view_of(self, full: torch.Tensor) -> torch.Tensor:
        """The elements of ``full`` this region covers (a view, possibly non-contiguous)."""
        if self.flat:
            return full.reshape(-1)[self.offsets[0] : self.offsets[0] + self.sizes[0]]
        index = tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))
        return full[index]


def whole(shape: Shape) -> Region:
    return Region(tuple(0 for _ in shape), tuple(shape))


class Placement:
    """How one parameter is split across the W ranks of a bucket's shard group.

    ``assign`` receives every parameter of a bucket that shares this placement's
    ``group_key`` (so Owned can balance across them and FlatShard can flatten them
    together) and returns, per parameter, per rank, the regions that rank stores.
    """

    #: placements whose per-param slots are padded to the same size on every rank, so
    #: a bucket of them lays out gradients exactly as torch FSDP2 does
    uniform_slots: bool = False
    #: planning order within a bucket: later stages see the loads of earlier ones and
    #: can fill the lighter ranks (fixed splits 0, Owned 1, BlockShard 2)
    stage: int = 0
    #: the runtime collective that moves a bucket of this placement, by name (see
    #: flexshard.runtime.strategies; a new placement registers its own there)
    collective: str = "sharded"

    def group_key(self) -> object:
        return self

    def validate(self, fqn: str, shape: Shape, world_size: int) -> None:
        """Raise ValueError naming ``fqn`` when this placement cannot hold ``shape``."""

    def assign(
        self,
        members: Sequence[tuple[Placement, Shape]],
        world_size: int,
        loads: Sequence[int],
        first_rank: int = 0,
    ) -> list[list[list[Region]]]:
        """``loads``: elements each rank already stores for the bucket's other groups
        (Owned balances against them; the contiguous placements ignore them).
        ``first_rank``: where ties between equally loaded ranks start, so that buckets
        planned one after another do not all put their largest item on rank 0."""
        raise NotImplementedError


def check_world_size(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")


def fill_levels(base: Sequence[float], total: float) -> list[float]:
    """How much of ``total`` each rank takes so that ranks end as level as possible
    (water-filling over what they already carry in ``base``)."""
    order = sorted(range(len(base)), key=lambda r: base[r])
    level = 0.0
    below = 0.0  # running sum of the j lightest ranks' base: O(W log W), not O(W^2)
    for j in range(1, len(base) + 1):
        below += base[order[j - 1]]
        level = (total + below) / j
        if j == len(base) or level <= base[order[j]]:
            break
    return [max(0.0, level - b) for b in base]


def contiguous_cuts(loads: Sequence[int], world_size: int, base: Sequence[float] = ()) -> list[int]:
    """Cut a sequence of item loads into ``world_size`` contiguous runs of near-equal load.

    Returns ``world_size + 1`` boundaries. Each cut goes to the item boundary nearest
    its target, so every run is within ``max(loads)`` of its share: ``total / W`` when
    ``base`` is empty, else the share that levels the ranks out over ``base``.
    """
    prefix = [0]
    for load in loads:
        prefix.append(prefix[-1] + load)
    total = prefix[-1]
    shares = fill_levels(base, total) if base else [total / world_size] * world_size
    cuts = [0]
    target = 0.0
    for k in range(1, world_size):
        target += shares[k - 1]
        i = cuts[-1]
        while i < len(loads) and prefix[i + 1] <= target:
            i += 1
        # i is the first item whose end passes the target: cut before or after it
        if i < len(loads) and prefix[i + 1] - target < target - prefix[i]:
            i += 1
        cuts.append(max(i, cuts[-1]))
    cuts.append(len(loads))
    return cuts


@dataclass(frozen=True)
class Replicate(Placement):
    collective: ClassVar[str] = "replicated"  # nothing to gather, gradients all-reduced

    def assign(
        self,
        members: Sequence[tuple[Placement, Shape]],
        world_size: int,
        loads: Sequence[int] = (),
        first_rank: int = 0,
    ) -> list[list[list[Region]]]:
        check_world_size(world_size)
        return [[[whole(shape)] for _ in range(world_size)] for _, shape in members]
