"""DeepSeek-V4's attention under context parallelism (``context_parallel``, set by
``apply_cp``): each rank holds two zig-zag chunks of ``n`` tokens and computes its
queries' attention exactly as one process does, from three kinds of keys.

- The sliding window: a query sees the ``sliding_window`` keys ending at itself, so a
  chunk needs the last ``sliding_window - 1`` keys before it: the tail of the chunk
  before, or of several when the chunks are shorter than the window
  (``tokens_before``: one all-gather of every chunk's tail).
- The compressed entries: entry ``w`` pools tokens ``w m .. w m + m - 1`` (with
  ``overlap``, the first half of the window before it too). Its tokens may lie in
  several chunks, so the entry is computed by the rank whose chunk holds its last
  token, from the token projections (``wkv``, ``wgate``) of its chunk and the ``m - 1``
  (``2 m - 1`` with overlap) before it (``tokens_before`` again). Each chunk completes
  ``floor((c + 1) n / m) - floor(c n / m)`` windows (at most ``ceil(n / m)``): padded to
  that, every rank's entries are all-gathered and the real ones kept in sequence
  order, so every rank holds all ``seq / m`` entries, rotated at their windows' first
  global positions. The indexer's keys are a compressor's entries too.
- Which entries a query sees, and the indexer's top-k among them, follow from its
  global position.

Every gather is differentiable (its backward reduce-scatters), so each gradient goes
back to the rank that owns the token. Hyper-connections, norms and the MoE act per
token and need nothing."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..parallel.context_parallel import ContextParallel
    from .compressed_attention import Compressor


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
