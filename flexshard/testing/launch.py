"""Run a function on W local gloo processes and collect what each returns."""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flexshard.trainer.launch import spawn_local

#: how the ranks start: "spawn" (a fresh interpreter each; the default) or "forkserver"
#: (forked from one server process that imported ``PRELOAD`` once: the same fresh
#: module state as spawn, without every rank's seconds of imports; the test suite sets
#: it in tests/conftest.py). A forkserver's ranks get the environment the server
#: started with (the first launch's), not the parent's at each launch.
START_METHOD_ENV = "FLEXSHARD_START_METHOD"
START_METHODS = ("spawn", "forkserver")
#: how long a rank may be gone without its result before the wait ends (its last
#: put may still be on its way through the queue's pipe)
SILENT_EXIT_GRACE_S = 10.0
#: the modules themselves: the packages' fronts import nothing (flexshard/__init__.py)
PRELOAD = [
    "torch.distributed",
    "flexshard.fsdp.api",
    "flexshard.checkpoint",
    "flexshard.optim",
    "flexshard.trainer.train",
]


def start_context() -> Any:
    """The multiprocessing context the ranks start in (see ``START_METHOD_ENV``)."""
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={method!r}: must be one of {START_METHODS}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _wait_for_the_others() -> None:
    """Rank 0's process holds the group's store: leaving before the other ranks are
    done with it (a rank still making a group) resets their connections."""
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    except Exception:  # a peer failed or broke the group: its own report says why
        pass


def _child(rank: int, fn: Callable, world_size: int, args: tuple, results: Any) -> None:
    try:
        torch.set_num_threads(1)  # W processes share two cores
        dist.init_process_group("gloo")  # spawn_local's environment names the group
        try:
            # by value: a tensor put as is travels as a file descriptor its process
            # must still be alive to hand over, and the rank exits right after this
            results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
            _wait_for_the_others()
        finally:
            dist.destroy_process_group()
    except BaseException:  # report anything, including a failed assert, to the parent
        results.put((rank, "error", traceback.format_exc()))


def start_ranks(fn: Callable, world_size: int, args: tuple) -> tuple[list[Any], Any]:
    """Spawn ``world_size`` processes running ``fn`` on a fresh gloo group; each puts
    ``(rank, "ok" | "error", value)`` on the returned queue."""
    ctx = start_context()
    results = ctx.Queue()
    started = spawn_local(
        _child,
        world_size,
        (fn, world_size, args, results),
        join=False,
        daemon=True,
        start_method=ctx.get_start_method(),
    )
    assert started is not None  # join=False: the processes, still running
    return started.processes, results


def next_result(results: Any, timeout: float) -> tuple[int, str, Any]:
    """The next ``(rank, "ok" | "error", value)`` a rank put on ``results`` (raises
    ``queue.Empty`` after ``timeout`` seconds)."""
    rank, status, value = results.get(timeout=timeout)
    return rank, status, pickle.loads(value) if status == "ok" else value


def _result_while_alive(
    results: Any, procs: list[Any], out: dict[int, Any], timeout: float
) -> tuple[int, str, Any]:
    """``next_result``, but a rank that exited without a word (killed, or dead before
    ``_child`` ran) ends the wait after a grace for its queue to flush, not at
    ``timeout``."""
    deadline = time.monotonic() + timeout
    silent_since = None
    while True:
        try:
            return next_result(results, max(0.0, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            now = time.monotonic()
            if now >= deadline:
                raise
            gone = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
            silent_since = (silent_since or now) if gone else None
            if silent_since is not None and now - silent_since > SILENT_EXIT_GRACE_S:
                codes = ", ".join(f"rank {r} exit code {procs[r].exitcode}" for r in gone)
                return gone[0], "error", f"exited without a result ({codes})"


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    ``fn`` must be importable (a module-level function). Returns the per-rank results;
    re-raises the first child's traceback; kills everything after ``timeout`` seconds.
    """
    procs, results = start_ranks(fn, world_size, args)
    out: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            try:
                rank, status, value = _result_while_alive(results, procs, out, timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"{fn.__name__} on {world_size} ranks gave no result within {timeout}s; "
                    f"ranks done: {sorted(out)}"
                ) from None
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break  # the others may now hang waiting for it
            out[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 1)
            if proc.is_alive():
                proc.kill()
    if errors:  # a rank that died without a word (a signal) is often the cause
        died = [f"rank {r} exit code {p.exitcode}" for r, p in enumerate(procs) if r not in out]
        errors.append("ranks without a result: " + ", ".join(died))
        raise RuntimeError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
