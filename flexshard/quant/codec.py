"""Pure block-quantization codecs: ``quantize``/``dequantize`` and a one-buffer ``pack`` layout.

Tiling: tiles of ``fmt.block = (r, c)`` cover the last two dims; leading dims are a batch (e.g.
experts). A 1-D tensor is one row ``(1, n)``, a 0-d tensor is ``(1, 1)``. Partial edge tiles
use only their real elements (the codec zero-pads them, and a zero never raises ``|x|``'s max).
``QuantizedTensor.scale`` has the tile-grid shape ``lead + (ceil(R/r), ceil(C/c))``.

Inputs of any float dtype are first converted to float32; everything below is defined on that
float32 value. ``float8_e4m3fn`` has no inf: finite overflow is clamped to +-448 explicitly
(torch 2.13's CPU cast happens to saturate too, but older versions produced NaN) and NaN data
bytes are written as the canonical ``0x7F``.

Special values:

* ``FP8Blockwise``: ``amax`` ignores NaN/inf, so a tile keeps a useful scale; NaN elements stay
  NaN, ``+-inf`` elements saturate to ``+-448`` (so dequantize gives ``+-448 * scale``). An
  all-zero tile gets ``scale = 1e-4 / 448``.
* ``MXFP8``: a block whose ``amax`` is NaN *or inf* gets the NaN scale ``0xFF`` and all its
  data bytes are NaN; dequantize yields NaN for the whole block (OCP MX v1.0: a NaN scale makes
  every element NaN; E8M0 has no inf, and torchao's ``to_mx`` also maps NaN and inf ``amax`` to
  ``0xFF``). An all-zero block gets ``e = -127`` (byte ``0``), as in torchao, whose FLOOR path
  clamps ``-127 - 8`` up to ``-127``. float32 subnormal inputs are scaled, not flushed.

Speed: each call is a handful of whole-tensor ops, most in place (``kernels.py``: tile maxima
without an ``|x|`` temporary, fp8 widened through fp16 bit operations on CPU, NaN fix-ups
skipped on CPU when a small tensor shows there is nothing to fix). The results are bit for bit
those of the plain one-op-per-step formulation (``tests/quant/test_quant_fast.py``). The same codec
as branch-free expressions for ``torch.compile`` is ``fused.py`` (the quantized all-gather
compiles it where it pays: ``compiled.py``), bit for bit this one again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexshard.quant.formats import E4M3_MAX, MXFP8, FP8Blockwise, QuantFormat
from flexshard.quant.kernels import (
    abs_amax,
    canonical_nan_bytes,
    e4m3_bytes_to_float32,
    mxfp8_to_bfloat16,
    scale_tiles,
)

__all__ = [
    "QuantizedTensor",
    "quantize",
    "dequantize",
    "pack",
    "pack_into",
    "unpack",
    "packed_nbytes",
    "packed_scale_offset",
    "scale_shape",
]

_FP8 = torch.float8_e4m3fn
_E8M0 = torch.float8_e8m0fnu
_NAN_E4M3 = 0x7F  # canonical NaN byte for data (0xFF, negative NaN, is never written)
_NAN_E8M0 = 0xFF
_E8M0_BIAS = 127
_E4M3_EMAX = 8  # floor(log2(448))
_PACK_ALIGN = 16
# DeepSeek-V3's amax floor, as a float32 so the codec and any reference agree bit for bit.
_FP8_MIN_AMAX = torch.tensor(1e-4, dtype=torch.float32).item()


@dataclass(frozen=True)
class QuantizedTensor:
    """``data`` (``float8_e4m3fn``, shape of the original), ``scale`` (tile grid), ``fmt``."""

    data: torch.Tensor
    scale: torch.Tensor
    fmt: QuantFormat

    def __post_init__(self) -> None:
        if self.data.dtype != _FP8:
            raise TypeError(f"data must be float8_e4m3fn, got {self.data.dtype}")
        if self.scale.dtype != self.fmt.scale_dtype:
            raise TypeError(f"scale must be {self.fmt.scale_dtype}, got {self.scale.dtype}")
        want = scale_shape(self.data.shape, self.fmt)
        if tuple(self.scale.shape) != want:
            raise ValueError(f"scale shape {tuple(self.scale.shape)} != tile grid {want}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def _matrix_dims(shape: Sequence[int]) -> tuple[tuple[int, ...], int, int]:
    """Split a shape into (batch dims, rows, cols); 0-d is (1, 1) and 1-D is one row."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return (), 1, 1
    if len(shape) == 1:
        return (), 1, shape[0]
    return shape[:-2], shape[-2], shape[-1]


def scale_shape(shape: Sequence[int], fmt: QuantFormat) -> tuple[int, ...]:
    """Shape of the scale tensor for a tensor of ``shape``: batch dims + the tile grid."""
    lead, rows, cols = _matrix_dims(shape)
    r, c = fmt.block
    return (*lead, -(-rows // r), -(-cols // c))


def _check_fmt(fmt: object) -> None:
    if not isinstance(fmt, (FP8Blockwise, MXFP8)):
        raise TypeError(f"fmt must be FP8Blockwise or MXFP8, got {type(fmt).__name__}")


def _per_tile(t: torch.Tensor) -> torch.Tensor:
    """A ``(B, gr, gc)`` tile grid as ``(B, gr, 1, gc, 1)``, to broadcast over the tiles."""
    return t[:, :, None, :, None]


def _fp8_blockwise(
    tiles: torch.Tensor, amax: torch.Tensor, fmt: FP8Blockwise
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``tiles``: (B, gr, r, gc, c) float32, ``amax``: their ``|x|`` max (B, gr, gc) ->
    (scaled values, fp32 scale (B, gr, gc), whether the values may hold NaN)."""
    # NaN/inf must not set the scale: one bad element would flush the rest of the tile to 0.
    # On CPU the common all-finite case is read off the grid of maxima; elsewhere (no host
    # sync) and when some tile is not finite, the maxima are taken again over finite |x|.
    clean = tiles.device.type == "cpu" and bool(torch.isfinite(amax).all())
    if not clean:
        amax = tiles.abs().nan_to_num_(nan=0.0, posinf=0.0).amax(dim=2).amax(dim=-1)
    scale = amax.clamp_min(_FP8_MIN_AMAX) / E4M3_MAX
    if fmt.pow2_scale:
        # Round up to a power of two from the bits: exact, unlike exp2(ceil(log2(s))).
        # The scale is always a normal float (>= 1e-4/448), so bumping the exponent is enough.
        bits = scale.view(torch.int32)
        exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = (exp << 23).view(torch.float32)
    return tiles / _per_tile(scale), scale, not clean


def _mxfp8(
    tiles: torch.Tensor, amax: torch.Tensor, fmt: MXFP8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tiles``, ``amax`` (NaN propagated, inf kept) -> (scaled values, E8M0 byte per block
    as int32 (B, gr, gc), non-finite-block mask)."""
    bad = ~torch.isfinite(amax)
    # floor(log2(amax)) read exactly off the float32 bits (no float log2 rounding). A zero or
    # subnormal amax has biased exponent 0, so e lands below -127 and the clamp handles it.
    bits = amax.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - _E8M0_BIAS - _E4M3_EMAX
    if fmt.rounding == "rceil":
        # ceil(log2(amax/448)) = floor(log2(amax)) - 8 + [mantissa > 1.75], 448 = 1.75 * 2^8.
        e = e + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    e = e.clamp(-_E8M0_BIAS, _E8M0_BIAS)
    e = torch.where(bad, torch.zeros((), dtype=e.dtype), e)
    # 2^-e built from bits; e <= 120 for float32 inputs so 127 - e is a normal exponent.
    inv = ((_E8M0_BIAS - e) << 23).view(torch.float32)
    byte = torch.where(bad, torch.full((), _NAN_E8M0, dtype=e.dtype), e + _E8M0_BIAS)
    return tiles * _per_tile(inv), byte, bad


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even into e4m3fn codes (uint8), saturating to +-448, in place on ``y``
    (a temporary). NaN stays NaN, possibly as ``0xFF``: see ``canonical_nan_bytes``."""
    return y.clamp_(-E4M3_MAX, E4M3_MAX).to(_FP8).view(torch.uint8)


def _tile_view(x3: torch.Tensor, grid: Sequence[int], block: tuple[int, int]) -> torch.Tensor:
    """``(B, rows, cols)`` -> zero-padded ``(B, gr, r, gc, c)`` tiles (a view when they fit)."""
    batch, rows, cols = x3.shape
    (gr, gc), (r, c) = grid[-2:], block
    if gr * r != rows or gc * c != cols:
        # Zero padding leaves every tile's amax (and NaN/inf status) unchanged; cropped after.
        x3 = F.pad(x3, (0, gc * c - cols, 0, gr * r - rows))
    return x3.contiguous().view(batch, gr, r, gc, c)


def _untile(tiles: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of ``_tile_view``: crop the padding, give ``shape`` (a view when nothing was
    padded)."""
    batch, gr, r, gc, c = tiles.shape
    _, rows, cols = _matrix_dims(shape)
    flat = tiles.view(batch, gr * r, gc * c)
    if gr * r != rows or gc * c != cols:
        flat = flat[:, :rows, :cols]
    return flat.reshape(shape)


def quantize(x: torch.Tensor, fmt: QuantFormat) -> QuantizedTensor:
    """Quantize ``x`` tile by tile (see the module docstring for tiling and special values)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    _check_fmt(fmt)
    lead, rows, cols = _matrix_dims(x.shape)
    grid = scale_shape(x.shape, fmt)
    x3 = x.detach().to(torch.float32).reshape(math.prod(lead), rows, cols)
    tiles = _tile_view(x3, grid, fmt.block)
    amax = abs_amax(tiles)  # NaN propagates, inf stays inf

    if isinstance(fmt, FP8Blockwise):
        y, scale, may_have_nan = _fp8_blockwise(tiles, amax, fmt)
        codes = _to_e4m3(y)
        if may_have_nan:  # NaN elements stay NaN, as the canonical byte
            canonical_nan_bytes(codes)
        scale = scale.reshape(grid)
    else:
        y, byte, bad = _mxfp8(tiles, amax, fmt)
        codes = _to_e4m3(y)
        # A non-finite block is all NaN; good blocks hold no NaN (their x is finite).
        if tiles.device.type != "cpu" or bool(bad.any()):
            codes.masked_fill_(_per_tile(bad), _NAN_E4M3)
        scale = byte.to(torch.uint8).reshape(grid).view(_E8M0)

    data = _untile(codes, x.shape).view(_FP8)
    return QuantizedTensor(data.contiguous(), scale.contiguous(), fmt)


def _e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 -> float32 exactly: byte b is 2^(b-127); 0 is the fp32 subnormal 2^-127; 0xFF NaN."""
    b = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, torch.full((), 0x00400000, dtype=torch.int32), b << 23)
    bits = torch.where(b == _NAN_E8M0, torch.full((), 0x7FC00000, dtype=torch.int32), bits)
    return bits.view(torch.float32)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data.float() * scale`` per tile, in float32, then cast to ``dtype``.

    For MXFP8 the float32 product is exact (e4m3 values times the E8M0 powers of two the codec
    produces are float32 numbers) and a NaN scale makes the whole block NaN. The one inexact
    case is overflow: within ~6% of FLT_MAX a value may round up to 2^128 (MXFP8 "rceil",
    FP8Blockwise with ``pow2_scale``) or 448 * scale may round past FLT_MAX, giving +-inf.
    On CPU the fp8 bytes are widened through fp16 (``kernels.e4m3_bytes_to_float32``), with
    the same bits as torch's scalar fp8 cast and ~10x faster; MXFP8 into bfloat16 skips
    float32 altogether (``kernels.mxfp8_to_bfloat16``), same bits again.
    """
    return dequantized_values(q, dtype).to(dtype)


def dequantized_values(q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(q, dtype)`` before its final cast: in ``dtype`` or in float32, whichever
    the codec had at hand, so that a caller copying into a ``dtype`` tensor casts while it
    copies (one pass fewer; a copy casts exactly as ``.to`` does)."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor, got {type(q).__name__}")
    lead, rows, cols = _matrix_dims(q.data.shape)
    grid = scale_shape(q.data.shape, q.fmt)
    s = q.scale if isinstance(q.fmt, FP8Blockwise) else _e8m0_to_float32(q.scale)
    s = _per_tile(s.reshape(math.prod(lead), *grid[-2:]))
    codes3 = q.data.view(torch.uint8).reshape(math.prod(lead), rows, cols)
    codes = _tile_view(codes3, grid, q.fmt.block)
    fused = None
    if codes.device.type == "cpu" and isinstance(q.fmt, MXFP8) and dtype == torch.bfloat16:
        fused = mxfp8_to_bfloat16(codes, s)  # the mixed-precision gather's common case
    if fused is not None:
        return _untile(fused, q.data.shape)
    if codes.device.type == "cpu":
        values = scale_tiles(e4m3_bytes_to_float32(codes), s)
    else:
        values = codes.view(_FP8).to(torch.float32).mul_(s)
    return _untile(values, q.data.shape)


def packed_scale_offset(numel: int) -> int:
    """Where a ``pack`` of ``numel`` fp8 codes keeps its scale bytes: after the codes and
    their zero pad to 16 bytes."""
    return numel + (-numel % _PACK_ALIGN)


def packed_nbytes(shape: Sequence[int], fmt: QuantFormat) -> int:
    """Bytes of ``pack``: ``numel`` fp8 bytes + zero pad to 16 + the scale bytes."""
    _check_fmt(fmt)
    numel = math.prod(int(s) for s in shape)
    n_scales = math.prod(scale_shape(shape, fmt))
    itemsize = torch.empty((), dtype=fmt.scale_dtype).element_size()
    return packed_scale_offset(numel) + n_scales * itemsize


def pack(q: QuantizedTensor) -> torch.Tensor:
    """One flat uint8 buffer ``[fp8 data | zero pad to 16 B | scale bytes]`` (native order).

    The 16-byte pad keeps the scales aligned for a zero-copy fp32 view after one all-gather.
    """
    out = torch.empty(packed_nbytes(q.shape, q.fmt), dtype=torch.uint8, device=q.data.device)
    return pack_into(q, out)


def pack_into(q: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
    """``pack(q)`` written into ``out`` (a 1-D uint8 tensor of ``packed_nbytes`` bytes, e.g.
    a slice of a larger payload), without a temporary; returns ``out``."""
    numel = q.data.numel()
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != packed_nbytes(q.shape, q.fmt):
        raise ValueError(f"out must be 1-D uint8 of {packed_nbytes(q.shape, q.fmt)} bytes")
    out[:numel].copy_(q.data.view(torch.uint8).reshape(-1))
    end = packed_scale_offset(numel)
    out[numel:end].zero_()
    out[end:].copy_(q.scale.contiguous().view(torch.uint8).reshape(-1))
    return out


def unpack(buf: torch.Tensor, shape: Sequence[int], fmt: QuantFormat) -> QuantizedTensor:
    """Inverse of ``pack``. ``data`` and ``scale`` are views into ``buf`` when its alignment
    allows (the scale is copied if ``buf`` starts at an offset not divisible by 4)."""
    _check_fmt(fmt)
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError("buf must be a 1-D uint8 tensor")
    shape = tuple(int(s) for s in shape)
    want = packed_nbytes(shape, fmt)
    if buf.numel() != want:
        raise ValueError(f"buf has {buf.numel()} bytes, {shape} in {fmt} packs to {want}")
    numel = math.prod(shape)
    data = buf[:numel].view(_FP8).reshape(shape)
    raw = buf[packed_scale_offset(numel) :]
    try:
        scale = raw.view(fmt.scale_dtype)
    except RuntimeError:  # misaligned storage offset for a 4-byte view
        scale = raw.clone().view(fmt.scale_dtype)
    return QuantizedTensor(data, scale.reshape(scale_shape(shape, fmt)), fmt)
