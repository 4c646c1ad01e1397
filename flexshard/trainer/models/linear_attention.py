"""Qwen3.5's Gated DeltaNet layer: linear attention whose per-head state S [k, v] is
decayed by exp(g) and corrected by the delta rule at every token,

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t,

with q, k, v from one projection through a causal depthwise conv1d (SiLU), q and k
L2-normalised, beta = sigmoid(in_proj_b x), g = -exp(A_log) softplus(in_proj_a x +
dt_bias), and the output RMS-normalised per head and gated by SiLU(in_proj_z x).

The sequence runs in chunks (``chunk_gated_delta_rule``): within a chunk the delta
rule's updates are one triangular solve (the UT transform), between chunks the state
is carried. The arithmetic is transformers' torch path, op for op, so a folder's
logits match its own. Parameter names are the Hugging Face ones (``linear_attn.*``).

Generation keeps, per layer, the conv's last taps - 1 inputs and the state S in the
layer's ``LayerCache.states``: the prompt runs chunked, each new token through the
recurrence (``recurrent_gated_delta_rule``). Inside ``token_by_token()`` every forward,
the trainer's too, runs the conv over its window and the recurrence with per-row
arithmetic (exp / sigmoid / softplus on whole vectors), so a token's output has the
same bits whatever the batch, the sequence length or the decode step around it: with
the batch-invariant kernels, the generator's log-probabilities are the trainer's.

Under tensor parallelism (``tp_mesh``, set by ``apply_tp``) each tp rank runs the delta
rule on its own key heads and the value heads they serve: ``in_proj_z``, ``in_proj_b``,
``in_proj_a``, ``A_log`` and ``dt_bias`` split by head, ``out_proj`` row-wise. The packed
q|k|v rows of ``in_proj_qkv`` do not split by head in one contiguous shard, so it and the
depthwise conv (each channel on its own) split their channels contiguously, and the
conv's output is gathered once and sliced to this rank's heads (``heads_of_this_rank``).

Under context parallelism (``context_parallel``, set by ``apply_cp``) each rank runs
the rule on its own two zig-zag chunks only. A chunk needs the state S its first token
starts from, which depends on every chunk before it, on other ranks; but the rule is
linear in S, so each chunk runs once from an unknown start (``piece_transfers``: its
outputs from zero, what its queries read of S, and its transfer S -> A S + B), the
ranks all-gather the transfers (per value head k_dim x (k_dim + v_dim): small), and
each rank scans them in sequence order (``start_states``) for its chunks' S. The conv
reads the last taps - 1 inputs of the chunk before (``conv_window_across_ranks``). Both
gathers are differentiable (their backward reduce-scatters), so autograd carries the
gradients back to the ranks that own the chunks. Under tp each rank holds the states
of its own heads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..config import ModelConfig
from .layers import LayerCache, _linear
from .mla import _all_reduce_grad

if TYPE_CHECKING:
    from ..parallel.context_parallel import ContextParallel


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, scaled by ``weight`` and gated by SiLU(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.init_stds = {"weight": None}  # None: ones
        # set by apply_tp: the weight is shared by every head, and a tp rank's heads
        # give only their part of its gradient
        self.tp_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        weight = local(self.weight)
        if self.tp_mesh is not None:
            weight = _all_reduce_grad(weight, self.tp_mesh)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = weight * x.to(dtype)
        return (x * F.silu(gate.float())).to(dtype)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of each channel of ``x`` [b, channels, seq] convolved with its own kernel
    ``weight`` [channels, 1, taps] over itself and the taps - 1 tokens before it."""
    taps = weight.shape[-1]
    out = F.conv1d(x, weight, padding=taps - 1, groups=x.shape[1])[..., : x.shape[-1]]
    return F.silu(out)


_TOKEN_BY_TOKEN: ContextVar[bool] = ContextVar("token_by_token", default=False)

VECTOR_SPAN = 64  # a multiple of aten's vector loop step (2 vectors of 16 floats)
SERIAL_SPAN = 16384  # elements per call: under aten's parallel grain, one thread, no tail


@contextmanager
def token_by_token() -> Iterator[None]:
    """Gated DeltaNet layers run the recurrence with per-row arithmetic in every
    forward for the duration (see the module's docstring); other layers read it through
    ``per_row_arithmetic`` (the MoE's shared-expert gate)."""
    mark = _TOKEN_BY_TOKEN.set(True)
    try:
        yield
    finally:
        _TOKEN_BY_TOKEN.reset(mark)


def per_row_arithmetic() -> bool:
    """Inside ``token_by_token()``: every op must give a row the same bits whatever the
    rows around it."""
    return _TOKEN_BY_TOKEN.get()


def whole_vectors(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``op`` of every element of ``x`` through aten's vector loop: zero-padded to whole
    vectors and run in single-thread spans, so no element lands in the scalar tail
    (whose ``exp`` rounds differently) wherever it sits in the tensor. Differentiable."""
    flat = x.reshape(-1)
    flat = F.pad(flat, (0, (-flat.numel()) % VECTOR_SPAN))
    out = torch.cat([op(part) for part in flat.split(SERIAL_SPAN)])
    return out[: x.numel()].view(x.shape)


def windowed_depthwise_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the causal depthwise conv at the last ``window.shape[-1] - taps + 1``
    positions of ``window`` [b, channels, taps - 1 + s] (the taps - 1 inputs before
    them, then them): transformers' cached conv step."""
    return F.silu(F.conv1d(window, weight, groups=window.shape[1]))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor-parallel parameter (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def gathered_channels(mixed: torch.Tensor, mesh: DeviceMesh, channels: int) -> torch.Tensor:
    """All ``channels`` of ``mixed`` [b, channels / tp, s], this rank's contiguous share
    (the last ranks' may be shorter), gathered over ``mesh``. Each rank reads only some of
    the gathered channels, so the backward sums the ranks' gradients (reduce-scatter)."""
    b, _, s = mixed.shape
    shard = DTensor.from_local(
        mixed,
        mesh,
        [Shard(1)],
        run_check=False,
        shape=(b, channels, s),
        stride=(channels * s, s, 1),
    )
    return shard.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _per_value_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Both forms' inputs [b, v_heads, s, ...] in fp32: each key head repeated for the
    value heads it serves, queries and keys L2-normalised, queries scaled by 1/sqrt(k_dim)."""
    k_heads, v_heads = k.shape[2], v.shape[2]
    if k_heads != v_heads:
        q = q.repeat_interleave(v_heads // k_heads, dim=2)
        k = k.repeat_interleave(v_heads // k_heads, dim=2)
    q, k, v, beta, g = (
        t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for t in (q, k, v, beta, g)
    )
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, beta, g


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 64,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [b, s, v_heads, v_dim] of the gated delta rule from ``initial_state``
    [b, v_heads, k_dim, v_dim] (None: zeros), and the state after the last token
    (fp32): queries and keys [b, s, k_heads, k_dim] (L2-normalised here; each key head
    serving v_heads / k_heads consecutive value heads), values [b, s, v_heads, v_dim],
    the log decay ``g`` and the write strength ``beta`` [b, s, v_heads]. fp32 inside."""
    dtype = q.dtype
    q, k, v, beta, g = _per_value_head(q, k, v, beta, g)
    out, state = _chunked_rule(q, k, v, beta, g, chunk, initial_state)
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state


def _chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    chunk: int,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_gated_delta_rule`` on ``_per_value_head``'s fp32 inputs [b, v_heads, s,
    ...]: outputs [b, v_heads, s, v_dim] and the final state, both fp32."""
    b, v_heads, s, v_dim = v.shape
    pad = (chunk - s % chunk) % chunk  # the tail padded with zeros: no write, no decay
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (
        t.reshape(t.shape[0], t.shape[1], -1, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta)
    )
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk)
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = g.cumsum(dim=3)  # log of the decay from the chunk's start to each token
    # decay between tokens j <= i of a chunk (masked before exp: no overflow)
    pairwise = (decay.unsqueeze(4) - decay.unsqueeze(3)).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    within = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * decay.exp().unsqueeze(-1)
    # the UT transform: a chunk's sequential delta-rule writes as one unit-lower solve
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(
        system, decayed_k_beta, upper=False, unitriangular=True
    )
    if initial_state is None:
        state = new_values.new_zeros(b, v_heads, k.shape[-1], v_dim)
    else:
        state = initial_state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):  # the state carried from chunk to chunk
        correction = new_values[:, :, i] - k_decayed[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + within[:, :, i] @ correction
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ correction
    # the padded tail neither decays nor writes: ``state`` is the last token's
    return out.reshape(b, v_heads, -1, v_dim)[:, :, :s], state


def piece_transfers(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule over pieces of a sequence (``chunk_gated_delta_rule``'s
    inputs, one piece per batch row) whose state at the start is not known yet. The
    rule is linear in (start state, values), so one pass of the chunked rule from the
    start [I | 0] with values [0 | v] gives, per value head and in fp32,

    - ``outputs`` [b, v_heads, s, v_dim] from a zero start,
    - ``reads`` [b, v_heads, s, k_dim]: what each query reads of the start state S_in
      (the outputs from S_in are ``outputs + reads @ S_in``, ``outputs_from``),
    - ``transfer`` [b, v_heads, k_dim, k_dim + v_dim], [A | B]: the state after the
      piece is ``A @ S_in + B`` (``start_states`` scans the pieces with it)."""
    q, k, v, beta, g = _per_value_head(q, k, v, beta, g)
    b, v_heads, s, _ = v.shape
    k_dim = k.shape[-1]
    values = torch.cat([v.new_zeros(b, v_heads, s, k_dim), v], dim=-1)
    identity = torch.eye(k_dim, device=v.device).expand(b, v_heads, k_dim, k_dim)
    start = torch.cat([identity, v.new_zeros(b, v_heads, k_dim, v.shape[-1])], dim=-1)
    out, transfer = _chunked_rule(q, k, values, beta, g, chunk, start)
    return out[..., k_dim:], out[..., :k_dim], transfer


def start_states(transfers: torch.Tensor) -> torch.Tensor:
    """The state at the start of each of a sequence's consecutive pieces [b, pieces,
    v_heads, k_dim, v_dim] from their ``piece_transfers`` [b, pieces, v_heads, k_dim,
    k_dim + v_dim] (in sequence order): zero for the first, then S <- A @ S + B."""
    k_dim = transfers.shape[-2]
    transition, written = transfers[..., :k_dim], transfers[..., k_dim:]
    state = written.new_zeros(written[:, 0].shape)
    states = []
    for piece in range(transfers.shape[1]):
        states.append(state)
        state = transition[:, piece] @ state + written[:, piece]
    return torch.stack(states, dim=1)


def outputs_from(outputs: torch.Tensor, reads: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """``piece_transfers``' outputs with the pieces' start states ``start`` [b, v_heads,
    k_dim, v_dim] added: [b, s, v_heads, v_dim] (fp32)."""
    return (outputs + reads @ start).transpose(1, 2)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    per_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_gated_delta_rule``'s outputs and final state, one token at a time from
    ``state`` [b, v_heads, k_dim, v_dim] (None: zeros), transformers' recurrent form.
    Each op acts on a row alone, elementwise or summed over one head's dims;
    ``per_row``: the decays' exp on whole vectors too (``whole_vectors``)."""
    dtype = q.dtype
    b, s, _, k_dim = k.shape
    v_heads, v_dim = v.shape[-2:]
    q, k, v, beta, g = _per_value_head(q, k, v, beta, g)
    decay = whole_vectors(torch.exp, g) if per_row else g.exp()
    if state is None:
        state = torch.zeros(b, v_heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    outs = []
    for t in range(s):
        key = k[:, :, t, :, None]
        state = state * decay[:, :, t, None, None]
        delta = (v[:, :, t] - (state * key).sum(-2)) * beta[:, :, t, None]
        state = state + key * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    out = torch.stack(outs, dim=1) if outs else v.transpose(1, 2)
    return out.to(dtype, memory_format=torch.contiguous_format), state


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet token mixer (``linear_attn`` in a Qwen3.5 folder)."""

    def __init__(self, cfg: ModelConfig, out_std: float) -> None:
        super().__init__()
        la = cfg.linear_attention
        self.k_heads, self.v_heads = la.num_key_heads, la.num_value_heads
        self.k_dim, self.v_dim = la.key_head_dim, la.value_head_dim
        key_width, value_width = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_width = 2 * key_width + value_width
        self.in_proj_qkv = _linear(cfg.dim, self.conv_width, 0.02)
        self.in_proj_z = _linear(cfg.dim, value_width, 0.02)
        self.in_proj_b = _linear(cfg.dim, self.v_heads, 0.02)
        self.in_proj_a = _linear(cfg.dim, self.v_heads, 0.02)
        # weight [channels, 1, taps], run by causal_depthwise_conv
        self.conv1d = nn.Conv1d(
            self.conv_width, self.conv_width, la.conv_kernel, groups=self.conv_width, bias=False
        )
        self.conv1d.init_stds = {"weight": la.conv_kernel**-0.5}
        # per value head: the decay rate's log and the softplus step's bias; drawn by
        # init_module as transformers draws them (see init_decay)
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.init_stds = {"A_log": "decay", "dt_bias": None}
        self.norm = GatedRMSNorm(self.v_dim, cfg.norm_eps)
        self.out_proj = _linear(value_width, cfg.dim, out_std)
        self.tp_mesh: DeviceMesh | None = None  # set by apply_tp (see the module's docstring)
        self.context_parallel: ContextParallel | None = None  # set by apply_cp

    def heads_of_this_rank(
        self, mixed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys [b, s, k_dim * key heads] and values [b, s, v_dim * value heads]
        of this rank's heads (all of them without tp) from the conv's output ``mixed``
        [b, channels, s] (under tp: this rank's contiguous share of the channels)."""
        if self.tp_mesh is not None:
            mixed = gathered_channels(mixed, self.tp_mesh, self.conv_width)
        key_width = self.k_heads * self.k_dim
        widths = [key_width, key_width, self.conv_width - 2 * key_width]
        q, k, v = torch.split(mixed.transpose(1, 2), widths, dim=-1)
        if self.tp_mesh is None:
            return q, k, v
        # tp divides both head counts: key head group r serves value head group r
        rank, tp = self.tp_mesh.get_local_rank(), self.tp_mesh.size()
        return q.chunk(tp, -1)[rank], k.chunk(tp, -1)[rank], v.chunk(tp, -1)[rank]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        cp = self.context_parallel
        if cp is not None and cache is None:  # generation: no CP there
            if _TOKEN_BY_TOKEN.get():
                raise ValueError(
                    "token_by_token() under context parallelism: the Gated DeltaNet "
                    "layers' per-row recurrence runs on one process (parallelism.cp = 1)"
                )
            return self.mix(x, context_parallel=cp)
        return self.mix(x, cache)

    def mix(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> torch.Tensor:
        """The layer's output for the tokens ``x`` [b, s, dim] (after the ``cache``'s;
        under ``context_parallel``: this rank's two zig-zag chunks)."""
        b, s, _ = x.shape
        per_row = _TOKEN_BY_TOKEN.get()
        previous = cache.states if cache is not None else ()  # (conv inputs, state S)
        proj = self.in_proj_qkv(x).transpose(1, 2)
        conv_weight = local(self.conv1d.weight)
        taps = conv_weight.shape[-1]
        window = proj
        if per_row or cache is not None:
            history = previous[0] if previous else proj.new_zeros(b, proj.shape[1], taps - 1)
            window = torch.cat([history, proj], dim=-1)
        if context_parallel is not None:
            window = conv_window_across_ranks(proj, taps, context_parallel)
        if per_row or previous or context_parallel is not None:
            mixed = windowed_depthwise_conv(window, conv_weight)
        else:  # training and prefill: the folder's own arithmetic
            mixed = causal_depthwise_conv(proj, conv_weight)
        q, k, v = self.heads_of_this_rank(mixed)
        rows, length = q.shape[:2]  # under cp: each of the two chunks a row
        q = q.reshape(rows, length, -1, self.k_dim)
        k = k.reshape(rows, length, -1, self.k_dim)
        v = v.reshape(rows, length, -1, self.v_dim)
        a = self.in_proj_a(x).float() + local(self.dt_bias)
        decay_rate = -local(self.A_log).float().exp()
        if per_row:
            beta = whole_vectors(torch.sigmoid, self.in_proj_b(x))
            g = decay_rate * whole_vectors(F.softplus, a)
        else:
            beta = self.in_proj_b(x).sigmoid()
            g = decay_rate * F.softplus(a)
        if context_parallel is not None:
            beta, g = as_pieces(beta), as_pieces(g)
            out = delta_rule_across_ranks(q, k, v, g, beta, context_parallel)
        elif per_row or previous:
            state = previous[1] if previous else None
            out, state = recurrent_gated_delta_rule(q, k, v, g, beta, state, per_row)
        else:
            out, state = chunk_gated_delta_rule(q, k, v, g, beta)
        if cache is not None:
            cache.carry(s, window[..., window.shape[-1] - (taps - 1) :], state)
        z = self.in_proj_z(x)
        out = self.norm(out.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))
        return self.out_proj(out.reshape(b, s, -1))


def as_pieces(t: torch.Tensor) -> torch.Tensor:
    """A CP rank's [b, 2 * n, ...] (its two zig-zag chunks) as [2 * b, n, ...]: one
    chunk per row, the first chunks' rows first."""
    b, s = t.shape[:2]
    return t.unflatten(1, (2, s // 2)).transpose(0, 1).flatten(0, 1)


def from_pieces(t: torch.Tensor) -> torch.Tensor:
    """``as_pieces``'s inverse: [2 * b, n, ...] -> [b, 2 * n, ...]."""
    return t.unflatten(0, (2, t.shape[0] // 2)).transpose(0, 1).flatten(1, 2)


def conv_window_across_ranks(proj: torch.Tensor, taps: int, cp: ContextParallel) -> torch.Tensor:
    """The causal conv's windows [2 * b, channels, taps - 1 + n] of a CP rank's two
    chunks ``proj`` [b, channels, 2 * n], one per row (``as_pieces``): each chunk after
    the last taps - 1 inputs of the chunk before it, from whichever rank holds it
    (zeros before the first). One all-gather of every chunk's tail; its backward
    returns each tail's gradient to its owner."""
    b, channels, length = proj.shape
    n, history = length // 2, taps - 1
    if n < history:
        raise ValueError(
            f"context parallelism cuts the sequence into chunks of {n} tokens, fewer than "
            f"the Gated DeltaNet conv's taps - 1 = {history} (model.linear_attention."
            "conv_kernel): raise training.seq_len or lower parallelism.cp"
        )
    chunks = proj.transpose(1, 2).unflatten(1, (2, n))  # [b, 2, n, channels]
    tails = chunks[:, :, n - history :].flatten(1, 2)
    every_tail = cp.gather_sequence(tails, "Gated DeltaNet conv inputs").unflatten(1, (-1, history))
    # the tail before each chunk, in global chunk order: this rank keeps its two
    before = torch.cat([torch.zeros_like(every_tail[:, :1]), every_tail[:, :-1]], dim=1)
    before = cp.local_part(before)  # [b, 2, taps - 1, channels]
    window = torch.cat([before, chunks], dim=2)
    return window.transpose(0, 1).flatten(0, 1).transpose(1, 2)


def delta_rule_across_ranks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cp: ContextParallel,
) -> torch.Tensor:
    """The gated delta rule's outputs [b, 2 * n, v_heads, v_dim] of a CP rank's two
    zig-zag chunks (inputs as ``chunk_gated_delta_rule``'s, one chunk per row as
    ``as_pieces`` lays them): the rule runs on this rank's chunks only, from an unknown
    start (``piece_transfers``); every chunk's transfer [A | B] is all-gathered, each
    rank scans them in sequence order for its chunks' start states, and adds what its
    queries read of them. The gather's backward sums the ranks' gradients of each
    transfer (every rank's scan reads every chunk's)."""
    dtype = q.dtype
    # a chunk shorter than the rule's 64 runs as one (not padded to 64)
    outputs, reads, transfer = piece_transfers(q, k, v, g, beta, min(64, q.shape[1]))
    mine = transfer.unflatten(0, (2, -1)).transpose(0, 1)  # [b, 2, v_heads, k, k + v]
    every = cp.gather_sequence(mine, "Gated DeltaNet chunk transfers")
    start = cp.local_part(start_states(every))  # [b, 2, v_heads, k_dim, v_dim]
    out = outputs_from(outputs, reads, start.transpose(0, 1).flatten(0, 1))
    return from_pieces(out).to(dtype, memory_format=torch.contiguous_format)


def init_decay(param: torch.Tensor) -> None:
    """A_log as transformers draws it: log of uniform(0.01, 16) rates (the lower bound
    keeps log(A) finite)."""
    param.copy_(torch.empty_like(param).uniform_(0.01, 16).log_())
