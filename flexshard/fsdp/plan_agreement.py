"""Bucket specs that differ across ranks, detected before they can hang a collective.

Every rank digests the buckets it planned and shares the digests, with its own
validation error if it has one, in one small fixed-size all-gather per process group."""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..placements import Placement
from ..runtime.collectives import DEFAULT_TIMEOUT, MeshGroups, Pending, check_timeout
from ..torch_internals import all_gather_single

#: (bucket name, its (parameter, FQNs) members, their placements)
Plan = tuple[str, Sequence[tuple[nn.Parameter, list[str]]], Sequence[Placement]]


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _bucket_digest(
    name: str, members: Sequence[tuple[nn.Parameter, list[str]]], placements: Sequence[Placement]
) -> int:
    described = [
        (fqns, tuple(p.shape), str(p.dtype), repr(pl)) for (p, fqns), pl in zip(members, placements)
    ]
    return _digest(repr((name, described)))


def _gather(
    values: list[int],
    group: dist.ProcessGroup,
    device: torch.device,
    timeout: datetime.timedelta,
    buckets: list[str],
) -> torch.Tensor:
    """Bounded by ``timeout``: a rank that never reaches set-up makes the others raise."""
    local = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group) * len(values), dtype=torch.int64, device=device)
    Pending.launch(
        lambda: all_gather_single(out, local, group=group, async_op=True),
        "set-up agreement all-gather",
        ", ".join(buckets) or "(none planned on this rank)",
        timeout,
        group,
    ).wait()
    return out.view(dist.get_world_size(group), len(values)).cpu()


#: buckets whose own digest travels in the one exchange, so a mismatch can be named
NAMED_BUCKETS = 16
#: bytes of a failing rank's error message that travel with it
MESSAGE_BYTES = 512


def _encode(message: str) -> list[int]:
    raw = message.encode()[:MESSAGE_BYTES].ljust(MESSAGE_BYTES, b"\0")
    return [int.from_bytes(raw[i : i + 7], "little") for i in range(0, MESSAGE_BYTES, 7)]


def _decode(values: list[int]) -> str:
    raw = b"".join(int(v).to_bytes(7, "little") for v in values)
    return raw.rstrip(b"\0").decode(errors="replace")


def check_same_plan(
    groups: MeshGroups,
    plans: Sequence[Plan],
    local_error: Exception | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> None:
    """One small fixed-size all-gather per group, all of them before anything is
    raised: every rank must plan the same buckets with the same parameters, shapes,
    dtypes and placements, and none may have failed validation. Raises on every rank;
    a rank whose own validation failed raises its own error, the others quote it."""
    check_timeout(timeout)
    digests = [_bucket_digest(*plan) for plan in plans]
    named = (digests + [0] * NAMED_BUCKETS)[:NAMED_BUCKETS]
    message = _encode(str(local_error) if local_error is not None else "")
    mine = [int(local_error is not None), len(digests), _digest(repr(digests)), *named, *message]
    names = [name for name, _, _ in plans]
    summaries = [
        (group, _gather(mine, group, groups.device, timeout, names))
        for group in (groups.shard, groups.replicate)
        if group is not None and dist.get_world_size(group) > 1
    ]
    if local_error is not None:
        raise local_error
    for group, summary in summaries:
        ranks = dist.get_process_group_ranks(group)
        failed = [r for r in range(len(ranks)) if summary[r, 0]]
        if failed:
            first = _decode(summary[failed[0], 3 + NAMED_BUCKETS :].tolist())
            raise ValueError(
                f"flexshard input failed validation on ranks {[ranks[r] for r in failed]}; "
                f"rank {ranks[failed[0]]}: {first}"
            )
        if (summary[:, : 3 + NAMED_BUCKETS] == summary[0, : 3 + NAMED_BUCKETS]).all():
            continue
        counts = summary[:, 1].tolist()
        if len(set(counts)) > 1:
            raise ValueError(
                f"bucket specs differ across ranks: ranks {ranks} plan {counts} buckets; "
                f"this rank's are {names}"
            )
        for b, name in enumerate(names[:NAMED_BUCKETS]):
            column = summary[:, 3 + b]
            if not (column == column[0]).all():
                differ = [ranks[r] for r in range(len(ranks)) if column[r] != column[0]]
                raise ValueError(
                    f"bucket '{name}' is specified differently on ranks {differ} than on rank "
                    f"{ranks[0]} (parameters, shapes, dtypes or placements differ)"
                )
        raise ValueError(f"bucket specs differ across ranks {ranks} (a bucket past the first 16)")
