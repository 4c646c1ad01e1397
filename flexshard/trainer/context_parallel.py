"""Context parallelism: exact causal attention over a sequence split across a CP group.

The sequence is cut into ``2 * cp`` equal chunks and CP rank ``i`` keeps chunks ``i``
and ``2 * cp - 1 - i`` (zig-zag): under a causal mask the early chunks are cheap and
the late ones expensive, so each rank gets one of each and the same work. Each rank
keeps its queries and all-gathers the keys and values (before GQA's repeat, so only
the kv heads travel); the backward reduce-scatters their gradients. RoPE and the
causal mask use the tokens' global positions, so the result is the single-process
attention. torch's ``context_parallel`` needs CUDA; this runs on gloo as well.

That is ``method = "allgather"`` (K/V memory O(seq) per rank). ``method = "ring"``
(``ring_attention.py``) keeps this layout and passes the K/V blocks around the CP
group instead (O(seq / cp) per rank).

The integrator calls ``check_cp``, ``apply_cp(model, cp_mesh, method)`` and, on every batch,
``split_sequence(inputs, cp_mesh)`` / ``split_sequence(targets, cp_mesh)``.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flexshard.runtime.collectives import DEFAULT_TIMEOUT

from .exchange import Exchange
from .layout_checks import check_cp

Group = DeviceMesh | dist.ProcessGroup
CPMethod = Literal["allgather", "ring"]
CP_METHODS = ("allgather", "ring")


def as_group(cp: Group) -> dist.ProcessGroup:
    if isinstance(cp, DeviceMesh):
        if cp.ndim != 1:
            raise ValueError(f"the CP mesh must be 1-D, got dims {cp.mesh_dim_names}")
        return cp.get_group(0)
    if isinstance(cp, dist.ProcessGroup):
        return cp
    raise TypeError(f"cp_mesh must be a 1-D DeviceMesh or a ProcessGroup, got {type(cp)}")


def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 * cp``) that CP rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def local_positions(local_len: int, rank: int, cp: int, device: torch.device) -> torch.Tensor:
    """Global positions of this rank's ``local_len`` tokens (two chunks, in order)."""
    chunk = local_len // 2
    first, second = zigzag_chunks(rank, cp)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def _slot_of_chunk(cp: int) -> list[int]:
    """For each global chunk, its slot in the gathered tensor (rank-major, 2 per rank)."""
    slots = [0] * (2 * cp)
    for rank in range(cp):
        first, second = zigzag_chunks(rank, cp)
        slots[first], slots[second] = 2 * rank, 2 * rank + 1
    return slots


def split_sequence(tensor: torch.Tensor, cp_mesh: Group, dim: int = 1) -> torch.Tensor:
    """This CP rank's zig-zag part of a full-length batch (inputs, targets, ...)."""
    group = as_group(cp_mesh)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    check_cp(tensor.shape[dim], cp)
    chunks = tensor.chunk(2 * cp, dim=dim)
    first, second = zigzag_chunks(rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather [batch, local_len, heads, head_dim] from every CP rank into the full
    sequence in global order; the backward reduce-scatters (sums) the gradient, since
    every rank's queries read every rank's keys and values. Both are bounded by the
    exchange's timeout (a CollectiveError naming the layer and ``what``)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, exchange: Exchange, what: str) -> torch.Tensor:
        cp = exchange.size
        b, s, *rest = local.shape
        ctx.exchange, ctx.shape, ctx.what = exchange, local.shape, what
        gathered = local.new_empty(cp * local.numel())
        exchange.all_gather(gathered, local.contiguous().view(-1), f"CP {what} all-gather")
        # [cp, b, 2, chunk, ...] -> [b, 2 * cp slots, chunk, ...] -> chunks in global order
        slots = gathered.view(cp, b, 2, s // 2, *rest).transpose(0, 1).reshape(b, 2 * cp, -1)
        ordered = slots[:, _slot_of_chunk(cp)]
        return ordered.reshape(b, cp * s, *rest)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        exchange, shape = ctx.exchange, ctx.shape
        cp = exchange.size
        b, s, *rest = shape
        by_chunk = grad.reshape(b, 2 * cp, -1)
        slots = torch.empty_like(by_chunk)
        slots[:, _slot_of_chunk(cp)] = by_chunk
        full = slots.view(b, cp, 2, -1).transpose(0, 1).contiguous()
        local = grad.new_empty(shape)
        what = f"CP {ctx.what} gradient reduce-scatter (backward)"
        exchange.reduce_scatter(local.view(-1), full.view(-1), what)
        return local, None, None


class ContextParallel:
    """What the model's attention and RoPE need to run on a zig-zag sequence shard;
    one per attention layer (``name``, its FQN, in the errors of its exchanges)."""

    def __init__(
        self,
        cp_mesh: Group,
        method: CPMethod = "allgather",
        name: str = "attention",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        masks: dict[tuple[int, torch.device], torch.Tensor] | None = None,
    ) -> None:
        if method not in CP_METHODS:
            raise ValueError(f"parallelism.cp_method = {method!r}: must be one of {CP_METHODS}")
        self.group, self.method = as_group(cp_mesh), method
        self.exchange = Exchange(self.group, name, "cp", timeout)
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        # the causal masks depend on the length alone: the layers share one cache
        self._masks = masks if masks is not None else {}

    def global_len(self, local_len: int) -> int:
        if local_len % 2:
            raise ValueError(
                f"a context-parallel rank holds two equal chunks, got {local_len} tokens"
            )
        return local_len * self.size

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        return local_positions(local_len, self.rank, self.size, device)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [b, local, kv_heads, d] of the whole sequence, global order."""
        return (
            _GatherSequence.apply(k, self.exchange, "key"),
            _GatherSequence.apply(v, self.exchange, "value"),
        )

    def causal_mask(self, local_len: int, device: torch.device) -> torch.Tensor:
        """[local, global] booleans, True where a local query may see a key."""
        key = (local_len, device)
        if key not in self._masks:
            queries = self.positions(local_len, device)
            keys = torch.arange(self.global_len(local_len), device=device)
            self._masks[key] = keys[None, :] <= queries[:, None]
        return self._masks[key]


def apply_cp(
    model: nn.Module,
    cp_mesh: Group,
    method: CPMethod = "allgather",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> ContextParallel:
    """Switch the model's RoPE and attention into CP mode: from now on it takes this
    rank's ``split_sequence`` part of every sequence; each layer's exchanges wait at
    most ``timeout`` and count in flexshard's ``comm_stats()["cp"]``. Returns the
    root's ContextParallel (positions, masks); every attention layer gets its own,
    named by its FQN. Collective-free."""
    root = ContextParallel(cp_mesh, method, type(model).__name__, timeout)
    hooked = 0
    for fqn, module in model.named_modules():
        if hasattr(module, "context_parallel"):
            cp = root if not fqn else ContextParallel(cp_mesh, method, fqn, timeout, root._masks)
            module.context_parallel = cp
            cp.exchange.attach(module)  # comm_stats()["cp"] of the sharded model
            hooked += 1
    if not hooked:
        raise ValueError(f"{type(model).__name__} has no attention that supports CP")
    return root
