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
    cut into W contiguous runs balanced by bytes. ``owners`` pins each tile (row-major
    tile order) to a rank instead: a planner that balances whole experts over a model's
    many buckets says where each goes; the unpinned parameters then level out the rest."""

    block: tuple[int, int] = (128, 128)
    owners: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        block = tuple(self.block)
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"BlockShard block must be two positive ints, got {self.block!r}")
        object.__setattr__(self, "block", block)
        if self.owners is not None:
            owners = tuple(self.owners)
            if not all(isinstance(r, int) and not isinstance(r, bool) for r in owners):
                raise TypeError(f"BlockShard owners must be ints, got {self.owners!r}")
            object.__setattr__(self, "owners", owners)

    def validate(self, fqn: str, shape: Shape, world_size: int) -> None:
        if self.owners is None:
            return
        tiles = len(tile_grid(shape, self.block))
        if len(self.owners) != tiles:
            raise ValueError(
                f"BlockShard(owners=...) for parameter '{fqn}' names {len(self.owners)} "
                f"ranks for its {tiles} tiles of {self.block}"
            )
        outside = [r for r in self.owners if not 0 <= r < world_size]
        if outside:
            raise ValueError(
                f"BlockShard(owners=...) for parameter '{fqn}' names ranks {outside} outside "
                f"the shard group of size {world_size}"
            )

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
        out: list[list[list[Region]]] = [[[] for _ in range(world_size)] for _ in members]
        loads = list(loads) or [0] * world_size
        free = []
        for i, ((placement, _), grid) in enumerate(zip(members, grids)):
            pins = placement.owners  # type: ignore[attr-defined]
            if pins is None:
                free += [(i, tile) for tile in grid]
                continue
            for rank, tile in zip(pins, grid):
                out[i][rank].append(tile)
                loads[rank] += tile.numel
        # level out what the bucket's Shard, FlatShard, Owned and pinned tiles left uneven
        cuts = contiguous_cuts([tile.numel for _, tile in free], world_size, loads)
        for rank in range(world_size):
            for i, tile in free[cuts[rank] : cuts[rank + 1]]:
                out[i][rank].append(tile)
        return out
