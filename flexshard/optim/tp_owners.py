"""DistMuon on tensor-parallel matrices with one Newton–Schulz owner per tp group.

A TP matrix is split over tp (each tp rank holds a DTensor piece) and each piece over
the data-parallel group (flexshard's regions). Instead of gathering the whole matrix
on every rank and repeating Newton–Schulz there (``tp_matrices.gather_matrix``, what
MatrixOptimizer still does), each matrix gets one owner in its tp group, chosen by
LPT on Newton–Schulz FLOPs (as ``plan_exchanges`` picks owners in a dp group):

1. each rank gathers its tp pieces from its dp shards (one all-gather over the shard
   group for all the TP matrices of its buckets);
2. one packed all-to-all over tp sends every piece to its matrix's owner;
3. the owner assembles the whole matrix and orthogonalises it;
4. one packed all-to-all over tp returns each tp rank its piece of the update, and
   each rank keeps its dp part of it.

Everything travels in bf16: Newton–Schulz starts by casting its input to bf16 and
returns bf16, and casting is elementwise, so the result is bit for bit the
gather-everywhere one (torch.optim.Muon on the whole matrix). Each rank of a tp group
runs Newton–Schulz on ~1/tp of the TP matrices; replicas along dp repeat their row's
owner's work (dp ranks hold different shards, so the owner's row needs them all).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..placements.owned import lpt_owners
from ..runtime.bucket import Bucket
from ..runtime.dtensor.tensor_parallel import tp_group
from .matrices import Target
from .redistribute import WIRE_DTYPE, CommCounter, Exchange, Transfer
from .tp_matrices import dp_part, gather_groups, gather_pieces, gather_widths

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in the whole matrix


def piece_boxes(target: Target) -> tuple[Box, ...]:
    """Every tp rank's piece of ``target``'s matrix (torch.chunk's split, as DTensor's
    Shard: later pieces may be short or empty). A 1-D tp mesh, one Shard placement."""
    assert target.bucket is not None
    spec = target.bucket.params[target.index].tp_spec
    assert spec is not None
    (placement,) = spec.placements
    assert isinstance(placement, Shard)
    shape, dim, size = tuple(spec.shape), placement.dim, spec.mesh.size()
    boxes = []
    for rank in range(size):
        length, start = Shard.local_shard_size_and_offset(shape[dim], size, rank)
        offset = tuple(start if d == dim else 0 for d in range(len(shape)))
        boxes.append((offset, tuple(length if d == dim else n for d, n in enumerate(shape))))
    return tuple(boxes)


def owner_plannable(target: Target) -> bool:
    """Whether the owner plan takes ``target``: a 1-D tp mesh, one Shard placement
    (the trainer's TP); anything else is gathered whole on every rank."""
    assert target.bucket is not None
    spec = target.bucket.params[target.index].tp_spec
    return (
        spec is not None
        and spec.mesh.ndim == 1
        and len(spec.placements) == 1
        and isinstance(spec.placements[0], Shard)
    )


def _slot(target: Target) -> tuple[Bucket, int]:
    assert target.bucket is not None
    return target.bucket, target.index


def dp_holder(target: Target) -> int | None:
    """The dp rank whose storage holds ``target``'s whole tp piece (Owned), None when
    the piece is split across the shard group (or replicated)."""
    bucket, index = _slot(target)
    layout = bucket.layout.params[index]
    if bucket.layout.replicated or bucket.layout.world_size == 1:
        return None
    holders = [r for r, regions in enumerate(layout.regions) if regions]
    if len(holders) == 1 and layout.local_numel(holders[0]) == layout.numel:
        return holders[0]
    return None


def _row_members(targets: Sequence[Target]) -> list[Target]:
    """The targets this rank's tp group steps. [Note: TP pieces held whole over dp]
    A piece stored whole on one dp rank (Owned, pinned alike on every tp rank: the plan
    is made from shapes the tp ranks share) meets the other pieces of its matrix in
    that dp rank's tp group, so only that group steps it, with no dp collective; the
    other dp rows leave it out. A split piece is gathered over dp first, as before, by
    every row."""
    members = []
    for target in targets:
        holder = dp_holder(target)
        if holder is not None:
            boxes = piece_boxes(target)
            if len({box[1] for box in boxes}) != 1:
                raise ValueError(
                    f"DistMuon: {target.name}: its tensor-parallel pieces differ in shape "
                    f"({[box[1] for box in boxes]}), so the data-parallel owner planned on "
                    "each tp rank may differ; store it split (Shard(0)) or make its tp "
                    "dim divisible by tp"
                )
        if holder is None or holder == _slot(target)[0].store.rank:
            members.append(target)
    return members


def _numel(box: Box) -> int:
    return math.prod(box[1])


def _view(matrix: torch.Tensor, box: Box) -> torch.Tensor:
    return matrix[tuple(slice(o, o + s) for o, s in zip(*box))]


@dataclass
class TpCounter:
    """What the dp half of the TP path issued (the tp all-to-alls count in
    DistMuon's CommCounter) and the Newton–Schulz runs this rank did on TP matrices."""

    all_gather: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    newton_schulz: int = 0

    def count_gathers(self, targets: Sequence[Target]) -> None:
        """The all-gathers :func:`gather_pieces` issues for ``targets`` (one per shard
        group of more than one rank) and their padded bf16 bytes."""
        items = [_slot(t) for t in targets]
        for members in gather_groups(items):
            world = items[members[0]][0].layout.world_size
            if world == 1:
                continue
            width = sum(gather_widths(*items[k]) for k in members)
            size = width * WIRE_DTYPE.itemsize * (world - 1)
            self.all_gather += 1
            self.bytes_sent += size
            self.bytes_received += size


@dataclass
class TpUnit:
    target: Target
    owner: int  # its Newton–Schulz rank in the tp group
    boxes: tuple[Box, ...]  # per tp rank


@dataclass
class TpExchange:
    """The owner-planned TP matrices of one tp group."""

    wire: Exchange  # the tp group, for redistribute's Transfer (no units of its own)
    units: list[TpUnit]

    def splits(self, back: bool) -> list[list[int]]:
        """splits[s][d]: elements tp rank s sends tp rank d (forward: to owners)."""
        size = self.wire.world_size
        out = [[0] * size for _ in range(size)]
        for unit in self.units:
            for rank in range(size):
                if back:
                    out[unit.owner][rank] += _numel(unit.boxes[rank])
                else:
                    out[rank][unit.owner] += _numel(unit.boxes[rank])
        return out

    def owned(self) -> list[TpUnit]:
        return [u for u in self.units if u.owner == self.wire.rank]


def plan_tp(targets: Sequence[Target], cost: Callable[[Target], float]) -> list[TpExchange]:
    """Owners for ``targets`` (TP matrices), one exchange per tp group in first-seen
    order, by LPT on ``cost``. From the specs alone: every rank computes the same plan."""
    by_group: dict[str, list[Target]] = {}
    groups: dict[str, dist.ProcessGroup] = {}
    for target in _row_members(targets):
        assert target.bucket is not None
        group = tp_group(target.bucket.params[target.index].tp_spec)  # type: ignore[arg-type]
        by_group.setdefault(group.group_name, []).append(target)
        groups[group.group_name] = group
    plans = []
    for name, members in by_group.items():
        group = groups[name]
        size = dist.get_world_size(group)
        owners = lpt_owners([cost(t) for t in members], size)
        units = [TpUnit(t, o, piece_boxes(t)) for t, o in zip(members, owners)]
        first = members[0].bucket
        assert first is not None
        wire = Exchange(
            "tensor-parallel matrices",
            group,
            dist.get_rank(group),
            size,
            first.comm.timeout,
            first.storage.device,
            [],
        )
        plans.append(TpExchange(wire, units))
    return plans


def step_tp(
    plan: TpExchange,
    updates: dict[int, torch.Tensor],
    orthogonalize: Callable[[Target, torch.Tensor], torch.Tensor],
    apply: Callable[[Target, torch.Tensor], None],
    counter: CommCounter,
    tp_counter: TpCounter,
) -> None:
    """One step of ``plan``'s matrices: ``updates[id(param)]`` is this rank's local
    (momentum) update; ``apply(target, part)`` steps the local shard with its part of
    the orthogonalised matrix."""
    wire, rank = plan.wire, plan.wire.rank
    targets = [unit.target for unit in plan.units]
    # over dp, in bf16 (Newton–Schulz's first cast); a piece held whole here needs none
    held = [dp_holder(t) is not None for t in targets]
    split = [t for t, h in zip(targets, held) if not h]
    gathered = iter(
        gather_pieces([(*_slot(t), updates[id(t.param)].to(WIRE_DTYPE)) for t in split])
    )
    pieces = [
        updates[id(t.param)].to(WIRE_DTYPE).reshape(_slot(t)[0].layout.params[t.index].shape)
        if h
        else next(gathered)
        for t, h in zip(targets, held)
    ]
    tp_counter.count_gathers(split)
    order = sorted(range(len(plan.units)), key=lambda i: plan.units[i].owner)  # stable
    send = [pieces[i].reshape(-1) for i in order]
    flat = torch.cat(send) if send else torch.empty(0, dtype=WIRE_DTYPE, device=wire.device)
    received = Transfer(wire, plan.splits(back=False), flat, counter, "forward").wait()
    cursors = [0] * wire.world_size
    results = []
    for unit in plan.owned():
        full = torch.empty(unit.target.shape, dtype=WIRE_DTYPE, device=wire.device)
        for source, box in enumerate(unit.boxes):
            numel, start = _numel(box), cursors[source]
            _view(full, box).copy_(received[source][start : start + numel].view(box[1]))
            cursors[source] += numel
        results.append(orthogonalize(unit.target, full))
        tp_counter.newton_schulz += 1
    back = [
        _view(update, unit.boxes[dest]).reshape(-1)
        for dest in range(wire.world_size)
        for unit, update in zip(plan.owned(), results)
    ]
    flat = torch.cat(back) if back else torch.empty(0, dtype=WIRE_DTYPE, device=wire.device)
    returned = Transfer(wire, plan.splits(back=True), flat, counter, "back").wait()
    cursors = [0] * wire.world_size
    for unit in plan.units:
        box = unit.boxes[rank]
        numel, start = _numel(box), cursors[unit.owner]
        cursors[unit.owner] += numel
        piece = returned[unit.owner][start : start + numel].view(box[1])
        assert unit.target.bucket is not None
        apply(unit.target, dp_part(unit.target.bucket, unit.target.index, piece))
