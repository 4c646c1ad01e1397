"""One bucket's collectives: async launch, byte accounting, failures that name the bucket."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: how long a bucket waits for one collective before it raises (overridable per model)
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass
class CommStats:
    """Collectives a bucket issued and the bytes one rank sent and received.

    Bytes follow the ring algorithm every backend uses for large messages: an
    all-gather or reduce-scatter of a ``[W, S]`` buffer moves ``(W - 1) * S`` elements
    each way per rank; an all-reduce of N elements moves ``2 (W - 1) / W * N``.
    """

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    all_gather_bytes: int = 0  # of bytes_sent: the parameter all-gathers alone

    @property
    def collectives(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce

    def as_dict(self) -> dict[str, int]:
        return {
            "collectives": self.collectives,
            "all_gather": self.all_gather,
            "reduce_scatter": self.reduce_scatter,
            "all_reduce": self.all_reduce,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "all_gather_bytes": self.all_gather_bytes,
        }


class Pending:
    """An in-flight collective; ``wait`` raises naming the bucket if it fails or stalls."""

    def __init__(self, work: dist.Work | None, what: str, timeout: datetime.timedelta) -> None:
        self.work = work
        self.what = what
        self.timeout = timeout

    def wait(self) -> None:
        if self.work is None:
            return
        work, self.work = self.work, None
        try:
            ok = work.wait(self.timeout)
        except Exception as err:  # gloo raises on a dead peer or its own timeout
            raise RuntimeError(f"flexshard: {self.what} failed: {err}") from err
        if ok is False:
            raise RuntimeError(
                f"flexshard: {self.what} did not finish within {self.timeout}; a rank may "
                "have died or stalled"
            )


class BucketComm:
    """The collectives of one bucket, on its shard group and, for HSDP, its replicate
    group. Every rank issues them in the same order: gathers in forward order and
    its reverse, gradient reductions in a fixed queue (see hooks.StepState)."""

    def __init__(
        self,
        bucket: str,
        shard_group: dist.ProcessGroup,
        replicate_group: dist.ProcessGroup | None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        self.bucket = bucket
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.world_size = dist.get_world_size(shard_group)
        self.timeout = timeout
        self.stats = CommStats()

    def reset_stats(self) -> None:
        self.stats = CommStats()

    def _count(self, kind: str, moved: int) -> None:
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        self.stats.bytes_sent += moved
        self.stats.bytes_received += moved
        if kind == "all_gather":
            self.stats.all_gather_bytes += moved

    def all_gather(self, out: torch.Tensor, local: torch.Tensor) -> Pending:
        work = dist.all_gather_single(out, local, group=self.shard_group, async_op=True)
        self._count("all_gather", (self.world_size - 1) * local.numel() * local.element_size())
        return Pending(work, f"all-gather of bucket '{self.bucket}'", self.timeout)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> Pending:
        work = dist.reduce_scatter_single(
            out, full, op=dist.ReduceOp.AVG, group=self.shard_group, async_op=True
        )
        self._count("reduce_scatter", (self.world_size - 1) * out.numel() * out.element_size())
        return Pending(work, f"reduce-scatter of bucket '{self.bucket}'", self.timeout)

    def all_reduce(self, tensor: torch.Tensor, replicas: bool = False) -> Pending:
        """Average ``tensor`` over the shard group, or over the replicas (HSDP)."""
        group = self.replicate_group if replicas else self.shard_group
        size = dist.get_world_size(group)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=True)
        self._count("all_reduce", 2 * (size - 1) * tensor.numel() * tensor.element_size() // size)
        where = "across replicas " if replicas else ""
        return Pending(work, f"all-reduce {where}of bucket '{self.bucket}'", self.timeout)
