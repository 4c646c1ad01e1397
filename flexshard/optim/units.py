"""The matrices a redistributed parameter splits into (the whole 2-D matrix, or each
expert of a [E, R, C] stack) and, per rank, where its pieces of each one sit in the
local shard. Pure layout arithmetic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..placements import Region

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """``region.numel`` elements of a rank's local shard, from element ``local`` on
    (contiguous), that form ``region`` of one matrix (in the matrix's coordinates)."""

    local: int
    region: Region


def matrices(shape: Shape) -> list[tuple[int | None, Shape]]:
    """(expert index or None, matrix shape): the units an optimizer runs on (each expert
    of a 3-D stack apart; any other tensor whole)."""
    if len(shape) != 3:
        return [(None, shape)]
    experts, rows, cols = shape
    return [(e, (rows, cols)) for e in range(experts)]


def _expert_piece(region: Region, start: int, shape: Shape, expert: int) -> Piece | None:
    """The part of ``region`` (stored from local element ``start``) in ``expert``."""
    rows, cols = shape[1:]
    size = rows * cols
    if region.flat:  # a range of the flattened stack: intersect with the expert's range
        first, numel = region.offsets[0], region.sizes[0]
        lo, hi = max(first, expert * size), min(first + numel, (expert + 1) * size)
        if lo >= hi:
            return None
        return Piece(start + lo - first, Region((lo - expert * size,), (hi - lo,), flat=True))
    first, count = region.offsets[0], region.sizes[0]
    if not first <= expert < first + count:
        return None
    # a box [experts, rows, cols] in row-major order: each expert's slab is contiguous
    slab = math.prod(region.sizes[1:])
    return Piece(start + (expert - first) * slab, Region(region.offsets[1:], region.sizes[1:]))


def pieces(regions: Sequence[Region], shape: Shape, expert: int | None) -> tuple[Piece, ...]:
    """A rank's pieces of one matrix, in local storage order, from its ``regions``
    of the parameter (of shape ``shape``)."""
    out, start = [], 0
    for region in regions:
        if expert is None:
            out.append(Piece(start, region))
        else:
            piece = _expert_piece(region, start, shape, expert)
            if piece is not None:
                out.append(piece)
        start += region.numel
    return tuple(out)


def row_block_shapes(shape: Shape, rows: int) -> list[Shape]:
    """The blocks of ``rows`` full-width rows of a 2-D ``shape`` (the last may be short)."""
    height, width = shape
    return [(min(rows, height - top), width) for top in range(0, height, rows)]


def block_runs(region: Region, shape: Shape, rows: int) -> list[tuple[int, int, Shape]]:
    """(start, numel, block shape): the runs of a piece (``region`` of a 2-D matrix of
    ``shape``, stored contiguously in row-major order) that each lie in one block of
    ``rows`` full-width rows, from the piece's first element on."""
    height, width = shape
    if region.flat:  # a range of the flattened matrix
        per_row, base = width, region.offsets[0]
    else:  # a box: its rows one after another, each ``sizes[1]`` wide
        per_row, base = region.sizes[1], region.offsets[0] * region.sizes[1]
    runs = []
    for top, block in zip(range(0, height, rows), row_block_shapes(shape, rows)):
        lo = max(top * per_row - base, 0)
        hi = min((top + block[0]) * per_row - base, region.numel)
        if lo < hi:
            runs.append((lo, hi - lo, block))
    return runs
