"""What torch's CUDA caching allocator reserves over one rank's step: the plan's tensors
allocated and freed in the runtime's order, one by one where the plan knows them, on
the allocator's simulation (``allocator.py``).

The sequence follows ``peak.step_moments``: the sharded parameters and the optimizer
state once; per step the root's gathered buffer, each bucket's all-gather output (on
the all-gather stream, prefetched one ahead), the activations' storages as the fake
step made them (``timeline.StepTensors``), each bucket's unsharded gradients in its
backward (freed ``MAX_PENDING_REDUCTIONS`` blocks later), its sharded gradients (the
reduce-scatter's output, on its own stream) until the optimizer's step and
``zero_grad``, and the optimizer's temporaries. Two steps run: the second starts on the
first one's cache, as a measured step does.

``reserve`` is the peak reserved less the peak of the bytes requested in the
simulation: what the allocator holds beyond the live tensors (rounding, blocks left
whole, segments cached for another size or stream, a large pool's split leftovers).
Added to the plan's live peak it gives the reserved peak torchtitan logs. (The
simulation's own peak is up to a few % above the plan's: it also holds the
reduce-scatter outputs of the reductions in flight, which FSDP2 allocates as it issues
them.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from flexshard.runtime.hooks import MAX_PENDING_REDUCTIONS

from .allocator import CachingAllocator
from .buckets import BucketInfo
from .memory import FP32, muon_state_elements
from .peak import optimizer_temporaries, sharded_grad_bytes
from .timeline import StepTensors

GATHER, REDUCE = "all-gather", "reduce-scatter"  # FSDP2's streams for the collectives


@dataclass(frozen=True)
class Reserve:
    requested: int  # the simulation's peak of requested bytes (the plan's live tensors)
    reserved: int  # its peak reserved
    retries: int  # times the cache was released to stay within the device's memory

    @property
    def reserve(self) -> int:
        return self.reserved - self.requested


class _Step:
    """The allocation sequence of steps, fed to an allocator as it is built."""

    def __init__(self, allocator: CachingAllocator) -> None:
        self.alloc = allocator
        self._ids = itertools.count()
        self.pending_sharded: list[int] = []  # this step's reduce-scatter outputs

    def make(self, size: int, stream: str = "default") -> int:
        key = next(self._ids)
        if size > 0:
            self.alloc.malloc(key, size, stream)
        return key

    def drop(self, *keys: int) -> None:
        for key in keys:
            if self.alloc.is_live(key):  # a zero-byte tensor was never allocated
                self.alloc.free(key)

    def replay(
        self, events: tuple[tuple[int, int], ...], alive: dict[int, int] | None = None
    ) -> dict[int, int]:
        """One part's storages in order, freeing also those of ``alive`` (recorded id:
        key, made by an earlier part) it frees; what it leaves alive (with ``alive``'s)."""
        mine = dict(alive or {})
        for recorded, size in events:
            if size > 0:
                mine[recorded] = self.make(size)
            elif recorded in mine:
                self.drop(mine.pop(recorded))
        return mine


def _state_bytes(bucket: BucketInfo, optimizer: str) -> int:
    if optimizer == "muon":
        return muon_state_elements([bucket]) * FP32
    return 2 * max(bucket.rank_numels()) * FP32


def simulate(
    buckets: list[BucketInfo],
    tensors: StepTensors,
    optimizer: str,
    *,
    expandable: bool,
    capacity: int | None,
    held_microbatches: int = 0,
    accumulating: bool = False,
    root_prefetches: bool = False,
    foreach: bool = True,
    steps: int = 2,
) -> Reserve:
    """The allocator on ``steps`` of this rank's step (arguments as ``step_moments``)."""
    s = _Step(CachingAllocator(expandable, capacity))
    root = [b for b in buckets if b.is_root]
    units = [b for b in buckets if not b.is_root]
    for b in buckets:  # sharded parameters and optimizer state: allocated once
        s.make(max(b.storage_numels()) * b.storage_itemsize)
        s.make(_state_bytes(b, optimizer))
    saved = [size for _, size in tensors.forward if size > 0]
    for _ in range(held_microbatches * len(units)):  # other microbatches' activations
        for size in saved:
            s.make(size)
    if accumulating:  # unsharded gradients kept between backwards
        for b in buckets:
            s.make(b.unsharded_grad_bytes)
    for _ in range(steps):
        _one_step(s, root, units, tensors, accumulating, root_prefetches)
        sharded = [s.make(sharded_grad_bytes(b), REDUCE) for b in root]
        temporaries = s.make(optimizer_temporaries(buckets, foreach))
        s.drop(temporaries, *sharded, *s.pending_sharded)  # the step, then zero_grad
        s.pending_sharded.clear()
    a = s.alloc
    return Reserve(a.peak_requested, a.peak_reserved, a.retries)


def _one_step(
    s: _Step,
    root: list[BucketInfo],
    units: list[BucketInfo],
    tensors: StepTensors,
    accumulating: bool,
    root_prefetches: bool,
) -> None:
    root_gathered = [s.make(b.gathered_bytes, GATHER) for b in root]
    prelude = [s.make(size) for size in tensors.prelude]
    gathered: dict[int, int] = {}
    kept: list[dict[int, int]] = []  # each block's storages alive from its forward
    if units:
        gathered[0] = s.make(units[0].gathered_bytes, GATHER)
    for k, b in enumerate(units):
        if k + 1 < len(units):  # prefetch the next
            gathered[k + 1] = s.make(units[k + 1].gathered_bytes, GATHER)
        kept.append(s.replay(tensors.forward))
        if b.reshard_after_forward:
            s.drop(gathered.pop(k))
    root_grads = [] if accumulating else [s.make(b.unsharded_grad_bytes) for b in root]
    if units and root_prefetches and len(units) - 1 not in gathered:
        gathered[len(units) - 1] = s.make(units[-1].gathered_bytes, GATHER)
    passed = list(s.replay(tensors.head).values())  # the gradient into the last block
    pending: list[int] = []  # unsharded gradients whose reduce-scatter is in flight
    for k in reversed(range(len(units))):
        b = units[k]
        if k not in gathered:
            gathered[k] = s.make(b.gathered_bytes, GATHER)
        if k - 1 >= 0 and k - 1 not in gathered and units[k - 1].reshard_after_forward:
            gathered[k - 1] = s.make(units[k - 1].gathered_bytes, GATHER)
        grads = s.make(b.unsharded_grad_bytes) if not accumulating else -1
        left = s.replay(tensors.backward, kept[k])
        s.drop(*passed, gathered.pop(k))
        passed = list(left.values())  # the gradient passed down, what the forward left
        if not accumulating:
            s.pending_sharded.append(s.make(sharded_grad_bytes(b), REDUCE))
            pending.append(grads)
            if len(pending) > MAX_PENDING_REDUCTIONS:
                s.drop(pending.pop(0))
    s.drop(*pending, *passed, *root_grads, *root_gathered, *prelude, *gathered.values())
