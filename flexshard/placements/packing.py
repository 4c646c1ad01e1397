"""Copy parameters into and out of the flat per-rank layout (pure tensor ops)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Region
from .layout import BucketLayout, CopyBlock


def storage_shape(block: CopyBlock) -> tuple[int, ...]:
    """The block's region's shape, or ``(rows, cols, R, C)`` for a grid of tiles
    stored tile after tile."""
    if block.grid == (1, 1):
        return block.region.sizes
    return (*block.grid, *block.region.sizes[-2:])


def storage_view(block: CopyBlock, storage: torch.Tensor) -> torch.Tensor:
    """The block's slice of a rank's flat storage, shaped by ``storage_shape``."""
    return storage[block.offset : block.offset + block.numel].view(storage_shape(block))


def full_view(block: CopyBlock, full: torch.Tensor) -> torch.Tensor:
    """The same elements of the full tensor, shaped like ``storage_view``."""
    region = block.region
    if block.grid == (1, 1):
        return region.view_of(full)
    rows, cols = block.grid
    tile_rows, tile_cols = region.sizes[-2:]
    span = Region(region.offsets, (*region.sizes[:-2], rows * tile_rows, cols * tile_cols))
    box = span.view_of(full).view(rows * tile_rows, cols * tile_cols)  # batch dims are 1
    tiles = box.unflatten(0, (rows, tile_rows)).unflatten(-1, (cols, tile_cols))
    return tiles.permute(0, 2, 1, 3)


def _views(block: CopyBlock, storage: torch.Tensor, full: torch.Tensor):
    return storage_view(block, storage), full_view(block, full)


def pack_rank(
    layout: BucketLayout, rank: int, fulls: Sequence[torch.Tensor | None], out: torch.Tensor
) -> None:
    """Write ``rank``'s regions of the full tensors into its flat storage ``out``
    (``None`` entries are left as they are: zeros after ``pack_all``)."""
    for param, full in zip(layout.params, fulls):
        if full is None:
            continue
        for block in param.copy_blocks[rank]:
            dst, src = _views(block, out, full)
            dst.copy_(src)


def pack_all(layout: BucketLayout, fulls: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
    """Write every rank's storage into the rows of ``out`` ([W, S]); padding is zeroed."""
    if not layout.dense or any(full is None for full in fulls):
        out.zero_()
    for rank in range(layout.world_size):
        pack_rank(layout, rank, fulls, out[rank])


def unpack(
    layout: BucketLayout,
    gathered: torch.Tensor,
    fulls: Sequence[torch.Tensor | None],
) -> None:
    """Fill the full tensors from the gathered storage of all ranks ([W, S]).

    ``None`` entries are tensors that already alias ``gathered`` (no copy needed).
    """
    for param, full in zip(layout.params, fulls):
        if full is None:
            continue
        # a flat region of a strided tensor is no view of it: fill a contiguous copy
        target = full if full.is_contiguous() else torch.empty_like(full).contiguous()
        for rank in range(layout.world_size):
            for block in param.copy_blocks[rank]:
                src, dst = _views(block, gathered[rank], target)
                dst.copy_(src)
        if target is not full:
            full.copy_(target)


def gathered_alias(layout: BucketLayout, index: int, gathered: torch.Tensor) -> torch.Tensor | None:
    """The full parameter as a view of the flat gathered buffer, when its pieces sit
    there contiguously and in order (FlatShard, Owned, W = 1); otherwise None."""
    param = layout.params[index]
    pieces = []  # (position in the gathered buffer, first flat element of the param, numel)
    for rank in range(layout.world_size):
        position = rank * layout.shard_numel + param.offsets[rank]
        for region in param.regions[rank]:
            if region.flat:
                pieces.append((position, region.offsets[0], region.numel))
            elif region.numel == param.numel:
                pieces.append((position, 0, region.numel))
            elif region.numel:
                return None  # a box smaller than the parameter is strided in it
            position += region.numel
    pieces = [p for p in pieces if p[2]]
    if not pieces:
        return None
    start = pieces[0][0]
    covered = 0
    for position, first, numel in pieces:
        if first != covered or position != start + covered:
            return None
        covered += numel
    if covered != param.numel:
        return None
    return gathered.reshape(-1)[start : start + param.numel].view(param.shape)
