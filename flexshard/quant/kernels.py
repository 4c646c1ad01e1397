"""Fast tensor formulations of the codec's elementwise steps, bit for bit equal to the plain ones.

Why: on CPU, ``float8_e4m3fn -> float32`` is a scalar loop in torch (~10 ns per element, ~20x
a bf16 cast), and every out-of-place op on a large tensor pays for a fresh allocation. These
helpers build the same bits from a few vectorized integer ops (with the hardware fp16 -> fp32
conversion doing the rest), reduce tiles in two contiguous stages, and work in place.

Bit-exactness contract (checked over every byte and many scales in
``tests/quant/test_quant_fast.py``): every non-NaN result equals the plain formulation's
bits; NaN results sit at the same positions (NaN payloads are not part of the contract:
torch's own casts do not agree on them).
Data-dependent shortcuts (skip a NaN fix-up when there is none) are taken only on CPU, where
looking at a small tensor costs no device synchronisation.
"""

from __future__ import annotations

import torch

__all__ = [
    "abs_amax",
    "canonical_nan_bytes",
    "e4m3_bytes_to_float32",
    "mxfp8_to_bfloat16",
    "nan_byte_mask",
    "scale_tiles",
]

_F16_SIGN_MASK_OFF_BIT14 = -16385  # 0xBFFF as int16: clears bit 14 (see e4m3_bytes_to_float32)
_F16_TO_E4M3 = 256.0  # e4m3 bias 7 vs fp16 bias 15: the fp16 reading is 2^-8 of the e4m3 value
_BF16_KEEP = -30721  # 0x87FF as int16: the sign and the 11 bits of a shifted e4m3 magnitude
_BF16_TO_E4M3 = 2.0**120  # e4m3 bias 7 vs bf16 bias 127
_BF16_NAN = 0x7F80  # or'ed into a NaN byte's bits: exponent all ones, mantissa non-zero


def abs_amax(tiles: torch.Tensor) -> torch.Tensor:
    """``tiles.abs().amax(dim=(2, 4))`` of ``(B, gr, r, gc, c)`` tiles -> ``(B, gr, gc)``.

    As max(max x, -min x): two reductions, no full-size temporary, each in two contiguous
    stages (rows, then the c columns) instead of one strided (2, 4) reduction. NaN propagates
    and +-inf gives inf, as in the plain formulation; max is exact, so the bits agree (the
    final ``abs_`` turns a -0.0 of an all-zero tile into +0.0, as ``abs`` would).
    """
    hi = tiles.amax(dim=2).amax(dim=-1)
    lo = tiles.amin(dim=2).amin(dim=-1)
    return torch.maximum(hi, lo.neg_()).abs_()


def nan_byte_mask(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``0x80`` where an e4m3fn byte is NaN (``x111_1111``), ``0`` elsewhere.

    ``(b & 0x7F) + 1`` carries into bit 7 only for the low seven bits all set; byte ops are
    ~10x cheaper than a comparison producing a bool tensor on CPU.
    """
    return (codes & 0x7F).add_(1).bitwise_and_(0x80)


def canonical_nan_bytes(codes: torch.Tensor) -> torch.Tensor:
    """In place on uint8 e4m3fn codes: every NaN byte becomes the canonical ``0x7F``.

    torch's cast keeps a negative NaN's sign (``0xFF``); clearing bit 7 of NaN bytes only
    leaves every finite code (``<= 0x7E`` in magnitude after saturation) untouched.
    """
    return codes.bitwise_and_(nan_byte_mask(codes).bitwise_xor_(0xFF))


def e4m3_bytes_to_float32(codes: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """e4m3fn codes (uint8) -> float32 ``value / 256`` via fp16, on CPU; see the caller.

    fp16 and e4m3 share the layout ``sign | exponent | mantissa`` with the exponent's low
    bits aligned once the 7 magnitude bits sit at fp16 bits 13..7: fp16 then reads
    ``value * 2^-8`` exactly, subnormals included (e4m3's ``m/8 * 2^-6`` becomes fp16's
    ``m/8 * 2^-14``). The int8 -> int16 sign extension followed by ``<< 7`` puts the sign in
    bits 15 *and* 14; bit 14 is cleared, and set again for NaN bytes, which makes the fp16
    exponent all ones: NaN. The caller multiplies by ``256 * scale`` (exact: see
    ``scale_tiles``).
    """
    h = codes.view(torch.int8).to(torch.int16)
    h.bitwise_left_shift_(7).bitwise_and_(_F16_SIGN_MASK_OFF_BIT14)
    nan = nan_byte_mask(codes)
    if bool(nan.any()):  # CPU only: a cheap look at bytes; rare (NaN weights)
        h.bitwise_or_(nan.to(torch.int16).bitwise_left_shift_(7))
    return h.view(torch.float16).to(torch.float32)


def scale_tiles(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """In place: ``values`` (``(B, gr, r, gc, c)``, fp16 readings = e4m3 / 256) times ``scale``
    (``(B, gr, 1, gc, 1)`` float32), bit for bit ``(e4m3 value) * scale``.

    ``v/256 * (256 * s)`` and ``v * s`` are the same real number rounded once, as long as
    ``256 * s`` is itself exact, i.e. does not overflow (powers of two are exact otherwise,
    subnormal ``s`` included); where it would, the factor is applied separately (exact too:
    ``v/256 * 256`` is a normal float).
    """
    folded = scale * _F16_TO_E4M3
    if bool((torch.isinf(folded) & torch.isfinite(scale)).any()):  # scales near FLT_MAX
        return values.mul_(_F16_TO_E4M3).mul_(scale)
    return values.mul_(folded)


def mxfp8_to_bfloat16(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """MXFP8 tiles straight to bfloat16 on CPU: ``(B, gr, r, gc, c)`` uint8 codes times
    ``(B, gr, 1, gc, 1)`` float32 powers of two (or NaN), bit for bit ``(v * s).to(bf16)``;
    ``None`` (use the float32 route) when some scale exceeds 2^7.

    Two whole-tensor passes fewer than widening to float32: the 7 magnitude bits at bf16
    bits 10..4 read ``v * 2^-120`` exactly (e4m3 subnormals become bf16 subnormals), and
    ``2^120 * s`` is a bfloat16 power of two (no overflow for ``s <= 2^7``; E8M0's 2^-127 is
    a bf16 subnormal, exact). torch multiplies bfloat16 as float32 and rounds once, so the
    product is the float32 product ``v * s`` (exact, or rounded the same way in the
    subnormal range) rounded to bfloat16: the plain path's bits.
    """
    folded = scale * _BF16_TO_E4M3
    if bool((torch.isinf(folded) & torch.isfinite(scale)).any()):
        return None
    h = codes.view(torch.int8).to(torch.int16)
    h.bitwise_left_shift_(4).bitwise_and_(_BF16_KEEP)  # sign extension fills bits 14..11
    nan = nan_byte_mask(codes)
    if bool(nan.any()):
        h.bitwise_or_(nan.to(torch.int16).mul_(_BF16_NAN // 0x80))
    return h.view(torch.bfloat16).mul_(folded.to(torch.bfloat16))
