"""Shared by the codec tests (test_quant.py, test_quant_fp8.py): hypothesis settings,
the e4m3 value table decoded from its bit layout, and float32 inputs built from bit
patterns around a block exponent plus special values."""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from flexshard.quant import QuantizedTensor

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
u8 = torch.uint8

# float8_e4m3fn, decoded from its bit layout: bias 7, exponent field 0 = subnormal (m/8 * 2^-6),
# 0x7F = NaN, no inf. Codes 0..126 are the non-negative finite values, increasing with the code.
E4M3 = [
    Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
    for code in range(127)
    for e, m in [(code >> 3, code & 7)]
]
assert E4M3[-1] == 448


# ---- input generators: bit patterns around a block exponent, plus overlaid special values ----

# Mantissas hitting OCP edges: 0 (powers of two), 1.75 +- 1 ulp (rceil boundary), all 4-bit
# patterns (k << 19: exact e4m3 values and round-to-even ties), all-ones.
EDGE_MANTISSAS = [0, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF, 1, 0x400000]
EDGE_MANTISSAS += [k << 19 for k in range(16)]
SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 448.0, 464.0, 480.0, -1e38, 2.0**-9]
SPECIALS += [2.0**-149, 2.0**-127, -(2.0**-126), 3 * 2.0**-11]  # fp32 / e4m3 subnormal edges
BLOCKS = st.one_of(
    st.sampled_from([(1, 32), (32, 32), (3, 5), (1, 1), (4, 8)]),
    st.tuples(st.integers(1, 9), st.integers(1, 40)),
)


@st.composite
def float_tensors(draw, max_numel: int = 700) -> torch.Tensor:
    ndim = draw(st.sampled_from([1, 2, 2, 3]))
    shape = [draw(st.integers(1, 3))] if ndim == 3 else []
    shape += [draw(st.integers(1, 24)) for _ in range(min(ndim, 2))]
    while math.prod(shape) > max_numel:
        shape[-1] = max(1, shape[-1] // 2)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    base = draw(st.one_of(st.integers(0, 254), st.sampled_from([0, 1, 2, 8, 9, 10, 127, 254])))
    spread = draw(st.sampled_from([0, 2, 6, 12, 40, 254]))
    be = (base - torch.randint(0, spread + 1, (n,), generator=g)).clamp(0, 254)
    edge = torch.tensor(EDGE_MANTISSAS)[torch.randint(0, len(EDGE_MANTISSAS), (n,), generator=g)]
    man = torch.where(torch.rand(n, generator=g) < 0.5, edge, torch.randint(0, 1 << 23, (n,)))
    sign = torch.randint(0, 2, (n,), generator=g)
    bits = (sign << 31) | (be << 23) | man
    bits = torch.where(torch.rand(n, generator=g) < draw(st.sampled_from([0.0, 0.1, 1.0])), 0, bits)
    x = bits.to(torch.int32).view(torch.float32).clone()
    for pos, v in draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(SPECIALS)))):
        x[pos] = v
    return x.reshape(shape)


def scale_per_element(q: QuantizedTensor) -> torch.Tensor:
    r, c = q.fmt.block
    s = q.scale.float().repeat_interleave(r, -2).repeat_interleave(c, -1)
    if q.data.dim() < 2:
        return s[0, : max(1, q.data.numel())].reshape(q.data.shape)
    return s[..., : q.data.shape[-2], : q.data.shape[-1]]
