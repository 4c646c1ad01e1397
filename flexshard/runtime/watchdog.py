"""Timeouts without blocking: a thread polls the events of stream-ordered collectives
(CUDA/NCCL) and fails the ones past their deadline, so the CPU never waits on them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol


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
