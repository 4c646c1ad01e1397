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


def check_same_plan(groups: MeshGroups, plans: Sequence[Plan]) -> None:
    """One small fixed-size all-gather per group: every rank must plan the same buckets
    with the same parameters, shapes, dtypes and placements. Raises on every rank."""
    digests = [_bucket_digest(*plan) for plan in plans]
    for group in (groups.shard, groups.replicate):
        if group is None or dist.get_world_size(group) == 1:
            continue
        summary = _gather([len(digests), _digest(repr(digests))], group, groups.device)
        if (summary == summary[0]).all():
            continue
        ranks = dist.get_process_group_ranks(group)
        counts = summary[:, 0].tolist()
        if len(set(counts)) > 1:
            raise ValueError(
                f"bucket specs differ across ranks: ranks {ranks} plan {counts} buckets"
            )
        per_bucket = _gather(digests, group, groups.device)
        for b, (name, _, _) in enumerate(plans):
            column = per_bucket[:, b]
            if not (column == column[0]).all():
                differ = [ranks[r] for r in range(len(ranks)) if column[r] != column[0]]
                raise ValueError(
                    f"bucket '{name}' is specified differently on ranks {differ} than on rank "
                    f"{ranks[0]} (parameters, shapes, dtypes or placements differ)"
                )
