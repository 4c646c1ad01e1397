"""The codec as branch-free whole-tensor expressions, for ``torch.compile`` (inductor) to fuse.

``codec.quantize``/``dequantize`` are fast *eager* code: they look at small tensors to skip
fix-ups (host-side branches) and build fp8 bits with integer tricks that only pay one op at
a time. A compiled graph wants the opposite: no data-dependent Python, one expression per
element that inductor turns into one loop. Every formulation below was chosen for what
inductor's CPU backend vectorizes on AVX-512/AVX2 (torch 2.13):

* the e4m3 <-> float32 conversions are torch's own casts (``at::vec`` has vectorized fp8
  converts; inductor never sees a bit reinterpretation of a large tensor, which it would
  emit as a scalar loop), so the data bytes come in and go out typed ``float8_e4m3fn``;
* NaN tests are ``y != y`` and finiteness ``|x| < inf`` (``isnan`` is a scalar call);
* the scale of a tile is computed once per tile (a small tensor, bit tricks allowed there)
  and broadcast by index arithmetic, never materialized per element.

The results are the codec's bit for bit (same contract as ``kernels.py``: every non-NaN
value, NaN at the same places; data bytes exactly, NaN bytes canonical ``0x7F``), compiled
or run eagerly; ``tests/quant/test_quant_compiled.py`` checks both against the plain codec.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flexshard.quant.codec import _FP8_MIN_AMAX, _matrix_dims, scale_shape
from flexshard.quant.formats import E4M3_MAX, FP8Blockwise, QuantFormat

__all__ = ["dequantize_fused", "e8m0_bytes_to_float32", "quantize_fused"]

_FP8 = torch.float8_e4m3fn
_INF = float("inf")
_NAN = float("nan")


def _tiles(x3: torch.Tensor, grid: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """``(B, rows, cols)`` -> zero-padded ``(B, gr, r, gc, c)`` tiles."""
    batch, rows, cols = x3.shape
    (gr, gc), (r, c) = grid[-2:], block
    if gr * r != rows or gc * c != cols:
        x3 = F.pad(x3, (0, gc * c - cols, 0, gr * r - rows))
    return x3.reshape(batch, gr, r, gc, c)


def _to_e4m3(y: torch.Tensor, nan: torch.Tensor | None = None) -> torch.Tensor:
    """Saturating round-to-nearest-even into e4m3fn; NaN (and ``nan``) as the positive NaN,
    whose cast is the canonical byte ``0x7F``."""
    is_nan = y != y
    if nan is not None:
        is_nan = is_nan | nan
    return torch.where(is_nan, _NAN, y.clamp(-E4M3_MAX, E4M3_MAX)).to(_FP8)


def quantize_fused(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``codec.quantize(x, fmt)`` as ``(data, scale)``: float8_e4m3fn of ``x``'s shape and
    the scale grid, float32 (FP8Blockwise) or the E8M0 bytes as uint8 (MXFP8). No bit cast
    of either: one of the data is a scalar loop in a graph, one of the scales ends the loop
    nest of the tile maxima before the quantizing pass could share it."""
    lead, rows, cols = _matrix_dims(x.shape)
    grid = scale_shape(x.shape, fmt)
    x3 = x.detach().to(torch.float32).reshape(math.prod(lead), rows, cols)
    tiles = _tiles(x3, grid, fmt.block)
    mag = tiles.abs()
    if isinstance(fmt, FP8Blockwise):
        # the largest finite |x| (NaN < inf is false, so NaN counts as 0 too)
        amax = torch.where(mag < _INF, mag, 0.0).amax(dim=(2, 4), keepdim=True)
        scale = amax.clamp_min(_FP8_MIN_AMAX) / E4M3_MAX
        if fmt.pow2_scale:  # round up to a power of two from the bits (a normal float)
            bits = scale.view(torch.int32)
            exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
            scale = (exp << 23).view(torch.float32)
        codes = _to_e4m3(tiles / scale)
        scale = scale.reshape(grid)
    else:
        amax = mag.amax(dim=(2, 4), keepdim=True)  # NaN propagates, inf stays inf
        bad = ~(amax < _INF)
        bits = amax.view(torch.int32)
        e = ((bits >> 23) & 0xFF) - 127 - 8  # floor(log2(amax)) - emax(e4m3)
        if fmt.rounding == "rceil":
            e = e + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
        e = torch.where(bad, 0, e.clamp(-127, 127))
        inv = ((127 - e) << 23).view(torch.float32)
        codes = _to_e4m3(tiles * inv, bad)  # a non-finite block is all NaN
        scale = torch.where(bad, 255, e + 127).to(torch.uint8).reshape(grid)
    batch, gr, r, gc, c = codes.shape
    data = codes.reshape(batch, gr * r, gc * c)
    if gr * r != rows or gc * c != cols:
        data = data[:, :rows, :cols]
    return data.reshape(x.shape), scale


def e8m0_bytes_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> float32: ``2^(b-127)``, 0 the subnormal ``2^-127``, 0xFF NaN."""
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)
    return torch.where(b == 0xFF, 0x7FC00000, bits).view(torch.float32)


def dequantize_fused(
    data: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype
) -> torch.Tensor:
    """``codec.dequantize`` of ``data`` (float8_e4m3fn) and ``scale`` (float32 for
    FP8Blockwise, the E8M0 bytes as uint8 for MXFP8), in ``dtype``: the float32 product of
    each value and its tile's scale, rounded once to ``dtype``."""
    lead, rows, cols = _matrix_dims(data.shape)
    grid = scale_shape(data.shape, fmt)
    (gr, gc), (r, c) = grid[-2:], fmt.block
    batch = math.prod(lead)
    s = scale if isinstance(fmt, FP8Blockwise) else e8m0_bytes_to_float32(scale)
    s = s.reshape(batch, gr, 1, gc, 1).expand(batch, gr, r, gc, c)
    s = s.reshape(batch, gr * r, gc * c)[:, :rows, :cols]
    values = data.reshape(batch, rows, cols).to(torch.float32) * s
    return values.to(dtype).reshape(data.shape)
