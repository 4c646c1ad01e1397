"""A bucket of mixed dtypes, packed as bytes: the same regions, counted in bytes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Region, Shape
from .layout import BucketLayout, ParamLayout

#: every parameter starts on this byte boundary, so its bytes can be viewed as its dtype
ALIGN = 16


def byte_shape(shape: Shape, element_size: int) -> Shape:
    """A tensor's shape seen as uint8: the last dim ``element_size`` times longer."""
    if not shape:
        return (element_size,)
    return (*shape[:-1], shape[-1] * element_size)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as uint8 (a view: ``tensor`` must be contiguous)."""
    return tensor.reshape(1).view(torch.uint8) if tensor.dim() == 0 else tensor.view(torch.uint8)


def _in_bytes(region: Region, shape: Shape, element_size: int) -> Region:
    if not shape:  # a scalar is one whole region
        return Region((0,), (element_size,))
    *lead_offsets, last_offset = region.offsets
    *lead_sizes, last_size = region.sizes
    return Region(
        (*lead_offsets, last_offset * element_size),
        (*lead_sizes, last_size * element_size),
        region.flat,
    )


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def as_bytes(layout: BucketLayout, element_sizes: Sequence[int]) -> BucketLayout:
    """``layout`` with every parameter seen as uint8 and every region scaled to bytes
    (a region never splits an element, so each rank's bytes decode to its elements),
    each parameter's storage starting on an ``ALIGN`` boundary."""
    cursors = [0] * layout.world_size
    params = []
    for param, size in zip(layout.params, element_sizes):
        regions = tuple(
            tuple(_in_bytes(r, param.shape, size) for r in rank_regions)
            for rank_regions in param.regions
        )
        offsets = tuple(_align(c) for c in cursors)
        params.append(ParamLayout(param.fqn, byte_shape(param.shape, size), regions, offsets))
        cursors = [o + sum(r.numel for r in rs) for o, rs in zip(offsets, regions)]
    return BucketLayout(
        params=tuple(params),
        world_size=layout.world_size,
        shard_numel=_align(max(cursors, default=0)),
        replicated=layout.replicated,
    )
