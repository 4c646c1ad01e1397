"""BlockShard(block=(R, C)): whole 2-D tiles per rank, contiguous and balanced by bytes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .base import Placement, Region, Shape, contiguous_cuts, whole


def tile_grid(shape: Shape, block: tuple[int, int]) -> list[Region]:
    """The tiles of a parameter in row-major tile order.

    The last two dims are cut into ``block`` tiles (edge tiles may be partial); leading
    dims are a batch (e.g. experts), each index its own grid. A 1-D parameter is one
    row cut into ``block[1]``-wide tiles; a scalar is a single tile.
    """
    if len(shape) == 0:
        return [whole(shape)]
    rows_block, cols_block = block
    if len(shape) == 1:
        (cols,) = shape
        return [Region((c,), (min(cols_block, cols - c),)) for c in range(0, cols, cols_block)]
    *batch, rows, cols = shape
    tiles = []
    for index in itertools.product(*(range(b) for b in batch)):
        for r in range(0, rows, rows_block):
            for c in range(0, cols, cols_block):
                tiles.append(
                    Region(
                        (*index, r, c),
                        (*(1 for _ in index), min(rows_block, rows - r), min(cols_block, cols - c)),
                    )
                )
    return tiles


@dataclass(frozen=True)
class BlockShard(Placement):
    """Tiles never straddle ranks, so a rank can quantize its own tiles or run Muon on
    its own row blocks without talking to anyone. All BlockShard parameters of a
    bucket form one tile sequence (bucket order, then row-major tile order) that is
    cut into W contiguous runs balanced by bytes."""

    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        block = tuple(self.block)
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"BlockShard block must be two positive ints, got {self.block!r}")
        object.__setattr__(self, "block", block)

    stage = 2

    def group_key(self) -> object:
        return BlockShard

    def assign(
        self,
        members: Sequence[tuple[Placement, Shape]],
        world_size: int,
        loads: Sequence[int] = (),
        first_rank: int = 0,
    ) -> list[list[list[Region]]]:
        grids = [tile_grid(shape, p.block) for p, shape in members]  # type: ignore[attr-defined]
        tiles = [(i, tile) for i, grid in enumerate(grids) for tile in grid]
        # level out what the bucket's Shard, FlatShard and Owned parameters left uneven
        cuts = contiguous_cuts([tile.numel for _, tile in tiles], world_size, loads)
        out: list[list[list[Region]]] = [[[] for _ in range(world_size)] for _ in members]
        for rank in range(world_size):
            for i, tile in tiles[cuts[rank] : cuts[rank + 1]]:
                out[i][rank].append(tile)
        return out
