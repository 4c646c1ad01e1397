"""Per-block buckets under which a per-matrix optimizer (Muon: ``muon_buckets``; Shampoo /
SOAP through MatrixOptimizer: ``matrix_buckets``) steps whole matrices, with owners
balanced across the whole model.

One bucket per block (each child of the model's outermost ``ModuleList``: ``layers.3``),
so the forward gathers one block at a time as FSDP2 does, and one ``outer`` bucket for
the parameters under no block (embeddings, LM head, final norm). Every bucket is
``ragged``: its collectives move each rank's own elements, so a block whose few
matrices sit whole on a few ranks costs no padding.

Inside a block every optimizer matrix is ``Owned(rank=r)``, r pinned by one assignment
over the whole model that keeps each rank's total storage (elements over every bucket)
under ``STORAGE_SLACK`` x the mean and its Newton–Schulz work near level: matrices by
size, largest first, each to the least-busy rank it still fits on. A matrix that fits
on no rank is stored ``Shard(0)`` and the optimizer redistributes that one matrix in
its step (one owner gathers it): at more ranks than matrices most are, and the plan
degrades to FSDP2's storage with a redistributing optimizer, never worse (a
``row_blocks`` matrix is split into whole row blocks instead, ``BlockShard``, so per-head
Muon stays local; those tiles land where the bucket's layout puts them). Expert
stacks ``[E, R, C]`` are ``BlockShard((R, C))``, one tile per expert. Parameters the
optimizer does not take (AdamW's norms, biases, embeddings; frozen ones) are
``Shard(0)``. Pure arithmetic: no process group needed.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from ..fsdp.api import BucketSpec
from ..placements import BlockShard, Owned, Placement, Shard
from ..placements.layout import plan_bucket
from ..placements.owned import lpt_owners
from .matrix_units import preconditioner_flops
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
    slots included). ``split``: the matrices too large to own (stored Shard(0) and
    redistributed each step; ``row_blocks`` matrices BlockShard in whole row blocks)."""

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
    """The placement that does not depend on the owners: None for an owned matrix."""
    if not param.matrix:
        # (a scalar cannot be sharded: Owned, as small as it gets)
        return Shard(0) if param.shape else None
    if param.experts:
        return BlockShard(param.shape[-2:])  # one tile per expert
    if param.name in split:
        # row blocks stay whole (per-head Muon without a collective), the rest is
        # redistributed by the optimizer's step
        return BlockShard((param.rows, param.shape[1])) if param.rows else Shard(0)
    return None


def _shard0_slot(shape: Shape, world_size: int) -> int:
    """Elements Shard(0) reserves on every rank: the largest rank's slice (padded)."""
    return -(-shape[0] // world_size) * math.prod(shape[1:])


def _local_loads(
    params: Sequence[_Param], table: Mapping[str, Placement], world_size: int, cost: Cost
) -> tuple[list[int], list[float]]:
    """Per rank, the elements it stores (over the buckets of ``table``'s members) and
    the work on the matrices it holds whole (split ones are not local)."""
    storage, work = [0] * world_size, [0.0] * world_size
    members: dict[str, list[_Param]] = {}
    for p in params:
        if p.name in table:
            members.setdefault(p.bucket, []).append(p)
    for bucket, ps in members.items():
        if any(isinstance(table[p.name], BlockShard) for p in ps):
            # tiles fill the ranks the bucket's other members left light: lay it out
            entries = [(p.name, p.shape, table[p.name]) for p in ps]
            layout = plan_bucket(entries, world_size, bucket, ragged=True)
            for rank in range(world_size):
                storage[rank] += layout.extent(rank)
            for p, laid in zip(ps, layout.params):
                if not isinstance(table[p.name], Shard):
                    for rank, regions in enumerate(laid.regions):
                        work[rank] += sum(_work(p, r.sizes, cost) for r in regions)
            continue
        for p in ps:  # Shard(0) and Owned: known without laying the bucket out
            placement = table[p.name]
            if isinstance(placement, Owned):
                assert placement.rank is not None
                storage[placement.rank] += p.numel
                work[placement.rank] += _work(p, p.shape, cost)
            else:
                slot = _shard0_slot(p.shape, world_size)
                storage = [s + slot for s in storage]
    return storage, work


def _owners(
    candidates: Sequence[_Param],
    storage: Sequence[int],
    work: Sequence[float],
    cap: float,
    cost: Cost,
) -> tuple[dict[str, int], list[str]]:
    """Largest first, each matrix to the least-busy rank whose storage stays under
    ``cap`` (ties: less storage, then lower rank); the names that fit nowhere."""
    storage, work = list(storage), list(work)
    owners: dict[str, int] = {}
    over: list[str] = []
    for p in sorted(candidates, key=lambda p: -p.numel):  # stable: ties in model order
        fits = [r for r in range(len(storage)) if storage[r] + p.numel <= cap]
        if not fits:
            over.append(p.name)
            continue
        rank = min(fits, key=lambda r: (work[r], storage[r], r))
        owners[p.name] = rank
        storage[rank] += p.numel
        work[rank] += _work(p, p.shape, cost)
    return owners, over


#: re-plans of the owners against where a block's expert tiles really land
TILE_ROUNDS = 4


def _assign(
    params: Sequence[_Param], world_size: int, cost: Cost
) -> tuple[dict[str, Placement], list[str]]:
    """Every parameter's placement, and the matrices split (not owned whole). Splitting a
    matrix pads it and evens its share over all ranks, which moves the cap: re-plan
    until every remaining matrix fits."""
    split: set[str] = set()
    while True:
        fixed = {p.name: f for p in params if (f := _fixed(p, split)) is not None}
        storage, work = _local_loads(params, fixed, world_size, cost)
        candidates = [p for p in params if p.name not in fixed]
        cap = STORAGE_SLACK * (sum(storage) + sum(p.numel for p in candidates)) / world_size
        owners, over = _owners(candidates, storage, work, cap, cost)
        if not over:
            break
        split.update(over)
    table = _with_owners(params, fixed, owners)
    if any(isinstance(f, BlockShard) for f in fixed.values()):
        table = _settle_tiles(params, fixed, candidates, table, cap, world_size, cost)
    return table, [p.name for p in params if p.name in split]


def _with_owners(
    params: Sequence[_Param], fixed: Mapping[str, Placement], owners: Mapping[str, int]
) -> dict[str, Placement]:
    table = {**fixed, **{name: Owned(rank=rank) for name, rank in owners.items()}}
    return {p.name: table[p.name] for p in params}


def _settle_tiles(
    params: Sequence[_Param],
    fixed: Mapping[str, Placement],
    candidates: Sequence[_Param],
    table: dict[str, Placement],
    cap: float,
    world_size: int,
    cost: Cost,
) -> dict[str, Placement]:
    """BlockShard tiles fill the ranks their bucket's owned matrices leave light, so the
    owners move the tiles: re-plan the owners against where the tiles landed under the
    previous owners, keeping the levellest storage seen."""
    best, best_peak = table, max(_local_loads(params, table, world_size, cost)[0])
    for _ in range(TILE_ROUNDS):
        storage, work = _local_loads(params, table, world_size, cost)
        for p in candidates:  # the tiles' loads under these owners, without the owners
            rank = table[p.name].rank  # type: ignore[attr-defined]
            storage[rank] -= p.numel
            work[rank] -= _work(p, p.shape, cost)
        owners, over = _owners(candidates, storage, work, cap, cost)
        if over:
            break
        table = _with_owners(params, fixed, owners)
        peak = max(_local_loads(params, table, world_size, cost)[0])
        if peak >= best_peak:
            break
        best, best_peak = table, peak
    return best


def _balance(
    params: Sequence[_Param],
    table: Mapping[str, Placement],
    split: Sequence[str],
    world_size: int,
    cost: Cost,
) -> MuonBalance:
    storage, work = _local_loads(params, table, world_size, cost)
    # the optimizer's step picks owners of split matrices by LPT over the whole ones' work
    by_bucket: dict[str, list[_Param]] = {}
    for p in params:
        if p.matrix and isinstance(table[p.name], Shard):
            by_bucket.setdefault(p.bucket, []).append(p)
    for ps in by_bucket.values():
        costs = [_work(p, p.shape, cost) for p in ps]
        for owner, c in zip(lpt_owners(costs, world_size, loads=work), costs):
            work[owner] += c
    return MuonBalance(tuple(work), tuple(storage), tuple(split))


def _params(model: nn.Module, matrices: set[str], row_blocks: Mapping[str, int]) -> list[_Param]:
    prefixes = set(block_prefixes(model))
    out = []
    for name, param in model.named_parameters():  # ties once, under their first name
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
    # a tied parameter reachable inside a block but planned elsewhere: that block names
    # its members one by one, so no glob takes the parameter twice
    foreign = {
        fqn
        for fqn, param in model.named_parameters(remove_duplicate=False)
        if fqn != first[id(param)]
    }
    specs = []
    for bucket in [*block_prefixes(model), OUTER]:
        members = names.get(bucket)
        if not members:
            continue
        tied = any(
            fqn.startswith(f"{bucket}.") and bucket_of[first[id(param)]] != bucket
            for fqn, param in model.named_parameters(remove_duplicate=False)
            if fqn in foreign
        )
        patterns: str | list[str] = members if bucket == OUTER or tied else f"{bucket}.*"
        placement = PlacementByName({name: table[name] for name in members})
        specs.append(BucketSpec(patterns, placement=placement, name=bucket, ragged=True))
    return specs


def _plan(
    model: nn.Module,
    world_size: int,
    matrices: set[str],
    row_blocks: Mapping[str, int],
    cost: Cost,
) -> tuple[list[BucketSpec], MuonBalance]:
    params = _params(model, matrices, row_blocks)
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
) -> tuple[list[BucketSpec], MuonBalance]:
    muon, _ = split_named_params(
        model, adamw_patterns=adamw_patterns, muon_patterns=muon_patterns, detect_head=detect_head
    )
    cost = lambda shape: ns_flops(shape, ns_steps)  # noqa: E731
    return _plan(model, world_size, {n for n, _ in muon}, row_blocks or {}, cost)


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
    ``BlockShard`` one tile per expert, a parameter that fits on no rank ``Shard(0)``
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
) -> list[BucketSpec]:
    """Buckets for ``flex_shard(model, mesh=mesh, buckets=...)``: one ragged bucket per
    block (``layers.3``) plus ``outer``. Muon's matrices are ``Owned`` with owners pinned
    over the whole model (storage level within ``STORAGE_SLACK``, Newton–Schulz FLOPs
    near level), expert stacks ``BlockShard`` one tile per expert, and a matrix that fits
    on no rank ``Shard(0)``, which DistMuon redistributes; AdamW's parameters (embeddings,
    LM head, norms, biases, as ``split_muon_params`` decides) ``Shard(0)``.
    ``row_blocks`` (globs -> rows, e.g. ``{"*.wq.weight": head_dim}``) makes each block of
    rows a matrix of its own; pass the same to ``muon_and_adamw``. Call it on the
    unsharded model; :func:`muon_balance` reports the plan."""
    return _muon_plan(
        model, world_size, row_blocks, ns_steps, adamw_patterns, muon_patterns, detect_head
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
) -> MuonBalance:
    """Per-rank Newton–Schulz FLOPs and storage of the plan :func:`muon_buckets`
    proposes, and the matrices it splits."""
    return _muon_plan(
        model, world_size, row_blocks, ns_steps, adamw_patterns, muon_patterns, detect_head
    )[1]
