"""Which matrices of a parameter this rank holds whole, and which must be redistributed
before an optimizer steps them.

A parameter splits into the matrices a per-matrix optimizer runs on (the whole 2-D
matrix, or each expert of a ``[E, R, C]`` stack); per rank, its pieces of each one sit
in the local shard where the bucket layout says (pure layout arithmetic). One
classifier serves DistMuon and MatrixOptimizer, each with its own :class:`Rules`,
decided from the bucket layout of *every* rank, so all ranks of a shard group agree on
which parameters are redistributed."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..fsdp.replaced import check_not_replaced
from ..placements import Region
from ..runtime.bucket import Bucket, slot_of
from ..runtime.dtensor.tensor_parallel import local_of, tp_frame
from .tp_matrices import is_tp_matrix, whole_row_blocks

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """``region.numel`` elements of a rank's local shard, from element ``local`` on
    (contiguous), that form ``region`` of one matrix (in the matrix's coordinates)."""

    local: int
    region: Region


def units_of(shape: Shape) -> list[tuple[int | None, Shape]]:
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


class Kind(enum.Enum):
    WHOLE = "whole"  # the local tensor is the whole matrix (plain tensor, Owned owner)
    EXPERTS = "experts"  # the local tensor is whole experts of a [E, R, C] stack
    ROW_BLOCKS = "row_blocks"  # full-width row blocks, each its own matrix
    NOTHING = "nothing"  # a whole-matrix placement that put nothing on this rank
    REMOTE = "remote"  # the matrix is split across ranks: redistribute to an owner
    TENSOR_PARALLEL = "tp"  # split over tp (and dp): a whole matrix on its tp owner


@dataclass(frozen=True)
class Block:
    """A row block in the local tensor: ``numel`` elements from ``offset``, shaped ``shape``."""

    offset: int
    shape: Shape
    row: int = 0  # its first row in the stored tensor (names its state across placements)


@dataclass
class Target:
    """One parameter, resolved against its storage (``param``: this rank's local tensor)."""

    param: torch.Tensor
    name: str  # for error messages: the parameter and, if sharded, its bucket
    group: dict  # DistMuon's param group ({} for MatrixOptimizer's)
    kind: Kind
    shape: Shape  # the full parameter's shape
    bucket: Bucket | None = None
    index: int = -1
    blocks: tuple[Block, ...] = ()
    # row_blocks: rows per block (0: each stored region); a REMOTE target with rows is
    # stepped block by block on its owner
    rows: int | None = None
    first_row: int = 0  # row_blocks in a tensor-parallel piece: its first row in the matrix


def _any_shape(name: str, shape: Shape) -> None:
    """MatrixOptimizer steps a tensor of any shape whole (3-D: expert by expert)."""


@dataclass(frozen=True)
class Rules:
    """What differs between the optimizers :func:`classify` serves (the decisions do not)."""

    who: str  # the optimizer, as its errors name it
    foreign: str  # the end of the error for a DTensor flexshard did not shard
    tp_split: str  # the end of the error for a tensor-parallel split it cannot step
    check_shape: Callable[[str, Shape], None] = _any_shape  # raises for shapes it cannot take
    tp_2d_only: bool = False  # tensor-parallel matrices it gathers whole: 2-D only
    # row_blocks (by rows) whose storage cuts blocks: redistributed whole to an owner
    # that steps each block (else refused)
    remote_row_blocks: bool = False


def _is_full_width(region: Region, shape: Shape) -> bool:
    return not region.flat and region.offsets[-1] == 0 and region.sizes[-1] == shape[-1]


def _whole_experts(region: Region, shape: Shape) -> bool:
    return not region.flat and region.sizes[-2:] == shape[-2:]


def block_rows(option: bool | int | None, name: str, who: str) -> int | None:
    """``row_blocks``: False/None (whole matrices), True (each stored tile is a block:
    0 stands for "the regions as stored") or a number of rows per block."""
    if option is None or option is False:
        return None
    if option is True:
        return 0
    if isinstance(option, int) and option > 0:
        return option
    raise ValueError(f"{who}: row_blocks for {name} must be a bool or rows > 0, got {option!r}")


def _check_row_block_shape(name: str, shape: Shape, who: str) -> None:
    if len(shape) != 2:
        raise ValueError(f"{who}: row_blocks takes 2-D matrices; {name} has shape {shape}")


def _whole_blocks(region: Region, shape: Shape, rows: int) -> bool:
    """Whether a stored region is whole rows and, with ``rows`` per block, whole blocks."""
    if not _is_full_width(region, shape):
        return False
    start, size = region.offsets[0], region.sizes[0]
    return not rows or (start % rows == 0 and (size % rows == 0 or start + size == shape[0]))


def _check_row_block_region(
    name: str, shape: Shape, region: Region, rows: int, rules: Rules
) -> None:
    if not _whole_blocks(region, shape, rows):
        per = f"blocks of {rows} rows" if rows else "blocks"
        if rules.remote_row_blocks:  # only blocks given by rows are redistributed
            hint = "; or give row_blocks as rows per block to redistribute it"
        else:
            hint = f"; {rules.who} steps row blocks only where they are stored"
        raise ValueError(
            f"{rules.who}: {name} stores a piece of {region.sizes} at {region.offsets} that "
            f"is not whole {per} of its shape {shape}; per-block steps need storage in "
            f"whole row blocks, e.g. BlockShard(({rows or 'rows'}, {shape[-1]})){hint}"
        )


def _split_rows(region: Region, offset: int, rows: int) -> list[Block]:
    """The blocks of a full-width region stored from ``offset``: ``rows`` rows each, or
    the region itself when ``rows`` is 0."""
    height, width = region.sizes
    step = rows or height
    first = region.offsets[0]
    return [
        Block(offset + r * width, (min(step, height - r), width), first + r)
        for r in range(0, height, step)
    ]


def row_blocks_of(
    name: str, shape: Shape, regions: Sequence[Sequence[Region]], rows: int, rules: Rules
) -> list[tuple[Block, ...]]:
    """Each rank's row blocks of a 2-D tensor stored as ``regions`` (per rank; a plain
    tensor is one rank holding it whole), in its local storage order; raises naming
    ``name`` unless every stored region is whole blocks."""
    _check_row_block_shape(name, shape, rules.who)
    for region in (r for held in regions for r in held):
        _check_row_block_region(name, shape, region, rows, rules)
    out = []
    for held in regions:
        blocks, offset = [], 0
        for region in held:
            blocks.extend(_split_rows(region, offset, rows))
            offset += region.numel
        out.append(tuple(blocks))
    return out


def classify(param: torch.Tensor, name: str, row_blocks: bool | int | None, rules: Rules) -> Target:
    """Classify ``param`` (``row_blocks``: the group's option); raise naming it where
    the optimizer of ``rules`` cannot step it. No collective: every rank sees every
    rank's layout."""
    slot = slot_of(param)
    if isinstance(param, DTensor) and slot is None:  # its data is local: not a matrix here
        raise TypeError(
            f"{rules.who}: {name} is a DTensor that flexshard did not shard{rules.foreign}"
        )
    check_not_replaced(param, rules.who)  # collected before sharding: never trained
    local = local_of(param)  # the step works on this rank's local tensor
    rows = block_rows(row_blocks, name, rules.who)
    if slot is None:  # a plain tensor is a whole matrix (or a whole stack) on this rank
        shape = tuple(local.shape)
        rules.check_shape(name, shape)
        if rows is not None:
            whole = [(Region((0, 0), shape),)]
            blocks = row_blocks_of(name, shape, whole, rows, rules)[0]
            return Target(local, name, {}, Kind.ROW_BLOCKS, shape, blocks=blocks)
        return Target(local, name, {}, Kind.EXPERTS if len(shape) == 3 else Kind.WHOLE, shape)
    bucket, index = slot
    layout = bucket.layout.params[index]
    name = f"parameter '{layout.fqn}' in bucket '{bucket.name}'"
    shape = layout.shape
    first_row = 0
    if is_tp_matrix(bucket, index):
        spec = bucket.params[index].tp_spec
        assert spec is not None
        if not (rows and whole_row_blocks(bucket, index, rows)):
            # the piece is part of a larger matrix (per-head row blocks inside a
            # column-parallel piece are whole here: they go the usual way, on the piece)
            full = tuple(spec.shape)
            rules.check_shape(name, full)
            if rows is not None or (rules.tp_2d_only and len(full) != 2):
                raise ValueError(
                    f"{rules.who}: {name} is split by tensor parallelism into pieces that are "
                    f"not whole row blocks; {rules.tp_split}"
                )
            return Target(local, name, {}, Kind.TENSOR_PARALLEL, full, bucket, index)
        first_row = tp_frame(spec)[1][0]  # where this rank's piece starts in the matrix
    rules.check_shape(name, shape)
    target = Target(local, name, {}, Kind.REMOTE, shape, bucket, index)
    if rows and rules.remote_row_blocks and len(shape) == 2:
        stored = (r for held in layout.regions for r in held)
        if not all(_whole_blocks(region, shape, rows) for region in stored):
            target.rows = rows  # the storage cuts blocks: the owner steps them whole
            return target
    if rows is not None:  # every rank computes the blocks it stores (all, if replicated)
        blocks = row_blocks_of(name, shape, layout.regions, rows, rules)[bucket.store.rank]
        target.kind, target.blocks, target.rows = Kind.ROW_BLOCKS, blocks, rows
        target.first_row = first_row
        return target
    if bucket.layout.replicated:
        return target  # one owner computes, the others receive its update
    mine = bool(layout.regions[bucket.store.rank])
    whole = (Region((0,) * len(shape), shape),)
    if len(shape) != 3 and all(not regions or regions == whole for regions in layout.regions):
        target.kind = Kind.WHOLE if mine else Kind.NOTHING
    elif len(shape) == 3 and all(_whole_experts(r, shape) for rs in layout.regions for r in rs):
        target.kind = Kind.EXPERTS if mine else Kind.NOTHING
    return target


def rank_work(target: Target, cost: Callable[[Shape], float]) -> list[float] | None:
    """The ``cost`` (of one matrix) each rank of the shard group spends on a
    communication-free flexshard target (None for plain tensors and redistributed
    ones): known on every rank from the layout, so owners of redistributed matrices
    can avoid busy ranks."""
    if target.bucket is None or target.kind in (Kind.REMOTE, Kind.TENSOR_PARALLEL):
        return None
    layout = target.bucket.layout.params[target.index]
    work = []
    for regions in layout.regions:
        if target.kind is Kind.ROW_BLOCKS:
            assert target.rows is not None
            blocks = [b for r in regions for b in _split_rows(r, 0, target.rows)]
            work.append(sum((cost(b.shape) for b in blocks), 0.0))
        elif len(target.shape) == 3:  # whole experts: each region a stack of matrices
            work.append(sum((r.sizes[0] * cost(r.sizes[1:]) for r in regions), 0.0))
        else:  # whole matrices: each region is one
            work.append(sum((cost(r.sizes) for r in regions), 0.0))
    return work
