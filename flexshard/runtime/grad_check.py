"""The opt-in finite-gradient check: every rank names the same parameters, buckets and
ranks whose gradients hold a NaN or an inf, and raises the same error.

Each rank inspects its own unsharded gradients before they are reduced (after the
reduction a NaN is everywhere and its source is lost), then the ranks exchange one
small integer row each. Off, it costs nothing: no pass over gradients, no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .collectives import by_process_group
from .grads import INF, NAN

if TYPE_CHECKING:
    from .bucket import Bucket

#: parameters named in the message (the count of the rest follows)
NAMED = 8


def _exchange(buckets: list[Bucket], row: torch.Tensor) -> torch.Tensor:
    """Rows of every rank of the buckets' shard group (and replicas, for HSDP)."""
    comm = buckets[0].comm
    rows = row.view(1, -1)
    for replicas in comm.spanning():
        group = comm.group(replicas)
        out = torch.empty(
            dist.get_world_size(group) * rows.numel(), dtype=rows.dtype, device=rows.device
        )
        comm.gather_flags(out, rows.reshape(-1), replicas).wait()
        rows = out.view(-1, row.numel())
    return rows


def _describe(code: int) -> str:
    return " and ".join(name for bit, name in ((NAN, "NaN"), (INF, "inf")) if code & bit)


def check_finite_grads(buckets: Sequence[Bucket]) -> None:
    """Raise FloatingPointError on every rank if any checked bucket's gradient of this
    backward is not finite on any rank. One all-gather per process group (two for
    HSDP); every rank builds the message from the same rows, so all raise alike."""
    checked = [b for b in buckets if b.grads.check_finite]
    found: list[str] = []
    for group_buckets in by_process_group(checked):
        codes = [c for b in group_buckets for c in b.grads.nonfinite]
        device = group_buckets[0].storage.device
        row = torch.tensor([dist.get_rank(), *codes], dtype=torch.int64, device=device)
        rows = _exchange(group_buckets, row).cpu()
        for bucket in group_buckets:
            bucket.grads.clear_nonfinite()
        if not rows[:, 1:].any():
            continue
        slots = [(b, p.fqn) for b in group_buckets for p in b.params]
        for column, (bucket, fqn) in enumerate(slots, start=1):
            bad = [(int(r[0]), int(r[column])) for r in rows if r[column]]
            if bad:
                where = ", ".join(f"{_describe(code)} on rank {rank}" for rank, code in sorted(bad))
                found.append(f"parameter '{fqn}' of bucket '{bucket.name}' ({where})")
    if found:
        named = "; ".join(found[:NAMED])
        more = f"; and {len(found) - NAMED} more" if len(found) > NAMED else ""
        raise FloatingPointError(
            f"flexshard: non-finite gradients in {len(found)} parameter(s), before reduction: "
            f"{named}{more}. The reduced gradients are unusable: skip this optimizer step "
            "(set_check_finite_grads(True) is on)"
        )
