"""The trainer's own collectives: expert parallelism's all-to-alls, context
parallelism's K/V all-gathers and reduce-scatters, ring attention's sends.

Each is waited at most the configured timeout (``parallelism.timeout_s``, the model's
flexshard timeout too) through the runtime's ``Pending``: a peer that stalls, dies or
skips the exchange makes the others raise flexshard's ``CollectiveError`` naming the
layer and the exchange, instead of hanging for the backend's 30 minutes. On CUDA/NCCL
the wait is stream-ordered and the runtime's watchdog enforces the timeout.

Each ``Exchange`` also counts its calls and the bytes this rank sent and received (the
part of a message that leaves or reaches the rank: all-gathers and reduce-scatters by
the ring algorithm's ``(W - 1)`` chunks, as the buckets' ``CommStats``; an
all-to-all's rows for and from other ranks; a ring message whole) in a
a ``TrafficStats`` that ``attach`` hangs on the module it serves: flexshard's
``comm_stats()`` then reports it as ``"ep"`` / ``"cp"`` and in its ``"total"``, and the
trainer's per-step ``comm_bytes`` with it (``exchange_bytes`` reads the same counts
where the model is not flexshard's, as under the FSDP2 backend).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterable
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from flexshard.runtime.collectives import (
    DEFAULT_TIMEOUT,
    Pending,
    TrafficStats,
    attach_traffic,
    check_timeout,
)
from flexshard.runtime.device import device_runtime
from flexshard.torch_internals import all_gather_single, reduce_scatter_single

Kind = Literal["ep", "cp"]


class Exchange:
    """The collectives one layer issues on one group (an MoE layer's EP group, an
    attention layer's CP group), named ``name`` in errors."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        name: str,
        kind: Kind,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        check_timeout(timeout)
        self.group, self.name, self.kind, self.timeout = group, name, kind, timeout
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.traffic = TrafficStats()  # this rank's calls and bytes, reset by its reader
        self._side: torch.cuda.Stream | None = None  # CUDA/NCCL: ring sends' stream

    @property
    def bytes_sent(self) -> int:
        return self.traffic.bytes_sent

    def attach(self, module: nn.Module) -> None:
        """Count this exchange in ``comm_stats()[kind]`` of the flexshard modules at or
        above ``module`` (the layer it serves)."""
        attach_traffic(module, self.kind, self.traffic)

    def _launch(
        self,
        start: Callable[[], dist.Work | None],
        collective: str,
        tensor: torch.Tensor,
        counted: tuple[str, int, int] | None,
        wait_ignores_timeout: bool = False,
    ) -> Pending:
        """``counted``: (kind of collective, bytes sent, bytes received) to record once
        launched; None: not in the counts."""
        pending = Pending.launch(
            start,
            collective,
            self.name,
            self.timeout,
            self.group,
            wait_ignores_timeout,
            device_runtime(tensor.device, self.group),
            subject=f"layer '{self.name}'",
        )
        pending.keep = (tensor,)  # the input stays alive until the collective completed
        if counted is not None:
            self.traffic.record(*counted)
        return pending

    def wait(self, pending: Pending) -> None:
        """``pending.wait()``: a failure raises a CollectiveError naming the layer."""
        pending.wait()

    def all_to_all(
        self,
        out: torch.Tensor,
        rows: torch.Tensor,
        collective: str,
        out_splits: list[int] | None = None,
        in_splits: list[int] | None = None,
    ) -> torch.Tensor:
        """``all_to_all_single`` (rows ``in_splits[r]`` go to rank ``r``), waited."""
        group = self.group
        rows = rows.contiguous()
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()  # no rows: still known
        counts = in_splits if in_splits is not None else [rows.shape[0] // self.size] * self.size
        sent = (sum(counts) - counts[self.rank]) * row_bytes
        arriving = out_splits if out_splits is not None else [out.shape[0] // self.size] * self.size
        received = (sum(arriving) - arriving[self.rank]) * row_bytes
        self.wait(
            self._launch(
                lambda: dist.all_to_all_single(
                    out, rows, out_splits, in_splits, group=group, async_op=True
                ),
                collective,
                rows,
                ("all_to_all", sent, received),
            )
        )
        return out

    def all_gather(
        self, out: torch.Tensor, local: torch.Tensor, collective: str, counted: bool = True
    ) -> torch.Tensor:
        """``counted=False``: outside a training step (a state-dict gather), not in the
        step's bytes."""
        group = self.group
        moved = (self.size - 1) * local.numel() * local.element_size()  # each way (ring)
        self.wait(
            self._launch(
                lambda: all_gather_single(out, local, group=group, async_op=True),
                collective,
                local,
                ("all_gather", moved, moved) if counted else None,
            )
        )
        return out

    def reduce_scatter(
        self, out: torch.Tensor, full: torch.Tensor, collective: str
    ) -> torch.Tensor:
        """Sum ``full`` over the group, this rank's ``1 / W`` of it into ``out``."""
        group = self.group
        moved = (self.size - 1) * out.numel() * out.element_size()  # each way (ring)
        self.wait(
            self._launch(
                lambda: reduce_scatter_single(out, full, group=group, async_op=True),
                collective,
                full,
                ("reduce_scatter", moved, moved),
                wait_ignores_timeout=dist.get_backend(group) == "gloo",  # its wait ignores it
            )
        )
        return out

    def send_recv(
        self,
        send: torch.Tensor,
        recv: torch.Tensor,
        to: int,
        source: int,
        tag: int,
        collective: str,
    ) -> list[Pending]:
        """Send ``send`` to global rank ``to`` and receive ``recv`` from ``source`` in one
        batch (NCCL needs the pair grouped, or a ring of sends deadlocks); not waited:
        the caller computes meanwhile and then ``wait``s each."""
        ops = [
            dist.P2POp(dist.isend, send, to, self.group, tag),
            dist.P2POp(dist.irecv, recv, source, self.group, tag),
        ]
        works: list[dist.Work] = []

        def start() -> dist.Work | None:
            works.extend(dist.batch_isend_irecv(ops))
            return works[0] if works else None

        counted = (
            "send_recv",
            send.numel() * send.element_size(),
            recv.numel() * recv.element_size(),
        )
        runtime = device_runtime(send.device, self.group)
        if runtime.streams and self._side is None:
            self._side = torch.cuda.Stream(runtime.device, priority=-1)
        # stream-ordered: the launch makes the current stream wait on the transfer, so
        # it runs on a side stream (after the compute that made ``send``) and compute
        # waits on its event only in ``wait``: the next block travels during this one
        with runtime.on(self._side if runtime.streams else None):
            first = self._launch(start, collective, send, counted)
            rest = [self._launch(lambda w=w: w, collective, send, None) for w in works[1:]]
        return [first, *rest]


def exchange_bytes(modules: Iterable[nn.Module], reset: bool = True) -> dict[str, int]:
    """Bytes this rank sent in the EP and CP exchanges of ``modules`` (and their
    submodules) since the last reset, by kind: ``{"ep": ..., "cp": ...}`` for the
    kinds present. The counts flexshard's ``comm_stats()`` reports (and resets) too:
    read each model one way."""
    seen: set[int] = set()
    total: dict[str, int] = {}
    for module in modules:
        for sub in module.modules():
            for attr in ("expert_parallel", "context_parallel"):
                exchange = getattr(getattr(sub, attr, None), "exchange", None)
                if not isinstance(exchange, Exchange) or id(exchange) in seen:
                    continue
                seen.add(id(exchange))
                total[exchange.kind] = total.get(exchange.kind, 0) + exchange.bytes_sent
                if reset:
                    exchange.traffic.reset()
    return total


def configured_timeout(seconds: float) -> datetime.timedelta:
    """``parallelism.timeout_s`` as the timedelta flexshard and the exchanges take."""
    return datetime.timedelta(seconds=seconds)
