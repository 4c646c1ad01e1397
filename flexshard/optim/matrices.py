"""Which matrices a DistMuon parameter holds on this rank, and whether computing on
them needs communication. Decided from the bucket layout of *every* rank, so all
ranks of a shard group agree on which parameters are redistributed."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..placements import ParamLayout, Region
from ..replaced import check_not_replaced
from ..runtime.bucket import Bucket, slot_of
from ..runtime.tp_params import local_of
from .newton_schulz import ns_flops
from .tp_matrices import is_tp_matrix, whole_row_blocks

Shape = tuple[int, ...]


class Kind(enum.Enum):
    WHOLE = "whole"  # the local tensor is the whole 2-D matrix (plain tensor, Owned owner)
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
    """One parameter of a DistMuon group, resolved against its storage."""

    param: torch.Tensor
    name: str  # for error messages: the parameter and, if sharded, its bucket
    group: dict
    kind: Kind
    shape: Shape  # the full parameter's shape
    bucket: Bucket | None = None
    index: int = -1
    blocks: tuple[Block, ...] = ()
    rows: int | None = None  # row_blocks: rows per block (0: each stored region)


def _is_full_width(region: Region, shape: Shape) -> bool:
    return not region.flat and region.offsets[-1] == 0 and region.sizes[-1] == shape[-1]


def _whole_experts(region: Region, shape: Shape) -> bool:
    return not region.flat and region.sizes[-2:] == shape[-2:]


def _check_ndim(name: str, shape: Shape) -> None:
    if len(shape) not in (2, 3):
        raise ValueError(
            f"DistMuon: {name} has shape {tuple(shape)}; Muon takes 2-D matrices and 3-D "
            "expert stacks [E, R, C] only (give embeddings' 1-D params, norms and biases "
            "to AdamW, e.g. with flexshard.optim.muon_and_adamw)"
        )


def block_rows(option: bool | int | None, name: str, who: str = "DistMuon") -> int | None:
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


def _check_row_block_region(name: str, shape: Shape, region: Region, rows: int, who: str) -> None:
    """A stored region must be whole rows and, with ``rows`` per block, whole blocks."""
    whole_rows = _is_full_width(region, shape)
    if whole_rows and rows:
        start, size = region.offsets[0], region.sizes[0]
        whole_rows = start % rows == 0 and (size % rows == 0 or start + size == shape[0])
    if not whole_rows:
        per = f"blocks of {rows} rows" if rows else "blocks"
        raise ValueError(
            f"{who}: {name} stores a piece of {region.sizes} at {region.offsets} that is "
            f"not whole {per} of its shape {shape}; per-block steps need storage in whole "
            f"row blocks, e.g. BlockShard(({rows or 'rows'}, {shape[-1]}))"
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
    name: str, shape: Shape, regions: Sequence[Sequence[Region]], rows: int, who: str = "DistMuon"
) -> list[tuple[Block, ...]]:
    """Each rank's row blocks of a 2-D tensor stored as ``regions`` (per rank; a plain
    tensor is one rank holding it whole), in its local storage order; raises naming
    ``name`` unless every stored region is whole blocks."""
    _check_row_block_shape(name, shape, who)
    for region in (r for held in regions for r in held):
        _check_row_block_region(name, shape, region, rows, who)
    out = []
    for held in regions:
        blocks, offset = [], 0
        for region in held:
            blocks.extend(_split_rows(region, offset, rows))
            offset += region.numel
        out.append(tuple(blocks))
    return out


def resolve(param: torch.Tensor, name: str, group: dict) -> Target:
    """Classify ``param`` for DistMuon; raise ValueError naming it when Muon cannot
    take it. No collective: every rank sees every rank's layout."""
    slot = slot_of(param)
    if isinstance(param, DTensor) and slot is None:  # its data is local: not a matrix here
        raise TypeError(
            f"DistMuon: {name} is a DTensor that flexshard did not shard (tensor parallel?); "
            "DistMuon takes flexshard's parameters (tensor-parallel ones included: shard "
            "the model with flexshard after apply_tp) and plain tensors"
        )
    check_not_replaced(param, "DistMuon")  # collected before sharding: never trained
    param = local_of(param)  # the step works on this rank's local tensor
    rows = block_rows(group["row_blocks"], name)
    if slot is None:  # a plain tensor is a whole matrix (or a whole stack) on this rank
        shape = tuple(param.shape)
        _check_ndim(name, shape)
        if rows is not None:
            blocks = row_blocks_of(name, shape, [(Region((0, 0), shape),)], rows)[0]
            return Target(param, name, group, Kind.ROW_BLOCKS, shape, blocks=blocks)
        kind = Kind.WHOLE if len(shape) == 2 else Kind.EXPERTS
        return Target(param, name, group, kind, shape)
    bucket, index = slot
    layout: ParamLayout = bucket.layout.params[index]
    name = f"parameter '{layout.fqn}' in bucket '{bucket.name}'"
    shape = layout.shape
    spec = bucket.params[index].tp_spec
    if is_tp_matrix(bucket, index) and not (rows and whole_row_blocks(bucket, index, rows)):
        # the piece is part of a larger matrix (per-head row blocks inside a
        # column-parallel piece are whole here: they go the usual way, on the piece)
        assert spec is not None
        shape = tuple(spec.shape)
        _check_ndim(name, shape)
        if rows is not None or len(shape) != 2:
            raise ValueError(
                f"DistMuon: {name} is split by tensor parallelism into pieces that are not "
                f"whole row blocks; DistMuon takes whole 2-D tensor-parallel matrices, or "
                f"row_blocks in column-parallel (Shard(0)) pieces cut at block boundaries"
            )
        return Target(param, name, group, Kind.TENSOR_PARALLEL, shape, bucket, index)
    _check_ndim(name, shape)
    target = Target(param, name, group, Kind.REMOTE, shape, bucket, index)
    all_regions = [r for regions in layout.regions for r in regions]
    mine = layout.regions[bucket.rank]
    if rows is not None:  # every rank computes the blocks it stores (all, if replicated)
        blocks = row_blocks_of(name, shape, layout.regions, rows)[bucket.rank]
        target.kind, target.blocks, target.rows = Kind.ROW_BLOCKS, blocks, rows
        return target
    if bucket.layout.replicated:
        return target  # one owner computes, the others receive its update
    whole = (Region((0, 0), shape),)
    if len(shape) == 2 and all(not regions or regions == whole for regions in layout.regions):
        target.kind = Kind.WHOLE if mine else Kind.NOTHING
        return target
    if len(shape) == 3 and all(_whole_experts(r, shape) for r in all_regions):
        target.kind = Kind.EXPERTS if mine else Kind.NOTHING
        return target
    return target


def rank_work(target: Target, steps: int) -> list[float] | None:
    """Newton–Schulz FLOPs each rank of the shard group spends on a communication-free
    flexshard target (None for plain tensors and redistributed ones): known on every
    rank from the layout, so owners of redistributed matrices can avoid busy ranks."""
    if target.bucket is None or target.kind in (Kind.REMOTE, Kind.TENSOR_PARALLEL):
        return None
    layout = target.bucket.layout.params[target.index]
    work = []
    for regions in layout.regions:
        if target.kind is Kind.ROW_BLOCKS:
            assert target.rows is not None
            blocks = [b for r in regions for b in _split_rows(r, 0, target.rows)]
            work.append(sum(ns_flops(b.shape, steps) for b in blocks))
        else:  # whole matrices or whole experts: each region is a matrix or a stack
            work.append(sum(ns_flops(r.sizes, steps) for r in regions))
    return work
