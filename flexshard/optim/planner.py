"""Per-block buckets under which a per-matrix optimizer (Muon: ``muon_buckets``; Shampoo /
SOAP through MatrixOptimizer: ``matrix_buckets``) steps whole matrices, with owners
balanced across the whole model.

One bucket per block (each child of the model's outermost ``ModuleList``: ``layers.3``),
so the forward gathers one block at a time as FSDP2 does, and one ``outer`` bucket for
the parameters under no block (embeddings, LM head, final norm). Every bucket is
``ragged``: its collectives move each rank's own elements, so a block whose few
matrices sit whole on a few ranks costs no padding.

Inside a block every optimizer matrix is ``Owned(rank=r)`` and every expert of an
``[E, R, C]`` stack a ``BlockShard((R, C), owners=...)`` tile, each pinned by one
assignment over the whole model that keeps each rank's total storage (elements over
every bucket) under ``STORAGE_SLACK`` x the mean and its Newton–Schulz work near level:
units by size, largest first, each to the least-busy rank it still fits on. A matrix
that fits on no rank is stored ``FlatShard`` (an even split however few its rows) and
the optimizer redistributes that one
matrix in its step (one owner gathers it; per-head ``row_blocks`` matrices too): at
more ranks than matrices most are, and the plan degrades to FSDP2's storage with a
redistributing optimizer, never worse. An expert stack with an expert that fits
nowhere is stored ``Shard(0)`` too, whose pieces are whole experts. Parameters the
optimizer does not take (AdamW's norms, biases, embeddings; frozen ones) are
``Shard(0)``. Pure arithmetic: no process group needed.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from ..fsdp.arguments import BucketSpec
from ..placements import BlockShard, FlatShard, Owned, Placement, Shard
from ..placements.owned import lpt_owners
from .matrix_proxies import preconditioner_flops
from .muon_adamw import full_shape, split_named_params
from .newton_schulz import ns_flops

Shape = tuple[int, ...]
Cost = Callable[[Shape], float]

#: no rank stores more than this times the mean (elements over every bucket): a matrix
#: that would push every rank past it is split instead
STORAGE_SLACK = 1.05
#: the bucket of the parameters under no block
OUTER = "outer"


class PlacementByName:
    """What a plan decided, parameter FQN -> Placement, as a ``BucketSpec``'s placement
    policy, called as ``placement(fqn, param)``; ``repr`` shows it whole (each matrix's
    owner or block). Compares by identity, as the function it stands in for would."""

    def __init__(self, table: Mapping[str, Placement]) -> None:
        self.table = dict(table)

    def __call__(self, fqn: str, param: object) -> Placement:
        try:
            return self.table[fqn]
        except KeyError:
            raise KeyError(f"no placement was planned for parameter '{fqn}'") from None

    def __repr__(self) -> str:
        entries = ", ".join(f"{fqn!r}: {placement!r}" for fqn, placement in self.table.items())
        return f"PlacementByName({{{entries}}})"


def _peak_over_mean(values: Sequence[float]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0


@dataclass(frozen=True)
class MuonBalance:
    """Per rank under a plan: the optimizer's work each step (``flops``: Newton–Schulz
    FLOPs for Muon; a split matrix counts on the rank the optimizer's step picks as its
    owner) and the elements it stores over every bucket (``storage``, padding of Shard
    slots included). ``split``: the matrices too large to own (stored FlatShard and
    redistributed each step; expert stacks Shard(0) in whole experts)."""

    flops: tuple[float, ...]
    storage: tuple[int, ...] = ()
    split: tuple[str, ...] = ()

    @property
    def imbalance(self) -> float:
        """Busiest rank's work over the mean (1.0: perfectly level)."""
        return _peak_over_mean(self.flops)

    @property
    def storage_imbalance(self) -> float:
        """Fullest rank's storage over the mean (1.0: perfectly level)."""
        return _peak_over_mean(self.storage)


@dataclass(frozen=True)
class _Param:
    """One parameter as the plan sees it."""

    name: str
    shape: Shape
    bucket: str
    matrix: bool  # the optimizer steps it per matrix; the others are plain Shard(0)
    rows: int | None = None  # row_blocks: each ``rows`` rows its own matrix

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def experts(self) -> bool:
        return self.matrix and len(self.shape) == 3


def _work(param: _Param, sizes: Shape, cost: Cost) -> float:
    """The optimizer's work on ``sizes`` of ``param`` held whole (whole row blocks, whole
    experts); none for a parameter it does not step."""
    if not param.matrix:
        return 0.0
    if param.rows is not None:
        height, width = sizes
        return sum(cost((min(param.rows, height - r), width)) for r in range(0, height, param.rows))
    if param.experts:
        return sizes[0] * cost(sizes[-2:])
    return cost(sizes)


def block_prefixes(model: nn.Module) -> list[str]:
    """The FQN prefix of every block: each child of an outermost ``ModuleList`` (or
    ``ModuleDict``: a pipeline stage keeps its layers' names)."""
    containers: list[str] = []
    for name, module in model.named_modules():
        inside = any(not c or name.startswith(f"{c}.") for c in containers)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and not inside:
            containers.append(name)
    return [
        f"{c}.{child}" if c else child
        for c in containers
        for child, _ in model.get_submodule(c).named_children()
    ]


def _bucket_of(fqn: str, prefixes: set[str]) -> str:
    parts = fqn.split(".")
    for k in range(1, len(parts)):
        prefix = ".".join(parts[:k])
        if prefix in prefixes:
            return prefix
    return OUTER


def _rows_for(name: str, shape: Shape, row_blocks: Mapping[str, int]) -> int | None:
    for pattern, rows in row_blocks.items():
        if fnmatch.fnmatchcase(name, pattern):
            if len(shape) != 2 or rows <= 0:
                raise ValueError(
                    f"muon_buckets: row_blocks pattern for '{name}' needs a 2-D matrix and"
                    f" rows > 0, got shape {shape} and rows {rows}"
                )
            return rows
    return None


def _fixed(param: _Param, split: set[str]) -> Placement | None:
    """The placement that does not depend on the owners: None for a matrix (or expert
    stack) whose owners the plan picks."""
    if not param.matrix:
        # (a scalar cannot be sharded: Owned, as small as it gets)
        return Shard(0) if param.shape else None
    if param.name in split:
        # the optimizer's step redistributes it; flat ranges split it evenly however few
        # its rows (an expert stack's Shard(0) rows are whole experts: stepped in place)
        return Shard(0) if param.experts else FlatShard()
    return None


def _shard0_slot(shape: Shape, world_size: int) -> int:
    """Elements Shard(0) reserves on every rank: the largest rank's slice (padded)."""
    return -(-shape[0] // world_size) * math.prod(shape[1:])


@dataclass(frozen=True)
class _Unit:
    """What one owner takes whole: a matrix, or one expert of a stack."""

    param: _Param
    expert: int | None = None

    @property
    def numel(self) -> int:
        return self.param.numel if self.expert is None else math.prod(self.param.shape[-2:])

    def work(self, cost: Cost) -> float:
        if self.expert is None:
            return _work(self.param, self.param.shape, cost)
        return cost(self.param.shape[-2:])


def _units(param: _Param) -> list[_Unit]:
    if param.experts:
        return [_Unit(param, e) for e in range(param.shape[0])]
    return [_Unit(param)]


def _loads(
    params: Sequence[_Param], table: Mapping[str, Placement], world_size: int, cost: Cost
) -> tuple[list[int], list[float]]:
    """Per rank, the elements it stores (Shard(0) slots padded, as the runtime lays
    them out) and the work on the matrices it holds whole (split ones are not local)."""
    storage, work = [0] * world_size, [0.0] * world_size
    flat: dict[str, int] = {}  # per bucket, its FlatShard elements (split evenly)
    for p in params:
        placement = table.get(p.name)
        if isinstance(placement, FlatShard):
            flat[p.bucket] = flat.get(p.bucket, 0) + p.numel
        elif isinstance(placement, Owned):
            assert placement.rank is not None
            storage[placement.rank] += p.numel
            work[placement.rank] += _work(p, p.shape, cost)
        elif isinstance(placement, BlockShard):  # whole experts, each pinned
            assert placement.owners is not None
            for unit, rank in zip(_units(p), placement.owners):
                storage[rank] += unit.numel
                work[rank] += unit.work(cost)
        elif isinstance(placement, Shard):
            slot = _shard0_slot(p.shape, world_size)
            storage = [s + slot for s in storage]
            if p.experts:  # whole experts on each rank: stepped there
                per_rank = -(-p.shape[0] // world_size)
                for rank in range(world_size):
                    count = min(per_rank, max(0, p.shape[0] - rank * per_rank))
                    work[rank] += count * cost(p.shape[-2:])
    for total in flat.values():
        chunk = -(-total // world_size)
        for rank in range(world_size):
            storage[rank] += min(chunk, max(0, total - rank * chunk))
    return storage, work


def _owners(
    units: Sequence[_Unit],
    storage: Sequence[int],
    work: Sequence[float],
    cap: float,
    cost: Cost,
) -> tuple[dict[_Unit, int], list[str]]:
    """Largest first, each unit to the least-busy rank whose storage stays under
    ``cap`` (ties: less storage, then lower rank); the parameters with a unit that
    fits nowhere."""
    storage, work = list(storage), list(work)
    owners: dict[_Unit, int] = {}
    over: list[str] = []
    for unit in sorted(units, key=lambda u: -u.numel):  # stable: ties in model order
        fits = [r for r in range(len(storage)) if storage[r] + unit.numel <= cap]
        if not fits:
            if unit.param.name not in over:
                over.append(unit.param.name)
            continue
        rank = min(fits, key=lambda r: (work[r], storage[r], r))
        owners[unit] = rank
        storage[rank] += unit.numel
        work[rank] += unit.work(cost)
    return owners, over


def _assign(
    params: Sequence[_Param], world_size: int, cost: Cost
) -> tuple[dict[str, Placement], list[str]]:
    """Every parameter's placement, and the matrices split (not owned whole). Splitting a
    matrix pads it and evens its share over all ranks, which moves the cap: re-plan
    until every remaining matrix fits."""
    split: set[str] = set()
    while True:
        fixed = {p.name: f for p in params if (f := _fixed(p, split)) is not None}
        storage, work = _loads(params, fixed, world_size, cost)
        units = [u for p in params if p.name not in fixed for u in _units(p)]
        cap = STORAGE_SLACK * (sum(storage) + sum(u.numel for u in units)) / world_size
        owners, over = _owners(units, storage, work, cap, cost)
        if not over:
            break
        split.update(over)
    table: dict[str, Placement] = dict(fixed)
    for p in params:
        if p.name in table:
            continue
        ranks = tuple(owners[u] for u in _units(p))
        table[p.name] = (
            BlockShard(p.shape[-2:], owners=ranks) if p.experts else Owned(rank=ranks[0])
        )
    return {p.name: table[p.name] for p in params}, [p.name for p in params if p.name in split]


def _balance(
    params: Sequence[_Param],
    table: Mapping[str, Placement],
    split: Sequence[str],
    world_size: int,
    cost: Cost,
) -> MuonBalance:
    storage, work = _loads(params, table, world_size, cost)
    # the optimizer's step picks owners of split matrices by LPT over the whole ones' work
    by_bucket: dict[str, list[_Param]] = {}
    for p in params:
        if p.matrix and isinstance(table[p.name], FlatShard):
            by_bucket.setdefault(p.bucket, []).append(p)
    for ps in by_bucket.values():
        costs = [_work(p, p.shape, cost) for p in ps]
        for owner, c in zip(lpt_owners(costs, world_size, loads=work), costs):
            work[owner] += c
    return MuonBalance(tuple(work), tuple(storage), tuple(split))


def _params(
    model: nn.Module,
    matrices: set[str],
    row_blocks: Mapping[str, int],
    exclude: Sequence[str] = (),
) -> list[_Param]:
    prefixes = set(block_prefixes(model))
    out = []
    for name, param in model.named_parameters():  # ties once, under their first name
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude):
            continue
        shape = full_shape(param)
        matrix = name in matrices
        rows = _rows_for(name, shape, row_blocks) if matrix else None
        out.append(_Param(name, shape, _bucket_of(name, prefixes), matrix, rows))
    return out


def _specs(
    model: nn.Module, params: Sequence[_Param], table: Mapping[str, Placement]
) -> list[BucketSpec]:
    """One ragged bucket per block (``layers.3.*``), then ``outer`` (by name)."""
    names: dict[str, list[str]] = {}
    for p in params:
        names.setdefault(p.bucket, []).append(p.name)
    bucket_of = {p.name: p.bucket for p in params}
    first = {id(param): name for name, param in model.named_parameters()}
    every = list(model.named_parameters(remove_duplicate=False))
    specs = []
    for bucket in [*block_prefixes(model), OUTER]:
        members = names.get(bucket)
        if not members:
            continue
        # a parameter reachable inside the block but planned elsewhere (tied) or left
        # out (``exclude``): the block names its members one by one, so no glob takes it
        own = all(
            bucket_of.get(first[id(param)]) == bucket
            for fqn, param in every
            if fqn.startswith(f"{bucket}.")
        )
        patterns: str | list[str] = f"{bucket}.*" if bucket != OUTER and own else members
        placement = PlacementByName({name: table[name] for name in members})
        specs.append(BucketSpec(patterns, placement=placement, name=bucket, ragged=True))
    return specs


def _plan(
    model: nn.Module,
    world_size: int,
    matrices: set[str],
    row_blocks: Mapping[str, int],
    cost: Cost,
    exclude: Sequence[str] = (),
) -> tuple[list[BucketSpec], MuonBalance]:
    params = _params(model, matrices, row_blocks, exclude)
    table, split = _assign(params, world_size, cost)
    return _specs(model, params, table), _balance(params, table, split, world_size, cost)


def _muon_plan(
    model: nn.Module,
    world_size: int,
    row_blocks: Mapping[str, int] | None,
    ns_steps: int,
    adamw_patterns: Sequence[str],
    muon_patterns: Sequence[str],
    detect_head: bool,
    exclude: Sequence[str],
) -> tuple[list[BucketSpec], MuonBalance]:
    muon, _ = split_named_params(
        model, adamw_patterns=adamw_patterns, muon_patterns=muon_patterns, detect_head=detect_head
    )
    cost = lambda shape: ns_flops(shape, ns_steps)  # noqa: E731
    return _plan(model, world_size, {n for n, _ in muon}, row_blocks or {}, cost, exclude)


def _trainable(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def matrix_buckets(
    model: nn.Module,
    world_size: int,
    cost: Cost = preconditioner_flops,
) -> list[BucketSpec]:
    """Buckets for :class:`MatrixOptimizer` over every trainable parameter of ``model``:
    one ragged bucket per block plus ``outer``, each parameter ``Owned`` (owners pinned
    over the whole model, balanced on ``cost(shape)`` under a storage cap), 3-D stacks
    ``BlockShard`` one tile per expert, a parameter that fits on no rank ``FlatShard``
    (redistributed in the step). ``cost`` is the optimizer's work on one matrix:
    :func:`preconditioner_flops` for Shampoo/SOAP, ``lambda s: ns_flops(s, 5)`` for
    Muon. Call it on the unsharded model; :func:`matrix_balance` reports the plan."""
    return _plan(model, world_size, _trainable(model), {}, cost)[0]


def matrix_balance(
    model: nn.Module,
    world_size: int,
    cost: Cost = preconditioner_flops,
) -> MuonBalance:
    """Per-rank ``cost`` and storage of the plan :func:`matrix_buckets` proposes."""
    return _plan(model, world_size, _trainable(model), {}, cost)[1]


def muon_buckets(
    model: nn.Module,
    world_size: int,
    *,
    row_blocks: Mapping[str, int] | None = None,
    ns_steps: int = 5,
    adamw_patterns: Sequence[str] = (),
    muon_patterns: Sequence[str] = (),
    detect_head: bool = True,
    exclude: Sequence[str] = (),
) -> list[BucketSpec]:
    """Buckets for ``flex_shard(model, mesh=mesh, buckets=...)``: one ragged bucket per
    block (``layers.3``) plus ``outer``. Muon's matrices are ``Owned`` with owners pinned
    over the whole model (storage level within ``STORAGE_SLACK``, Newton–Schulz FLOPs
    near level), expert stacks ``BlockShard`` one tile per expert, and a matrix that fits
    on no rank ``FlatShard``, which DistMuon redistributes; AdamW's parameters (embeddings,
    LM head, norms, biases, as ``split_muon_params`` decides) ``Shard(0)``.
    ``row_blocks`` (globs -> rows, e.g. ``{"*.wq.weight": head_dim}``) makes each block of
    rows a matrix of its own; pass the same to ``muon_and_adamw``. ``exclude`` (FQN
    globs): parameters left out, for buckets of their own (expert weights on an
    expert-parallel mesh: plan them with a ``muon_buckets`` call of their own). Call it
    on the unsharded model; :func:`muon_balance` reports the plan."""
    return _muon_plan(
        model,
        world_size,
        row_blocks,
        ns_steps,
        adamw_patterns,
        muon_patterns,
        detect_head,
        exclude,
    )[0]


def muon_balance(
    model: nn.Module,
    world_size: int,
    *,
    row_blocks: Mapping[str, int] | None = None,
    ns_steps: int = 5,
    adamw_patterns: Sequence[str] = (),
    muon_patterns: Sequence[str] = (),
    detect_head: bool = True,
    exclude: Sequence[str] = (),
) -> MuonBalance:
    """Per-rank Newton–Schulz FLOPs and storage of the plan :func:`muon_buckets`
    proposes, and the matrices it splits."""
    return _muon_plan(
        model,
        world_size,
        row_blocks,
        ns_steps,
        adamw_patterns,
        muon_patterns,
        detect_head,
        exclude,
    )[1]
