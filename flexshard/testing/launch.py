"""Run a function on W local gloo processes and collect what each returns."""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: Any) -> None:
    try:
        torch.set_num_threads(1)  # W processes share two cores
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report anything, including a failed assert, to the parent
        results.put((rank, "error", traceback.format_exc()))


def start_ranks(fn: Callable, world_size: int, args: tuple) -> tuple[list[Any], Any]:
    """Spawn ``world_size`` processes running ``fn`` on a fresh gloo group; each puts
    ``(rank, "ok" | "error", value)`` on the returned queue."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, port, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    return procs, results


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
                rank, status, value = results.get(timeout=timeout)
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
    if errors:
        raise RuntimeError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]
