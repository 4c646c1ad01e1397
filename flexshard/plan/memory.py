"""Per-rank memory of one step: sharded parameters, gradients and optimizer state from
the bucket layouts (every rank of the group), the gathered buffers the runtime's
prefetch policy keeps in flight, and the activations."""

from __future__ import annotations

from dataclasses import dataclass

from flexshard.runtime.hooks import MAX_PENDING_REDUCTIONS

from .buckets import BucketInfo
from .peak import Moment, peak

FP32 = 4


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank (``rank`` of the shard group: the busiest one by default).
    ``total`` is the peak: the largest sum alive at one moment of the step
    (``flexshard/plan/peak.py``), not the sum of each part's own maximum."""

    params: int
    grads: int
    optimizer: int
    gathered_peak: int  # all-gather outputs + unsharded gradients in flight at their worst moment
    gathered_detail: str  # which buffers make that peak
    activations: int  # at their own worst moment (the loss, or a recompute in backward)
    moment: Moment | None = None  # the step's largest moment (None: parts added)
    staging: int = 0  # host memory: the async checkpoint's CPU copy (not on the device)

    @property
    def total(self) -> int:
        if self.moment is None:
            return self.params + self.grads + self.optimizer + self.gathered_peak + self.activations
        return self.moment.total(self.params + self.optimizer)

    def as_dict(self) -> dict[str, object]:
        m = self.moment
        at_peak = {
            "params": self.params,
            "optimizer": self.optimizer,
            "grads": m.grads if m else self.grads,
            "gathered": m.gathered if m else self.gathered_peak,
            "activations": m.activations if m else self.activations,
            "temporaries": m.temporaries if m else 0,
        }
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "gathered_peak": self.gathered_peak,
            "gathered_detail": self.gathered_detail,
            "activations": self.activations,
            "total": self.total,
            "peak_moment": m.label if m else "each part at its own peak",
            "at_peak": at_peak,
            "sum_of_part_peaks": self.params
            + self.grads
            + self.optimizer
            + self.gathered_peak
            + self.activations,
            "staging_host": self.staging,
        }


def muon_state_elements(buckets: list[BucketInfo]) -> int:
    """fp32 state elements of the busiest rank under Muon: one momentum buffer on its
    matrices, AdamW's two moments on the rest (embedding, LM head, norms)."""
    from .comm import is_muon_matrix

    groups: dict[int, list[int]] = {}
    for b in buckets:
        per_rank = groups.setdefault(b.world, [0] * b.world)
        for param in b.layout.params:
            slots = 1 if is_muon_matrix(param.fqn, param.shape) else 2
            for r in range(b.world):
                per_rank[r] += slots * param.local_numel(r)
    return sum(max(v) for v in groups.values())


def gathered_in_flight(buckets: list[BucketInfo]) -> tuple[int, str]:
    """The worst moment of the runtime's schedule (forward order = ``buckets`` order,
    root bucket aside): in forward, the root bucket plus the running bucket plus the
    one prefetched (depth 1), plus every earlier bucket left gathered when it does not
    reshard after forward; in backward, the running bucket and the prefetched one
    gathered, the running one's unsharded gradients, and up to
    ``MAX_PENDING_REDUCTIONS`` reduce-scatter inputs still in flight."""
    root = [b for b in buckets if b.is_root]
    blocks = [b for b in buckets if not b.is_root]
    root_bytes = sum(b.gathered_bytes for b in root)
    best, detail = root_bytes, "root bucket"
    kept = 0  # buckets that stay gathered after their forward
    for i, bucket in enumerate(blocks):
        following = blocks[i + 1].gathered_bytes if i + 1 < len(blocks) else 0
        moment = root_bytes + kept + bucket.gathered_bytes + following
        if moment > best:
            best, detail = moment, f"forward of {bucket.name}: root + current + prefetched"
            if kept:
                detail += " + kept (no reshard)"
        if not bucket.reshard_after_forward:
            kept += bucket.gathered_bytes
    backward = list(reversed(blocks))
    root_back = sum(b.gathered_bytes for b in root if not b.reshard_after_forward)
    for i, bucket in enumerate(backward):
        following = backward[i + 1].gathered_bytes if i + 1 < len(backward) else 0
        grads = bucket.layout.wire_numel * bucket.gather_itemsize
        pending = sum(
            b.unsharded_grad_bytes for b in backward[max(0, i - MAX_PENDING_REDUCTIONS) : i]
        )
        still = sum(b.gathered_bytes for b in backward[i + 1 :] if not b.reshard_after_forward)
        moment = root_back + still + bucket.gathered_bytes + following + grads + pending
        if moment > best:
            best = moment
            detail = (
                f"backward of {bucket.name}: current + prefetched + its gradients + "
                f"{min(i, MAX_PENDING_REDUCTIONS)} reductions in flight"
            )
    return best, detail


def busiest_elements(buckets: list[BucketInfo]) -> int:
    """Real (unpadded) elements the busiest rank stores: the sharded gradients and the
    optimizer state are shaped like the local shards, not like the padded storage.
    Groups of different sizes (EP's experts) add their busiest ranks (an upper bound)."""
    groups: dict[int, list[int]] = {}
    for b in buckets:
        per_rank = groups.setdefault(b.world, [0] * b.world)
        for r, n in enumerate(b.rank_numels()):
            per_rank[r] += n
    return sum(max(v) for v in groups.values())


def storage_bytes(buckets: list[BucketInfo]) -> int:
    """The busiest rank's storage buffers, per group size (an upper bound across
    groups, as ``busiest_elements``)."""
    groups: dict[int, list[int]] = {}
    for b in buckets:
        per_rank = groups.setdefault(b.world, [0] * b.world)
        for r, n in enumerate(b.storage_numels()):
            per_rank[r] += n * b.storage_itemsize
    return sum(max(v) for v in groups.values())


def rank_memory(
    buckets: list[BucketInfo],
    optimizer: str,
    activations: int,
    moments: list[Moment] | None = None,
    staging: bool = False,
) -> RankMemory:
    """``moments``: the step's (peak.step_moments); without them the parts are added.
    ``staging``: an async checkpoint stages a CPU copy of the parameters and the
    optimizer state (the real elements the state dict holds)."""
    # the runtime allocates the padded shard on every rank of the group (a ragged
    # bucket: each rank's own extent, so the busiest rank over all buckets counts)
    params = storage_bytes(buckets)
    itemsize = max((b.storage_itemsize for b in buckets), default=FP32)
    elements = busiest_elements(buckets)
    grads = elements * itemsize
    slots = muon_state_elements(buckets) if optimizer == "muon" else 2 * elements
    state = slots * FP32
    gathered, detail = gathered_in_flight(buckets)
    moment = None
    if moments:
        moment = peak(moments, params + state)
        activations = max(m.activations for m in moments)
        worst = max(moments, key=lambda m: m.gathered)
        gathered, detail = worst.gathered, worst.label
    host = elements * itemsize + state if staging else 0
    return RankMemory(params, grads, state, gathered, detail, activations, moment, host)
