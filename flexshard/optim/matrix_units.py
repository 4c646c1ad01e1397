"""Which matrices of a parameter an adapted optimizer steps on this rank without
communication, and which must travel to an owner first. Decided from the bucket layout
of every rank, so all ranks of a shard group agree.

A *matrix* is what a per-matrix optimizer (Shampoo, SOAP, PSGD, Muon) preconditions on
its own: a 2-D parameter, one expert of a ``[E, R, C]`` stack, or any other tensor
whole. Storage that holds whole matrices (Owned, whole experts, a plain tensor) is
stepped in place through *proxies*: plain tensors viewing the local storage, which the
inner optimizer sees as its parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..placements import Region
from ..replaced import check_not_replaced
from ..runtime.bucket import Bucket, slot_of
from ..runtime.tp_params import local_of, tp_frame
from .matrices import Block, Kind, Target, row_blocks_of
from .tp_matrices import is_tp_matrix, whole_row_blocks
from .units import matrices, pieces

Shape = tuple[int, ...]
Cost = Callable[[Shape], float]
WHO = "MatrixOptimizer"


def preconditioner_flops(shape: Shape) -> float:
    """Rough per-step work of a Kronecker-factored preconditioner (Shampoo, SOAP, PSGD)
    on one matrix: a cubic root or eigendecomposition per dimension plus the projections
    of the gradient. Only its proportions matter: owners are balanced on it."""
    numel = math.prod(shape)
    return float(sum(d**3 for d in shape) + 2 * numel * sum(shape))


def state_key(expert: int | None) -> str:
    """The key of one matrix's state in the adapter's per-parameter state."""
    return "matrix" if expert is None else f"expert{expert}"


def block_key(block: Block, first_row: int = 0) -> str:
    """The key of a row block's state: its rows in the whole parameter (``first_row``:
    where this rank's tensor-parallel piece starts), the same under any placement."""
    start = first_row + block.row
    return f"rows{start}-{start + block.shape[0]}"


@dataclass
class MatrixState:
    """The inner optimizer's state of one matrix, whole. One opaque value per matrix:
    torch.distributed.checkpoint pickles it, so it is written once (by the rank that
    computes the matrix) and read by whichever rank computes it after a change of world
    size or placement."""

    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class LocalMatrix:
    """A matrix this rank holds whole: ``numel`` elements of the local storage from
    ``offset`` on, stepped through ``proxy`` (a plain tensor viewing them)."""

    key: str
    shape: Shape
    offset: int
    proxy: torch.Tensor


@dataclass
class Resolved:
    """One parameter of the adapter: its local matrices and, if its storage splits
    matrices, the target the redistribution plans for."""

    param: torch.Tensor  # as in the param group (a DTensor for flexshard parameters)
    name: str
    local: list[LocalMatrix]
    remote: Target | None = None
    work: list[float] | None = None  # per rank of the shard group: cost of local matrices
    tensor_parallel: tuple[Bucket, int] | None = None  # gathered whole on every rank


def _view(local: torch.Tensor, offset: int, shape: Shape) -> torch.Tensor:
    return local.detach().view(-1)[offset : offset + math.prod(shape)].view(shape)


def grad_view(param: torch.Tensor, matrix: LocalMatrix) -> torch.Tensor:
    """The gradient of ``matrix`` in ``param.grad`` (a view, as the storage's)."""
    assert param.grad is not None
    return _view(local_of(param.grad), matrix.offset, matrix.shape)


def _whole_experts(regions: list[Region], shape: Shape) -> bool:
    return all(not r.flat and r.sizes[-2:] == shape[-2:] for r in regions)


def _blocks(
    local: torch.Tensor, blocks: tuple[Block, ...], first_row: int = 0
) -> list[LocalMatrix]:
    return [
        LocalMatrix(block_key(b, first_row), b.shape, b.offset, _view(local, b.offset, b.shape))
        for b in blocks
    ]


def resolve_param(param: torch.Tensor, name: str, cost: Cost, rows: int | None = None) -> Resolved:
    """Classify ``param``; raise naming it where the adapter cannot step it. ``rows``:
    per row block (DistMuon's ``row_blocks``: rows per block, 0 for each stored tile)."""
    slot = slot_of(param)
    if isinstance(param, DTensor) and slot is None:
        raise TypeError(
            f"MatrixOptimizer: {name} is a DTensor that flexshard did not shard; the adapter "
            "takes flexshard's parameters and plain tensors"
        )
    check_not_replaced(param, "MatrixOptimizer")  # collected before sharding: never trained
    if slot is None:  # a plain tensor: every matrix whole on this rank
        shape = tuple(param.shape)
        if rows is not None:
            blocks = row_blocks_of(name, shape, [(Region((0, 0), shape),)], rows, WHO)[0]
            return Resolved(param, name, _blocks(param, blocks))
        if len(shape) != 3:  # the parameter is its own proxy
            return Resolved(param, name, [LocalMatrix("matrix", shape, 0, param)])
        local = [
            LocalMatrix(state_key(e), s, e * math.prod(s), _view(param, e * math.prod(s), s))
            for e, s in matrices(shape)
        ]
        return Resolved(param, name, local)
    bucket, index = slot
    layout = bucket.layout.params[index]
    name = f"parameter '{layout.fqn}' in bucket '{bucket.name}'"
    local = local_of(param)
    first_row = 0
    if is_tp_matrix(bucket, index):
        if not (rows and whole_row_blocks(bucket, index, rows)):
            if rows is not None:
                raise ValueError(
                    f"{WHO}: {name} is split by tensor parallelism into pieces that are not "
                    "whole row blocks; row_blocks under tensor parallelism takes "
                    "column-parallel (Shard(0)) pieces cut at block boundaries"
                )
            return Resolved(param, name, [], tensor_parallel=(bucket, index))
        first_row = tp_frame(bucket.params[index].tp_spec)[1][0]  # blocks whole in the piece
    shape = tuple(layout.shape)
    mine = list(layout.regions[bucket.rank])
    if rows is not None:  # every rank steps the blocks it stores (all, if replicated)
        blocks = row_blocks_of(name, shape, layout.regions, rows, WHO)
        work = [sum(cost(b.shape) for b in held) for held in blocks]
        return Resolved(param, name, _blocks(local, blocks[bucket.rank], first_row), None, work)
    all_regions = [r for regions in layout.regions for r in regions]
    remote = Target(local, name, {}, Kind.REMOTE, shape, bucket, index)
    if bucket.layout.replicated:  # one owner computes, the back exchange shares it
        return Resolved(param, name, [], remote)
    if len(shape) == 3 and _whole_experts(all_regions, shape):
        experts = []
        for e, matrix in matrices(shape):
            for piece in pieces(mine, shape, e):
                experts.append(
                    LocalMatrix(
                        state_key(e), matrix, piece.local, _view(local, piece.local, matrix)
                    )
                )
        work = [sum(r.sizes[0] * cost(shape[1:]) for r in regions) for regions in layout.regions]
        return Resolved(param, name, experts, None, work)
    whole = (Region(tuple(0 for _ in shape), shape),)
    if len(shape) != 3 and all(not r or tuple(r) == whole for r in layout.regions):
        matrix = [LocalMatrix("matrix", shape, 0, _view(local, 0, shape))] if mine else []
        work = [cost(shape) if regions else 0.0 for regions in layout.regions]
        return Resolved(param, name, matrix, None, work)
    return Resolved(param, name, [], remote)
