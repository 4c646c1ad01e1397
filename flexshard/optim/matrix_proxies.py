"""MatrixOptimizer's parameters as the matrices its inner optimizer steps.

A *matrix* is what a per-matrix optimizer (Shampoo, SOAP, PSGD, Muon) preconditions on
its own: a 2-D parameter, one expert of a ``[E, R, C]`` stack, or any other tensor
whole. Each parameter is resolved (by :func:`.matrices.classify`) into the matrices
this rank holds whole, stepped in place through *proxies* (plain tensors viewing the
local storage, which the inner optimizer sees as its parameters), or a target that
travels to an owner first. Each matrix's inner state is one :class:`MatrixState`
under a key that names it the same way under any placement.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..placements import Region
from ..runtime.bucket import Bucket
from ..runtime.dtensor.tensor_parallel import local_of
from .matrices import Block, Kind, Rules, Target, classify, pieces, rank_work, units_of

Shape = tuple[int, ...]
Cost = Callable[[Shape], float]
WHO = "MatrixOptimizer"
#: a per-matrix optimizer steps any tensor whole (3-D: each expert), TP ones gathered
RULES = Rules(
    WHO,
    foreign="; the adapter takes flexshard's parameters and plain tensors",
    tp_split="row_blocks under tensor parallelism takes column-parallel (Shard(0)) pieces "
    "cut at block boundaries",
)


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
    size or placement. flexshard's checkpoint loads allow it by name
    (``flexshard/checkpoint/safe_load.py``: nothing else a pickle names is built)."""

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


def _blocks(
    local: torch.Tensor, blocks: tuple[Block, ...], first_row: int = 0
) -> list[LocalMatrix]:
    return [
        LocalMatrix(block_key(b, first_row), b.shape, b.offset, _view(local, b.offset, b.shape))
        for b in blocks
    ]


def resolve_param(
    param: torch.Tensor, name: str, cost: Cost, row_blocks: bool | int | None = None
) -> Resolved:
    """Classify ``param`` (``row_blocks``: DistMuon's option, see :func:`.classify`);
    raise naming it where the adapter cannot step it."""
    target = classify(param, name, row_blocks, RULES)
    name, local, shape = target.name, target.param, target.shape
    work = rank_work(target, cost)
    if target.kind is Kind.TENSOR_PARALLEL:  # gathered whole on every rank
        assert target.bucket is not None
        return Resolved(param, name, [], tensor_parallel=(target.bucket, target.index))
    if target.kind is Kind.REMOTE:
        return Resolved(param, name, [], target)
    if target.kind is Kind.ROW_BLOCKS:
        return Resolved(param, name, _blocks(local, target.blocks, target.first_row), None, work)
    if target.kind is Kind.EXPERTS:
        mine = _regions_here(target)
        experts = [
            LocalMatrix(state_key(e), matrix, piece.local, _view(local, piece.local, matrix))
            for e, matrix in units_of(shape)
            for piece in pieces(mine, shape, e)
        ]
        return Resolved(param, name, experts, None, work)
    if target.kind is Kind.WHOLE:  # a plain tensor is its own proxy
        proxy = param if target.bucket is None else _view(local, 0, shape)
        return Resolved(param, name, [LocalMatrix("matrix", shape, 0, proxy)], None, work)
    return Resolved(param, name, [], None, work)  # NOTHING: a whole matrix on another rank


def _regions_here(target: Target) -> tuple[Region, ...]:
    """What this rank stores of the parameter (a plain tensor: all of it)."""
    if target.bucket is None:
        return (Region((0,) * len(target.shape), target.shape),)
    return target.bucket.layout.params[target.index].regions[target.bucket.store.rank]
