"""A parameter no rank used in a backward keeps ``.grad`` None, as FSDP2 leaves it.

flexshard reduces the gradient of every trainable parameter, zeros for one a rank did
not use, so that a parameter unused on some ranks only cannot desynchronise the
collectives (FSDP2 takes every rank to use the same parameters, and hangs or mis-sizes
its reduce-scatter otherwise). Telling "unused on every rank" apart needs the ranks to
agree, and no bit of the reduce-scatter can carry it (a longer buffer changes gloo's
summation order, so FSDP2's results would no longer be matched bit for bit). So after
the last reduction of a backward the ranks all-reduce (MAX) one small bitmap per
process group: which trainable parameters each used. A parameter no rank used gets no
gradient (its reduced zeros are dropped and its post-accumulate-grad hooks do not run),
so Adam's moments and weight decay leave it alone, as in FSDP2.

Only a rank that lacked a gradient itself waits for the bitmap and reads it. A rank
that had every gradient knows the answer already (the MAX of its all-ones is all ones),
so it leaves its all-reduces running in the background and waits for them at the next
agreement, where an error of theirs surfaces: with every parameter used, no rank stops
at the end of backward for the ranks to meet (measured: ~10 ms of a ~215 ms backward at
W = 4 on gloo). Counted in ``comm_stats()["grad_agreement"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .collectives import Pending, by_process_group
from .traffic import TrafficStats

if TYPE_CHECKING:
    from .bucket import Bucket

#: the ``comm_stats`` entry of the agreement's all-reduces
AGREEMENT = "grad_agreement"


class UnusedGradAgreement:
    """One root's agreements: their traffic (``stats``) and the all-reduces a rank that
    had every gradient left running (waited for at the next agreement)."""

    def __init__(self) -> None:
        self.stats = TrafficStats()
        self._background: list[Pending] = []

    def __call__(self, buckets: Sequence[Bucket]) -> None:
        """Land the gradients of the parameters some rank used on every rank; leave
        those no rank used without one. Every rank calls it with the same buckets, in
        the same order, after their reductions landed."""
        self.finish()
        settling = [b for b in buckets if b.reduction.used_here is not None]
        for group_buckets in by_process_group(settling):
            self._agree(group_buckets)

    def finish(self) -> None:
        """Wait for the all-reduces left running (a failure of theirs raises here)."""
        background, self._background = self._background, []
        for pending in background:
            pending.wait()

    def _agree(self, buckets: list[Bucket]) -> None:
        used = [b.reduction.used_here or {} for b in buckets]
        flat = [u for per_bucket in used for u in per_bucket.values()]
        comm = buckets[0].comm
        spanning = comm.spanning()
        if spanning and flat:
            flags = torch.tensor(flat, dtype=torch.int32)
            device = buckets[0].storage.device
            if device.type != "cpu":  # a pageable copy would make the host wait for compute
                flags = flags.pin_memory().to(device, non_blocking=True)
            if all(flat):  # the result is all ones: nothing to wait for or read
                for replicas in spanning:  # a tensor each: they may run at once
                    self._background.append(comm.agree(flags.clone(), replicas, self.stats.record))
            else:
                for replicas in spanning:  # HSDP: the replicas combine their groups' flags
                    comm.agree(flags, replicas, self.stats.record).wait()
                flat = [bool(f) for f in flags.tolist()]
        cursor = 0
        for bucket, per_bucket in zip(buckets, used):
            keys = list(per_bucket)
            anywhere = dict(zip(keys, flat[cursor : cursor + len(keys)]))
            cursor += len(keys)
            bucket.settle_unused(anywhere)
