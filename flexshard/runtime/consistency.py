"""Detect bucket specs that differ across ranks before they can hang a collective."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..placements import Placement
from .groups import MeshGroups

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


def _gather(values: list[int], group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    local = torch.tensor(values, dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group) * len(values), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, local, group=group)
    return out.view(dist.get_world_size(group), len(values)).cpu()


#: buckets whose own digest travels in the one exchange, so a mismatch can be named
NAMED_BUCKETS = 16


def check_same_plan(
    groups: MeshGroups, plans: Sequence[Plan], local_error: Exception | None = None
) -> None:
    """One small fixed-size all-gather per group, all of them before anything is
    raised: every rank must plan the same buckets with the same parameters, shapes,
    dtypes and placements, and none may have failed validation. Raises on every rank
    (a rank whose own validation failed raises its own error)."""
    digests = [_bucket_digest(*plan) for plan in plans]
    named = (digests + [0] * NAMED_BUCKETS)[:NAMED_BUCKETS]
    mine = [int(local_error is not None), len(digests), _digest(repr(digests)), *named]
    summaries = [
        (group, _gather(mine, group, groups.device))
        for group in (groups.shard, groups.replicate)
        if group is not None and dist.get_world_size(group) > 1
    ]
    if local_error is not None:
        raise local_error
    for group, summary in summaries:
        ranks = dist.get_process_group_ranks(group)
        if summary[:, 0].any():
            bad = [ranks[r] for r in range(len(ranks)) if summary[r, 0]]
            raise ValueError(f"bucket specs failed validation on ranks {bad}; see their errors")
        if (summary == summary[0]).all():
            continue
        counts = summary[:, 1].tolist()
        if len(set(counts)) > 1:
            raise ValueError(
                f"bucket specs differ across ranks: ranks {ranks} plan {counts} buckets"
            )
        for b, (name, _, _) in enumerate(plans[:NAMED_BUCKETS]):
            column = summary[:, 3 + b]
            if not (column == column[0]).all():
                differ = [ranks[r] for r in range(len(ranks)) if column[r] != column[0]]
                raise ValueError(
                    f"bucket '{name}' is specified differently on ranks {differ} than on rank "
                    f"{ranks[0]} (parameters, shapes, dtypes or placements differ)"
                )
        raise ValueError(f"bucket specs differ across ranks {ranks} (a bucket past the first 16)")
