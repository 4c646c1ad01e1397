"""Block-quantization codecs: FP8 blockwise vs DeepSeek-V3's formula in NumPy (and vs a
per-tile loop); tiling, batching, dtypes, pack / unpack and bad inputs of every format."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexshard.quant import (
    MXFP8,
    FP8Blockwise,
    QuantizedTensor,
    dequantize,
    pack,
    packed_nbytes,
    quantize,
    scale_shape,
    unpack,
)

from ..helpers.quant_cases import BLOCKS, E4M3, SETTINGS, float_tensors, scale_per_element, u8

# ---- FP8 blockwise ----------------------------------------------------------------------------


def ref_fp8_blockwise(x: torch.Tensor, fmt: FP8Blockwise) -> tuple[torch.Tensor, torch.Tensor]:
    """Straightforward per-tile loop (fp32 arithmetic, as in DeepSeek-V3's recipe)."""
    rows, cols = (1, 1) if x.dim() == 0 else (1, x.shape[0]) if x.dim() == 1 else x.shape[-2:]
    x3 = x.float().reshape(-1, rows, cols)
    r, c = fmt.block
    grid = scale_shape(x.shape, fmt)
    data = torch.empty(x3.shape, dtype=u8)
    scale = torch.empty(x3.shape[0], *grid[-2:])
    for b in range(x3.shape[0]):
        for i in range(grid[-2]):
            for j in range(grid[-1]):
                t = x3[b, i * r : i * r + r, j * c : j * c + c]
                fin = t[t.isfinite()].abs()
                amax = fin.max() if fin.numel() else torch.tensor(0.0)
                s = torch.maximum(amax, torch.tensor(1e-4)) / 448
                if fmt.pow2_scale:
                    m, ex = math.frexp(s.item())
                    s = torch.tensor(2.0 ** (ex - 1) if m == 0.5 else 2.0**ex)
                y = (t / s).clamp(-448, 448)
                q = torch.where(y.isnan(), 0x7F, y.to(torch.float8_e4m3fn).view(u8))
                data[b, i * r : i * r + r, j * c : j * c + c] = q
                scale[b, i, j] = s
    return data.reshape(x.shape), scale.reshape(grid)


@SETTINGS
@given(float_tensors(max_numel=400), BLOCKS, st.booleans())
def test_fp8_blockwise_matches_loop_reference(x, block, pow2):
    fmt = FP8Blockwise(block, pow2)
    q = quantize(x, fmt)
    data, scale = ref_fp8_blockwise(x, fmt)
    assert q.scale.dtype == torch.float32 and q.scale.shape == scale.shape
    assert torch.equal(q.scale, scale) and torch.equal(q.data.view(u8), data)


# ---- FP8 blockwise against DeepSeek-V3's formula, in NumPy (no torch float8 code) ------------
#
# DeepSeek-V3 (technical report, section 3.3.1; ``act_quant_kernel`` in its inference/kernel.py:
# ``s = max(|x|) / 448.; y = x / s``): 128 x 128 weight blocks, per block ``amax = max|x|`` in
# fp32, ``scale = amax / 448`` in fp32, data ``x / scale`` cast to float8_e4m3fn (round to
# nearest even, bias 7, 3 mantissa bits, saturating at 448); dequantization ``data * scale`` in
# fp32. The 1e-4 floor on amax is DeepGEMM's ``per_block_cast_to_fp8`` (``clamp(1e-4)``), so an
# all-zero block has a finite scale. Finite inputs only: the recipe does not define NaN/inf
# (test_fp8_blockwise_special_tiles covers them).


def np_e4m3(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (float8_e4m3fn byte, its value as float32), from the format's definition."""
    a = np.minimum(np.abs(y.astype(np.float64)), 448.0)
    _, exp = np.frexp(a)  # a = f * 2^exp, f in [0.5, 1): the binade is 2^(exp - 1)
    quantum = np.ldexp(1.0, np.maximum(exp - 1, -6) - 3)  # 3 mantissa bits; subnormals 2^-9
    value = np.minimum(np.rint(a / quantum) * quantum, 448.0)  # rint: ties to even
    f, exp = np.frexp(value)
    normal = value >= 2.0**-6
    field = np.where(normal, exp - 1 + 7, 0)
    mantissa = np.where(normal, (f * 2 - 1) * 8, value / 2.0**-9).astype(np.int64)
    code = (field << 3 | mantissa) | np.where(np.signbit(y), 0x80, 0)
    return code.astype(np.uint8), np.copysign(value, y).astype(np.float32)


def deepseek_v3_fp8(x: np.ndarray, block: int = 128) -> tuple[np.ndarray, ...]:
    """A 2-D float32 array -> (fp8 bytes, fp32 scale per block, fp32 dequantized)."""
    rows, cols = x.shape
    gr, gc = -(-rows // block), -(-cols // block)
    codes = np.zeros(x.shape, dtype=np.uint8)
    deq = np.zeros(x.shape, dtype=np.float32)
    scale = np.zeros((gr, gc), dtype=np.float32)
    for i in range(gr):
        for j in range(gc):
            index = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            tile = x[index]
            amax = np.maximum(np.abs(tile).max(), np.float32(1e-4))
            scale[i, j] = amax / np.float32(448.0)  # float32 / float32: one fp32 rounding
            codes[index], values = np_e4m3(tile / scale[i, j])  # fp32 division, then the cast
            deq[index] = values * scale[i, j]
    return codes, scale, deq


def _deepseek_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    cases = []
    for shape in [(128, 128), (256, 384), (200, 300), (1, 129), (130, 1), (3, 5)]:
        # per-element magnitudes over many binades, so tiles have very different scales
        x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 6, size=shape)
        cases.append(x.astype(np.float32))
    tiles = np.zeros((128, 640), dtype=np.float32)  # columns 0-127: an all-zero block
    tiles[:, 128:256] = 1e-6 * rng.standard_normal((128, 128))  # amax below the 1e-4 floor
    # amax = 448: scale 1, so every e4m3 tie (midpoint of two codes) reaches the cast exactly
    grid = np.array([float(v) for v in E4M3])  # the exact e4m3 values, increasing
    ties = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    block = np.resize(np.concatenate([ties, -ties, grid.astype(np.float32)]), 128 * 128)
    block[0] = 448.0
    tiles[:, 256:384] = block.reshape(128, 128)
    tiles[:, 384:512] = 448.0 * rng.uniform(-1, 1, (128, 128))  # near saturation
    # an inexact scale (amax 3.3), values within 8 fp32 ulps of tie * scale: here the
    # order of operations decides the code (x / scale and x * (448 / amax) differ)
    amax = np.float32(3.3)
    centre = ties[1:, None] * (amax / np.float32(448.0))
    near = centre + np.arange(-8, 9, dtype=np.float32) * np.spacing(centre)
    block = np.resize(np.concatenate([near.ravel(), -near.ravel()]), 128 * 128)
    block[0] = amax
    tiles[:, 512:640] = block.reshape(128, 128)
    cases.append(tiles)
    return cases


@pytest.mark.parametrize("index", range(7))
def test_fp8_blockwise_matches_deepseek_v3_numpy(index):
    """The codec equals DeepSeek-V3's formula computed in NumPy: bytes, scales (bit for
    bit) and the dequantized values, over partial edge tiles, the amax floor, every
    round-to-even tie and values near saturation."""
    x = _deepseek_cases()[index]
    codes, scale, deq = deepseek_v3_fp8(x)
    q = quantize(torch.from_numpy(x), FP8Blockwise((128, 128)))
    assert q.scale.dtype == torch.float32
    np.testing.assert_array_equal(q.scale.numpy().view(np.uint32), scale.view(np.uint32))
    np.testing.assert_array_equal(q.data.view(u8).numpy(), codes)
    np.testing.assert_array_equal(dequantize(q).numpy().view(np.uint32), deq.view(np.uint32))


def test_numpy_e4m3_reference_decodes_its_codes():
    """The NumPy cast is self-consistent: every code it returns decodes (by the format's
    bit layout, the table above) to the value it returned, that value is a nearest e4m3
    value, and each of the 254 finite values casts to itself."""
    table32 = np.array([float(v) for v in E4M3], dtype=np.float32)
    exact, _ = np_e4m3(np.concatenate([table32, -table32]))
    assert exact.tolist() == list(range(127)) + list(range(0x80, 0x80 + 127))
    y = np.concatenate(
        [np.linspace(-460, 460, 20001), np.linspace(-0.03, 0.03, 4001)]  # normals, subnormals
    ).astype(np.float32)
    codes, values = np_e4m3(y)
    magnitude = np.array([float(E4M3[c & 0x7F]) for c in codes])
    np.testing.assert_array_equal(np.where(codes & 0x80, -magnitude, magnitude), values)
    table = np.array([float(v) for v in E4M3])
    nearest = np.abs(np.abs(y.astype(np.float64))[:, None] - table[None, :]).min(axis=1)
    clipped = np.abs(np.abs(values) - np.minimum(np.abs(y), 448.0))
    assert (clipped <= nearest + 1e-12).all()


@SETTINGS
@given(float_tensors(max_numel=400), BLOCKS)
def test_fp8_blockwise_pow2_and_error_bound(x, block):
    # Finite, and below 2^126: 448 * scale may round past FLT_MAX (see test_decode_overflow).
    x = torch.where(x.isfinite(), x, 0.0).clamp(-(2.0**126), 2.0**126)
    exact = quantize(x, FP8Blockwise(block)).scale
    for pow2 in (False, True):
        q = quantize(x, FP8Blockwise(block, pow2))
        if pow2:
            m, _ = torch.frexp(q.scale)
            assert (m == 0.5).all() and (q.scale >= exact).all() and (q.scale < 2 * exact).all()
        # e4m3 has 3 mantissa bits: normals within 2^-4 relative, subnormals within 2^-10 * s
        # (plus fp32 rounding of x / s and q * s).
        err = (dequantize(q).double() - x.double()).abs()
        bound = (2.0**-4 * x.abs().double() + 2.0**-10 * scale_per_element(q).double()) * 1.0001
        assert (err <= bound).all()


def test_fp8_pow2_scale_rounding_edges():
    # Tiles whose exact scale is a power of two (mantissa 0) or one ulp above it (mantissa 1).
    amax = (torch.arange(0x43E00000, 0x43E00000 + 4096, dtype=torch.int32)).view(torch.float32)
    s = amax / 448
    man = s.view(torch.int32) & 0x7FFFFF
    pick = torch.cat([amax[man == 0][:1], amax[man == 1][:1]])
    assert pick.numel() == 2
    q = quantize(pick.reshape(1, 2), FP8Blockwise((1, 1), pow2_scale=True))
    assert q.scale.tolist() == [[1.0, 2.0]]


def test_fp8_blockwise_special_tiles():
    x = torch.zeros(3, 200)  # 128x128 tiles: partial in both dims
    x[0, 0], x[0, 1], x[0, 2], x[1, 3] = 2.0, math.nan, math.inf, -math.inf
    x[2, 150] = -7.0
    q = quantize(x, FP8Blockwise())
    assert q.scale.shape == (1, 2)
    s0, s1 = q.scale[0, 0], q.scale[0, 1]
    assert s0 == torch.tensor(2.0) / 448 and s1 == torch.tensor(7.0) / 448  # NaN/inf ignored
    d = dequantize(q)
    assert d[0, 0] == 2.0 and d[0, 1].isnan() and d[0, 2] == 448 * s0 and d[1, 3] == -448 * s0
    assert d[2, 150] == -7.0 and (d[:, 4:128] == 0).all()
    z = quantize(torch.zeros(5, 5), FP8Blockwise())
    assert z.scale.item() == (torch.tensor(1e-4) / 448).item() and (z.data.view(u8) == 0).all()


# ---- shared semantics: tiling, batching, dtypes -----------------------------------------------

FORMATS = [FP8Blockwise((4, 8)), FP8Blockwise((128, 128), True), MXFP8(), MXFP8((1, 32), "rceil")]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_tiling_is_local(fmt):
    # Tiles are independent: batch slices, tile-aligned row splits and 1-D rows all agree.
    x = torch.randn(3, 70, 45, generator=torch.Generator().manual_seed(0))
    x = x * torch.logspace(-3, 3, 45)
    q = quantize(x, fmt)
    assert q.data.shape == x.shape and q.scale.shape == scale_shape(x.shape, fmt)
    for b in range(3):
        qb = quantize(x[b], fmt)
        assert torch.equal(qb.data.view(u8), q.data[b].view(u8))
        assert torch.equal(qb.scale.view(u8), q.scale[b].view(u8))
    r = fmt.block[0]
    if r < 70:
        top, bot = quantize(x[:, :r], fmt), quantize(x[:, r:], fmt)
        assert torch.equal(torch.cat([top.data, bot.data], 1).view(u8), q.data.view(u8))
    row = quantize(x[0, 0], fmt)
    assert row.scale.shape == (1, -(-45 // fmt.block[1]))
    assert torch.equal(row.data.view(u8), quantize(x[0, :1], fmt).data[0].view(u8))
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(
        quantize(x.to(torch.bfloat16), fmt).scale, quantize(x.bfloat16().float(), fmt).scale
    )


def test_odd_shapes():
    g = torch.Generator().manual_seed(0)
    for shape in [(), (0, 5), (2, 0, 3), (1,), (7,)]:
        x = torch.randn(shape, generator=g)
        q = quantize(x, MXFP8())
        assert q.data.shape == x.shape and q.scale.shape == scale_shape(shape, q.fmt)
        # OCP floor puts amax in [256, 512): spacing 32 there, and saturation above 448
        torch.testing.assert_close(dequantize(q), x, rtol=0.125, atol=0)
        buf = pack(q)
        assert buf.numel() == packed_nbytes(shape, q.fmt)
        assert torch.equal(unpack(buf, shape, q.fmt).data.view(u8), q.data.view(u8))


# ---- pack / unpack ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_pack_roundtrip(fmt):
    x = torch.randn(2, 33, 70, generator=torch.Generator().manual_seed(0))
    q = quantize(x, fmt)
    buf = pack(q)
    n = x.numel()
    assert buf.dtype == u8 and buf.numel() == packed_nbytes(x.shape, fmt)
    assert torch.equal(buf[:n], q.data.view(u8).reshape(-1))
    assert (buf[n : n + (-n % 16)] == 0).all() and (n + (-n % 16)) % 16 == 0
    assert torch.equal(buf[n + (-n % 16) :], q.scale.view(u8).reshape(-1))
    for b in (buf, torch.cat([torch.zeros(1, dtype=u8), buf])[1:]):  # aligned and misaligned
        q2 = unpack(b, x.shape, fmt)
        assert q2.fmt == fmt and q2.scale.dtype == q.scale.dtype
        assert torch.equal(q2.data.view(u8), q.data.view(u8))
        assert torch.equal(q2.scale.view(u8), q.scale.view(u8))
        torch.testing.assert_close(dequantize(q2), dequantize(q), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="packs to"):
        unpack(buf[:-1], x.shape, fmt)
    with pytest.raises(TypeError):
        unpack(buf.view(torch.int8), x.shape, fmt)


@pytest.mark.parametrize(
    ("fmt", "ratio"),
    [(FP8Blockwise(), 1.0002), (MXFP8((32, 32)), 1.001), (MXFP8((1, 32)), 1.031)],
)
def test_bytes_per_element(fmt, ratio):
    n = 4096 * 4096
    scale_bytes = math.prod(scale_shape((4096, 4096), fmt)) * fmt.scale_dtype.itemsize
    assert packed_nbytes((4096, 4096), fmt) == n + scale_bytes  # n is a multiple of 16: no pad
    assert abs(packed_nbytes((4096, 4096), fmt) / n - ratio) < 1e-3
    assert packed_nbytes((3, 5), MXFP8((1, 32))) == 15 + 1 + 3  # 15 B data, pad to 16, 3 scales


# ---- validation -------------------------------------------------------------------------------


def test_bad_inputs():
    for bad in [(0, 4), (4, -1), (4,), (1, 2, 3), (1.5, 2), (True, 32), "32x32", 32]:
        with pytest.raises(ValueError, match="block"):
            MXFP8(bad)
        with pytest.raises(ValueError, match="block"):
            FP8Blockwise(bad)
    with pytest.raises(ValueError, match="rounding"):
        MXFP8(rounding="bogus")
    with pytest.raises(ValueError, match="pow2_scale"):
        FP8Blockwise(pow2_scale="yes")
    for dt in (torch.int64, torch.bool, torch.complex64, torch.uint8):
        x = torch.ones(3, dtype=dt)
        with pytest.raises(TypeError, match="floating-point"):
            quantize(x, MXFP8())
    with pytest.raises(TypeError):
        quantize([1.0, 2.0], MXFP8())
    with pytest.raises(TypeError, match="fmt"):
        quantize(torch.ones(2), "mxfp8")
    fmt = MXFP8([1, 32])
    assert fmt.block == (1, 32) and hash(fmt) == hash(MXFP8((1, 32)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fmt.block = (2, 2)
    with pytest.raises(ValueError, match="tile grid"):
        QuantizedTensor(
            torch.ones(4, 4).to(torch.float8_e4m3fn), torch.ones(2, 2), FP8Blockwise((4, 4))
        )
