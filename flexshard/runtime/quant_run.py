"""One run of the quantized all-gather's plan (runtime/quantized.py makes the plan,
runtime/quantized_compiled.py compiles a codec per plan): a leaf module, so the two
share the type without importing each other."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..placements.layout import CopyBlock


@dataclass(frozen=True)
class QuantRun:
    """Consecutive copy blocks of one rank with one tile shape: quantized as one batch
    of tiles (bit for bit as block by block: tiles are independent) and sent as one
    ``quant.pack`` buffer at byte ``start`` of the rank's payload."""

    offset: int  # in the rank's storage
    numel: int
    tile: tuple[int, ...]
    start: int
    members: tuple[tuple[int, CopyBlock], ...]  # (parameter index, block), in order

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.numel // math.prod(self.tile), *self.tile)

    def tiles(self, block: CopyBlock) -> slice:
        """Which of the run's tiles are ``block``'s."""
        size = math.prod(self.tile)
        first = (block.offset - self.offset) // size
        return slice(first, first + block.numel // size)
