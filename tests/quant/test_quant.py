"""Block-quantization codecs: MXFP8 bit-exact vs an OCP-spec reference (FP8
blockwise, tiling, packing and input errors: test_quant_fp8.py)."""

from __future__ import annotations

import bisect
import math
import struct
from fractions import Fraction

import torch
from hypothesis import given
from hypothesis import strategies as st

from flexshard.quant import (
    MXFP8,
    FP8Blockwise,
    QuantizedTensor,
    dequantize,
    quantize,
    scale_shape,
)

from ..helpers.quant_cases import BLOCKS, E4M3, SETTINGS, float_tensors, scale_per_element, u8

# ---- pure-Python OCP MX v1.0 reference (no torch float8 code involved) ---------------------


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def ref_e4m3(v: Fraction, negative: bool) -> int:
    """Round to nearest, ties to even code (= even mantissa), saturating to 448 (OCP 6.3)."""
    a = abs(v)
    if a >= 448:
        code = 0x7E
    else:
        hi = bisect.bisect_left(E4M3, a)  # E4M3[hi-1] < a <= E4M3[hi]
        lo = hi - 1
        if E4M3[hi] == a or a - E4M3[lo] > E4M3[hi] - a:
            code = hi
        elif a - E4M3[lo] < E4M3[hi] - a:
            code = lo
        else:
            code = hi if hi % 2 == 0 else lo
    return code | (0x80 if negative else 0)


def ref_shared_exp(amax: float, rounding: str) -> int:
    """Unbiased E8M0 exponent from the float32 bits of the block amax, by integer math."""
    bits = f32_bits(amax)
    be, man = bits >> 23, bits & 0x7FFFFF
    if bits == 0:
        return -127  # all-zero block: smallest scale (torchao's convention)
    floor_log2 = be - 127 if be else man.bit_length() - 1 - 149  # exact, subnormals too
    exact = Fraction(amax)
    assert Fraction(2) ** floor_log2 <= exact < Fraction(2) ** (floor_log2 + 1)
    if rounding == "floor":
        e = floor_log2 - 8  # 8 = emax of e4m3
    else:  # smallest e with 448 * 2^e >= amax
        e = floor_log2 - 9
        while 448 * Fraction(2) ** e < exact:
            e += 1
    return max(-127, min(127, e))


def ref_mxfp8(x: torch.Tensor, fmt: MXFP8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (data bytes, scale bytes, exact dequantized float32), tile by tile in Python."""
    shape = tuple(x.shape)
    rows, cols = (1, 1) if x.dim() == 0 else (1, shape[0]) if x.dim() == 1 else shape[-2:]
    vals = x.reshape(-1, rows, cols).tolist()
    r, c = fmt.block
    gr, gc = -(-rows // r), -(-cols // c)
    data = [[[0] * cols for _ in range(rows)] for _ in vals]
    deq = [[[0.0] * cols for _ in range(rows)] for _ in vals]
    scales = [[[0] * gc for _ in range(gr)] for _ in vals]
    for b, mat in enumerate(vals):
        for i in range(gr):
            for j in range(gc):
                idx = [
                    (p, q)
                    for p in range(i * r, min(rows, i * r + r))
                    for q in range(j * c, min(cols, j * c + c))
                ]
                tile = [mat[p][q] for p, q in idx]
                if not all(math.isfinite(v) for v in tile):  # NaN or inf: NaN scale, NaN data
                    scales[b][i][j] = 0xFF
                    for p, q in idx:
                        data[b][p][q], deq[b][p][q] = 0x7F, math.nan
                    continue
                e = ref_shared_exp(max(abs(v) for v in tile), fmt.rounding)
                scales[b][i][j] = e + 127
                for p, q in idx:
                    v = mat[p][q]
                    code = ref_e4m3(Fraction(v) / Fraction(2) ** e, math.copysign(1, v) < 0)
                    data[b][p][q] = code
                    sign = -1 if code & 0x80 else 1
                    deq[b][p][q] = sign * float(E4M3[code & 0x7F] * Fraction(2) ** e)
    grid = scale_shape(shape, fmt)
    return (
        torch.tensor(data, dtype=u8).reshape(shape),
        torch.tensor(scales, dtype=u8).reshape(grid),
        torch.tensor(deq, dtype=torch.float64).to(torch.float32).reshape(shape),
    )


def assert_mx_matches_ref(x: torch.Tensor, fmt: MXFP8) -> None:
    q = quantize(x, fmt)
    data, scale, deq = ref_mxfp8(x, fmt)
    assert q.scale.dtype == torch.float8_e8m0fnu and q.data.dtype == torch.float8_e4m3fn
    assert torch.equal(q.scale.view(u8), scale)
    assert torch.equal(q.data.view(u8), data)
    torch.testing.assert_close(dequantize(q), deq, rtol=0, atol=0, equal_nan=True)


# ---- MXFP8 ------------------------------------------------------------------------------------


@SETTINGS
@given(float_tensors(), BLOCKS, st.sampled_from(["floor", "rceil"]))
def test_mxfp8_bit_exact_vs_spec_reference(x, block, rounding):
    assert_mx_matches_ref(x, MXFP8(block, rounding))


@SETTINGS
@given(st.lists(st.floats(width=32), min_size=1, max_size=70), st.integers(1, 33))
def test_mxfp8_bit_exact_raw_floats(vals, c):
    x = torch.tensor(vals, dtype=torch.float32)
    for rounding in ("floor", "rceil"):
        assert_mx_matches_ref(x, MXFP8((1, c), rounding))


def test_mxfp8_every_e4m3_tie_and_neighbour():
    # amax in [256, 512) -> floor e = 0: elements reach the e4m3 cast unscaled, which pins the
    # rounding (every tie, both neighbours) and the saturation above 448.
    mids = [float((a + b) / 2) for a, b in zip(E4M3, E4M3[1:])] + [456.0, 464.0, 470.0, 511.9]
    near = [
        torch.nextafter(torch.tensor(m), torch.tensor(d)).item() for m in mids for d in (0, 1e9)
    ]
    vals = torch.tensor(mids + near + [float(v) for v in E4M3], dtype=torch.float32)
    x = torch.cat([vals, -vals, torch.tensor([256.0])]).reshape(1, -1)
    assert_mx_matches_ref(x, MXFP8((1, x.shape[1]), "floor"))
    q = quantize(x, MXFP8((1, x.shape[1])))
    assert q.scale.view(u8).item() == 127 and q.data.view(u8)[0, len(mids) - 4] == 0x7E


def test_mxfp8_scale_rules_at_boundaries():
    def byte(amax: float, rounding: str) -> int:
        return quantize(torch.tensor([amax]), MXFP8((1, 1), rounding)).scale.view(u8).item()

    assert byte(1.0, "floor") == 127 - 8 and byte(1.99, "floor") == 127 - 8
    assert byte(448.0, "rceil") == 127 and byte(449.0, "rceil") == 128
    assert byte(1.75, "rceil") == 127 - 8 and byte(1.7500001, "rceil") == 127 - 7
    assert byte(0.0, "floor") == 0 and byte(0.0, "rceil") == 0  # all-zero: 2^-127
    assert byte(2.0**-149, "rceil") == 0 and byte(3.4e38, "floor") == 127 + 119
    # torchao's float rceil (amax * (1/448)) goes through an fp32 subnormal for this amax and
    # picks 2^-127, saturating the max element; the exact rule picks 2^-126.
    x = torch.tensor([0x04600001], dtype=torch.int32).view(torch.float32)
    assert quantize(x, MXFP8((1, 1), "rceil")).scale.view(u8).item() == 1


def test_mxfp8_special_blocks():
    x = torch.ones(4, 64)
    x[0, 3], x[1, 40], x[2, :32] = math.nan, -math.inf, 0.0
    x[2, 5] = -0.0
    q = quantize(x, MXFP8((1, 32)))
    s = q.scale.view(u8)
    assert s[0].tolist() == [255, 119] and s[1].tolist() == [119, 255] and s[2, 0] == 0
    assert (q.data.view(u8)[0, :32] == 0x7F).all() and (q.data.view(u8)[1, 32:] == 0x7F).all()
    d = dequantize(q)
    assert d[0, :32].isnan().all() and d[1, 32:].isnan().all()
    assert (d[0, 32:] == 1).all() and (d[3] == 1).all()
    assert q.data.view(u8)[2, 5] == 0x80 and (d[2, :32] == 0).all()  # signed zero kept


def test_mxfp8_error_bound_rceil():
    x = torch.randn(5, 64, 96, generator=torch.Generator().manual_seed(0))
    x = x * torch.logspace(-20, 20, 96)
    q = quantize(x, MXFP8((32, 32), "rceil"))
    err = (dequantize(q) - x).abs()
    assert (err <= 2.0**-4 * x.abs() + 2.0**-10 * scale_per_element(q)).all()  # nothing clips
    assert (q.data.float().abs().amax(dim=(-1)) <= 448).all()


def test_decode_overflow_near_flt_max():
    # The quantized values are right, but decoding them to float32 can overflow: rceil puts
    # FLT_MAX at 2^120 * 255.99.. which rounds to e4m3 256, and 256 * 2^120 = 2^128.
    big = torch.tensor([torch.finfo(torch.float32).max])
    assert dequantize(quantize(big, MXFP8((1, 1), "rceil"))).isinf().all()
    assert dequantize(quantize(big, MXFP8((1, 1), "floor"))) == 448 * 2.0**119  # saturated
    assert dequantize(quantize(big, FP8Blockwise((1, 1), pow2_scale=True))).isinf().all()


def test_e8m0_decode_matches_torch():
    scale = torch.arange(256, dtype=torch.int32).to(u8).view(torch.float8_e8m0fnu)[None]
    ones = torch.ones(1, 256).to(torch.float8_e4m3fn)
    d = dequantize(QuantizedTensor(ones, scale, MXFP8((1, 1))))
    torch.testing.assert_close(d, scale.float(), rtol=0, atol=0, equal_nan=True)
    assert d[0, 0] == 2.0**-127 and d[0, 127] == 1 and d[0, 255].isnan()


def test_torch_e4m3_cast_behaviour():
    # What torch 2.13's CPU cast does by itself: saturates finite overflow *and* inf, keeps NaN
    # with its sign. The codec clamps before the cast and writes NaN as 0x7F, so it relies on
    # none of this (older torch turned finite overflow into NaN).
    x = torch.tensor([500.0, 1e30, math.inf, -math.inf, math.nan, -math.nan])
    got = x.to(torch.float8_e4m3fn).view(u8).tolist()
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):
        assert got == [126, 126, 126, 254, 127, 255]
    q = quantize(x, FP8Blockwise((1, 1)))  # one element per tile: finite ones scale to 448
    assert q.data.view(u8).tolist() == [126, 126, 126, 254, 0x7F, 0x7F]
