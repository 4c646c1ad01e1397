"""The compiled codec (``quant/fused.py`` under ``torch.compile``, ``quant/compiled.py``,
``runtime/quantized.py``) gives the eager codec's bits: the existing bit-exactness
inputs (every byte under every scale, special values, subnormal scales) on the compiled
path; the quantized all-gather compiled equals it eager in one process (training through
the runtime's hooks: test_quant_compiled_training.py); a wrong or failing compiled function
is caught and the eager codec serves.

Compiling costs seconds per graph; the slow-marked tests cover every format and shape."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import flexshard as fs
from flexshard.placements.layout import plan_bucket
from flexshard.quant import MXFP8, FP8Blockwise, QuantizedTensor, dequantize, quantize
from flexshard.quant import compiled as qc
from flexshard.quant.fused import dequantize_fused, quantize_fused
from flexshard.runtime import quantized as rqc
from flexshard.runtime.quantized import QuantizedGather
from flexshard.runtime.storage import BucketStorage

from ..helpers.quant_plain import plain_dequantize, plain_quantize
from .test_quant_fast import FORMATS, FP32_SCALES, OUT_DTYPES, SHAPES, _special_input
from .test_quant_fast import assert_same_bits as same_bits

u8 = torch.uint8


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    qc.reset()
    qc.set_compile_mode(None)
    yield
    qc.reset()
    qc.set_compile_mode(None)


def _compiled(key: tuple, body):
    """``body`` compiled once for ``key`` (its own dynamo cache, as the runtime does)."""
    qc.set_compile_mode("on")
    entry = qc.compiled_fn(qc.intern(key), lambda: body)
    assert entry is not None
    return entry


def _scale_arg(q: QuantizedTensor) -> torch.Tensor:
    return q.scale if isinstance(q.fmt, FP8Blockwise) else q.scale.view(u8)


def _check_fused(x: torch.Tensor, fmt, quant, dequant) -> None:
    """``quant(x)`` / ``dequant(data, scale)`` (3 dtypes) against the plain codec."""
    data, scale = quant(x)
    want_data, want_scale = plain_quantize(x, fmt)
    assert torch.equal(data.view(u8), want_data)
    assert torch.equal(scale.contiguous().view(u8), want_scale.view(u8))
    q = quantize(x, fmt)
    for dtype, got in zip(OUT_DTYPES, dequant(q.data, _scale_arg(q))):
        same_bits(got, plain_dequantize(q.data, q.scale, fmt, dtype))


def _eager(fmt):
    return (
        lambda x: quantize_fused(x, fmt),
        lambda d, s: [dequantize_fused(d, s, fmt, t) for t in OUT_DTYPES],
    )


def _compiled_pair(fmt, shape):
    quant = _compiled(("q", fmt, shape), lambda x: quantize_fused(x, fmt))
    dequant = _compiled(
        ("d", fmt, shape), lambda d, s: [dequantize_fused(d, s, fmt, t) for t in OUT_DTYPES]
    )
    return quant, dequant


# ------------------------------------------------------------------ the fused formulation
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_eagerly_equals_plain(fmt, shape):
    """Run as Python (what dynamo would fall back to), partial edge tiles included."""
    _check_fused(_special_input(shape, seed=len(shape)), fmt, *_eager(fmt))


def test_compiled_every_byte_under_every_e8m0_scale():
    data = torch.arange(256, dtype=u8).repeat(256, 1).view(torch.float8_e4m3fn)
    scale = torch.arange(256, dtype=u8).view(256, 1)
    fmt = MXFP8((1, 256))
    dequant = _compiled(
        ("e8m0", fmt), lambda d, s: [dequantize_fused(d, s, fmt, t) for t in OUT_DTYPES]
    )
    for dtype, got in zip(OUT_DTYPES, dequant(data, scale)):
        same_bits(got, plain_dequantize(data, scale.view(torch.float8_e8m0fnu), fmt, dtype))


def test_compiled_every_byte_under_float32_scales():
    """Ordinary, subnormal (down to 2^-149), near FLT_MAX, inf, NaN, zero, negative."""
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (18,), generator=g, dtype=torch.int64)
    scales = torch.cat([FP32_SCALES, random_bits.to(torch.int32).view(torch.float32)])
    data = torch.arange(256, dtype=u8).repeat(len(scales), 1).view(torch.float8_e4m3fn)
    fmt = FP8Blockwise((1, 256))
    dequant = _compiled(
        ("fp32", fmt), lambda d, s: [dequantize_fused(d, s, fmt, t) for t in OUT_DTYPES]
    )
    for dtype, got in zip(OUT_DTYPES, dequant(data, scales.view(-1, 1))):
        same_bits(got, plain_dequantize(data, scales.view(-1, 1), fmt, dtype))


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [(MXFP8((32, 32)), (2, 64, 96)), (FP8Blockwise((32, 32), pow2_scale=True), (64, 96))],
    ids=str,
)
def test_compiled_special_inputs_equal_plain(fmt, shape):
    """NaN, +-inf, -0.0, float32 subnormals, near FLT_MAX, e4m3 ties, all-zero and
    subnormal tiles, through the compiled quantize and dequantize."""
    x = _special_input(shape, seed=7)
    x[..., :32, :32] = 0.0
    x[..., 32:64, 32:64] = torch.finfo(torch.float32).tiny / 3
    _check_fused(x, fmt, *_compiled_pair(fmt, shape))


WHOLE = [(4, 8, 96), (2, 96, 160), (3, 128, 128), (64, 64)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_compiled_every_format_equals_plain(fmt):
    r, c = fmt.block
    for shape in [s for s in WHOLE if s[-2] % r == 0 and s[-1] % c == 0]:
        x = _special_input(shape, seed=len(shape))
        _check_fused(x, fmt, *_compiled_pair(fmt, shape))
        finite = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 1e-3
        _check_fused(finite, fmt, *_compiled_pair(fmt, shape))  # no NaN fix-up at all


# ------------------------------------------------------------------ the mode
def test_mode_from_environment_and_override(monkeypatch):
    for value, mode in [("auto", "auto"), ("1", "on"), ("ON", "on"), ("0", "off"), ("off", "off")]:
        monkeypatch.setenv(qc.ENV, value)
        assert qc.compile_mode() == mode
    monkeypatch.setenv(qc.ENV, "sometimes")
    with pytest.raises(ValueError, match="FLEXSHARD_QUANT_COMPILE"):
        qc.compile_mode()
    qc.set_compile_mode("off")
    assert qc.compile_mode() == "off"
    with pytest.raises(ValueError, match="mode"):
        qc.set_compile_mode("fast")
    monkeypatch.delenv(qc.ENV)
    qc.set_compile_mode(None)
    assert qc.compile_mode() == "auto"


# ------------------------------------------------------------------ the gather in one process
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _gathers(params, fmt, world=2, tile=(32, 32), seed=0):
    """Every rank's QuantizedGather of one bucket (no process group needed) and the fulls."""
    layout = plan_bucket([(n, s, fs.BlockShard(tile)) for n, s in params], world)
    g = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=g) * 0.02 for _, s in params]
    fulls[0].view(-1)[:7] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-42, 3e38])
    gathers = []
    for rank in range(world):
        store = BucketStorage(layout, rank, [torch.float32] * len(params), [4] * len(params),
                              BF16, torch.device("cpu"))  # fmt: skip
        store.load(fulls)
        gathers.append(QuantizedGather(store, fmt))
    return gathers, fulls


# a split parameter (its tiles on both ranks), a whole one, a 3-D (batched) one
PARAMS = [("a", (64, 96)), ("b", (96, 64)), ("c", (32, 64)), ("e", (2, 32, 64))]


def _gather_round(gathers, version, dtype=torch.bfloat16):
    payloads = [g.encode(g.store.buffer, version) for g in gathers]
    gathered = torch.stack(payloads)
    outs = []
    for g in gathers:
        fulls = [torch.empty(p.shape, dtype=dtype) for p in g.layout.params]
        g.decode(gathered, fulls)
        outs.append(fulls)
    return payloads, outs


def _assert_rounds_equal(a, b):
    for pa, pb in zip(a[0], b[0]):
        assert torch.equal(pa, pb)
    for fa, fb in zip(a[1], b[1]):
        for x, y in zip(fa, fb):
            same_bits(x, y)


def test_compiled_gather_equals_eager_in_one_process():
    """Encode per rank and decode (through ``torch._dynamo.disable``, as the hooks call
    it) compiled: the eager payload bytes and full parameters, and the graphs really run."""
    gathers, fulls = _gathers(PARAMS, MXFP8((32, 32)))
    qc.set_compile_mode("off")
    want = _gather_round(gathers, "v0")
    assert all(g.compiled.whole for g in gathers)

    qc.set_compile_mode("on")
    hook = torch._dynamo.disable(_gather_round, recursive=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = hook(gathers, "v1")
        again = hook(gathers, "v2")  # the checked graphs, as every later step runs them
    assert not [w for w in seen if "flexshard.quant" in str(w.message)]  # no mismatch
    _assert_rounds_equal(got, want)
    _assert_rounds_equal(again, want)
    stats = qc.stats()
    assert stats["broken"] is None and stats["eager_body_runs"] == 0
    entries = stats["entries"]
    assert len(entries) == 2  # both ranks hold 9 tiles: one encode shape, one decode
    assert all(e["checked"] and not e["failed"] and e["calls"] >= 3 for e in entries)
    # what the full parameters hold is the codec's dequantize(quantize(full))
    for full, got_full in zip(fulls, got[1][0]):
        same_bits(got_full, dequantize(quantize(full, MXFP8((32, 32))), torch.bfloat16))


def test_compiled_decode_into_reused_buffers():
    """As the runtime does: the same gathered buffer and full parameters every step, their
    memory freed and given back (``storage.resize_``) in between, new bytes each time."""
    gathers, _ = _gathers(PARAMS, FP8Blockwise((32, 32)))
    qc.set_compile_mode("on")
    g = gathers[0]
    gathered = torch.empty(2, g.nbytes, dtype=u8)
    fulls = [torch.empty(p.shape, dtype=torch.bfloat16) for p in g.layout.params]
    want = [torch.empty_like(f) for f in fulls]
    for step in range(3):
        for other in gathers:
            other.store.buffer.mul_(-1.5)  # an optimizer step
        gathered.copy_(torch.stack([x.encode(x.store.buffer, step) for x in gathers]))
        for f in [gathered, *fulls]:  # reshard, then unshard into new memory
            size = f.untyped_storage().size()
            f.untyped_storage().resize_(0)
            f.untyped_storage().resize_(size)
        g.decode(gathered, fulls)
        g.decode_eager(gathered, want)
        for got, ref in zip(fulls, want):
            same_bits(got, ref)
    entries = qc.stats()["entries"]
    assert all(e["checked"] and not e["failed"] for e in entries)


def test_eager_decode_holds_a_bounded_piece_of_values(monkeypatch):
    """The eager decode (CUDA's, and CPU's small buckets) dequantizes at most
    ``DECODE_CHUNK`` elements at a time (here two 32 x 32 tiles): its temporaries (int16
    codes, float32 values, their untiled copy) are a few of those, never the bucket's."""
    from flexshard.runtime import quantized
    from flexshard.testing.live_memory import LiveTensors

    chunk = 2 * 32 * 32
    monkeypatch.setattr(quantized, "DECODE_CHUNK", chunk)
    params, fmt = [("a", (128, 256)), ("b", (256, 128)), ("e", (3, 32, 64))], MXFP8((32, 32))
    gathers, fulls_fp32 = _gathers(params, fmt, world=3)
    g = gathers[0]
    gathered = torch.stack([x.encode_eager(x.store.buffer) for x in gathers])
    fulls = [torch.empty(p.shape, dtype=torch.bfloat16) for p in g.layout.params]
    with LiveTensors() as live:
        start = live.bytes_now()
        g.decode_eager(gathered, fulls)
    for got, full in zip(fulls, fulls_fp32):
        same_bits(got, dequantize(quantize(full, fmt), torch.bfloat16))
    temporaries = live.peak_bytes - start
    assert 0 < temporaries <= 6 * chunk * 4 < g.layout.numel * 4 / 4, temporaries


@pytest.mark.slow
def test_compiled_gather_with_edge_tiles_of_whole_blocks():
    """Edge tiles that are still whole format blocks (64 x 64 tiles of a 96-row weight:
    a 32-row edge, MXFP8 32 x 32): a parameter of two tile shapes, written piece by piece."""
    params = [("a", (96, 64)), ("b", (64, 160)), ("e", (2, 96, 64))]
    gathers, _ = _gathers(params, MXFP8((32, 32)), world=3, tile=(64, 64))
    qc.set_compile_mode("off")
    want = _gather_round(gathers, "v0")
    assert all(g.compiled.whole for g in gathers)
    qc.set_compile_mode("on")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _gather_round(gathers, "v1")
    assert not [w for w in seen if "flexshard.quant" in str(w.message)]
    _assert_rounds_equal(got, want)
    assert all(e["checked"] and not e["failed"] for e in qc.stats()["entries"])


def test_partial_edge_tiles_stay_eager():
    """Tiles that are not whole format blocks never compile (inductor's loop split)."""
    gathers, _ = _gathers([("w", (40, 64))], MXFP8((32, 32)))
    assert not any(g.compiled.whole for g in gathers)
    qc.set_compile_mode("on")
    _gather_round(gathers, "v")
    assert qc.stats()["entries"] == []


def test_auto_compiles_big_cpu_buckets_from_their_second_call(monkeypatch):
    requested = []
    monkeypatch.setattr(rqc, "compiled_fn", lambda key, make: requested.append(key))
    small, _ = _gathers(PARAMS, MXFP8((32, 32)))
    for version in range(3):
        _gather_round(small, version)
    assert requested == []  # under AUTO_MIN_NUMEL: the eager codec
    monkeypatch.setattr(rqc, "AUTO_MIN_NUMEL", 1)
    big, _ = _gathers(PARAMS, MXFP8((32, 32)), seed=1)
    first = big[0]
    first.encode(first.store.buffer, 0)
    assert requested == []  # the first call of a shape (key) runs eagerly
    _gather_round(big, 1)  # both encodes (one shape, seen before); the decode's first
    assert len(requested) == 3 and len(set(requested)) == 2  # call (rank 0) runs eagerly
    qc.set_compile_mode("off")
    _gather_round(big, 2)
    assert len(requested) == 3


def _wrong(entry_fn, corrupt):
    """A CompiledFn running ``entry_fn`` eagerly, then ``corrupt`` on its result/args."""

    def run(*args):
        out = entry_fn(*args)
        corrupt(out, args)
        return out

    return qc.CompiledFn(run)


def test_a_wrong_compiled_decode_is_caught_and_retired(monkeypatch):
    """A graph that leaves elements unwritten (what inductor's loop split did to partial
    tiles) shows against the NaN / 1.0 prefills; the eager bits are used, with a warning."""
    gathers, _ = _gathers(PARAMS, FP8Blockwise((32, 32)))
    qc.set_compile_mode("off")
    want = _gather_round(gathers, "v0")
    made = []

    def fake(key, make):
        if not made:
            body = make()
            snapshot = []

            def run(*args):
                target = args[2][0]
                snapshot.append(target.reshape(-1)[-5:].clone())  # the prefill, kept
                body(*args)
                target.reshape(-1)[-5:].copy_(snapshot[-1])

            made.append(qc.CompiledFn(run))
        return None if made[0].failed else made[0]

    monkeypatch.setattr(rqc, "compiled_fn", fake)
    monkeypatch.setattr(rqc, "traced", lambda: None)  # the fake runs the body as Python
    qc.set_compile_mode("on")
    payloads = [g.encode_eager(g.store.buffer) for g in gathers]
    fulls = [torch.empty(p.shape, dtype=torch.bfloat16) for p in gathers[0].layout.params]
    with pytest.warns(RuntimeWarning, match="decode differed"):
        gathers[0].compiled.decode(torch.stack(payloads), fulls, gathers[0].decode_eager)
    for got, ref in zip(fulls, want[1][0]):
        same_bits(got, ref)
    assert made[0].failed
    gathers[0].decode(torch.stack(payloads), fulls)  # retired: eager from now on, silently
    for got, ref in zip(fulls, want[1][0]):
        same_bits(got, ref)


def test_a_wrong_compiled_encode_is_caught(monkeypatch):
    gathers, _ = _gathers(PARAMS, MXFP8((32, 32)))
    made = []

    def fake(key, make):
        if not made:

            def flip(out, args):
                out[0].view(u8)[3] ^= 1  # (payload, scales)

            made.append(_wrong(make(), flip))
        return None if made[0].failed else made[0]

    monkeypatch.setattr(rqc, "compiled_fn", fake)
    monkeypatch.setattr(rqc, "traced", lambda: None)  # the fake runs the body as Python
    qc.set_compile_mode("on")
    g = gathers[0]
    with pytest.warns(RuntimeWarning, match="encode differed"):
        got = g.compiled.encode(g.store.buffer, g.encode_eager)
    assert torch.equal(got, g.encode_eager(g.store.buffer))
    assert made[0].failed


def test_a_compile_error_turns_compiling_off(monkeypatch):
    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no C++ compiler")

        return call

    monkeypatch.setattr(qc.torch, "compile", broken)
    gathers, _ = _gathers(PARAMS, MXFP8((32, 32)))
    qc.set_compile_mode("off")
    want = _gather_round(gathers, "v0")
    qc.set_compile_mode("on")
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        got = _gather_round(gathers, "v1")
    _assert_rounds_equal(got, want)
    assert qc.compile_mode() == "off" and "no C++ compiler" in qc.stats()["broken"]
