"""Each rank's progress through a checkpoint load, kept in the job's store, so that a
load that loses a rank names it.

Before the read, the load checks the checkpoint together (rank 0 sends the manifest
and ``.metadata``, each rank's findings and keys are gathered); after it, the param
groups. Each of those collectives is a point too (``collective``), numbered alike on
every rank. A DCP load runs collective steps of its own (the plan: a gather of every rank's local
plan to the coordinator, its global plan, a scatter back; the read: an all-gather once
every rank read), and the striped reader one exchange per batch. A rank that dies or
stalls in any of them fails the others' collective with the backend's generic error.
Every rank records in the job's store how far it got before each step (``arrive``);
the readers of a load do it at each point (``TrackedReader``). When a collective fails,
a rank asks the store which ranks never reached what that step needs from them
(``failure``), giving a live rank that was merely slower ``settle_s`` to arrive.

The store is served by one process: rank 0's under a plain ``init_process_group``
(rank 0's death takes the store with it, so a store that does not answer at all names
rank 0), torchrun's agent's under torchrun (the store outlives every rank).

Under torchrun the agent answers a worker's death by sending every other worker SIGTERM
(its monitor polls every 0.1 s by default), then SIGKILL after a grace period (30 s):
left to its default action, SIGTERM ends a surviving rank before it can say whom it
lost. During a load each rank holds the agent's SIGTERM (``holding_agent_stop``): a
rank whose collective failed then names the ranks behind at once (the agent stops the
workers because one of them died), raises that error, and a load that completes
delivers the held signal afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ..runtime.collectives import CollectiveError, backend_cause, is_backend_failure
from ..torch_internals import default_store
from .bounded import abandon
from .safe_load import SafeReader

#: the points of a load, in order: (phase, batch); a rank's record only grows
STARTED = (0, 0)  # then (0, n): the n-th collective of the checks before the read
LOCAL_PLAN = (1, 0)  # this rank's local plan made: it enters the plan's gather
GLOBAL_PLAN = (2, 0)  # the coordinator's global plan made: it enters the scatter
READ = (4, 0)  # this rank read everything it needs: it enters the read's all-gather
CHECKED_AFTER = 5  # (5, n): the n-th collective of the load, a check after the read


def batch(number: int) -> tuple[int, int]:
    """The striped exchange of batch ``number``."""
    return (3, number)


class LoadProgress:
    """One load's progress on ``group`` (every member makes one per load, in the same
    order: their loads are numbered alike). ``root``: the checkpoint, for messages."""

    #: loads started per group (the same count on every member)
    _loads: dict[tuple[int, ...], int] = defaultdict(int)

    def __init__(self, group: dist.ProcessGroup, root: str) -> None:
        self._group = group
        self._ranks = tuple(dist.get_process_group_ranks(group))
        LoadProgress._loads[self._ranks] += 1
        self._load = LoadProgress._loads[self._ranks]
        self._store = default_store()
        self._root = root
        self._coordinator = self._ranks[0]  # DCP's: the group's rank 0
        self.last = STARTED
        self._collectives = 0  # the checks' collectives entered, for their points
        self._check = ""  # the check this rank entered last, for messages
        self.agent_stopped = False  # torchrun's agent sent this worker SIGTERM mid-load
        self.arrive(STARTED)

    def _key(self, rank: int) -> str:
        return f"flexshard/load/{'-'.join(map(str, self._ranks))}/{rank}"

    def arrive(self, point: tuple[int, int]) -> None:
        self.last = point
        self._store.set(self._key(dist.get_rank()), f"{self._load} {point[0]} {point[1]}")

    def _needed(self) -> dict[int, tuple[int, int]]:
        """What the collective this rank entered last needs from each other rank."""
        me = dist.get_rank()
        if self.last == LOCAL_PLAN:  # the gather, then the coordinator's scatter
            need = {r: LOCAL_PLAN for r in self._ranks if r != me}
            if self._coordinator != me:
                need[self._coordinator] = GLOBAL_PLAN
            return need
        if self.last == GLOBAL_PLAN:  # the coordinator, in its scatter
            return {r: LOCAL_PLAN for r in self._ranks if r != me}
        return {r: self.last for r in self._ranks if r != me}

    def missing(self, settle_s: float = 10.0) -> list[int] | None:
        """The group's ranks whose recorded progress stays short of what this rank's
        failed collective needs from them for ``settle_s``; a rank short of it that
        failed itself (alive: its collective failed first) stands for the ranks it
        names. None: the store cannot say (it never answered)."""
        need = self._needed()
        behind = sorted(need)
        named: list[int] = behind
        answered = False
        deadline = time.monotonic() + settle_s
        try:
            while True:
                behind = [r for r in behind if not self._reached(r, need[r])]
                failed = {r: self._failed(r) for r in behind}
                alive = {r for r, said in failed.items() if said is not None}
                blamed = {m for said in failed.values() if said for m in said[1]}
                named = sorted(({*behind} - alive | blamed) - {dist.get_rank()})
                answered = True
                # settled: every rank behind failed itself or is named by one that did;
                # or the agent is stopping the workers: one of them died, none is slow
                settled = set(behind) <= alive | blamed or self.agent_stopped
                if settled or time.monotonic() >= deadline:
                    return named
                time.sleep(0.1)
        except Exception:  # the store's host is gone (or went after answering once)
            return named if answered else None

    def _record(self, key: str) -> tuple[int, list[int]] | None:
        """A rank's record: the load it is in and what it noted there (None: none)."""
        if not self._store.check([key]):
            return None
        load, *values = map(int, self._store.get(key).split())
        return load, values

    def _reached(self, rank: int, point: tuple[int, int]) -> bool:
        record = self._record(self._key(rank))
        return record is not None and (record[0], *record[1]) >= (self._load, *point)

    def _failed(self, rank: int) -> tuple[bool, list[int]] | None:
        """Whether ``rank``'s own collective failed in this load (None: not that it
        said): whether it has settled on the ranks it names, and those ranks."""
        record = self._record(self._key(rank) + "/failed")
        if record is None or record[0] != self._load:
            return None
        return bool(record[1][0]), record[1][1:]

    def _note_failed(self, settled: bool, named: list[int]) -> None:
        record = " ".join(map(str, [self._load, int(settled), *named]))
        try:
            self._store.set(self._key(dist.get_rank()) + "/failed", record)
        except Exception:  # the store is gone: nobody can read it
            pass

    def failure(self, err: BaseException, step: str) -> CollectiveError:
        """The error of this rank's failed collective in ``step``: the ranks that never
        reached it, read from the store."""
        self._note_failed(False, [])  # alive: the others do not wait for this rank
        missing = self.missing()
        if missing is not None:  # a rank waiting on this one names the ranks it waits on
            self._note_failed(True, missing)
        abandon(self._group)  # the ranks blocked on this one fail now, not at the timeout
        if missing is not None and dist.get_rank() == 0 and _rank_zero_hosts_the_store():
            self._serve_the_others(missing)
        if missing is None and _rank_zero_hosts_the_store():
            who = "rank(s) [0] never reached it (rank 0 served the job's store, now gone)"
        elif missing is None:
            who = "which rank failed is unknown (the job's store does not answer)"
        elif missing:
            who = f"rank(s) {missing} never reached it"
        else:
            who = "every rank reached it (one died or stalled in it)"
        if self.agent_stopped:
            who += "; torchrun's agent is stopping the workers"
        rank = dist.get_rank()
        return CollectiveError(
            f"flexshard: load of checkpoint '{self._root}' failed on rank {rank} in "
            f"{step}: {who}; no rank's model changed [backend: {backend_cause(err)}]",
            bucket=f"checkpoint '{self._root}'",
            collective=step,
            rank=rank,
            backend_error=err,
        )

    def _serve_the_others(self, missing: list[int], settle_s: float = 10.0) -> None:
        """Rank 0 serves the store: it waits (at most ``settle_s``) for the group's other
        live ranks to note their own failure, so they read the store before it goes."""
        others = [r for r in self._ranks if r not in missing and r != dist.get_rank()]
        deadline = time.monotonic() + settle_s
        try:
            while others and time.monotonic() < deadline:
                others = [r for r in others if not (self._failed(r) or (False,))[0]]
                time.sleep(0.1)
        except Exception:  # the store failed after all: nobody can read it
            pass

    @contextlib.contextmanager
    def holding_agent_stop(self) -> Iterator[None]:
        """Under torchrun, hold the agent's SIGTERM for the load (see the module's
        docstring): noted in ``agent_stopped``; delivered when the load completes (a
        load that fails raises its error instead, and the agent's SIGKILL follows its
        grace period). Elsewhere, or off the main thread (no signal handler there),
        nothing changes."""
        under_agent = not _rank_zero_hosts_the_store()
        if not under_agent or threading.current_thread() is not threading.main_thread():
            yield
            return

        def hold(signum: int, frame: Any) -> None:
            self.agent_stopped = True

        previous = signal.signal(signal.SIGTERM, hold)
        completed = False
        try:
            yield
            completed = True
        finally:
            signal.signal(signal.SIGTERM, previous)
            if completed and self.agent_stopped:
                signal.raise_signal(signal.SIGTERM)

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """One collective of the load's checks (``what``), before or after the read:
        this rank notes it entered it; a backend failure (a lost or stalled peer) in it
        raises :meth:`failure`, naming the ranks that never reached it."""
        self._collectives += 1
        phase = CHECKED_AFTER if self.last >= READ else STARTED[0]
        self._check = what
        self.arrive((phase, self._collectives))
        try:
            yield
        except CollectiveError:
            raise
        except Exception as err:
            if not is_backend_failure(err):
                raise
            raise self.failure(err, self.step()) from None

    def step(self) -> str:
        """The step this rank's last collective was in, for messages."""
        if self.last[0] in (STARTED[0], CHECKED_AFTER) and self.last != STARTED:
            return f"the load's check ({self._check})"
        if self.last in (LOCAL_PLAN, GLOBAL_PLAN):
            return "DCP's plan (gather, global plan, scatter)"
        if self.last == READ:
            return "DCP's read (all-gather)"
        if self.last[0] == batch(0)[0]:
            return f"the striped read's batch {self.last[1]}"
        return "the load's set-up"


def _rank_zero_hosts_the_store() -> bool:
    """torchrun's agent serves the store when it says so; otherwise rank 0 does."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


class TrackedReader(SafeReader):
    """A SafeReader that records the load's progress (``progress``; None: not tracked)
    at each of DCP's steps. Subclasses read in ``read_chunks``."""

    def __init__(
        self,
        root: str,
        metadata_bytes: bytes | None = None,
        progress: LoadProgress | None = None,
    ) -> None:
        super().__init__(root, metadata_bytes)
        self.progress = progress

    def _arrive(self, point: tuple[int, int]) -> None:
        if self.progress is not None:
            self.progress.arrive(point)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = super().prepare_local_plan(plan)
        self._arrive(LOCAL_PLAN)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        self._arrive(GLOBAL_PLAN)
        return plans

    def read_chunks(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read what ``plan`` names into ``planner``'s targets (torch's reader)."""
        super().read_data(plan, planner).wait()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[Any]:
        self.read_chunks(plan, planner)
        self._arrive(READ)
        done: Future[None] = Future()
        done.set_result(None)
        return done
