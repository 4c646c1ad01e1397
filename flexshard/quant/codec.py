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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flexshard.quant.formats import E4M3_MAX, MXFP8, FP8Blockwise, QuantFormat

__all__ = [
    "QuantizedTensor",
    "quantize",
    "dequantize",
    "pack",
    "unpack",
    "packed_nbytes",
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


def _fp8_blockwise(tiles: torch.Tensor, fmt: FP8Blockwise) -> tuple[torch.Tensor, torch.Tensor]:
    """``tiles``: (B, gr, r, gc, c) float32 -> (scaled values, fp32 scale (B, gr, 1, gc, 1))."""
    mag = tiles.abs()
    # NaN/inf must not set the scale: one bad element would flush the rest of the tile to 0.
    mag = torch.where(torch.isfinite(mag), mag, torch.zeros((), dtype=mag.dtype))
    amax = mag.amax(dim=(2, 4), keepdim=True)
    scale = amax.clamp_min(_FP8_MIN_AMAX) / E4M3_MAX
    if fmt.pow2_scale:
        # Round up to a power of two from the bits: exact, unlike exp2(ceil(log2(s))).
        # The scale is always a normal float (>= 1e-4/448), so bumping the exponent is enough.
        bits = scale.view(torch.int32)
        exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = (exp << 23).view(torch.float32)
    return tiles / scale, scale


def _mxfp8(tiles: torch.Tensor, fmt: MXFP8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tiles`` -> (scaled values, E8M0 byte per block as int32, non-finite-block mask)."""
    amax = tiles.abs().amax(dim=(2, 4), keepdim=True)  # NaN propagates, inf stays inf
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
    return tiles * inv, byte, bad


def _to_e4m3(y: torch.Tensor, nan_mask: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even into e4m3fn, saturating to +-448; NaN where ``nan_mask``."""
    q = y.clamp(-E4M3_MAX, E4M3_MAX).to(_FP8).view(torch.uint8)
    q = torch.where(nan_mask, torch.full((), _NAN_E4M3, dtype=torch.uint8), q)
    return q.view(_FP8)


def quantize(x: torch.Tensor, fmt: QuantFormat) -> QuantizedTensor:
    """Quantize ``x`` tile by tile (see the module docstring for tiling and special values)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    _check_fmt(fmt)
    lead, rows, cols = _matrix_dims(x.shape)
    r, c = fmt.block
    grid = scale_shape(x.shape, fmt)
    gr, gc = grid[-2], grid[-1]
    batch = math.prod(lead)
    x3 = x.detach().to(torch.float32).reshape(batch, rows, cols)
    # Zero padding leaves every tile's amax (and NaN/inf status) unchanged; cropped below.
    x3 = F.pad(x3, (0, gc * c - cols, 0, gr * r - rows))
    tiles = x3.view(batch, gr, r, gc, c)

    if isinstance(fmt, FP8Blockwise):
        y, scale = _fp8_blockwise(tiles, fmt)
        data = _to_e4m3(y, torch.isnan(y))
        scale = scale.reshape(grid)
    else:
        y, byte, bad = _mxfp8(tiles, fmt)
        data = _to_e4m3(y, bad.expand_as(y))
        scale = byte.to(torch.uint8).reshape(grid).view(_E8M0)

    data = data.reshape(batch, gr * r, gc * c)[:, :rows, :cols].reshape(x.shape)
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
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor, got {type(q).__name__}")
    lead, rows, cols = _matrix_dims(q.data.shape)
    r, c = q.fmt.block
    s = q.scale if isinstance(q.fmt, FP8Blockwise) else _e8m0_to_float32(q.scale)
    # Broadcast each tile's scale over its r x c elements, then crop the partial edge tiles.
    s = s.repeat_interleave(r, dim=-2).repeat_interleave(c, dim=-1)[..., :rows, :cols]
    d = q.data.to(torch.float32).reshape(*lead, rows, cols)
    return (d * s).reshape(q.data.shape).to(dtype)


def _pad16(n: int) -> int:
    return -n % _PACK_ALIGN


def packed_nbytes(shape: Sequence[int], fmt: QuantFormat) -> int:
    """Bytes of ``pack``: ``numel`` fp8 bytes + zero pad to 16 + the scale bytes."""
    _check_fmt(fmt)
    numel = math.prod(int(s) for s in shape)
    n_scales = math.prod(scale_shape(shape, fmt))
    itemsize = torch.empty((), dtype=fmt.scale_dtype).element_size()
    return numel + _pad16(numel) + n_scales * itemsize


def pack(q: QuantizedTensor) -> torch.Tensor:
    """One flat uint8 buffer ``[fp8 data | zero pad to 16 B | scale bytes]`` (native order).

    The 16-byte pad keeps the scales aligned for a zero-copy fp32 view after one all-gather.
    """
    payload = q.data.contiguous().view(torch.uint8).reshape(-1)
    scale = q.scale.contiguous().view(torch.uint8).reshape(-1)
    pad = torch.zeros(_pad16(payload.numel()), dtype=torch.uint8, device=payload.device)
    return torch.cat([payload, pad, scale])


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
    raw = buf[numel + _pad16(numel) :]
    try:
        scale = raw.view(fmt.scale_dtype)
    except RuntimeError:  # misaligned storage offset for a 4-byte view
        scale = raw.clone().view(fmt.scale_dtype)
    return QuantizedTensor(data, scale.reshape(scale_shape(shape, fmt)), fmt)
