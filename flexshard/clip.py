"""Gradient clipping over sharded gradients: the norm of the whole model, not the shard."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .runtime.bucket import Bucket
from .runtime.collectives import Pending
from .runtime.module import subtree_buckets
from .runtime.tp_params import tp_group, tp_sharded


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every bucket's gradient shards so that the gradient of the full model has
    at most ``max_norm``; return the full model's gradient norm (the same on every rank).

    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on flexshard's local
    shards would clip each rank by its own shard's norm and let the ranks drift apart.
    One all-reduce over the shard group; Replicate buckets count once.
    """
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"clip_grad_norm_: {name} must be a number, got {value!r}")
    if not max_norm >= 0:  # also rejects NaN
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or inf), got {norm_type}")
    buckets = list(subtree_buckets(module))
    if not buckets:
        raise ValueError("clip_grad_norm_ needs a module sharded by flexshard")
    group = buckets[0].comm.shard_group
    if any(b.comm.shard_group is not group for b in buckets):
        raise ValueError(
            "clip_grad_norm_: the module's buckets use different shard groups: "
            f"{[b.name for b in buckets]}"
        )
    device = buckets[0].storage.device
    # [parameters split over tp, the others]: tensor-parallel pieces also sum over tp
    partial = torch.zeros(2, dtype=torch.float32, device=device)
    tp_groups = set()
    for bucket in buckets:
        if bucket.layout.replicated and bucket.rank != 0:
            continue  # every rank holds the same Replicate gradients: count them once
        for i, param in enumerate(bucket.params):
            if param.tp_spec is not None:
                tp_groups.add(tp_group(param.tp_spec))
            grad = bucket.local_grad(i)
            if grad is None or grad.numel() == 0:
                continue
            norm = torch.linalg.vector_norm(grad.float(), norm_type)
            slot = 0 if tp_sharded(param.tp_spec) else 1
            partial[slot] = (
                torch.maximum(partial[slot], norm)
                if norm_type == float("inf")
                else (partial[slot] + norm**norm_type)
            )
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    if len(tp_groups) > 1:
        raise ValueError("clip_grad_norm_: the module's TP parameters use different tp meshes")
    names = ", ".join(b.name for b in buckets)
    _all_reduce(partial, op, group, "clip_grad_norm_ all-reduce", names, buckets[0])
    if tp_groups:
        tp = tp_groups.pop()
        _all_reduce(partial[0:1], op, tp, "clip_grad_norm_ tp all-reduce", names, buckets[0])
    partial = partial.max() if norm_type == float("inf") else partial.sum()
    total = partial if norm_type == float("inf") else partial ** (1.0 / norm_type)
    scale_grads(buckets, max_norm, total)
    return total


def _all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp,
    group: dist.ProcessGroup,
    collective: str,
    names: str,
    bucket: Bucket,
) -> None:
    """An all-reduce bounded by the model's timeout (a CollectiveError naming the
    buckets where a peer stalls or dies), not by the backend's own default."""
    Pending.launch(
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        collective,
        names,
        bucket.comm.timeout,
        group,
        runtime=bucket.runtime(),
    ).wait()


def scale_grads(buckets: Sequence[Bucket], max_norm: float, total: torch.Tensor) -> None:
    """Scale every local gradient so that a total norm ``total`` becomes ``max_norm``
    (never scaled up)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for bucket in buckets:
        for i in range(len(bucket.params)):
            grad = bucket.local_grad(i)
            if grad is not None:
                grad.mul_(coef.to(grad.dtype))
