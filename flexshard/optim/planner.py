"""Buckets whose placements make a per-matrix optimizer communication-free, balanced on
its per-matrix cost (Newton–Schulz FLOPs for Muon: ``muon_buckets``; a preconditioner's
root/eigendecomposition cost for Shampoo/SOAP through MatrixOptimizer: ``matrix_buckets``).

Every Muon matrix is stored whole on one rank (``Owned``), or in whole row blocks
(``BlockShard((rows, C))`` per attention head, for parameters named in ``row_blocks``),
or as whole experts (``BlockShard((R, C))`` of an ``[E, R, C]`` stack: one tile per
expert). The block/expert bucket is planned first; its per-rank Newton–Schulz FLOPs
are the starting loads of an LPT over the whole matrices, whose owners are then pinned
(``Owned(rank=...)``), so the sum over both buckets is level. AdamW parameters go to a
``Shard(0)`` bucket. Pure arithmetic: no process group needed.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..fsdp.api import BucketSpec
from ..placements import BlockShard, Owned, Placement, Shard
from ..placements.layout import plan_bucket
from ..placements.owned import lpt_owners
from .matrix_units import preconditioner_flops
from .muon_adamw import full_shape, split_named_params
from .newton_schulz import ns_flops

Shape = tuple[int, ...]


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


@dataclass(frozen=True)
class MuonBalance:
    """Newton–Schulz FLOPs each rank runs per step under a plan."""

    flops: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """Busiest rank over the mean (1.0: perfectly level)."""
        mean = sum(self.flops) / len(self.flops)
        return max(self.flops) / mean if mean else 1.0


def _rows_for(name: str, row_blocks: Mapping[str, int]) -> int | None:
    for pattern, rows in row_blocks.items():
        if fnmatch.fnmatchcase(name, pattern):
            return rows
    return None


def _block_placement(name: str, shape: Shape, row_blocks: Mapping[str, int]) -> Placement | None:
    rows = _rows_for(name, row_blocks)
    if rows is not None:
        if len(shape) != 2 or rows <= 0:
            raise ValueError(
                f"muon_buckets: row_blocks pattern for '{name}' needs a 2-D matrix and rows > 0,"
                f" got shape {shape} and rows {rows}"
            )
        return BlockShard((rows, shape[1]))
    if len(shape) == 3:
        return BlockShard((shape[1], shape[2]))  # one tile per expert
    return None


def _plan(
    matrices: list[tuple[str, torch.Tensor]],
    rest: list[tuple[str, torch.Tensor]],
    world_size: int,
    row_blocks: Mapping[str, int],
    cost: Callable[[Shape], float],
    prefix: str,
) -> tuple[list[BucketSpec], MuonBalance]:
    """Communication-free buckets for ``matrices`` balanced on ``cost`` per matrix (each
    row block, each expert), and a Shard(0) bucket for ``rest``."""
    blocks: list[tuple[str, Shape, Placement]] = []
    whole: list[tuple[str, Shape]] = []
    for name, param in matrices:
        shape = full_shape(param)
        placement = _block_placement(name, shape, row_blocks)
        if placement is None:
            whole.append((name, shape))
        else:
            blocks.append((name, shape, placement))
    loads = [0.0] * world_size
    specs = []
    if blocks:
        layout = plan_bucket(blocks, world_size, bucket=f"{prefix}_blocks")
        for param in layout.params:
            for rank, regions in enumerate(param.regions):
                for r in regions:  # a row block, or a box of whole experts
                    count = r.sizes[0] if len(r.sizes) == 3 else 1
                    loads[rank] += count * cost(r.sizes[-2:])
        placements = {name: placement for name, _, placement in blocks}
        specs.append(
            BucketSpec(
                [name for name, _, _ in blocks],
                placement=PlacementByName(placements),
                name=f"{prefix}_blocks",
            )
        )
    if whole:
        costs = [cost(shape) for _, shape in whole]
        owners = lpt_owners(costs, world_size, loads=loads)
        for owner, c in zip(owners, costs):
            loads[owner] += c
        pinned = {name: Owned(rank=owner) for (name, _), owner in zip(whole, owners)}
        specs.append(
            BucketSpec(
                [name for name, _ in whole],
                placement=PlacementByName(pinned),
                name=f"{prefix}_owned",
            )
        )
    if rest:
        specs.append(BucketSpec([name for name, _ in rest], placement=Shard(0), name="adamw"))
    return specs, MuonBalance(tuple(loads))


def _muon_plan(
    model: nn.Module,
    world_size: int,
    row_blocks: Mapping[str, int],
    ns_steps: int,
    split_kwargs: dict,
) -> tuple[list[BucketSpec], MuonBalance]:
    muon, adamw = split_named_params(model, **split_kwargs)
    cost = lambda shape: ns_flops(shape, ns_steps)  # noqa: E731
    return _plan(muon, adamw, world_size, row_blocks, cost, "muon")


def matrix_buckets(
    model: nn.Module,
    world_size: int,
    cost: Callable[[Shape], float] = preconditioner_flops,
) -> list[BucketSpec]:
    """Buckets under which :class:`MatrixOptimizer` over every trainable parameter of
    ``model`` moves no byte: ``matrix_blocks`` (``BlockShard`` one tile per expert of
    each 3-D stack) and ``matrix_owned`` (every other parameter whole, ``Owned`` with
    owners pinned by LPT on ``cost(shape)`` on top of the experts' work). ``cost`` is
    the optimizer's work on one matrix: :func:`preconditioner_flops` for Shampoo/SOAP,
    ``lambda s: ns_flops(s, 5)`` for Muon. Call it on the unsharded model;
    :func:`matrix_balance` reports the per-rank work."""
    return _plan(_trainable(model), [], world_size, {}, cost, "matrix")[0]


def matrix_balance(
    model: nn.Module,
    world_size: int,
    cost: Callable[[Shape], float] = preconditioner_flops,
) -> MuonBalance:
    """Per-rank ``cost`` of the plan :func:`matrix_buckets` proposes."""
    return _plan(_trainable(model), [], world_size, {}, cost, "matrix")[1]


def _trainable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


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
    """Buckets for ``flex_shard(model, mesh=mesh, buckets=...)`` under which DistMuon's step
    moves no byte: ``muon_blocks`` (BlockShard per head for ``row_blocks`` globs -> rows,
    e.g. ``{"*.qkv.weight": head_dim}``, and per expert for 3-D stacks), ``muon_owned``
    (Owned, owners pinned by LPT on Newton–Schulz FLOPs on top of the block bucket's),
    ``adamw`` (Shard(0): embeddings, LM head, norms, biases, as ``split_muon_params``
    decides). Pass the same ``row_blocks`` to ``muon_and_adamw``. Call it on the
    unsharded model; :func:`muon_balance` reports the per-rank work."""
    return _muon_plan(
        model,
        world_size,
        row_blocks or {},
        ns_steps,
        _split(adamw_patterns, muon_patterns, detect_head),
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
    """Per-rank Newton–Schulz FLOPs of the plan :func:`muon_buckets` proposes."""
    return _muon_plan(
        model,
        world_size,
        row_blocks or {},
        ns_steps,
        _split(adamw_patterns, muon_patterns, detect_head),
    )[1]


def _split(adamw_patterns: Sequence[str], muon_patterns: Sequence[str], detect_head: bool) -> dict:
    return {
        "adamw_patterns": adamw_patterns,
        "muon_patterns": muon_patterns,
        "detect_head": detect_head,
    }
