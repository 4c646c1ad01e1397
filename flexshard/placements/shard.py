"""Shard(dim): torch FSDP2 semantics, ``ceil(size[dim] / W)`` slices per rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .base import Placement, Region, Shape, check_world_size


def chunk_bounds(size: int, world_size: int) -> list[tuple[int, int]]:
    """The (start, length) torch.chunk gives each rank; trailing ranks may get nothing."""
    check_world_size(world_size)
    per_rank = -(-size // world_size) if size else 0
    bounds = []
    for rank in range(world_size):
        start = min(rank * per_rank, size)
        bounds.append((start, min(per_rank, size - start)))
    return bounds


@dataclass(frozen=True)
class Shard(Placement):
    """Each rank stores a contiguous slice of dim ``dim`` (FSDP2's ``Shard(dim)``)."""

    dim: int = 0
    uniform_slots = True  # padded per parameter, like FSDP2, for bitwise parity

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim): dim must be an int, got {self.dim!r}")

    def validate(self, fqn: str, shape: Shape, world_size: int) -> None:
        if len(shape) == 0 or not -len(shape) <= self.dim < len(shape):
            raise ValueError(
                f"Shard({self.dim}) is out of range for parameter '{fqn}' of shape {tuple(shape)}"
            )

    def assign(
        self,
        members: Sequence[tuple[Placement, Shape]],
        world_size: int,
        loads: Sequence[int] = (),
        first_rank: int = 0,
    ) -> list[list[list[Region]]]:
        out = []
        for placement, shape in members:
            assert isinstance(placement, Shard)
            dim = placement.dim % len(shape)
            per_rank = []
            for start, length in chunk_bounds(shape[dim], world_size):
                offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
                sizes = tuple(length if d == dim else s for d, s in enumerate(shape))
                per_rank.append([Region(offsets, sizes)])
            out.append(per_rank)
        return out
