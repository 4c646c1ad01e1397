"""What the quantized all-gather's codec costs per element on this CPU, next to what the
bf16 gather does in its place: its encode against the bf16 payload's cast, its decode
against the bf16 copy-out. One process, one thread, one run of 64 tiles of 128 x 128
(1 Mi elements, as a bucket's payload holds its tiles).

    .venv/bin/python -m benchmarks.bench_codec [--out DIR]

Per step a rank encodes its shard once and decodes every rank's payload once per
unshard (forward and backward), so the codec's extra CPU per step is about
``(encode - cast) * N / W + 2 * (decode - copy) * N`` for N gathered elements; the
halved all-gather bytes have to save more than that for the quantized row to be faster.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flexshard.quant import MXFP8, FP8Blockwise, QuantFormat, dequantize, quantize
from flexshard.quant.fused import dequantize_fused, quantize_fused

from .common import write_results

RESULTS = Path(__file__).parent / "results"
SHAPE = (64, 128, 128)
FORMATS: dict[str, QuantFormat] = {
    "fp8 128x128": FP8Blockwise((128, 128)),
    "mxfp8 32x32": MXFP8((32, 32)),
}


def _ns_per_element(fn: Callable[[], object], numel: int, calls: int = 30) -> float:
    """Median over 7 rounds of ``calls`` calls, in ns per element."""
    fn()
    fn()
    rounds = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds) / numel * 1e9


def _format_rows(name: str, fmt: QuantFormat, weight: torch.Tensor, full: torch.Tensor) -> list:
    q = quantize(weight, fmt)
    data, scale = quantize_fused(weight, fmt)

    def decode_into(d: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(dequantize_fused(d, s, fmt, torch.bfloat16))

    # static shapes: a second format recompiling the same code would turn dynamic (slow)
    encode = torch.compile(lambda x: quantize_fused(x, fmt), dynamic=False)
    decode = torch.compile(decode_into, dynamic=False)
    cases: list[tuple[str, Callable[[], object], int]] = [
        ("encode, compiled", lambda: encode(weight), 30),
        ("encode, eager", lambda: quantize(weight, fmt), 5),
        ("decode, compiled", lambda: decode(data, scale, full), 30),
        ("decode, eager", lambda: dequantize(q, torch.bfloat16), 5),
    ]
    return [
        {"what": f"{name} {what}", "ns": _ns_per_element(fn, weight.numel(), calls)}
        for what, fn, calls in cases
    ]


def measure() -> list[dict]:
    torch.manual_seed(0)
    weight = torch.randn(SHAPE)
    full = torch.empty(SHAPE, dtype=torch.bfloat16)
    source = weight.to(torch.bfloat16)
    codes = weight.to(torch.float8_e4m3fn)
    cast = torch.compile(lambda c, out: out.copy_(c.float()), dynamic=False)
    rows = [
        {
            "what": "bf16 copy-out (the bf16 row's decode)",
            "ns": _ns_per_element(lambda: full.copy_(source), weight.numel()),
        },
        {
            "what": "fp32 -> bf16 cast (the bf16 row's encode)",
            "ns": _ns_per_element(lambda: full.copy_(weight), weight.numel()),
        },
        {  # a decode's floor: inductor's vectorized (at::vec) fp8 conversion, no scale
            "what": "e4m3 -> fp32 -> bf16 cast alone, compiled (no scale)",
            "ns": _ns_per_element(lambda: cast(codes, full), weight.numel()),
        },
    ]
    for name, fmt in FORMATS.items():
        rows += _format_rows(name, fmt, weight, full)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure()
    copy = rows[0]["ns"]
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "shape": SHAPE,
    }
    lines = [
        "# Codec cost per element (one thread)",
        "",
        "Command: `.venv/bin/python -m benchmarks.bench_codec`  ",
        f"Date: {meta['date']}; torch {meta['torch']}; CPU capability {meta['isa']}; "
        f"a run of {SHAPE[0]} float32 tiles of {SHAPE[1]} x {SHAPE[2]}, bf16 out; median of "
        "7 rounds.",
        "",
        "| what | ns / element | / bf16 copy-out |",
        "|---|---|---|",
        *(f"| {r['what']} | {r['ns']:.3f} | {r['ns'] / copy:.1f} |" for r in rows),
    ]
    text = "\n".join(lines) + "\n"
    write_results(args.out, "codec_bench", meta, rows, text)
    print(text)


if __name__ == "__main__":
    main()
