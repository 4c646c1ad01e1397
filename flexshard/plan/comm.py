"""Bytes one rank sends per optimizer step, per bucket, counted as the runtime's
``comm_stats`` counts them ((W - 1) shards per all-gather or reduce-scatter,
2 (R - 1) / R of the buffer per all-reduce; a ragged bucket's: the mean over its ranks,
whose own counts follow their shares), and the matrix optimizer's work per rank."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass

from flexshard.optim.newton_schulz import ns_flops
from flexshard.placements.owned import lpt_owners

from .buckets import BucketInfo, whole_on_rank

#: DistMuon's wire dtype for redistributed matrices (bf16)
MUON_WIRE_BYTES = 2
NS_STEPS = 5


@dataclass(frozen=True)
class BucketComm:
    name: str
    all_gather: int  # bytes sent per step (forward, and again in backward if resharded)
    all_gathers: int
    reduce_scatter: int
    all_reduce: int  # HSDP: over the replicas
    padding: float

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "bucket": self.name,
            "all_gather_bytes": self.all_gather,
            "all_gathers": self.all_gathers,
            "reduce_scatter_bytes": self.reduce_scatter,
            "all_reduce_bytes": self.all_reduce,
            "padding": self.padding,
        }


def bucket_comm(info: BucketInfo, microbatches: int, keep_between_micro: bool) -> BucketComm:
    """``microbatches`` forward/backward passes per step; gradients are reduced once, after
    the last (``set_requires_gradient_sync``); pipeline stages (``keep_between_micro``)
    do not reshard after backward until the last microbatch."""
    w = info.world
    if info.layout.replicated:
        size = info.numel * info.reduce_itemsize
        return BucketComm(info.name, 0, 0, 0, 2 * (w - 1) * size // w, 0.0)
    per_pass = 2 if info.reshard_after_forward else 1
    # pipeline stages keep parameters gathered after each backward but the last: only
    # the first forward gathers, each backward re-gathers if forward resharded
    gathers = 1 + (microbatches if info.reshard_after_forward else 0)
    if not keep_between_micro:
        gathers = per_pass * microbatches
    # a ragged bucket: the ranks' mean ((W - 1) / W of the bucket, what each ring link
    # carries); one rank's own count (comm_stats) follows its share
    ag = gathers * (w - 1) * info.shard_numel * info.gather_itemsize
    rs = (w - 1) * info.shard_numel * info.reduce_itemsize
    r = info.replicas
    ar = 2 * (r - 1) * info.shard_numel * info.reduce_itemsize // r if r > 1 else 0
    return BucketComm(info.name, ag, gathers, rs, ar, info.padding)


@dataclass(frozen=True)
class MatrixWork:
    """Newton–Schulz FLOPs per rank and the all-to-all bytes the busiest rank sends to
    move split matrices to their owner and the updates back."""

    flops: tuple[float, ...]
    all_to_all_bytes: int
    owned: int = 0  # matrices (each expert one) stepped where they are stored
    moved: int = 0  # matrices redistributed to an owner and back

    @property
    def imbalance(self) -> float:
        mean = sum(self.flops) / len(self.flops)
        return max(self.flops) / mean if mean else 1.0

    @property
    def busiest(self) -> float:
        return max(self.flops)


def is_muon_matrix(fqn: str, shape: tuple[int, ...]) -> bool:
    """As the trainer's split: matrices, but not the embedding or the LM head."""
    return len(shape) >= 2 and not fqn.startswith(("tok_embeddings", "output"))


def _row_blocks(fqn: str, row_blocks: Mapping[str, int]) -> int | None:
    return next((r for pat, r in row_blocks.items() if fnmatch.fnmatchcase(fqn, pat)), None)


def _matrix_flops(shape: tuple[int, ...], rows: int | None) -> float:
    """Newton–Schulz FLOPs of one matrix, per block of ``rows`` rows (per head) if set."""
    if rows is None:
        return ns_flops(shape, NS_STEPS)
    height, width = shape
    return sum(ns_flops((min(rows, height - r), width), NS_STEPS) for r in range(0, height, rows))


def muon_work(buckets: list[BucketInfo], row_blocks: Mapping[str, int] | None = None) -> MatrixWork:
    """Muon on these buckets as DistMuon runs it: matrices whole on a rank (Owned,
    full-width row blocks, whole experts) are computed there; split ones go, bucket by
    bucket, to LPT owners on Newton–Schulz FLOPs (experts one by one) on top of each
    rank's load so far, and come back. ``row_blocks`` (FQN globs -> rows): matrices
    orthogonalised per block of rows (per head). Groups of several sizes (EP's experts
    over their own mesh) keep their loads apart, their busiest ranks added (an upper
    bound). A tensor-parallel piece's matrix is whole on one rank of its tp group: a
    piece held whole on one dp rank travels over tp alone, from that rank's tp group;
    a split one is first all-gathered over dp, on every row."""
    row_blocks = row_blocks or {}
    loads: dict[int, list[float]] = {}
    sent = 0.0  # bytes per rank, averaged over each group's ranks
    owned = 0
    # every rank's work on what it holds whole comes first: owners of the split
    # matrices are then picked bucket by bucket on top of it (DistMuon's plan)
    moved_by_bucket: list[tuple[int, list[tuple[float, int]]]] = []
    for info in buckets:
        world = info.world
        load = loads.setdefault(world, [0.0] * world)
        moved: list[tuple[float, int]] = []  # (flops, elements) of each redistributed matrix
        moved_by_bucket.append((world, moved))
        for i, (param, placement) in enumerate(zip(info.layout.params, info.placements)):
            if not is_muon_matrix(param.fqn, param.shape):
                continue
            full = info.full_shape(i)
            rows = _row_blocks(param.fqn, row_blocks)
            whole = whole_on_rank(placement, param.shape) or info.layout.replicated
            if full != param.shape:  # a tensor-parallel piece
                tp = math.prod(full) // max(param.numel, 1)
                flops = _matrix_flops(full, rows) / tp  # its tp group's share, per rank
                piece = param.numel * MUON_WIRE_BYTES
                holders = [r for r, regions in enumerate(param.regions) if regions]
                if whole and len(holders) == 1:
                    load[holders[0]] += flops
                    sent += 2 * piece * (tp - 1) / tp / world
                else:
                    for r in range(world):
                        load[r] += flops
                    sent += piece * (world - 1) / world + 2 * piece * (tp - 1) / tp
                continue
            if whole:
                for rank, regions in enumerate(param.regions):
                    for r in regions:
                        count = r.sizes[0] if len(r.sizes) == 3 else 1
                        load[rank] += count * _matrix_flops(r.sizes[-2:], rows)
                owned += math.prod(param.shape[:-2])
                continue
            experts = math.prod(param.shape[:-2])
            matrix = param.shape[-2:]
            moved += [(_matrix_flops(matrix, rows), math.prod(matrix))] * experts
    for world, moved in moved_by_bucket:
        if moved:
            load = loads[world]
            owners = lpt_owners([f for f, _ in moved], world, loads=load)
            for owner, (flops, _) in zip(owners, moved):
                load[owner] += flops
            # each matrix: (W - 1) / W of it travels to its owner and back, spread over
            # the ranks
            elements = sum(n for _, n in moved)
            sent += 2 * elements * MUON_WIRE_BYTES * (world - 1) / world / world
    if not loads:
        return MatrixWork((0.0,), 0)
    # the busiest rank of each group, added: ranks of the widest group carry them
    widest = max(loads)
    busiest = [max(load) for w, load in loads.items() if w != widest]
    flops = tuple(x + sum(busiest) for x in loads[widest])
    moved = sum(len(m) for _, m in moved_by_bucket)
    return MatrixWork(flops, int(sent), owned, moved)


def gather_all_muon(buckets: list[BucketInfo]) -> MatrixWork:
    """Muon over FSDP-style storage without redistribution, the baseline DistMuon is
    measured against (``benchmarks/muon_gather.py``): every rank all-gathers every matrix
    of its buckets (bf16) and runs every Newton–Schulz itself. Buckets may have groups of
    different sizes (experts over their own mesh): each gathers over its own."""
    flops, sent = 0.0, 0
    for info in buckets:
        for param in info.layout.params:
            if not is_muon_matrix(param.fqn, param.shape):
                continue
            experts = math.prod(param.shape[:-2])
            matrix = param.shape[-2:]
            flops += experts * ns_flops(matrix, NS_STEPS)
            if not info.layout.replicated:
                sent += math.prod(param.shape) * MUON_WIRE_BYTES * (info.world - 1) // info.world
    world = max((b.world for b in buckets), default=1)
    return MatrixWork((flops,) * world, sent)
