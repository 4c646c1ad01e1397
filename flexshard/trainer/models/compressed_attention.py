"""DeepSeek-V4's attention: one shared key-and-value head (MQA, K = V), queries through
a q_lora_rank latent, each query head RMS-normalised, RoPE on the trailing
``rotary_dim`` dims of every head in adjacent pairs (and undone on the output, so each
value enters at its relative position), a learned per-head sink in the softmax, a
sliding window of ``sliding_window`` keys, and the heads' output through ``o_groups``
low-rank projections (``wo_a``) then one mix (``wo_b``).

Beside the window, a layer may attend compressed entries, each a softmax-gated sum of
``m`` consecutive tokens' projections (``Compressor``), visible to a query once all
``m`` tokens are in its past:

- ``heavily_compressed_attention``: every entry (``m = compress_rate_hca``);
- ``compressed_sparse_attention``: entries of ``2 m`` overlapping tokens (the previous
  window's first half of the projection beside this window's second half,
  ``m = compress_rate_csa``), of which a lightning indexer keeps ``index_topk`` per
  query: its own compressor at ``index_head_dim`` scores each entry as
  ``sum_h w_h relu(q_h . k)``. The choice is a top-k, so the indexer's weights get no
  gradient from the language-model loss (as in transformers' reference).

Names are DeepSeek's own (``wq_a``, ``wkv``, ``attn_sink``, ``compressor.ape``), as
transformers saves them. Computes what transformers' ``DeepseekV4Attention`` does
without a cache (training; positions from 0); under context parallelism, for a rank's
two zig-zag chunks, with what they need from the other ranks
(the functions after ``CompressedAttention``).

Under tensor parallelism (``tp_mesh``, set by ``apply_tp``) each tp rank holds whole
query heads (``wq_b`` rows, ``attn_sink``) and the output groups they make (``wo_a``
rows, ``wo_b`` columns); the shared key-and-value head, the compressors and the indexer
stay replicated, computed whole on every rank: every head reads all of their output,
so splitting them would only add a gather."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import ModelConfig
from .hyper_connections import unweighted_rms_norm
from .layers import RMSNorm, _linear, apply_rope
from .linear_attention import as_pieces, from_pieces, local
from .mla import _all_reduce_grad, yarn_frequencies

if TYPE_CHECKING:
    from ..parallel.context_parallel import ContextParallel

SLIDING = "sliding_attention"
SPARSE = "compressed_sparse_attention"
HEAVY = "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, SPARSE, HEAVY)


def v4_rope_tables(
    cfg: ModelConfig, seq_len: int, device: torch.device
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos and sin [seq_len, rotary_dim / 2] of the sliding branch (``"main"``: plain
    RoPE at ``rope_theta``) and the compressed ones (``"compress"``:
    ``compress_rope_theta`` with YaRN's frequencies where ``rope_scaling`` says, and no
    attention factor, as DeepSeek's reference)."""
    dim = cfg.rotary_dim()
    positions = torch.arange(seq_len, device=device).float()
    theta = cfg.deepseek_v4.compress_rope_theta
    plain = 1.0 / theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    scaling = cfg.rope_scaling
    compress = yarn_frequencies(dim, theta, scaling).to(device) if scaling.type == "yarn" else plain
    main = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    tables = {}
    for name, freqs in (("main", main), ("compress", compress)):
        angles = torch.outer(positions, freqs)
        tables[name] = (angles.cos(), angles.sin())
    return tables


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the trailing dims of ``x`` [b, s, h, d] that the tables cover."""
    dim = 2 * cos.shape[-1]
    return torch.cat([x[..., :-dim], apply_rope(x[..., -dim:], cos, sin)], dim=-1)


class Compressor(nn.Module):
    """Entries of ``rate`` tokens each: per token a projection (``wkv``) and a gate
    (``wgate`` + ``ape``, one row per place in the window), softmax over the window's
    places per channel, the weighted sum RMS-normalised (``norm``) and rotated at the
    window's first position. ``overlap``: projections twice as wide, the first half
    feeding the next window's entry (compressed sparse attention)."""

    def __init__(self, dim: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.rate, self.head_dim, self.overlap = rate, head_dim, overlap
        self.wkv = _linear(dim, width, 0.02)
        self.wgate = _linear(dim, width, 0.02)
        self.ape = nn.Parameter(torch.empty(rate, width))
        self.norm = RMSNorm(head_dim, eps)
        self.init_stds = {"ape": "zeros"}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The complete windows' entries [b, n, head_dim] of ``x`` [b, s, dim]."""
        b, s, _ = x.shape
        m, d = self.rate, self.head_dim
        n = s // m
        if n == 0:
            return x.new_zeros(b, 0, d)
        kv = self.wkv(x[:, : n * m]).view(b, n, m, -1)
        gate = self.wgate(x[:, : n * m]).view(b, n, m, -1) + self.ape
        if self.overlap:  # the first window has no previous one: one of no weight in front
            kv = F.pad(kv, (0, 0, 0, 0, 1, 0))
            gate = F.pad(gate, (0, 0, 0, 0, 1, 0), value=float("-inf"))
        return rotated_entries(self.pool(kv, gate), m, cos, sin)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The entries [b, n, head_dim] (not rotated) of ``n`` consecutive windows' token
        projections ``kv`` and gates ``gate`` (``ape`` added) [b, n, rate, width]; with
        ``overlap`` one window more in front, read only for its first half."""
        d = self.head_dim
        if self.overlap:  # [previous window's first half | this window's second half]
            kv = torch.cat([kv[:, :-1, :, :d], kv[:, 1:, :, d:]], dim=2)
            gate = torch.cat([gate[:, :-1, :, :d], gate[:, 1:, :, d:]], dim=2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        return self.norm((kv * weights).sum(dim=2))


def rotated_entries(
    entries: torch.Tensor, rate: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``entries`` [b, n, head_dim] (windows 0 .. n - 1 of ``rate`` tokens) rotated at
    their windows' first positions."""
    where = torch.arange(entries.shape[1], device=entries.device) * rate
    return rope_tail(entries.unsqueeze(2), cos[where], sin[where]).squeeze(2)


def visible_entries(positions: torch.Tensor, entries: int, rate: int) -> torch.Tensor:
    """[queries, entries]: whether the query at each of ``positions`` sees entry w (all
    of its tokens at or before the query)."""
    ready = (positions + 1) // rate
    return torch.arange(entries, device=positions.device)[None, :] < ready[:, None]


class Indexer(nn.Module):
    """The lightning indexer: which ``topk`` compressed entries each query attends."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v4 = cfg.deepseek_v4
        self.heads, self.head_dim, self.topk = v4.index_n_heads, v4.index_head_dim, v4.index_topk
        rate = v4.compress_rate_csa
        self.compressor = Compressor(cfg.dim, self.head_dim, rate, True, cfg.norm_eps)
        self.wq_b = _linear(cfg.q_lora_rank, self.heads * self.head_dim, 0.02)
        self.weights_proj = _linear(cfg.dim, self.heads, 0.02)

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        keys: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """[b, s, T] additive bias over the T compressed entries: 0 where chosen, for the
        queries ``x`` at ``positions`` (``cos`` / ``sin``: their rows of the tables)
        and the compressor's entries ``keys`` [b, T, index_head_dim]."""
        b, s, _ = x.shape
        q = rope_tail(self.wq_b(q_latent).view(b, s, self.heads, self.head_dim), cos, sin)
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores) * self.head_dim**-0.5  # [b, s, h, T]
        weights = self.weights_proj(x).float() * self.heads**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
        visible = visible_entries(positions, keys.shape[1], self.compressor.rate)
        scores = scores.masked_fill(~visible, float("-inf"))
        chosen = scores.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        # a query with fewer visible entries than topk: its extra picks stay masked
        picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        bias = torch.zeros_like(scores, dtype=x.dtype)
        return bias.masked_fill(~(picked & visible), float("-inf"))


def window_bias(
    queries: torch.Tensor, keys: torch.Tensor, window: int, dtype: torch.dtype
) -> torch.Tensor:
    """[..., q, k] additive bias: 0 where the key at position ``keys`` is one of the
    ``window`` ending at the query at ``queries`` (and in the sequence), else -inf."""
    gap = queries[..., :, None] - keys[..., None, :]
    seen = (gap >= 0) & (gap < window) & (keys[..., None, :] >= 0)
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(
        ~seen, float("-inf")
    )


class CompressedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, out_std: float, kind: str) -> None:
        super().__init__()
        v4 = cfg.deepseek_v4
        self.kind, self.n_heads, self.head_dim = kind, cfg.n_heads, cfg.head_size()
        self.window, self.groups, self.eps = v4.sliding_window, v4.o_groups, cfg.norm_eps
        inner = cfg.n_heads * self.head_dim
        self.wq_a = _linear(cfg.dim, cfg.q_lora_rank, 0.02)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = _linear(cfg.q_lora_rank, inner, 0.02)
        self.wkv = _linear(cfg.dim, self.head_dim, 0.02)
        self.norm = RMSNorm(self.head_dim, cfg.norm_eps)
        # block-diagonal: group g's heads -> its o_lora_rank rows
        self.wo_a = _linear(inner // v4.o_groups, v4.o_groups * v4.o_lora_rank, 0.02)
        self.wo_b = _linear(v4.o_groups * v4.o_lora_rank, cfg.dim, out_std)
        self.attn_sink = nn.Parameter(torch.empty(cfg.n_heads))
        self.init_stds = {"attn_sink": "zeros"}
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if kind == HEAVY:
            self.compressor = Compressor(
                cfg.dim, self.head_dim, v4.compress_rate_hca, False, cfg.norm_eps
            )
        elif kind == SPARSE:
            self.compressor = Compressor(
                cfg.dim, self.head_dim, v4.compress_rate_csa, True, cfg.norm_eps
            )
            self.indexer = Indexer(cfg)
        # set by apply_tp: the keys and values are shared by every head, and a tp rank's
        # heads give only their part of their gradient
        self.tp_mesh: DeviceMesh | None = None
        self.context_parallel: ContextParallel | None = None  # set by apply_cp

    def forward(
        self, x: torch.Tensor, tables: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """The layer's output for the tokens ``x`` [b, s, dim] (under
        ``context_parallel``: this rank's two zig-zag chunks; ``tables``: the whole
        sequence's)."""
        b, s, _ = x.shape
        cp = self.context_parallel
        cos, sin = tables["main" if self.compressor is None else "compress"]
        if cp is None:
            positions, here = torch.arange(s, device=x.device), (cos, sin)
        else:  # this rank's tokens sit at zig-zag global positions
            positions = cp.positions(s, x.device)
            here = (cos[positions], sin[positions])
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(b, s, self.n_heads, self.head_dim)
        q = rope_tail(unweighted_rms_norm(q, self.eps), *here)
        kv = rope_tail(self.norm(self.wkv(x)).unsqueeze(2), *here).squeeze(2)
        if cp is None:
            keys, mask = kv, window_bias(positions, positions, self.window, x.dtype).expand(b, s, s)
        else:  # one row per chunk (``as_pieces``), each with the window keys before it
            chunk_keys, key_positions = window_keys_across_ranks(kv, self.window, cp)
            keys = chunk_keys.transpose(0, 1).flatten(0, 1)
            mask = window_bias(positions.view(2, -1), key_positions, self.window, x.dtype)
            mask = mask.unsqueeze(1).expand(-1, b, -1, -1).flatten(0, 1)
            q = as_pieces(q)
        if self.compressor is not None:
            entries = self.entries(self.compressor, x, cos, sin)
            if self.indexer is not None:
                index_keys = self.entries(self.indexer.compressor, x, cos, sin)
                bias = self.indexer(x, q_latent, index_keys, *here, positions)
            else:
                visible = visible_entries(positions, entries.shape[1], self.compressor.rate)
                bias = torch.zeros(s, entries.shape[1], dtype=x.dtype, device=x.device)
                bias = bias.masked_fill(~visible, float("-inf")).expand(b, -1, -1)
            if cp is not None:  # every chunk reads every entry
                entries, bias = entries.repeat(2, 1, 1), as_pieces(bias)
            keys = torch.cat([keys, entries], dim=1)
            mask = torch.cat([mask, bias], dim=-1)
        out = self.attend(q, keys, mask)
        if cp is not None:
            out = from_pieces(out)
        out = rope_tail(out, here[0], -here[1])
        grouped = out.reshape(b * s, self.groups, -1).transpose(0, 1)
        w = local(self.wo_a.weight).view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        low_rank = torch.bmm(grouped, w).transpose(0, 1).reshape(b, s, -1)
        return self.wo_b(low_rank)

    def entries(
        self,
        compressor: Compressor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """``compressor``'s entries [b, T, d] of the whole sequence, rotated (``cos`` /
        ``sin``: the whole sequence's tables)."""
        cp = self.context_parallel
        if cp is None:
            return compressor(x, cos, sin)
        pooled = entries_across_ranks(compressor, x, cp)
        return rotated_entries(pooled, compressor.rate, cos, sin)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Every head's attention [rows, s, h, d] of the queries ``q`` [rows, s, h, d] over
        the shared ``keys`` (= values) [rows, K, d] under the additive ``mask`` [rows, s, K],
        each head's sink beside them in the softmax."""
        if self.tp_mesh is not None:
            keys = _all_reduce_grad(keys, self.tp_mesh)
        rows, s = q.shape[:2]
        scores = torch.matmul(q.transpose(1, 2), keys.unsqueeze(1).transpose(2, 3))
        scores = scores * self.head_dim**-0.5 + mask.unsqueeze(1)
        sinks = local(self.attn_sink).reshape(1, -1, 1, 1).expand(rows, -1, s, 1).to(scores.dtype)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys.unsqueeze(1)).transpose(1, 2)


# DeepSeek-V4's attention under context parallelism (``context_parallel``, set by
# ``apply_cp``): each rank holds two zig-zag chunks of ``n`` tokens and computes its
# queries' attention exactly as one process does, from three kinds of keys.
#
# - The sliding window: a query sees the ``sliding_window`` keys ending at itself, so a
#   chunk needs the last ``sliding_window - 1`` keys before it: the tail of the chunk
#   before, or of several when the chunks are shorter than the window
#   (``tokens_before``: one all-gather of every chunk's tail).
# - The compressed entries: entry ``w`` pools tokens ``w m .. w m + m - 1`` (with
#   ``overlap``, the first half of the window before it too). Its tokens may lie in
#   several chunks, so the entry is computed by the rank whose chunk holds its last
#   token, from the token projections (``wkv``, ``wgate``) of its chunk and the ``m - 1``
#   (``2 m - 1`` with overlap) before it (``tokens_before`` again). Each chunk completes
#   ``floor((c + 1) n / m) - floor(c n / m)`` windows (at most ``ceil(n / m)``): padded to
#   that, every rank's entries are all-gathered and the real ones kept in sequence
#   order, so every rank holds all ``seq / m`` entries, rotated at their windows' first
#   global positions. The indexer's keys are a compressor's entries too.
# - Which entries a query sees, and the indexer's top-k among them, follow from its
#   global position.
#
# Every gather is differentiable (its backward reduce-scatters), so each gradient goes
# back to the rank that owns the token. Hyper-connections, norms and the MoE act per
# token and need nothing.


def tokens_before(local: torch.Tensor, count: int, cp: ContextParallel, what: str) -> torch.Tensor:
    """The ``count`` tokens [b, 2, count, ...] before each of this rank's two chunks
    ``local`` [b, 2 n, ...], from whichever ranks hold them (zeros before the
    sequence's start). One all-gather of each chunk's last ``min(n, count)`` tokens;
    a chunk shorter than ``count`` reads the chunks before it whole."""
    b, length = local.shape[:2]
    n, rest = length // 2, local.shape[2:]
    if count == 0:
        return local.new_zeros(b, 2, 0, *rest)
    tail, reach = min(n, count), math.ceil(count / n)  # tokens per chunk, chunks back
    tails = local.unflatten(1, (2, n))[:, :, n - tail :].flatten(1, 2)
    every = cp.gather_sequence(tails, what).unflatten(1, (-1, tail))  # [b, 2 cp, tail, ...]
    chunks = every.shape[1]
    padded = torch.cat([every.new_zeros(b, reach, tail, *rest), every], dim=1)
    # chunk c's predecessors c - reach .. c - 1 are padded's c .. c + reach - 1
    before = torch.cat([padded[:, back : back + chunks] for back in range(reach)], dim=2)
    return cp.local_part(before[:, :, reach * tail - count :])


def window_keys_across_ranks(
    kv: torch.Tensor, window: int, cp: ContextParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's sliding-window keys [b, 2, window - 1 + n, d] (the ``window - 1``
    before it, then its own) from this rank's keys ``kv`` [b, 2 n, d], and their global
    positions [2, window - 1 + n] (negative: before the sequence, never seen)."""
    n = kv.shape[1] // 2
    before = tokens_before(kv, window - 1, cp, "sliding-window keys")
    keys = torch.cat([before, kv.unflatten(1, (2, n))], dim=2)
    offsets = torch.arange(1 - window, n, device=kv.device)
    starts = torch.tensor(cp.chunk_starts(kv.shape[1]), device=kv.device)
    return keys, starts[:, None] + offsets[None, :]


def entries_across_ranks(
    compressor: Compressor,
    x: torch.Tensor,
    cp: ContextParallel,
) -> torch.Tensor:
    """The whole sequence's compressed entries [b, seq / rate, head_dim], not yet
    rotated, as ``compressor`` pools them on one process: this rank pools the windows
    whose last token its chunks ``x`` [b, 2 n, dim] hold, then every rank's are
    gathered."""
    b, length, _ = x.shape
    n, m, chunks = length // 2, compressor.rate, 2 * cp.size
    # each token's projection and gate, side by side: the windows before need them
    projected = torch.cat([compressor.wkv(x), compressor.wgate(x)], dim=-1)
    width = projected.shape[-1] // 2
    lead = 1 if compressor.overlap else 0  # windows read before the first one pooled
    reach = (1 + lead) * m - 1
    before = tokens_before(projected, reach, cp, f"compressor inputs (rate {m})")
    spans = torch.cat([before, projected.unflatten(1, (2, n))], dim=2)  # [b, 2, reach + n, 2w]
    most = math.ceil(n / m)  # the most windows one chunk completes
    mine = []
    for piece, start in enumerate(cp.chunk_starts(length)):
        first, last = start // m, (start + n) // m  # windows completed in this chunk
        windows = last - first
        # no window ends in this chunk: pool none, but through the same ops, so that every
        # rank's parameters get a gradient and its backward runs the same collectives
        read = windows + lead if windows else 0
        offset = (first - lead) * m - (start - reach) if windows else 0  # the first read
        tokens = spans[:, piece, offset : offset + read * m]
        kv, gate = tokens.unflatten(1, (read, m)).split(width, dim=-1)
        gate = gate + compressor.ape
        if windows and first - lead < 0:  # the first window's previous: before the sequence
            gate = torch.cat([torch.full_like(gate[:, :1], float("-inf")), gate[:, 1:]], 1)
        pooled = compressor.pool(kv, gate)
        mine.append(torch.nn.functional.pad(pooled, (0, 0, 0, most - pooled.shape[1])))
    every = cp.gather_sequence(torch.cat(mine, dim=1), f"compressed entries (rate {m})")
    real = [c * most + j for c in range(chunks) for j in range((c + 1) * n // m - c * n // m)]
    return every[:, real]
