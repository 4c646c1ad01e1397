"""Bytes one rank sends per optimizer step, per bucket, counted as the runtime's
``comm_stats`` counts them ((W - 1) shards per all-gather or reduce-scatter,
2 (R - 1) / R of the buffer per all-reduce), and the matrix optimizer's work per rank."""

from __future__ import annotations

import math
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


def muon_work(buckets: list[BucketInfo]) -> MatrixWork:
    """Muon on these buckets as DistMuon runs it: matrices whole on a rank (Owned,
    full-width row blocks, whole experts) are computed there; split ones go to an
    LPT owner on Newton–Schulz FLOPs (experts one by one) and come back. All buckets
    must share one group size (the trainer's Muon runs on data parallelism alone)."""
    world = max((b.world for b in buckets), default=1)
    loads = [0.0] * world
    moved: list[tuple[float, int]] = []  # (flops, elements) of each redistributed matrix
    for info in buckets:
        if info.world != world:
            raise ValueError(
                f"muon_work: bucket '{info.name}' has {info.world} ranks, others {world}"
            )
        for param, placement in zip(info.layout.params, info.placements):
            if not is_muon_matrix(param.fqn, param.shape):
                continue
            if whole_on_rank(placement, param.shape) or info.layout.replicated:
                for rank, regions in enumerate(param.regions):
                    loads[rank] += sum(ns_flops(r.sizes, NS_STEPS) for r in regions)
                continue
            experts = math.prod(param.shape[:-2])
            matrix = param.shape[-2:]
            moved += [(ns_flops(matrix, NS_STEPS), math.prod(matrix))] * experts
    if moved:
        owners = lpt_owners([f for f, _ in moved], world, loads=loads)
        for owner, (flops, _) in zip(owners, moved):
            loads[owner] += flops
    # each matrix: (W - 1) / W of it travels to its owner and back, spread over the ranks
    elements = sum(n for _, n in moved)
    a2a = int(2 * elements * MUON_WIRE_BYTES * (world - 1) / world / world)
    return MatrixWork(tuple(loads), a2a)


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
