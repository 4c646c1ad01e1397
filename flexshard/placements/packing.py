"""Copy parameters into and out of the flat per-rank layout (pure tensor ops)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Region
from .layout import BucketLayout, ParamLayout


def _is_next_tile(prev: Region, region: Region, run: int) -> bool:
    """``region`` continues a run of ``run`` equal tiles along the last dim."""
    return (
        not region.flat
        and len(region.sizes) >= 2
        and region.sizes == prev.sizes
        and region.offsets[:-1] == prev.offsets[:-1]
        and region.offsets[-1] == prev.offsets[-1] + run * prev.sizes[-1]
    )


def _rank_views(param: ParamLayout, rank: int, storage: torch.Tensor):
    """Pairs (slice of the rank's flat storage, matching view of a full tensor) for one
    parameter. Equal tiles side by side in one tile row are merged into one 3-D copy,
    so BlockShard costs a copy per tile row, not per tile."""
    offset = param.offsets[rank]
    regions = param.regions[rank]
    i = 0
    while i < len(regions):
        first = regions[i]
        run = 1
        while i + run < len(regions) and _is_next_tile(first, regions[i + run], run):
            run += 1
        i += run
        numel = first.numel * run
        if run == 1:
            yield storage[offset : offset + numel].view(first.sizes), first.view_of
        else:
            span = Region(first.offsets, (*first.sizes[:-1], first.sizes[-1] * run))

            def tiles(full: torch.Tensor, span: Region = span, run: int = run) -> torch.Tensor:
                # (..., R, run * C) -> (run, ..., R, C): tile-major, as the storage holds them
                return span.view_of(full).unflatten(-1, (run, -1)).movedim(-2, 0)

            yield storage[offset : offset + numel].view(run, *first.sizes), tiles
        offset += numel


def pack_rank(
    layout: BucketLayout, rank: int, fulls: Sequence[torch.Tensor | None], out: torch.Tensor
) -> None:
    """Write ``rank``'s regions of the full tensors into its flat storage ``out``
    (``None`` entries are left as they are: zeros after ``pack_all``)."""
    for param, full in zip(layout.params, fulls):
        if full is None:
            continue
        for dst, view_of in _rank_views(param, rank, out):
            dst.copy_(view_of(full))


def pack_all(layout: BucketLayout, fulls: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
    """Write every rank's storage into the rows of ``out`` ([W, S]); padding is zeroed."""
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
            for src, view_of in _rank_views(param, rank, gathered[rank]):
                view_of(target).copy_(src)
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
