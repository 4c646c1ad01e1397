"""Checkpoint I/O bounded by the model's timeout.

DCP's collectives (plan gathers, scatters, barriers) and the manifest's all-gathers
run on the group they are given and wait as long as that group's timeout, 30 minutes
by default on gloo. ``save`` / ``load`` run them instead on a copy of the group made
with the timeout (the model's flexshard timeout unless told otherwise; one copy per
group and timeout, created on first use), so a peer that stalls or dies mid-save
makes the others fail within it; ``in_flight`` turns the backend's failure into a
``CollectiveError`` naming the checkpoint step and path. ``Ranks`` is what ``save`` /
``load`` run on: the group (or this process alone), its path and timeout.

A group a rank failed on stays broken (the ranks no longer agree on what was sent),
as a bucket's does: the job restarts from its last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
from torch import nn

from ..runtime.collectives import CollectiveError, backend_failures_raise, check_timeout
from ..runtime.module import subtree_buckets

_GROUPS: dict[tuple[tuple[int, ...], float, str], dist.ProcessGroup] = {}


def model_timeout(modules: Iterable[nn.Module]) -> datetime.timedelta | None:
    """The shortest flexshard timeout among the modules' buckets (None: no bucket)."""
    timeouts = [b.comm.timeout for m in modules for b in subtree_buckets(m)]
    return min(timeouts, default=None)


def bounded_group(group: dist.ProcessGroup, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A process group of ``group``'s ranks and backend whose collectives time out after
    ``timeout``. Every rank of ``group`` calls this (with the same arguments) the first
    time; the group is kept for later calls."""
    check_timeout(timeout)
    ranks = tuple(dist.get_process_group_ranks(group))
    backend = str(dist.get_backend(group))
    key = (ranks, timeout.total_seconds(), backend)
    cached = _GROUPS.get(key)
    if cached is not None:
        try:  # a group of a process group torn down since is gone
            dist.get_process_group_ranks(cached)
            return cached
        except (RuntimeError, ValueError, KeyError):
            del _GROUPS[key]
    made = dist.new_group(
        list(ranks), timeout=timeout, backend=backend, use_local_synchronization=True
    )
    assert made is not None  # every caller is a member
    _GROUPS[key] = made
    return made


def abandon(group: dist.ProcessGroup) -> None:
    """Tear down a bounded group a rank failed on (it is broken): peers still blocked
    on this rank in it fail at once, not at their timeout. A group not made by
    ``bounded_group`` is left alone."""
    for key, made in list(_GROUPS.items()):
        if made is group:
            del _GROUPS[key]
            dist.destroy_process_group(group)


@contextlib.contextmanager
def in_flight(
    step: str, path: str, group: dist.ProcessGroup | None, timeout: datetime.timedelta | None
) -> Iterator[None]:
    """Run a checkpoint step's collectives; a backend failure (timeout, lost peer)
    raises a CollectiveError naming ``step`` and ``path``."""
    if group is None:  # this process alone: nothing to convert
        yield
        return

    def error(err: BaseException, cause: str) -> CollectiveError:
        rank = dist.get_rank()
        members = dist.get_process_group_ranks(group)
        limit = f"timeout {timeout.total_seconds():g} s" if timeout is not None else "no timeout"
        message = (
            f"flexshard: {step} of checkpoint '{path}' failed on rank {rank} (group ranks "
            f"{members}, {limit}): a rank of the group died, stalled or skipped it; the "
            f"checkpoint is incomplete [backend: {cause}]"
        )
        return CollectiveError(message, bucket=f"checkpoint '{path}'", collective=step, rank=rank)

    with backend_failures_raise(error):
        yield


class Progress(Protocol):
    """What a load's progress (``load_progress.LoadProgress``) gives the checks: a
    context per collective that notes the rank reached it."""

    def collective(self, what: str) -> Any: ...


@dataclass(frozen=True)
class Ranks:
    """The ranks taking part (a process group, or this process alone); with a
    ``timeout``, their collectives run on a copy of the group bounded by it, and a
    peer that stalls or dies raises a CollectiveError naming the step and ``path``;
    with a load's ``progress``, also the ranks that never reached it."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    path: str = ""
    timeout: datetime.timedelta | None = None
    progress: Progress | None = None  # a load's: its checks note each step reached

    @staticmethod
    def of(
        group: dist.ProcessGroup | None,
        path: str = "",
        timeout: datetime.timedelta | None = None,
    ) -> Ranks:
        if not dist.is_initialized():
            return Ranks(None, 0, 1, path)
        group = group or dist.group.WORLD
        if timeout is not None:
            with in_flight("set-up of the bounded checkpoint group", path, group, timeout):
                group = bounded_group(group, timeout)
        return Ranks(group, dist.get_rank(group), dist.get_world_size(group), path, timeout)

    @property
    def no_dist(self) -> bool:
        return self.group is None

    def step(self, what: str) -> Any:
        """A context in which ``what``'s collectives run (their failure names it)."""
        if self.progress is not None:
            return self.progress.collective(what)
        return in_flight(what, self.path, self.group, self.timeout)

    def barrier(self, what: str = "barrier") -> None:
        if self.group is not None:
            with self.step(what):
                dist.barrier(group=self.group)

    def all_gather(self, value: Any, what: str = "all-gather") -> list[Any]:
        if self.group is None:
            return [value]
        out: list[Any] = [None] * self.world
        with self.step(what):
            dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast(self, value: Any, what: str = "broadcast") -> Any:
        """Rank 0's ``value``, on every rank (the others pass anything)."""
        if self.group is None:
            return value
        box = [value]
        with self.step(what):
            dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]
