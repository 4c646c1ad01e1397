"""Batch-invariant CPU kernels: inside ``batch_invariant()`` every row of a result is
computed by the same arithmetic whatever the batch, the padding, the sequence length
or the decode step around it, so a generator's per-token log-probabilities equal the
trainer's recomputed ones bit for bit.

The ops are swapped for the whole process through ``torch.library`` (aten's CPU
kernels, below autograd, DTensor and the sharding hooks), so every model family and
layout gets them without model code. Which default CPU ops are batch-dependent was
measured on an AVX-512 CPU (tests/trainer/test_rl_batch_invariant.py switches each one
back and sees the bits change):

- ``mm``: BLAS picks its blocking from the row count, so a row's dot products are
  summed in another order at M = batch (decode) than at M = batch * seq (training).
  Here: the rows zero-padded to a multiple of ``ROW_TILE``, one BLAS call: MKL then
  gives each row the same arithmetic at every such row count (measured from 32 to
  3000 rows, 1 and 2 threads; the tests hold it).
- CPU flash attention: its query/key block sizes follow the sequence lengths, so a
  decode step (1 query against the cache) and the causal forward sum keys differently.
  Here: two batched BLAS calls of fixed blockings, queries zero-padded to whole
  ``QUERY_TILE``s and keys to whole ``KEY_TILE``s (MKL then gives a score the same
  arithmetic at every batch, query and key count), probabilities times values in
  tiles of at most ``VALUE_TILE`` keys from key 0 (past 256 keys MKL's blocking follows
  the key count), summed in order; masked keys exact zeros (a masked tile adds +0.0).
- ``scaled_dot_product_attention`` with queries wider than the values (MLA): sdpa
  leaves the flash kernel for its math path, batched matmuls whose sums follow the key
  count. Here: the three zero-padded to one width, into the flash kernel above.
- ``silu``: the vectorised loop leaves a tail to a scalar ``exp``, so an element's
  bits depend on where it falls in the tensor. Here: zero-padded so that every element
  takes the vector path (``exp`` in the attention too).

The norms' ``mean`` and ``log_softmax`` over a 256-wide vocabulary, ``cos``/``sin`` of
the RoPE tables and the elementwise rest were found invariant and keep their kernels.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

ROW_TILE = 32  # matmul rows padded to a multiple of this
QUERY_TILE = 8  # attention queries padded to a multiple of this (batched BLAS calls)
KEY_TILE = 16  # keys padded to a multiple of this
VALUE_TILE = 256  # keys per probabilities-times-values BLAS call: MKL keeps one blocking
CHUNK = 16384  # elements per elementwise call on several threads: under the 32768 grain
VECTOR = 64  # elements a vectorised loop takes whole (its scalar tail: the rest)
EXP_FLOOR = -87.0  # e^-87: float32's smallest normal numbers are e^-87.3


def _padded(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to a multiple of ``multiple``."""
    pad = (-x.shape[dim]) % multiple
    if not pad:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:dim], pad, *x.shape[dim + 1 :])], dim)


def _vectorised(op: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``op(x, out=...)`` with every element on the vector path: one call on ``x``
    zero-padded to whole ``VECTOR``s on one thread; on more, one call per ``CHUNK``
    (serial under the parallel grain, so no thread starts a tail of its own)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        one_call = torch.get_num_threads() == 1
        if one_call and x.is_contiguous() and x.numel() % VECTOR == 0:
            return op(x, out=torch.empty_like(x))
        flat = _padded(x.reshape(-1), 0, VECTOR if one_call else CHUNK).contiguous()
        out = torch.empty_like(flat)
        step = flat.numel() if one_call else CHUNK
        for start in range(0, flat.numel(), step):
            op(flat[start : start + step], out=out[start : start + step])
        return out[: x.numel()].view(x.shape)

    return run


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    rows = a.shape[0]
    if rows % ROW_TILE == 0:  # mm.out: the native kernel, one call
        return torch.mm(a, b, out=a.new_empty(rows, b.shape[1]))
    a = _padded(a, 0, ROW_TILE)
    return torch.mm(a, b, out=a.new_empty(a.shape[0], b.shape[1]))[:rows]


_silu = _vectorised(torch.ops.aten.silu.out)
_exp = _vectorised(torch.ops.aten.exp.out)


def _flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_scaled_dot_product_flash_attention_for_cpu``'s (output, logsumexp) from
    batched BLAS calls of fixed blockings: queries padded to whole ``QUERY_TILE``s,
    keys to whole ``KEY_TILE``s, probabilities times values in tiles of ``VALUE_TILE``
    keys from key 0 summed in order (masked keys add exact zeros). The output keeps
    the native layout (queries before heads in memory) for the native backward."""
    if dropout_p:
        raise NotImplementedError("batch-invariant attention: dropout_p must be 0")
    b, h, q_len, d = query.shape
    keys, dv = key.shape[2], value.shape[-1]
    if key.shape[1] != h:  # grouped queries: each kv head serves h / kv_heads of them
        key, value = (t.repeat_interleave(h // key.shape[1], dim=1) for t in (key, value))
    scale = d**-0.5 if scale is None else scale
    width = math.ceil(keys / KEY_TILE) * KEY_TILE
    q = query.new_zeros(b, h, math.ceil(q_len / QUERY_TILE) * QUERY_TILE, d, dtype=torch.float32)
    q[:, :, :q_len] = query
    k = query.new_zeros(b, h, width, d, dtype=torch.float32)
    k[:, :, :keys] = key
    # the values and a column of ones: the denominator from the same BLAS calls
    v = query.new_zeros(b, h, width, dv + 1, dtype=torch.float32)
    v[:, :, :keys, :dv] = value
    v[:, :, :keys, dv] = 1.0
    q, k, v = q.view(b * h, -1, d), k.view(b * h, width, d), v.view(b * h, width, dv + 1)
    scores = torch.bmm(q, k.transpose(1, 2))[:, :q_len].view(b, h, q_len, width)
    # the mask as 0 / -inf (or sdpa's additive mask), padded keys -inf
    if is_causal:  # key j > query i
        bias = torch.full((q_len, width), float("-inf"), device=query.device).triu_(1)
        if q_len > keys:
            bias[:, keys:] = float("-inf")
    elif attn_mask is None:
        bias = F.pad(query.new_zeros(q_len, keys, dtype=torch.float32), (0, width - keys))
        bias[:, keys:] = float("-inf")
    else:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=torch.float32).masked_fill_(
                ~attn_mask, float("-inf")
            )
        bias = F.pad(attn_mask.float(), (0, width - keys), value=float("-inf"))
    scores = scores * scale + bias
    # a max is exact in any order; a row of masked keys only: 0
    top = scores.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)
    # exp of -inf, and of arguments whose result is subnormal, takes a slow path:
    # weights under e^-87 of the row's largest (below float32's normal range) become
    # e^-87, then masked keys exact zeros
    probs = _exp((scores - top).clamp_(min=EXP_FLOOR)).mul_(bias > float("-inf"))
    probs = _padded(probs.view(b * h, q_len, width), 1, QUERY_TILE)
    summed = torch.bmm(probs[..., :VALUE_TILE], v[:, :VALUE_TILE])
    for start in range(VALUE_TILE, width, VALUE_TILE):  # in order from key 0
        tile = slice(start, start + VALUE_TILE)
        summed = summed + torch.bmm(probs[..., tile], v[:, tile])
    summed = summed[:, :q_len].view(b, h, q_len, dv + 1)
    safe = summed[..., dv:].clamp_min(1.0)  # >= 1 (e^0 for the largest) unless all masked
    native = query.new_empty(b, q_len, h, dv).transpose(1, 2)  # kernel's layout
    torch.div(summed[..., :dv], safe, out=native)
    return native, top[..., 0] + torch.log(safe[..., 0])


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` always through the flash kernel above: queries
    and keys of another width than the values (MLA) are zero-padded to one width, which
    adds exact zeros to the scores and the output (the scale stays the queries'), where
    sdpa would take its math path (batched matmuls whose sums follow the key count)."""
    width, dv = max(query.shape[-1], value.shape[-1]), value.shape[-1]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    query, key, value = (
        F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t
        for t in (query, key, value)
    )
    choice = torch._fused_sdp_choice(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    if choice != SDPBackend.FLASH_ATTENTION.value:
        raise NotImplementedError(
            f"batch-invariant attention: sdpa would take backend {choice}, not the flash "
            f"kernel (queries {tuple(query.shape)}, keys {tuple(key.shape)}, "
            f"enable_gqa={enable_gqa}, dropout_p={dropout_p})"
        )
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as sdpa hands it over
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
            ~attn_mask, float("-inf")
        )
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out[..., :dv]


#: the ops swapped in batch-invariant mode: aten name -> implementation
OPS: dict[str, Callable[..., object]] = {
    "mm": _mm,
    "_scaled_dot_product_flash_attention_for_cpu": _flash_attention,
    "scaled_dot_product_attention": _attention,
    "silu": _silu,
}
#: the dispatch key each one is registered for (default "CPU"): sdpa's own entry is the
#: composite that picks a backend, above autograd (the flash kernel's backward is used)
KEYS = {"scaled_dot_product_attention": "CompositeImplicitAutograd"}


@contextmanager
def batch_invariant(ops: Sequence[str] | None = None) -> Iterator[None]:
    """Swap ``ops`` (default: all of ``OPS``) for their batch-invariant CPU kernels for
    the duration; the native kernels come back on exit."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel"
            warnings.simplefilter("ignore")
            for name in OPS if ops is None else ops:
                library.impl(name, OPS[name], KEYS.get(name, "CPU"))
        yield
    finally:
        library._destroy()
