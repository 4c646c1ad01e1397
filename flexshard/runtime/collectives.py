"""One bucket's collectives: async launch, byte accounting, failures that name the bucket.

Bounded waits on collective work whose own ``wait(timeout)`` ignores the timeout
(gloo's reduce-scatter in torch 2.13): a helper thread waits, the caller gives up.

Timeouts without blocking: a thread polls the events of stream-ordered collectives
(CUDA/NCCL) and fails the ones past their deadline, so the CPU never waits on them.

The one converter of a backend failure (a collective torch ran itself timed out or
lost a peer) into flexshard's ``CollectiveError``, for code that runs torch's own
collectives (checkpoint I/O, the trainer's waits).

Process groups for a bucket, resolved from a DeviceMesh (1-D: shard; 2-D: replicate x shard).

Traffic besides the buckets': collectives that code around a sharded model issues
itself (the trainer's expert-parallel all-to-alls, context-parallel K/V exchanges)
and wants counted in ``FlexShardModule.comm_stats()``.

``attach_traffic(module, kind, stats)`` hangs a ``TrafficStats`` on ``module``; every
flexshard module at or above ``module`` then reports the sum of its subtree's stats of
that ``kind`` as ``comm_stats()[kind]``, adds it to ``"total"`` and resets it with
``reset=True``. Whoever issues the collectives ``record``\\ s them on the stats (this
module imports nothing of theirs: the dependency stays one way)."""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..torch_internals import all_gather_single, reduce_scatter_single
from .device import HOST, DeviceRuntime, abort, device_runtime


class _WaitThread:
    """A long-lived thread that runs ``work.wait()`` for waits that must give up after
    a timeout the work itself ignores: a thread started per wait cost more than the
    wait of a small bucket. Waits are handed over one at a time; a wait that timed out
    leaves this thread blocked for good (harmlessly), and the next wait gets a new one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # outcomes come back one per job; a queue of its own per thread, so a thread
        # dropped after a timeout can never hand its late outcome to another wait
        self._outcomes: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="flexshard-wait", daemon=True).start()

    def _serve(self) -> None:
        while True:
            work = self._jobs.get()
            try:
                outcome = work.wait()
            except BaseException as err:
                outcome = err
            self._outcomes.put(outcome)

    def wait(self, work: dist.Work, seconds: float) -> bool | BaseException | None:
        """``work.wait()``'s result or exception; None when it did not end in time."""
        self._jobs.put(work)
        try:  # SimpleQueue's timed get: no Python-level lock hand-off per wait
            return self._outcomes.get(timeout=seconds)
        except queue.Empty:
            return None


#: waiter threads not waiting now (a caller takes one, or starts one, and gives it back)
_idle_waiters: list[_WaitThread] = []


def wait_in_thread(work: dist.Work, seconds: float) -> bool:
    """``work.wait()`` given up after ``seconds`` (False then; the backend's failure
    raises). gloo's reduce-scatter work (torch 2.13) ignores wait's timeout and never
    reports ``is_completed``, so a helper thread waits (and stays blocked, harmlessly,
    when the peer never comes)."""
    try:
        waiter = _idle_waiters.pop()
    except IndexError:
        waiter = _WaitThread()
    outcome = waiter.wait(work, seconds)
    if outcome is None:  # a waiter blocked on a peer that never comes is dropped
        return False
    _idle_waiters.append(waiter)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome is not False


class Event(Protocol):
    def query(self) -> bool: ...


class Watched(Protocol):
    """What the watchdog polls: a Pending of runtime/collectives.py."""

    event: Event | None
    started: float
    error: Any

    def timed_out(self) -> Any: ...


class Watchdog:
    """Polls watched collectives every ``interval`` s. One past its timeout gets its
    ``error`` set (``timed_out()``, a CollectiveError naming bucket, collective and
    rank), becomes the sticky ``failure`` every later ``check`` raises, and
    ``on_timeout`` runs (abort the group so stuck kernels exit)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.failure: BaseException | None = None
        self._watched: list[tuple[Watched, float, Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, pending: Watched, seconds: float, on_timeout: Callable[[], None]) -> None:
        with self._lock:
            self._watched.append((pending, pending.started + seconds, on_timeout))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="flexshard-watchdog", daemon=True
                )
                self._thread.start()

    def check(self) -> None:
        """Raise the collective failure the thread found, if any (on the main thread)."""
        if self.failure is not None:
            raise self.failure

    def poll(self) -> None:
        """One pass: forget completed collectives, fail those past their deadline."""
        now = time.monotonic()
        with self._lock:
            live, expired = [], []
            for entry in self._watched:
                pending, deadline, _ = entry
                if pending.event is None or pending.event.query():
                    continue
                (expired if now >= deadline else live).append(entry)
            self._watched = live
        for pending, _, on_timeout in expired:
            pending.error = pending.timed_out()
            if self.failure is None:
                self.failure = pending.error
            on_timeout()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval)
            self.poll()


#: the process's watchdog (stream-ordered collectives only; gloo waits block instead)
WATCHDOG = Watchdog()


_HasComm = TypeVar("_HasComm")  # a Bucket (runtime/bucket.py imports this file)

#: how long a bucket waits for one collective before it raises (overridable per model)
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
# [Note: collectives without streams] gloo (CPU) runs a collective on its own thread
# on a temporary copy of the whole buffer (an all-gather's output; 1.5x a
# reduce-scatter's input): left in flight beside compute, that copy sits on top of the
# compute's peak. So without streams a bucket's collective is waited for at launch, as
# FSDP2's block on CPU (its unshard_async_op is False), except
# - forward's prefetches: the step's peak is in backward (every activation saved,
#   gradients arriving), so a next bucket's all-gather in flight beside forward compute
#   does not raise it, and forward stops waiting on the wire;
# - gradient reduce-scatters: one is left in flight beside the next bucket's backward
#   (at most ``hooks.MAX_PENDING_REDUCTIONS``, FSDP2's 1), as FSDP2's reduce-scatter
#   stream runs on CUDA, for one bucket's gradient buffer and gloo's copy of it.
# CUDA/NCCL: every collective is stream-ordered. flexshard/plan models the same rule.


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


def check_timeout(timeout: object) -> None:
    """The ``timeout`` of flex_shard/fully_shard: how long any one collective may take."""
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta (how long one collective may take), "
            f"got {timeout!r}"
        )
    if timeout <= datetime.timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout}")


class CollectiveError(RuntimeError):
    """A bucket's collective failed or did not complete within the timeout: a rank of
    its group died, stalled or skipped it. The process group is unusable afterwards,
    the local shards are as they were before the step (restart from a checkpoint).

    ``backend_error``: what the backend raised, when it noticed first (its first line
    is in the message). Kept here, not chained: a chained cause is printed first, and
    the first error line a user reads must name the collective, whichever wait won."""

    def __init__(
        self,
        message: str,
        *,
        bucket: str,
        collective: str,
        rank: int,
        backend_error: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.collective = collective
        self.rank = rank
        self.backend_error = backend_error


#: what gloo's and NCCL's failures say (a timeout, a peer that closed its pair)
_BACKEND_SIGNS = ("gloo", "Timed out", "timed out", "pair closure", "Connection closed", "NCCL")


def is_backend_failure(err: BaseException) -> bool:
    """A collective torch ran itself that timed out or lost a peer (flexshard's own
    CollectiveErrors are not: they already name what failed)."""
    if isinstance(err, CollectiveError):
        return False
    text = str(err)
    return isinstance(err, dist.DistError) or any(sign in text for sign in _BACKEND_SIGNS)


def backend_cause(err: BaseException) -> str:
    """The first line of a backend failure, for a CollectiveError's message."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


#: what c10d's ``Work.wait(timeout)`` raises (a RuntimeError) when that timeout passes
_WAIT_TIMED_OUT = "Operation timed out!"


def _wait_gave_up(err: BaseException) -> bool:
    """``err`` is a bounded ``work.wait(timeout)`` giving up (flexshard's own timeout),
    not the backend's failure: the backend's own timeout says "Timed out waiting Nms"."""
    return isinstance(err, RuntimeError) and str(err).strip() == _WAIT_TIMED_OUT


#: what a bucket's failed collective leaves: its error's last words
SHARDS_UNCHANGED = "the process group is unusable now, the local shards are unchanged"


class Pending:
    """An in-flight collective; ``wait`` raises a CollectiveError naming the bucket and
    the collective if it fails or does not complete within ``timeout``.

    A failure is sticky: the work (and the buffers it writes) is kept and every later
    ``wait`` raises the same error, so a caller that retries never frees or reads a
    buffer that gloo's thread may still write into.

    Stream-ordered (CUDA/NCCL, ``event`` set): ``wait`` makes the current stream wait
    on the event and never blocks the CPU; the watchdog enforces the timeout."""

    def __init__(
        self,
        work: dist.Work | None,
        collective: str,
        bucket: str,
        timeout: datetime.timedelta,
        group: dist.ProcessGroup | None = None,
        wait_ignores_timeout: bool = False,
        subject: str | None = None,
        afterwards: str = SHARDS_UNCHANGED,
    ) -> None:
        self.work = work
        #: what the error names as the collective's owner, and what it says is left
        self.subject = subject if subject is not None else f"bucket '{bucket}'"
        self.afterwards = afterwards
        self.wait_ignores_timeout = wait_ignores_timeout
        self.collective = collective
        self.bucket = bucket
        self.timeout = timeout
        self.group = group
        self.started = time.monotonic()
        self.error: CollectiveError | None = None
        self.runtime = HOST
        self.event: torch.cuda.Event | None = None  # stream-ordered: marks completion
        self._stream_waited = False
        #: buffers the collective reads (its input): alive until it completed
        self.keep: tuple[torch.Tensor, ...] = ()
        #: local work that turns what landed into the result (a ragged reduction's sum
        #: over the ranks' rows), run once by the first ``wait`` after it completed
        self.then: Callable[[], None] | None = None

    @classmethod
    def launch(
        cls,
        start: Callable[[], dist.Work | None],
        collective: str,
        bucket: str,
        timeout: datetime.timedelta,
        group: dist.ProcessGroup,
        wait_ignores_timeout: bool = False,
        runtime: DeviceRuntime = HOST,
        subject: str | None = None,
        afterwards: str = SHARDS_UNCHANGED,
    ) -> Pending:
        """Issue a collective; a group already broken can refuse it at once. On a
        stream-ordered ``runtime`` the current stream is made to wait on it at once.
        ``subject``: what its error names (default: the bucket); ``afterwards``: what
        that error says is left."""
        if WATCHDOG.failure is not None:  # a collective that timed out earlier broke the group
            WATCHDOG.check()
        pending = cls(
            None, collective, bucket, timeout, group, wait_ignores_timeout, subject, afterwards
        )
        pending.runtime = runtime
        try:
            pending.work = start()
            if runtime.streams:  # else waits block the CPU (gloo): no event
                pending.event = runtime.enqueue_wait(pending.work)
        except Exception as err:
            pending.error = pending._error(err)
            raise pending.error from None  # the backend's words are in its message
        if pending.event is not None:
            WATCHDOG.watch(pending, timeout.total_seconds(), lambda: abort(group))
        return pending

    def timed_out(self) -> CollectiveError:
        """The error the watchdog sets when the collective passed its timeout."""
        return self._error(None)

    def _error(self, cause: BaseException | None) -> CollectiveError:
        rank = dist.get_rank()
        members = dist.get_process_group_ranks(self.group) if self.group is not None else []
        elapsed = time.monotonic() - self.started
        seconds = self.timeout.total_seconds()
        what = (
            f"did not complete within the timeout ({seconds:g} s)"
            if elapsed + 0.05 >= seconds  # wait() gives up at the timeout to the clock tick
            else f"failed {elapsed:.1f} s after launch (timeout {seconds:g} s)"
        )
        message = (
            f"flexshard: {self.collective} of {self.subject} {what} on rank {rank} "
            f"(group ranks {members}): a rank of the group died, stalled or skipped this "
            f"collective; {self.afterwards}"
        )
        if cause is not None:
            message += f" [backend: {backend_cause(cause)}]"
        return CollectiveError(
            message,
            bucket=self.bucket,
            collective=self.collective,
            rank=rank,
            backend_error=cause,
        )

    def wait(self) -> None:
        if self.error is not None:
            raise self.error
        if self.event is not None:  # CUDA/NCCL: the current stream waits, the CPU does not
            WATCHDOG.check()
            if not self._stream_waited:
                self.runtime.wait(self.event)
                self._stream_waited = True
            self.keep = ()  # the compute stream is past the collective
            self._then()
            return
        if self.work is None:
            if self.then is not None:
                self._then()
            return
        # the clock runs from launch: a prefetch waited on late gets no extra time
        left = max(self.timeout.total_seconds() - (time.monotonic() - self.started), 0.001)
        try:
            if self.wait_ignores_timeout:
                ok = wait_in_thread(self.work, left)
            else:  # gloo's all-gather and all-reduce: it blocks this thread (NCCL gets
                # here only for the one-time set-up agreement; buckets are stream-ordered)
                ok = self.work.wait(datetime.timedelta(seconds=left))
        except Exception as err:  # our timeout, gloo's own, or a peer that closed
            # whichever noticed first, the same error: not chained (see CollectiveError)
            self.error = self._error(None if _wait_gave_up(err) else err)
            raise self.error from None
        if ok is False:
            self.error = self._error(None)
            raise self.error
        self.work = None
        self.keep = ()
        if self.then is not None:
            self._then()

    def _then(self) -> None:
        then, self.then = self.then, None
        if then is not None:
            then()


def by_process_group(buckets: Sequence[_HasComm]) -> list[list[_HasComm]]:
    """``buckets`` (anything with a ``comm``) grouped by their shard and replicate
    groups, in first-seen order: buckets over other groups agree among their own ranks,
    and every rank of a group sees its buckets in the same order."""
    groups: dict[tuple[int, int], list[_HasComm]] = {}
    for bucket in buckets:
        key = (id(bucket.comm.shard_group), id(bucket.comm.replicate_group))
        groups.setdefault(key, []).append(bucket)
    return list(groups.values())


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
        check_timeout(timeout)
        self.bucket = bucket
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.world_size = dist.get_world_size(shard_group)
        self.timeout = timeout
        self.stats = CommStats()
        # gloo's reduce-scatter ignores wait's timeout: waited for on a helper thread
        self._gloo = dist.get_backend(shard_group) == "gloo"
        self._landed: dict[tuple[str, int], Pending] = {}  # see ``_done``

    def reset_stats(self) -> None:
        self.stats = CommStats()

    def group(self, replicas: bool) -> dist.ProcessGroup | None:
        """The replicate group (HSDP; None without) or the shard group."""
        return self.replicate_group if replicas else self.shard_group

    def spanning(self) -> list[bool]:
        """What an exchange among every rank of the bucket goes over: ``replicas`` of
        each group with more than one rank, the shard group first (HSDP: then the
        replicas)."""
        groups = [(r, self.group(r)) for r in (False, True)]
        return [r for r, g in groups if g is not None and dist.get_world_size(g) > 1]

    def _count(
        self, kind: str, moved: int, payload: bool = True, received: int | None = None
    ) -> None:
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        self.stats.bytes_sent += moved
        self.stats.bytes_received += moved if received is None else received
        if kind == "all_gather" and payload:
            self.stats.all_gather_bytes += moved

    def _launch(
        self,
        start: Callable[[], dist.Work | None],
        collective: str,
        group: dist.ProcessGroup,
        tensor: torch.Tensor,
        wait_ignores_timeout: bool = False,
        keep: tuple[torch.Tensor, ...] = (),
        overlap: bool = False,
    ) -> Pending:
        runtime = device_runtime(tensor.device, group)
        pending = Pending.launch(
            start, collective, self.bucket, self.timeout, group, wait_ignores_timeout, runtime
        )
        pending.keep = keep
        if not runtime.streams and not overlap:  # [Note: collectives without streams]
            # a failure stays on ``pending``: it raises where the bucket waits, as before
            with contextlib.suppress(CollectiveError):
                pending.wait()
        return pending

    def _done(self, collective: str, group: dist.ProcessGroup) -> Pending:
        """A collective over a group of one rank: nothing to send, so none is issued
        (FSDP2 copies instead of calling c10d there too) and none is counted. One
        landed Pending per kind and group, made once: waiting on it changes nothing."""
        key = (collective, id(group))
        if key not in self._landed:
            self._landed[key] = Pending(None, collective, self.bucket, self.timeout, group)
        return self._landed[key]

    def all_gather(
        self, out: torch.Tensor, local: torch.Tensor, forward_prefetch: bool = False
    ) -> Pending:
        """``forward_prefetch``: left in flight on CPU too (see the Note above)."""
        group = self.shard_group
        if self.world_size == 1:
            if out.data_ptr() != local.data_ptr():  # not written in place already
                out.copy_(local.view(-1))
            return self._done("all-gather", group)
        pending = self._launch(
            lambda: all_gather_single(out, local, group=group, async_op=True),
            "all-gather",
            group,
            out,
            keep=(local,),
            overlap=forward_prefetch,
        )
        self._count("all_gather", (self.world_size - 1) * local.numel() * local.element_size())
        return pending

    def reduce_scatter(
        self, out: torch.Tensor, full: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.AVG
    ) -> Pending:
        group = self.shard_group
        if self.world_size == 1:  # the sum or average over one rank is its input
            out.copy_(full)
            return self._done("reduce-scatter", group)
        pending = self._launch(
            lambda: reduce_scatter_single(out, full, op=op, group=group, async_op=True),
            "reduce-scatter",
            group,
            out,
            wait_ignores_timeout=self._gloo,
            keep=(full,),
            overlap=True,
        )
        self._count("reduce_scatter", (self.world_size - 1) * out.numel() * out.element_size())
        return pending

    # [Note: collectives of per-rank sizes]
    # A ragged bucket's ranks hold unequal shares (a block's whole matrices over more
    # ranks than it has matrices: most ranks hold none of them). Its all-gather moves
    # exactly the ranks' shares back to back and its reduction lands exactly each
    # rank's share, so nothing travels or is held for padding. NCCL has both natively
    # (torch's list all_gather / reduce_scatter of per-rank sizes: grouped broadcasts
    # and reduces, the same bytes per link as the ring collectives). gloo has neither,
    # so there they are all-to-alls (gloo takes per-rank splits): the gather's input
    # repeats this rank's share once per peer, the reduction's output holds every
    # rank's contribution to this rank's share, summed here in rank order. Each is
    # still one collective per direction, counted as the all-gather and reduce-scatter
    # it stands for, with the bytes this rank really sends and receives.

    def all_gather_ragged(
        self,
        out: torch.Tensor,
        local: torch.Tensor,
        extents: Sequence[int],
        forward_prefetch: bool = False,
    ) -> Pending:
        """Every rank's ``local`` (``extents[r]`` elements from rank r) into ``out``,
        back to back (see the Note above)."""
        group = self.shard_group
        if self.world_size == 1:
            if out.data_ptr() != local.data_ptr():
                out.copy_(local.view(-1))
            return self._done("all-gather", group)
        mine, size = local.numel(), self.world_size
        if dist.get_backend(group) == "gloo":
            send = local.view(-1).repeat(size)
            splits = list(extents)

            def start() -> dist.Work | None:
                return dist.all_to_all_single(
                    out, send, splits, [mine] * size, group=group, async_op=True
                )

            keep: tuple[torch.Tensor, ...] = (send,)
        else:
            pieces = list(out.split(list(extents)))

            def start() -> dist.Work | None:
                return dist.all_gather(pieces, local.view(-1), group=group, async_op=True)

            keep = (local,)
        pending = self._launch(start, "all-gather", group, out, keep=keep, overlap=forward_prefetch)
        item = local.element_size()
        self._count("all_gather", (size - 1) * mine * item, received=(out.numel() - mine) * item)
        return pending

    def reduce_scatter_ragged(
        self,
        out: torch.Tensor,
        full: torch.Tensor,
        extents: Sequence[int],
        op: dist.ReduceOp = dist.ReduceOp.AVG,
    ) -> Pending:
        """Reduce ``full`` (every rank's share back to back, ``extents[r]`` elements for
        rank r) over the group into this rank's share ``out`` (see the Note above)."""
        group = self.shard_group
        if self.world_size == 1:
            out.copy_(full)
            return self._done("reduce-scatter", group)
        mine, size = out.numel(), self.world_size
        then: Callable[[], None] | None = None
        if dist.get_backend(group) == "gloo":
            landed = torch.empty(size * mine, dtype=out.dtype, device=out.device)
            rows = landed.view(size, mine)
            splits = list(extents)

            def start() -> dist.Work | None:
                return dist.all_to_all_single(
                    landed, full, [mine] * size, splits, group=group, async_op=True
                )

            def then() -> None:
                out.copy_(rows[0])
                for row in rows[1:]:  # rank order, the same on every run
                    out.add_(row)
                if op == dist.ReduceOp.AVG:
                    out.div_(size)

        else:
            pieces = list(full.split(list(extents)))

            def start() -> dist.Work | None:
                return dist.reduce_scatter(out, pieces, op=op, group=group, async_op=True)

        pending = self._launch(
            start,
            "reduce-scatter",
            group,
            out,
            wait_ignores_timeout=dist.get_backend(group) == "gloo",
            keep=(full,),
            overlap=True,
        )
        pending.then = then
        item = out.element_size()
        self._count(
            "reduce_scatter", (full.numel() - mine) * item, received=(size - 1) * mine * item
        )
        return pending

    def all_reduce(
        self, tensor: torch.Tensor, replicas: bool = False, op: dist.ReduceOp = dist.ReduceOp.AVG
    ) -> Pending:
        """Average (or ``op``) ``tensor`` over the shard group, or the replicas (HSDP)."""
        group = self.group(replicas)
        size = dist.get_world_size(group)
        if size == 1:
            return self._done("all-reduce", group)
        pending = self._launch(
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
            "all-reduce across replicas" if replicas else "all-reduce",
            group,
            tensor,
        )
        self._count("all_reduce", 2 * (size - 1) * tensor.numel() * tensor.element_size() // size)
        return pending

    def agree(
        self, flags: torch.Tensor, replicas: bool, record: Callable[[str, int, int], None]
    ) -> Pending:
        """The largest of every rank's ``flags`` (all-reduce MAX) over the shard group or
        the replicas: the ranks' agreement on the parameters none of them used (see
        runtime/hooks.py). Counted by ``record``, not in the bucket's stats."""
        group = self.group(replicas)
        size = dist.get_world_size(group)
        pending = self._launch(
            lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True),
            "unused-parameter agreement all-reduce",
            group,
            flags,
            keep=(flags,),  # alive until waited for, which may be a backward later
            overlap=True,  # the caller waits only when it needs the result
        )
        moved = 2 * (size - 1) * flags.numel() * flags.element_size() // size
        record("all_reduce", moved, moved)
        return pending

    def gather_flags(self, out: torch.Tensor, local: torch.Tensor, replicas: bool) -> Pending:
        """All-gather a few small integers (the opt-in finite-gradient check); counted
        as an all-gather, not as parameter bytes."""
        group = self.group(replicas)
        size = dist.get_world_size(group)
        if size == 1:
            out.copy_(local.view(-1))
            return self._done("finite-gradient check all-gather", group)
        pending = self._launch(
            lambda: all_gather_single(out, local, group=group, async_op=True),
            "finite-gradient check all-gather",
            group,
            out,
        )
        moved = (size - 1) * local.numel() * local.element_size()
        self._count("all_gather", moved, payload=False)
        return pending


@contextlib.contextmanager
def backend_failures_raise(
    error: Callable[[BaseException, str], CollectiveError], note: str | None = None
) -> Iterator[None]:
    """The one converter of a collective torch ran itself into flexshard's error: a
    backend failure (timeout, lost peer) raised inside becomes ``error(err, cause)``
    (``cause``: the backend's first line; the failure itself is its ``backend_error``);
    flexshard's own CollectiveErrors pass, with ``note`` added (where they struck)."""
    try:
        yield
    except CollectiveError as err:
        if note is not None:
            err.add_note(note)
        raise
    except Exception as err:
        if not is_backend_failure(err):
            raise
        named = error(err, backend_cause(err))
        named.backend_error = err
        raise named from None  # not chained: see CollectiveError


@dataclass(frozen=True)
class MeshGroups:
    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None  # HSDP: gradients are all-reduced across it
    rank: int  # this rank's index in ``shard``
    device: torch.device
    #: the sharded parameters' DTensor mesh: (shard) or (replicate, shard)
    mesh: DeviceMesh

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard)


def resolve_mesh(mesh: DeviceMesh | dist.ProcessGroup | None) -> MeshGroups:
    if not dist.is_initialized():
        raise RuntimeError("flexshard needs torch.distributed to be initialised first")
    replicate = None
    if mesh is None:
        shard = dist.group.WORLD
        device_type = "cpu" if dist.get_backend() == "gloo" else "cuda"
    elif isinstance(mesh, DeviceMesh):
        if mesh.get_coordinate() is None:
            raise ValueError(
                f"the mesh {mesh.mesh.tolist()} does not contain this rank "
                f"({dist.get_rank()}); build the model's mesh from ranks that include it"
            )
        if mesh.ndim == 1:
            shard = mesh.get_group(0)
        elif mesh.ndim == 2:
            replicate, shard = mesh.get_group(0), mesh.get_group(1)
        else:
            raise ValueError(
                f"flexshard takes a 1-D or 2-D (replicate, shard) mesh, got {mesh.ndim}-D"
            )
        device_type = mesh.device_type
    elif mesh is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"the process group does not contain this rank ({dist.get_rank()})")
    elif isinstance(mesh, dist.ProcessGroup):
        if dist.get_rank(mesh) < 0:
            raise ValueError(f"the process group does not contain this rank ({dist.get_rank()})")
        shard = mesh
        device_type = "cpu" if dist.get_backend(mesh) == "gloo" else "cuda"
    else:
        raise TypeError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh)}")
    device = torch.device(device_type)
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if not isinstance(mesh, DeviceMesh):  # a group, or the world: its 1-D mesh
        mesh = DeviceMesh.from_group(shard, device_type)
    return MeshGroups(shard, replicate, dist.get_rank(shard), device, mesh)


#: what ``TrafficStats.record`` counts, one call each
TRAFFIC_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
_ATTR = "_flexshard_traffic"  # module attribute: {kind: [TrafficStats, ...]}


@dataclass
class TrafficStats(CommStats):
    """A bucket's ``CommStats`` keys plus ``all_to_all`` and ``send_recv`` (a send and a
    receive issued together: one call). ``all_gather_bytes`` (parameter all-gathers)
    stays 0: none of this is a parameter gather. Bytes: what this rank sent and
    received, counted by the caller (the ring algorithm's ``(W - 1)`` chunks for an
    all-gather or reduce-scatter, as the buckets do)."""

    all_to_all: int = 0
    send_recv: int = 0

    @property
    def collectives(self) -> int:
        return super().collectives + self.all_to_all + self.send_recv

    def as_dict(self) -> dict[str, int]:
        return {**super().as_dict(), "all_to_all": self.all_to_all, "send_recv": self.send_recv}

    def record(self, collective: str, sent: int, received: int) -> None:
        """One ``collective`` (a name of ``TRAFFIC_COLLECTIVES``) that sent ``sent`` and
        received ``received`` bytes on this rank."""
        if collective not in TRAFFIC_COLLECTIVES:
            raise ValueError(
                f"TrafficStats.record: collective {collective!r} must be one of "
                f"{TRAFFIC_COLLECTIVES}"
            )
        if sent < 0 or received < 0:
            raise ValueError(f"TrafficStats.record: negative bytes ({sent}, {received})")
        setattr(self, collective, getattr(self, collective) + 1)
        self.bytes_sent += sent
        self.bytes_received += received

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)


def attach_traffic(module: nn.Module, kind: str, stats: TrafficStats) -> None:
    """Report ``stats`` as part of ``comm_stats()[kind]`` of every flexshard module at
    or above ``module`` (attach before or after sharding; once per ``stats``)."""
    if not isinstance(stats, TrafficStats):
        raise TypeError(f"attach_traffic: stats must be a TrafficStats, got {stats!r}")
    if not kind or kind == "total":
        raise ValueError(f"attach_traffic: kind {kind!r} is not a usable comm_stats key")
    attached: dict[str, list[TrafficStats]] = module.__dict__.setdefault(_ATTR, {})
    entries = attached.setdefault(kind, [])
    if not any(s is stats for s in entries):
        entries.append(stats)


def subtree_traffic(module: nn.Module) -> dict[str, list[TrafficStats]]:
    """Every ``TrafficStats`` attached at or below ``module``, once each, by kind (in
    module order)."""
    out: dict[str, list[TrafficStats]] = {}
    seen: set[int] = set()
    for sub in module.modules():
        for kind, entries in sub.__dict__.get(_ATTR, {}).items():
            for stats in entries:
                if id(stats) not in seen:
                    seen.add(id(stats))
                    out.setdefault(kind, []).append(stats)
    return out


def summed(entries: list[TrafficStats]) -> dict[str, int]:
    """One ``comm_stats`` entry: the ``as_dict`` of ``entries`` added key by key."""
    total = TrafficStats().as_dict()
    for stats in entries:
        for key, value in stats.as_dict().items():
            total[key] += value
    return total
