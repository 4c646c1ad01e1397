"""Context parallelism: exact causal attention over a sequence split across a CP group.

The sequence is cut into ``2 * cp`` equal chunks and CP rank ``i`` keeps chunks ``i``
and ``2 * cp - 1 - i`` (zig-zag): under a causal mask the early chunks are cheap and
the late ones expensive, so each rank gets one of each and the same work. Each rank
keeps its queries and all-gathers the keys and values (before GQA's repeat, so only
the kv heads travel); the backward reduce-scatters their gradients. RoPE and the
causal mask use the tokens' global positions, so the result is the single-process
attention. torch's ``context_parallel`` needs CUDA; this runs on gloo as well.

That is ``method = "allgather"`` (K/V memory O(seq) per rank). ``method = "ring"``
(``trainer/parallel/context_parallel.py``) keeps this layout and passes the K/V blocks around the CP
group instead (O(seq / cp) per rank).

The integrator calls ``check_cp``, ``apply_cp(model, cp_mesh, method)`` and, on every batch,
``split_sequence(inputs, cp_mesh)`` / ``split_sequence(targets, cp_mesh)``.

Ring attention: context parallelism that never holds the whole sequence's keys and
values. Each CP rank keeps its zig-zag queries (chunks ``i`` and ``2 * cp - 1 - i``, the
layout of ``context_parallel.split_sequence``) and passes its keys and values around
the CP ring, one rank's block per step, sending the next block (async ``isend`` /
``irecv``) while it computes attention with the current one. The blocks' partial
results are merged with their log-sum-exp (online softmax), so the result is exact
causal attention; only the summation order differs from one process (fp32 rounding).

Zig-zag makes every step the same work on every rank: with the block of rank ``src``,
rank ``r``'s queries see (``src == r``) their own block under a causal mask, (``src <
r``) the whole first chunk of ``src``, (``src > r``) the whole of ``src`` from their
second chunk only, i.e. half a block each time.

The backward is a second ring (an ``autograd.Function``, not autograd through the
forward): keys and values travel again, with the fp32 gradient accumulators of their
owner behind them, and each block's probabilities are recomputed from the saved
output and log-sum-exp. Saved for backward: the local q, k, v, output and lse, all
O(seq / cp). The scores are computed for tiles of query rows (``SCORE_TILE``), so
every buffer, K/V in hand and in flight included, is O(seq / cp) per rank."""

from __future__ import annotations

import datetime
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flexshard.runtime.collectives import DEFAULT_TIMEOUT, Pending

from ..config import ConfigError
from .exchange import Exchange

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


def check_cp(seq_len: int, cp: int) -> None:
    """The zig-zag split needs ``2 * cp`` equal chunks."""
    if cp < 1:
        raise ConfigError(f"parallelism.cp must be >= 1, got {cp}")
    if seq_len % (2 * cp):
        raise ConfigError(
            f"training.seq_len = {seq_len} is not divisible by 2 * parallelism.cp = {2 * cp}: "
            "context parallelism splits every sequence into 2 * cp equal zig-zag chunks"
        )


def split_sequence(tensor: torch.Tensor, cp_mesh: Group, dim: int = 1) -> torch.Tensor:
    """This CP rank's zig-zag part of a full-length batch (inputs, targets, ...)."""
    group = as_group(cp_mesh)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    # the tensor's length, not the config's (that was checked before the ranks started):
    # uneven chunks would silently misplace tokens
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

    def chunk_starts(self, local_len: int) -> tuple[int, int]:
        """The global positions of this rank's two chunks' first tokens (host ints: no
        device round trip)."""
        first, second = zigzag_chunks(self.rank, self.size)
        return first * (local_len // 2), second * (local_len // 2)

    def ring_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """``ring_attention`` over this layer's CP exchange: the model's attention calls
        it through the object ``apply_cp`` gave it, without importing this file."""
        return ring_attention(q, k, v, self.exchange, scale)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [b, local, kv_heads, d] of the whole sequence, global order."""
        return (
            _GatherSequence.apply(k, self.exchange, "key"),
            _GatherSequence.apply(v, self.exchange, "value"),
        )

    def gather_sequence(self, local: torch.Tensor, what: str) -> torch.Tensor:
        """[b, local, ...] of every rank as the whole sequence [b, global, ...] in global
        order (the backward sums the ranks' gradients and keeps this rank's chunks)."""
        return _GatherSequence.apply(local, self.exchange, what)

    def local_part(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's zig-zag chunks of ``whole`` [b, global, ...] (``split_sequence``)."""
        chunks = whole.chunk(2 * self.size, dim=1)
        first, second = zigzag_chunks(self.rank, self.size)
        return torch.cat([chunks[first], chunks[second]], dim=1)

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


class _Ring:
    """The CP group's ring neighbours (global ranks, as the P2P ops want them); every
    send and receive is bounded by the exchange's timeout (a CollectiveError naming the
    layer and the message)."""

    def __init__(self, exchange: Exchange, stage: str) -> None:
        self.exchange, self.stage = exchange, stage
        group = exchange.group
        self.size, self.rank = exchange.size, exchange.rank
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, send: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, list[Pending]]:
        """Send ``send`` to the next rank, receive the previous rank's into a new buffer
        (``tag``: the backward's K/V and gradient messages are in flight together)."""
        recv = torch.empty_like(send)
        what = "K/V gradient" if tag else "K/V block"
        collective = f"CP ring {what} send/recv ({self.stage})"
        return recv, self.exchange.send_recv(send, recv, self.next, self.prev, tag, collective)

    def wait(self, pending: list[Pending]) -> None:
        for one in pending:
            self.exchange.wait(one)


def _rows_and_keys(src: int, rank: int, half: int) -> tuple[slice, slice, bool]:
    """Which local query rows see which rows of rank ``src``'s block, and whether the
    causal mask applies (own block only): the zig-zag case analysis above."""
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


# at most this many fp32 scores per tile (4 MiB): query rows are taken in tiles so
# that no (seq/cp) x (seq/cp) score matrix is ever materialised
SCORE_TILE = 1 << 20


def _block_in_hand(
    kv: torch.Tensor, ring: _Ring, step: int, half: int, repeat: int, k_dim: int
) -> tuple[slice, slice, bool, torch.Tensor, torch.Tensor]:
    """At ring step ``step``: which local query rows see which rows of the block in hand
    (rank ``rank - step``'s; K and V concatenated along the head dim, the first
    ``k_dim`` K's), whether under a causal mask, and its fp32 K and V with GQA's heads
    repeated."""
    rows, keys, causal = _rows_and_keys((ring.rank - step) % ring.size, ring.rank, half)
    k_blk, v_blk = (
        _repeat(t[:, :, keys].float(), repeat) for t in kv.split([k_dim, kv.shape[-1] - k_dim], -1)
    )
    return rows, keys, causal, k_blk, v_blk


def _tiles(q: torch.Tensor, n_keys: int) -> list[slice]:
    """Query-row tiles of ``q`` [b, h, rows, d] against ``n_keys`` keys."""
    b, h, rows, _ = q.shape
    step = max(1, SCORE_TILE // max(1, b * h * n_keys))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool, first_row: int, scale: float
) -> torch.Tensor:
    """Scaled scores of query rows ``first_row ..`` of a block; under ``causal`` (own
    block: local positions ascend in q and k alike) key j > row i is masked."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        rows, n = scores.shape[-2:]
        mask = torch.ones(rows, n, dtype=torch.bool, device=q.device).triu(first_row + 1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _repeat(kv: torch.Tensor, repeat: int) -> torch.Tensor:
    """GQA: [b, kv_heads, n, d] -> [b, heads, n, d] (each kv head serves ``repeat``)."""
    return kv.repeat_interleave(repeat, dim=1)


def _unrepeat(grad: torch.Tensor, repeat: int) -> torch.Tensor:
    """The adjoint of ``_repeat``: sum the gradients of the query heads a kv head served."""
    b, h, n, d = grad.shape
    return grad.view(b, h // repeat, repeat, n, d).sum(2)


class _RingAttention(torch.autograd.Function):
    """q and k [b, heads / kv_heads, L, d], v [b, kv_heads, L, d_v] (L = this rank's
    two chunks; MLA's d_v differs from d)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        exchange: Exchange,
        scale: float,
    ) -> torch.Tensor:
        ring = _Ring(exchange, "forward")
        repeat, half, k_dim = q.shape[1] // k.shape[1], q.shape[2] // 2, k.shape[-1]
        qf = q.float()
        out = qf.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = torch.full(qf.shape[:-1], float("-inf"), device=q.device)
        kv = torch.cat([k, v], dim=-1)  # one message per step
        for step in range(ring.size):
            if step < ring.size - 1:
                kv_next, works = ring.start(kv)
            rows, keys, causal, k_blk, v_blk = _block_in_hand(kv, ring, step, half, repeat, k_dim)
            q_rows, out_rows, lse_rows = qf[:, :, rows], out[:, :, rows], lse[:, :, rows]
            for tile in _tiles(q_rows, k_blk.shape[2]):
                scores = _scores(q_rows[:, :, tile], k_blk, causal, tile.start, scale)
                blk_lse = scores.logsumexp(-1)
                blk_out = torch.exp(scores - blk_lse[..., None]) @ v_blk
                # online softmax: step 0 (own block, causal) leaves every lse finite
                old_lse = lse_rows[:, :, tile]
                new_lse = torch.logaddexp(old_lse, blk_lse)
                out_rows[:, :, tile] = (
                    out_rows[:, :, tile] * torch.exp(old_lse - new_lse)[..., None]
                    + blk_out * torch.exp(blk_lse - new_lse)[..., None]
                )
                lse_rows[:, :, tile] = new_lse
            if step < ring.size - 1:
                ring.wait(works)
                kv = kv_next
        ctx.exchange, ctx.scale = exchange, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.exchange, "backward")
        repeat, half, k_dim = q.shape[1] // k.shape[1], q.shape[2] // 2, k.shape[-1]
        scale = ctx.scale
        qf, dout = q.float(), grad_out.float()
        delta = (dout * out).sum(-1)  # rowsum(dO * O), as in flash attention's backward
        dq = torch.zeros_like(qf)
        kv = torch.cat([k, v], dim=-1)
        # fp32 dk, dv accumulators of the block in hand; they follow it around the ring
        dkv_recv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        dkv_works: list[Pending] = []
        for step in range(ring.size):
            if step < ring.size - 1:
                kv_next, kv_works = ring.start(kv)
            rows, keys, causal, k_blk, v_blk = _block_in_hand(kv, ring, step, half, repeat, k_dim)
            dk_blk, dv_blk = torch.zeros_like(k_blk), torch.zeros_like(v_blk)
            q_rows, dq_rows = qf[:, :, rows], dq[:, :, rows]
            d_rows, delta_rows, lse_rows = dout[:, :, rows], delta[:, :, rows], lse[:, :, rows]
            for tile in _tiles(q_rows, k_blk.shape[2]):
                q_t, d_t = q_rows[:, :, tile], d_rows[:, :, tile]
                scores = _scores(q_t, k_blk, causal, tile.start, scale)
                probs = torch.exp(scores - lse_rows[:, :, tile, None])
                dv_blk += probs.transpose(-1, -2) @ d_t
                dscores = probs * (d_t @ v_blk.transpose(-1, -2) - delta_rows[:, :, tile, None])
                dq_rows[:, :, tile] += (dscores @ k_blk) * scale
                dk_blk += (dscores.transpose(-1, -2) @ q_t) * scale
            ring.wait(dkv_works)  # block src's accumulators arrive behind its k and v
            dkv = dkv_recv
            dkv[:, :, keys, :k_dim] += _unrepeat(dk_blk, repeat)
            dkv[:, :, keys, k_dim:] += _unrepeat(dv_blk, repeat)
            dkv_recv, dkv_works = ring.start(dkv, tag=1)  # to the next holder, finally home
            if step < ring.size - 1:
                ring.wait(kv_works)
                kv = kv_next
        ring.wait(dkv_works)
        dk, dv = dkv_recv.split([k_dim, v.shape[-1]], -1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Exchange | dist.ProcessGroup,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact causal attention of this rank's zig-zag shard, [b, local, heads, d] in and
    out (k and v with their kv heads; GQA's repeat happens per block, so only the kv
    heads travel; v's head dim may differ from q's and k's, as MLA's does). ``ring``: a
    layer's CP exchange (its timeout, name, byte count), or a bare CP group (the default
    timeout). ``scale``: the softmax scale, ``d ** -0.5`` by default."""
    if q.shape[1] % 2:
        raise ValueError(f"ring attention: a CP rank holds two equal chunks, got {q.shape[1]}")
    if isinstance(ring, dist.ProcessGroup):
        ring = Exchange(ring, "ring attention", "cp")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ring, scale)
    return out.transpose(1, 2)
