"""Bounded waits on collective work whose own ``wait(timeout)`` ignores the timeout
(gloo's reduce-scatter in torch 2.13): a helper thread waits, the caller gives up."""

from __future__ import annotations

import queue
import threading

import torch.distributed as dist


class _WaitThread:
    """A long-lived thread that runs ``work.wait()`` for waits that must give up after
    a timeout the work itself ignores: a thread started per wait cost more than the
    wait of a small bucket. Waits are handed over one at a time; a wait that timed out
    leaves this thread blocked for good (harmlessly), and the next wait gets a new one."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="flexshard-wait", daemon=True).start()

    def _serve(self) -> None:
        while True:
            work, done, outcome = self._jobs.get()
            try:
                outcome.append(work.wait())
            except BaseException as err:
                outcome.append(err)
            finally:
                done.set()

    def wait(self, work: dist.Work, seconds: float) -> bool | BaseException | None:
        """``work.wait()``'s result or exception; None when it did not end in time."""
        done, outcome = threading.Event(), []
        self._jobs.put((work, done, outcome))
        return outcome[0] if done.wait(seconds) else None


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
