"""The trainer's waits outside the layers' exchanges, bounded by ``parallelism.timeout_s``.

- ``all_reduce``: the trainer's own all-reduces (the step's loss, the MoE load counts)
  go through the runtime's ``Pending``: waited at most the timeout, then a
  ``CollectiveError`` naming the all-reduce and what it belongs to.
- ``in_flight``: the collectives torch issues itself on the trainer's groups (TP's
  DTensor redistributions, the pipeline schedule's sends and receives, FSDP2's) wait as
  long as their group's timeout, which the trainer's mesh sets to ``timeout_s``
  (``trainer/parallel/dims.py``). A backend failure raised within this context (gloo's timeout, a
  pair a peer closed) becomes a ``CollectiveError`` naming what was running and the
  groups; flexshard's own CollectiveErrors (buckets, EP / CP exchanges) pass through.

After either, the group a rank failed on stays broken: restart from a checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flexshard.runtime.collectives import (
    DEFAULT_TIMEOUT,
    CollectiveError,
    Pending,
    backend_failures_raise,
)
from flexshard.torch_internals import gloo_timeout

if TYPE_CHECKING:
    from .dims import Meshes

#: what is left after a failed wait on a trainer group
_AFTERWARDS = "the process group is unusable now: restart from the last complete checkpoint"


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    collective: str,
    of: str,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
) -> torch.Tensor:
    """``dist.all_reduce(tensor, op, group)`` in place, waited at most ``timeout``; a
    failure raises a CollectiveError "``collective`` of ``of`` ..." (e.g. "loss
    all-reduce of training step 3"). ``group`` None: the world."""
    group = group if group is not None else dist.group.WORLD
    assert group is not None
    Pending.launch(
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        collective,
        of,
        timeout,
        group,
        subject=of,
        afterwards=_AFTERWARDS,
    ).wait()
    return tensor


def all_reduce_over(
    groups: list[dist.ProcessGroup], collective: str, timeout: datetime.timedelta
) -> Callable[[torch.Tensor, str], None]:
    """``tensor, of -> None``: ``all_reduce`` (sum) over each of ``groups`` in turn (e.g.
    dp_replicate, then dp_shard_cp), for a model's code that sums over the ranks without
    knowing the mesh (the MoE load)."""

    def reduce(tensor: torch.Tensor, of: str) -> None:
        for group in groups:
            all_reduce(tensor, group, collective, of, timeout)

    return reduce


def _ranks(groups: Mapping[str, dist.ProcessGroup | None]) -> str:
    return ", ".join(
        f"{name} group ranks {dist.get_process_group_ranks(group)}"
        for name, group in groups.items()
        if group is not None
    )


def _timeout_of(groups: Mapping[str, dist.ProcessGroup | None]) -> datetime.timedelta | None:
    """The first gloo group's own timeout, for a message (None: not known)."""
    for group in groups.values():
        try:
            return gloo_timeout(group)  # type: ignore[arg-type]
        except (AttributeError, RuntimeError):
            continue
    return None


@contextlib.contextmanager
def in_flight(
    what: str,
    of: str,
    groups: Mapping[str, dist.ProcessGroup | None],
    timeout: datetime.timedelta | None = None,
) -> Iterator[None]:
    """Run ``what`` (of ``of``), whose collectives are torch's on ``groups`` (by name:
    {"tp": ..., "pp": ...}); a backend failure raises a CollectiveError naming them.
    ``timeout``: the groups' own, for the message."""

    def error(err: BaseException, cause: str) -> CollectiveError:
        rank = dist.get_rank()
        limit_of = timeout if timeout is not None else _timeout_of(groups)
        limit = f"timeout {limit_of.total_seconds():g} s" if limit_of is not None else "its timeout"
        message = (
            f"flexshard: {what} of {of} failed on rank {rank} ({_ranks(groups)}; {limit}): "
            f"a rank of the group died, stalled or skipped a collective; {_AFTERWARDS} "
            f"[backend: {cause}]"
        )
        return CollectiveError(message, bucket=of, collective=what, rank=rank)

    # flexshard's own errors are already named: the note says where they struck
    with backend_failures_raise(error, note=f"flexshard: raised in {what} of {of}"):
        yield


def step_in_flight(meshes: Meshes, step: int, timeout: datetime.timedelta) -> Any:
    """``in_flight`` for a training step's forward and backward: the collectives torch
    issues there run on the tp mesh (DTensor) and the pp mesh (the schedule's sends)."""
    named = {"tp": meshes.tp, "pp": meshes.pp}
    groups = {name: mesh.get_group() for name, mesh in named.items() if mesh is not None}
    return in_flight("forward and backward", f"training step {step}", groups, timeout)
