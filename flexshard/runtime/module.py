"""FlexShardModule: the methods a sharded module gains (FSDP2's FSDPModule names)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .bucket import Bucket


def subtree_buckets(module: nn.Module) -> Iterator[Bucket]:
    for m in module.modules():
        yield from getattr(m, "_flexshard_buckets", ())


def _check_bool(method: str, name: str, value: object) -> None:
    # a truthy string ("no") would silently mean True
    if not isinstance(value, bool):
        raise TypeError(f"{method}: {name} must be a bool, got {value!r}")


class UnshardHandle:
    def __init__(self, buckets: list[Bucket]) -> None:
        self._buckets = buckets

    def wait(self) -> None:
        for bucket in self._buckets:
            bucket.unshard()


class FlexShardModule(nn.Module):
    """Mixed into the class of every module that ``flex_shard``/``fully_shard`` wrapped."""

    _flexshard_buckets: list[Bucket]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's buckets; with ``async_op`` return a handle to wait on."""
        _check_bool("unshard", "async_op", async_op)
        buckets = list(self._flexshard_buckets)
        for bucket in buckets:
            bucket.unshard(async_op=True)
        handle = UnshardHandle(buckets)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        for bucket in self._flexshard_buckets:
            bucket.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: keep unsharded gradients across backward passes and reduce nothing
        (gradient accumulation); the next backward with True reduces the sum."""
        _check_bool("set_requires_gradient_sync", "requires_gradient_sync", requires_gradient_sync)
        _check_bool("set_requires_gradient_sync", "recurse", recurse)
        buckets = subtree_buckets(self) if recurse else self._flexshard_buckets
        for bucket in buckets:
            bucket.requires_grad_sync = requires_gradient_sync

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        _check_bool("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward)
        _check_bool("set_reshard_after_forward", "recurse", recurse)
        buckets = subtree_buckets(self) if recurse else self._flexshard_buckets
        for bucket in buckets:
            bucket.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False: keep the gathered parameters after backward, so the next microbatch's
        forward and backward need no all-gather (pipeline schedules set it for every
        microbatch but the last, as torch does for FSDP2)."""
        _check_bool("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward)
        _check_bool("set_reshard_after_backward", "recurse", recurse)
        buckets = subtree_buckets(self) if recurse else self._flexshard_buckets
        for bucket in buckets:
            bucket.reshard_after_backward = reshard_after_backward

    def set_check_finite_grads(self, check_finite_grads: bool, *, recurse: bool = True) -> None:
        """True: after every backward, raise FloatingPointError on every rank if a
        gradient holds a NaN or an inf on any rank, naming the parameter, bucket and
        rank (one small all-gather per backward). Off (default): no cost at all. Every
        rank must set the same."""
        _check_bool("set_check_finite_grads", "check_finite_grads", check_finite_grads)
        _check_bool("set_check_finite_grads", "recurse", recurse)
        buckets = subtree_buckets(self) if recurse else self._flexshard_buckets
        for bucket in buckets:
            bucket.check_finite = check_finite_grads

    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """Per bucket: collectives issued and bytes this rank sent and received since
        the last reset, plus a ``"total"`` entry."""
        _check_bool("comm_stats", "reset", reset)
        stats: dict[str, dict[str, int]] = {}
        total: dict[str, int] = {}
        for bucket in subtree_buckets(self):
            entry = bucket.comm.stats.as_dict()
            key, copy = bucket.name, 1
            while key in stats:  # fully_shard buckets share a class name until named
                copy += 1
                key = f"{bucket.name}#{copy}"
            stats[key] = entry
            for key, value in entry.items():
                total[key] = total.get(key, 0) + value
            if reset:
                bucket.comm.reset_stats()
        stats["total"] = total
        return stats

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # nn.Module._apply gives every parameter a new tensor (to_empty, .to(device)):
        # move the bucket storage the same way and make the parameters views again
        for bucket in self._flexshard_buckets:
            bucket.reshard()
        super()._apply(fn, recurse)
        for bucket in self._flexshard_buckets:
            bucket.rebind_storage(fn)
        return self


def make_flexshard_class(module: nn.Module) -> None:
    """Give ``module`` FlexShardModule's methods, as FSDP2 does with a dynamic subclass."""
    cls = type(module)
    if isinstance(module, FlexShardModule):
        return
    module.__class__ = type(f"FlexShard{cls.__name__}", (FlexShardModule, cls), {})
