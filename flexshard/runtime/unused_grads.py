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

Only a rank that lacked a gradient itself reads the bitmap: on CUDA the others never
wait for it on the host. Counted in ``comm_stats()["grad_agreement"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .collectives import by_process_group
from .traffic import TrafficStats

if TYPE_CHECKING:
    from .bucket import Bucket

#: the ``comm_stats`` entry of the agreement's all-reduces
AGREEMENT = "grad_agreement"


def agree_on_unused(buckets: Sequence[Bucket], stats: TrafficStats) -> None:
    """Land the gradients of the parameters some rank used on every rank; leave those
    no rank used without one. Every rank calls it with the same buckets, in the same
    order, after their reductions landed."""
    settling = [b for b in buckets if b.reduction.used_here is not None]
    for group_buckets in by_process_group(settling):
        _agree(group_buckets, stats)


def _agree(buckets: list[Bucket], stats: TrafficStats) -> None:
    used = [b.reduction.used_here or {} for b in buckets]
    flat = [u for per_bucket in used for u in per_bucket.values()]
    unused_here = not all(flat)
    comm = buckets[0].comm
    spanning = comm.spanning()
    if spanning and flat:
        flags = torch.tensor(flat, dtype=torch.int32)
        device = buckets[0].storage.device
        if device.type != "cpu":  # a pageable copy would make the host wait for compute
            flags = flags.pin_memory().to(device, non_blocking=True)
        for replicas in spanning:  # HSDP: the replicas combine their groups' flags
            comm.agree(flags, replicas, stats.record).wait()
        if unused_here:  # a host read: only where a gradient was missing
            flat = [bool(f) for f in flags.tolist()]
    cursor = 0
    for bucket, per_bucket in zip(buckets, used):
        keys = list(per_bucket)
        anywhere = dict(zip(keys, flat[cursor : cursor + len(keys)]))
        cursor += len(keys)
        bucket.settle_unused(anywhere)
