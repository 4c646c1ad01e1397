"""The fast codec kernels equal the plain one-op-per-step codec
(tests/helpers/quant_plain.py) bit for bit: every e4m3 byte under every kind of scale,
special inputs, odd and batched shapes, input dtypes, and the run-of-tiles shapes the
quantized all-gather uses."""

from __future__ import annotations

import pytest
import torch

from flexshard.quant import MXFP8, FP8Blockwise, QuantizedTensor, dequantize, quantize
from flexshard.quant.codec import _e8m0_to_float32
from flexshard.quant.kernels import canonical_nan_bytes, e4m3_bytes_to_float32, mxfp8_to_bfloat16

from ..helpers.quant_plain import plain_dequantize, plain_quantize

u8 = torch.uint8
FORMATS = [
    FP8Blockwise((128, 128)),
    FP8Blockwise((4, 8), pow2_scale=True),
    FP8Blockwise((1, 3)),
    MXFP8((32, 32)),
    MXFP8((1, 32), "rceil"),
    MXFP8((3, 5), "floor"),
]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype and shape, NaN at the same places, every other element bit for bit."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    ints = {1: u8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    keep = ~want.isnan()
    assert torch.equal(got.view(ints)[keep], want.view(ints)[keep])


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


# FP8Blockwise scales: ordinary, subnormal, 2^-149, near FLT_MAX (256 * s overflows), inf,
# NaN, zero, negative: any float32 a caller may hand to dequantize.
FP32_SCALES = _f32(
    [0x3F800000, 0x3E2AAAAB, 0x00400000, 0x00000001, 0x007FFFFF, 0x7F7FFFFF, 0x7B800000]
    + [0x7B7FFFFF, 0x7F800000, 0x7FC00000, 0x00000000, 0xBF123456, 0x35000001, 0x80000000]
)


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_every_byte_under_every_e8m0_scale(dtype):
    """256 data bytes x 256 E8M0 scale bytes (2^-127 subnormal, 2^127, NaN included)."""
    data = torch.arange(256, dtype=u8).repeat(256, 1).view(torch.float8_e4m3fn)
    scale = torch.arange(256, dtype=u8).view(256, 1).view(torch.float8_e8m0fnu)
    fmt = MXFP8((1, 256))
    got = dequantize(QuantizedTensor(data, scale, fmt), dtype)
    assert_same_bits(got, plain_dequantize(data, scale, fmt, dtype))


def test_mxfp8_straight_to_bfloat16_every_byte_and_scale():
    """The direct bf16 route (taken when every scale is <= 2^7) under every such E8M0 scale
    and NaN; a scale of 2^8 sends the whole call to the float32 route."""
    scale_bytes = torch.cat([torch.arange(135, dtype=u8), torch.tensor([0xFF], dtype=u8)])
    data = torch.arange(256, dtype=u8).repeat(len(scale_bytes), 1)
    scale = scale_bytes.view(-1, 1).view(torch.float8_e8m0fnu)
    codes = data.view(1, -1, 1, 1, 256)
    fused = mxfp8_to_bfloat16(codes, _e8m0_to_float32(scale).view(1, -1, 1, 1, 1))
    assert fused is not None
    fmt = MXFP8((1, 256))
    want = plain_dequantize(data.view(torch.float8_e4m3fn), scale, fmt, torch.bfloat16)
    assert_same_bits(fused.view(want.shape), want)
    big = torch.full((1, 1, 1, 1, 1), 2.0**8)
    assert mxfp8_to_bfloat16(codes[:, :1], big) is None


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_every_byte_under_float32_scales(dtype):
    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (50,), generator=generator, dtype=torch.int64)
    scales = torch.cat([FP32_SCALES, random_bits.to(torch.int32).view(torch.float32)])
    data = torch.arange(256, dtype=u8).repeat(len(scales), 1).view(torch.float8_e4m3fn)
    fmt = FP8Blockwise((1, 256))
    q = QuantizedTensor(data, scales.view(-1, 1), fmt)
    assert_same_bits(dequantize(q, dtype), plain_dequantize(data, q.scale, fmt, dtype))


def test_e4m3_widening_matches_torch_cast():
    """The fp16 route reads value / 256 for every byte; NaN bytes read NaN."""
    codes = torch.arange(256, dtype=u8)
    got = e4m3_bytes_to_float32(codes) * 256
    assert_same_bits(got, codes.view(torch.float8_e4m3fn).to(torch.float32))
    assert got.isnan().nonzero().flatten().tolist() == [0x7F, 0xFF]


def test_canonical_nan_bytes_only_touches_nan():
    codes = torch.arange(256, dtype=u8)
    want = codes.clone()
    want[0xFF] = 0x7F
    assert torch.equal(canonical_nan_bytes(codes.clone()), want)


def _special_input(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Normal values over many magnitudes with zeros, -0.0, subnormals, +-inf, NaN of both
    signs, values near FLT_MAX and e4m3 rounding ties sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g))
    specials = _f32(
        [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000]
        + [0xFFC00000, 0x7F7FFFFF, 0xFF7FFFFF, 0x43E00000, 0x43E80000, 0x3B000000]
    )
    pick = torch.randint(0, 40, shape, generator=g)
    hit = pick < len(specials)
    x[hit] = specials[pick[hit]]
    return x


def _check_quantize(x: torch.Tensor, fmt) -> None:
    q = quantize(x, fmt)
    data, scale = plain_quantize(x, fmt)
    assert torch.equal(q.data.view(u8), data)
    assert torch.equal(q.scale.view(u8), scale.view(u8))
    for dtype in OUT_DTYPES:
        assert_same_bits(dequantize(q, dtype), plain_dequantize(q.data, q.scale, fmt, dtype))


SHAPES = [(), (7,), (5, 13), (64, 96), (3, 33, 70), (2, 2, 9, 4), (0, 6), (4, 0)]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_special_inputs_equal_plain(fmt, shape):
    _check_quantize(_special_input(shape, seed=len(shape)), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_finite_inputs_and_all_zero_tiles_equal_plain(fmt):
    """The all-finite fast path (no NaN fix-up), with an all-zero and an all-(-0.0) tile."""
    x = torch.randn(96, 160, generator=torch.Generator().manual_seed(1)) * 1e-3
    x[:32, :32] = 0.0
    x[32:64, 32:64] = -0.0
    x[64:, 64:] = torch.finfo(torch.float32).tiny / 3  # subnormal tiles
    _check_quantize(x, fmt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_input_dtypes_equal_plain(dtype):
    x = _special_input((40, 72), seed=3).to(dtype)
    for fmt in (FP8Blockwise((8, 8)), MXFP8((8, 8))):
        _check_quantize(x, fmt)


def test_non_contiguous_input_is_read_not_written():
    x = _special_input((70, 96), seed=4)
    before = x.clone()
    for fmt in FORMATS:
        _check_quantize(x.t(), fmt)
        _check_quantize(x[:, ::2], fmt)
        _check_quantize(x, fmt)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("fmt", [FP8Blockwise((128, 128)), MXFP8((32, 32))], ids=str)
def test_runs_of_tiles_as_the_gather_quantizes_them(fmt):
    """The quantized all-gather's shapes: a run of (n, 128, 128) tiles, fp32 master weights,
    dequantized into bf16."""
    x = torch.randn(3, 128, 128, generator=torch.Generator().manual_seed(5)) * 0.02
    _check_quantize(x, fmt)
    x[2, 5, 7] = float("nan")
    x[1, 100, 1] = float("-inf")
    _check_quantize(x, fmt)
