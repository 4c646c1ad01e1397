"""Replicate(): DDP semantics, every rank stores all of it; gradients are all-reduced."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from .base import Placement, Region, Shape, check_world_size, whole


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
