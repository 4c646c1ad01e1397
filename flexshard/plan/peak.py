"""The peak memory of a rank: the largest sum of what is alive at one moment of a step.

Adding each part's own maximum overstates the peak (measured 15-21% above the live
tensors of small runs): the gathered buffers peak in backward, the activations at the
loss, the gradients at the optimizer step. The step is walked moment by moment, in the
runtime's order, and each moment sums what is alive then:

- always: the sharded parameters (padded storage) and the optimizer state;
- forward of bucket k: the root's gathered buffer, bucket k's, the one prefetched,
  every earlier bucket that does not reshard after forward; the activations of the
  blocks before it and the running block's own (``ActivationTimeline.forward``);
- head (final norm, LM head, loss; its forward and backward up to the last block):
  the root gathered with its unsharded gradients, all blocks' activations and the
  loss's buffers (fp32 logits, log-softmax and gradients, measured);
- backward of bucket k: the root and its gradients (reduced at the end of backward),
  bucket k's buffer and gradients, the one prefetched, up to ``MAX_PENDING_REDUCTIONS``
  reduce-scatter inputs, the sharded gradients of the buckets already reduced, the
  activations of the blocks not yet done;
- optimizer step: all sharded gradients, and AdamW's temporaries (the foreach path on
  a GPU: one fp32 copy of the state-shaped tensors; the per-tensor path on CPU: one
  parameter's).

Gradient accumulation and pipeline microbatches keep every bucket's unsharded
gradients between backwards (``set_requires_gradient_sync(False)``): counted at every
moment, an upper bound for the last microbatch's backward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flexshard.runtime.hooks import MAX_PENDING_REDUCTIONS

from .buckets import BucketInfo
from .timeline import ActivationTimeline

FP32 = 4
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Moment:
    label: str
    gathered: int  # all-gather outputs and unsharded gradients alive
    grads: int  # sharded gradients alive
    activations: int
    temporaries: int = 0  # the optimizer's

    def total(self, static: int) -> int:
        return static + self.gathered + self.grads + self.activations + self.temporaries


def _blocks(bucket: BucketInfo) -> set[int]:
    found = set()
    # fully_shard's buckets name their parameters from their module, which the bucket
    # is named after ("layers.3"): the block is in that name
    for name in (*(p.fqn for p in bucket.layout.params), f"{bucket.name}."):
        m = _LAYER.search(name)
        if m:
            found.add(int(m.group(1)))
    return found


def sharded_grad_bytes(bucket: BucketInfo, busiest: dict[int, int] | None = None) -> int:
    """The busiest rank's sharded gradients of this bucket (real, unpadded elements).
    Ragged buckets' shares are level over the model, not bucket by bucket: theirs are
    those of the rank that holds most over all of them (``busiest``, per group size)."""
    numels = bucket.rank_numels()
    if bucket.layout.ragged and busiest:
        return numels[busiest[bucket.world]] * bucket.storage_itemsize
    return max(numels) * bucket.storage_itemsize


def busiest_ragged_rank(buckets: list[BucketInfo]) -> dict[int, int]:
    """Per group size, the rank whose ragged buckets hold the most elements."""
    totals: dict[int, list[int]] = {}
    for b in buckets:
        if b.layout.ragged:
            per_rank = totals.setdefault(b.world, [0] * b.world)
            for r, n in enumerate(b.rank_numels()):
                per_rank[r] += n
    return {w: v.index(max(v)) for w, v in totals.items()}


def optimizer_temporaries(buckets: list[BucketInfo], foreach: bool) -> int:
    """AdamW's temporaries: ``_foreach_sqrt`` of the second moments over the whole
    state on the foreach path (GPU); one parameter's worth on the per-tensor path."""
    sizes = [
        sum(r.numel for r in p.regions[b.rank_numels().index(max(b.rank_numels()))])
        for b in buckets
        for p in b.layout.params
    ]
    return FP32 * (sum(sizes) if foreach else max(sizes, default=0))


def step_moments(
    buckets: list[BucketInfo],
    act: ActivationTimeline,
    held_microbatches: int = 0,
    accumulating: bool = False,
    root_prefetches: bool = False,
    foreach: bool = False,
) -> list[Moment]:
    """Every moment of a step's last microbatch, in order. ``held_microbatches``: other
    microbatches' activations a pipeline stage holds meanwhile; ``accumulating``: the
    unsharded gradients of every bucket kept between backwards."""
    root = [b for b in buckets if b.is_root]
    units = [b for b in buckets if not b.is_root]
    busiest = busiest_ragged_rank(buckets)
    root_gathered = sum(b.gathered_bytes for b in root)
    root_grads = sum(b.unsharded_grad_bytes for b in root)
    blocks_seen: list[int] = []  # index of each unit's last block in this stage's order
    seen: set[int] = set()
    for b in units:
        seen |= _blocks(b)
        blocks_seen.append(max(len(seen) - 1, 0))
    n_blocks = len(seen)
    held = held_microbatches * n_blocks * act.per_block
    kept_grads = sum(b.unsharded_grad_bytes for b in buckets) if accumulating else 0
    out = []
    kept = 0  # buckets that stay gathered after their forward
    for k, b in enumerate(units):
        nxt = units[k + 1].gathered_bytes if k + 1 < len(units) else 0
        gathered = root_gathered + kept + b.gathered_bytes + nxt + kept_grads
        out.append(Moment(f"forward of {b.name}", gathered, 0, held + act.forward(blocks_seen[k])))
        if not b.reshard_after_forward:
            kept += b.gathered_bytes
    still = sum(b.gathered_bytes for b in units if not b.reshard_after_forward)
    # the root is gathered again for the LM head's backward and stays so until the
    # end of backward (the embedding's backward comes last); its gradients too
    first_back = units[-1].gathered_bytes if units and root_prefetches else 0
    head = root_gathered + still + first_back + max(root_grads, kept_grads)
    if any(p.fqn.endswith("output.weight") for b in root for p in b.layout.params):
        out.append(Moment("loss and LM head", head, 0, held + act.head(n_blocks)))
    # (a pipeline stage without the LM head has no loss: its backward starts at once)
    back = list(reversed(range(len(units))))
    for i, k in enumerate(back):
        b = units[k]
        nxt = units[back[i + 1]] if i + 1 < len(back) else None
        prefetched = nxt.gathered_bytes if nxt is not None and nxt.reshard_after_forward else 0
        pending = [units[j] for j in back[max(0, i - MAX_PENDING_REDUCTIONS) : i]]
        grads = sum(x.unsharded_grad_bytes for x in (b, *pending))
        resident = still - (0 if b.reshard_after_forward else b.gathered_bytes)
        gathered = root_gathered + resident + b.gathered_bytes + prefetched
        gathered += kept_grads if accumulating else root_grads + grads
        done = back[: max(0, i - MAX_PENDING_REDUCTIONS)]  # reduced: sharded gradients
        reduced = sum(sharded_grad_bytes(units[j], busiest) for j in done)
        activations = held + act.backward(blocks_seen[k])
        out.append(Moment(f"backward of {b.name}", gathered, reduced, activations))
    all_grads = sum(sharded_grad_bytes(b, busiest) for b in buckets)
    temporaries = optimizer_temporaries(buckets, foreach)
    out.append(Moment("optimizer step", 0, all_grads, 0, temporaries))
    return out


def peak(moments: list[Moment], static: int) -> Moment:
    return max(moments, key=lambda m: m.total(static))
