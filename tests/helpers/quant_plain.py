"""The codec as it was before the fast kernels (flexshard 4f46980), kept verbatim as the
oracle the fast formulation must match bit for bit: one op per step, float32 throughout,
torch's own fp8 casts, repeat_interleave'd scales."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flexshard.quant import E4M3_MAX, MXFP8, FP8Blockwise, QuantFormat, scale_shape

_FP8 = torch.float8_e4m3fn
_MIN_AMAX = torch.tensor(1e-4, dtype=torch.float32).item()


def _dims(shape: torch.Size) -> tuple[tuple[int, ...], int, int]:
    if len(shape) == 0:
        return (), 1, 1
    if len(shape) == 1:
        return (), 1, shape[0]
    return tuple(shape[:-2]), shape[-2], shape[-1]


def _to_e4m3(y: torch.Tensor, nan_mask: torch.Tensor) -> torch.Tensor:
    q = y.clamp(-E4M3_MAX, E4M3_MAX).to(_FP8).view(torch.uint8)
    return torch.where(nan_mask, torch.full((), 0x7F, dtype=torch.uint8), q)


def plain_quantize(x: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (data bytes as uint8, scale bytes as uint8), both in the codec's shapes."""
    lead, rows, cols = _dims(x.shape)
    r, c = fmt.block
    grid = scale_shape(x.shape, fmt)
    gr, gc = grid[-2], grid[-1]
    batch = math.prod(lead)
    x3 = x.detach().to(torch.float32).reshape(batch, rows, cols)
    x3 = F.pad(x3, (0, gc * c - cols, 0, gr * r - rows))
    tiles = x3.view(batch, gr, r, gc, c)
    if isinstance(fmt, FP8Blockwise):
        mag = tiles.abs()
        mag = torch.where(torch.isfinite(mag), mag, torch.zeros((), dtype=mag.dtype))
        scale = mag.amax(dim=(2, 4), keepdim=True).clamp_min(_MIN_AMAX) / E4M3_MAX
        if fmt.pow2_scale:
            bits = scale.view(torch.int32)
            exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
            scale = (exp << 23).view(torch.float32)
        y = tiles / scale
        data = _to_e4m3(y, torch.isnan(y))
        scale_bytes = scale.reshape(grid).contiguous().view(torch.uint8)
    else:
        assert isinstance(fmt, MXFP8)
        amax = tiles.abs().amax(dim=(2, 4), keepdim=True)
        bad = ~torch.isfinite(amax)
        bits = amax.view(torch.int32)
        e = ((bits >> 23) & 0xFF) - 127 - 8
        if fmt.rounding == "rceil":
            e = e + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
        e = torch.where(bad, torch.zeros((), dtype=e.dtype), e.clamp(-127, 127))
        inv = ((127 - e) << 23).view(torch.float32)
        byte = torch.where(bad, torch.full((), 0xFF, dtype=e.dtype), e + 127)
        data = _to_e4m3(tiles * inv, bad.expand_as(tiles))
        scale_bytes = byte.to(torch.uint8).reshape(grid)
    data = data.reshape(batch, gr * r, gc * c)[:, :rows, :cols].reshape(x.shape)
    return data.contiguous(), scale_bytes.contiguous()


def _e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    b = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, torch.full((), 0x00400000, dtype=torch.int32), b << 23)
    bits = torch.where(b == 0xFF, torch.full((), 0x7FC00000, dtype=torch.int32), bits)
    return bits.view(torch.float32)


def plain_dequantize(
    data: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype
) -> torch.Tensor:
    """``data`` float8_e4m3fn, ``scale`` in ``fmt.scale_dtype``."""
    lead, rows, cols = _dims(data.shape)
    r, c = fmt.block
    s = scale if isinstance(fmt, FP8Blockwise) else _e8m0_to_float32(scale)
    s = s.repeat_interleave(r, dim=-2).repeat_interleave(c, dim=-1)[..., :rows, :cols]
    d = data.to(torch.float32).reshape(*lead, rows, cols)
    return (d * s).reshape(data.shape).to(dtype)
