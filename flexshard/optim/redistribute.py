"""Moving split matrices to the rank that computes them (their owner) and the results
back: one packed all_to_all_single per bucket and direction, planned from the layout
alone. DistMuon sends its momentum-updated gradients (one channel, bf16) and gets
orthogonalised updates back; MatrixOptimizer sends gradient and parameter (two
channels, the storage dtype) and gets the stepped parameter back."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..placements.owned import lpt_owners
from ..runtime.collectives import Pending
from .matrices import Piece, Target, pieces, units_of

#: the wire format: Newton–Schulz starts by casting to bf16 and returns bf16, so
#: sending bf16 both ways changes no bit of the result and halves fp32's bytes
WIRE_DTYPE = torch.bfloat16


@dataclass
class Unit:
    """One redistributed matrix (a 2-D parameter, or one expert of a stack)."""

    target: Target
    shape: tuple[int, ...]  # the matrix's
    owner: int
    inputs: tuple[tuple[Piece, ...], ...]  # per rank: what it sends the owner
    outputs: tuple[tuple[Piece, ...], ...]  # per rank: what the owner sends it back
    expert: int | None = None  # which expert of a [E, R, C] stack (None: the whole)

    def input_numel(self, rank: int) -> int:
        return sum(p.region.numel for p in self.inputs[rank])

    def output_numel(self, rank: int) -> int:
        return sum(p.region.numel for p in self.outputs[rank])


@dataclass
class CommCounter:
    """What an optimizer's steps sent: all-to-alls and bytes (this rank's, without the
    part a rank 'sends' itself)."""

    all_to_all: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "all_to_all": self.all_to_all,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }


@dataclass
class Exchange:
    """The redistributed matrices of one flexshard bucket."""

    name: str
    group: dist.ProcessGroup
    rank: int
    world_size: int
    timeout: datetime.timedelta
    device: torch.device
    units: list[Unit]
    # splits[s][d]: elements rank s sends rank d, forward (to owners) and back
    forward: list[list[int]] = field(default_factory=list)
    back: list[list[int]] = field(default_factory=list)
    who: str = "DistMuon"  # for error messages

    def __post_init__(self) -> None:
        w = self.world_size
        self.forward = [[0] * w for _ in range(w)]
        self.back = [[0] * w for _ in range(w)]
        for unit in self.units:
            for rank in range(w):
                self.forward[rank][unit.owner] += unit.input_numel(rank)
                self.back[unit.owner][rank] += unit.output_numel(rank)

    def owned(self) -> list[Unit]:
        return [u for u in self.units if u.owner == self.rank]


def plan_exchanges(
    targets: Sequence[Target],
    cost: Callable[[Target, tuple[int, ...]], float],
    loads: dict[int, list[float]] | None = None,
    who: str = "DistMuon",
) -> list[Exchange]:
    """Group redistributed targets by bucket (in first-seen order), split each into its
    matrices (each expert of a stack apart) and pick owners by LPT on ``cost(target,
    matrix shape)``, starting from ``loads`` (per shard-group size, each rank's work on
    matrices it stores whole) and carrying each rank's load from bucket to bucket so
    the whole step is balanced. Deterministic: every rank computes the same plan."""
    by_bucket: dict[int, list[Target]] = {}
    for target in targets:
        by_bucket.setdefault(id(target.bucket), []).append(target)
    exchanges = []
    loads = {w: list(load) for w, load in (loads or {}).items()}
    for members in by_bucket.values():
        bucket = members[0].bucket
        assert bucket is not None
        w = bucket.layout.world_size
        load = loads.setdefault(w, [0.0] * w)
        items = [(t, e, shape) for t in members for e, shape in units_of(t.shape)]
        costs = [cost(t, shape) for t, _, shape in items]
        owners = lpt_owners(costs, w, loads=load)
        units = []
        for (target, expert, shape), owner, c in zip(items, owners, costs):
            load[owner] += c
            regions = bucket.layout.params[target.index].regions
            held = tuple(pieces(regions[r], target.shape, expert) for r in range(w))
            inputs = held
            if bucket.layout.replicated:  # the owner holds it all, everyone gets it all
                inputs = tuple(held[r] if r == owner else () for r in range(w))
            units.append(Unit(target, shape, owner, inputs, held, expert))
        exchanges.append(
            Exchange(
                bucket.name,
                bucket.comm.shard_group,
                bucket.store.rank,
                w,
                bucket.comm.timeout,
                bucket.storage.device,
                units,
                who=who,
            )
        )
    return exchanges


class Transfer:
    """One in-flight packed all-to-all and the buffer it fills."""

    def __init__(
        self,
        exchange: Exchange,
        splits: list[list[int]],
        send: torch.Tensor,
        counter: CommCounter,
        what: str,
    ) -> None:
        rank, w = exchange.rank, exchange.world_size
        send_sizes = splits[rank]
        recv_sizes = [splits[s][rank] for s in range(w)]
        self.recv = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
        self.recv_sizes = recv_sizes
        self._send = send  # alive while gloo reads it
        # a bucket whose data never leaves its rank (W = 1, or a replicated bucket's
        # forward) needs no collective; every rank knows this from the same layout
        if all(splits[s][d] == 0 for s in range(w) for d in range(w) if s != d):
            self.recv.copy_(send)
            self.pending: Pending | None = None
            return
        # bounded by the model's timeout: a stalled or dead peer raises a CollectiveError
        # naming the bucket and this exchange. Waited on the host, not stream-ordered at
        # launch: on CUDA the compute stream would otherwise queue the previous bucket's
        # step behind this exchange and lose the overlap
        self.pending = Pending.launch(
            lambda: dist.all_to_all_single(
                self.recv, send, recv_sizes, send_sizes, group=exchange.group, async_op=True
            ),
            f"{exchange.who} {what} all-to-all",
            exchange.name,
            exchange.timeout,
            exchange.group,
        )
        size = send.element_size()
        counter.all_to_all += 1
        counter.bytes_sent += (sum(send_sizes) - send_sizes[rank]) * size
        counter.bytes_received += (sum(recv_sizes) - recv_sizes[rank]) * size

    def wait(self) -> list[torch.Tensor]:
        """The received buffer, split by source rank."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()
        self._send = None
        return list(torch.split(self.recv, self.recv_sizes))


def send_inputs(
    exchange: Exchange,
    inputs: dict[int, torch.Tensor],
    counter: CommCounter,
    channels: int = 1,
    dtype: torch.dtype = WIRE_DTYPE,
) -> Transfer:
    """Launch the forward all-to-all: ``inputs[id(param)]`` is this rank's local update
    (shaped like its shard), or ``channels`` of them stacked (``[channels, *shard]``);
    the pieces go to each matrix's owner, owner by owner, a piece's channels together."""
    rank = exchange.rank
    per_owner: list[list[torch.Tensor]] = [[] for _ in range(exchange.world_size)]
    for unit in exchange.units:
        local = inputs[id(unit.target.param)].reshape(channels, -1)
        per_owner[unit.owner].extend(
            local[:, p.local : p.local + p.region.numel].reshape(-1) for p in unit.inputs[rank]
        )
    flat = [p for dest in per_owner for p in dest]
    empty = torch.empty(0, dtype=dtype, device=exchange.device)
    send = torch.cat(flat).to(dtype) if flat else empty
    splits = [[n * channels for n in row] for row in exchange.forward]
    return Transfer(exchange, splits, send, counter, "forward")


def assemble(
    exchange: Exchange,
    received: list[torch.Tensor],
    channels: int = 1,
    dtype: torch.dtype = WIRE_DTYPE,
) -> list[torch.Tensor]:
    """The owner's full matrices, in ``exchange.owned()`` order, from every rank's pieces
    (``[channels, *matrix]`` when more than one channel was sent)."""
    cursors = [0] * exchange.world_size
    fulls = []
    for unit in exchange.owned():
        full = torch.empty((channels, *unit.shape), dtype=dtype, device=exchange.device)
        for source, held in enumerate(unit.inputs):
            for piece in held:
                numel = piece.region.numel
                start = cursors[source]
                chunk = received[source][start : start + channels * numel].view(channels, numel)
                cursors[source] += channels * numel
                for channel in range(channels):
                    view = piece.region.view_of(full[channel])
                    view.copy_(chunk[channel].view(view.shape))
        fulls.append(full if channels > 1 else full[0])
    return fulls


def send_updates(
    exchange: Exchange,
    updates: list[torch.Tensor],
    counter: CommCounter,
    dtype: torch.dtype = WIRE_DTYPE,
) -> Transfer:
    """Launch the back all-to-all: each rank receives its regions of every update."""
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(exchange.world_size)]
    for unit, update in zip(exchange.owned(), updates):
        for rank, held in enumerate(unit.outputs):
            per_rank[rank].extend(p.region.view_of(update).reshape(-1) for p in held)
    flat = [p for dest in per_rank for p in dest]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=exchange.device)
    return Transfer(exchange, exchange.back, send, counter, "back")


def local_updates(
    exchange: Exchange, received: list[torch.Tensor]
) -> list[tuple[Unit, Piece, torch.Tensor, torch.Tensor]]:
    """(unit, piece, that piece of the local parameter, its update), flat, for every
    piece of every matrix this rank stores."""
    rank = exchange.rank
    cursors = [0] * exchange.world_size
    out = []
    for unit in exchange.units:
        param = unit.target.param.view(-1)
        for piece in unit.outputs[rank]:
            numel, cursor = piece.region.numel, cursors[unit.owner]
            update = received[unit.owner][cursor : cursor + numel]
            cursors[unit.owner] += numel
            out.append((unit, piece, param[piece.local : piece.local + numel], update))
    return out
