"""Block-quantized all-gather: fp32, bf16, FP8 128x128 and MXFP8 32x32 flexshard buckets
side by side with torch FSDP2 in bf16, same model and data, in one launch.

    .venv/bin/python -m benchmarks.bench_quant [--world-sizes 2 3 4] [--steps 4] [--reps 5]
        [--configs "flex bf16" "flex mxfp8 32x32"]

Compute is bf16: on a CPU without AVX-512 BF16 / AMX torch's bf16 GEMM is an order of
magnitude slower than fp32, and this benchmark takes ~15 minutes instead of ~2.

The quantized rows compile their codec (``flexshard.quant.compiled``, "auto"); the
``... eager`` configurations (not run by default) force the eager codec for comparison.

Every configuration runs ``--reps`` times (5 by default), the order reversed on every
other repetition; the time ratios to FSDP2 bf16 and to flex bf16 (the quantized rows'
target: <= 1.00) are per repetition, then the median with its spread (flexshard/testing/stats.py).
``--configs`` runs a subset (flex bf16 is always added: every ratio needs it).

Writes benchmarks/results/quant_bench.{json,md} (or into ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flexshard as fs
from flexshard.quant import MXFP8, FP8Blockwise
from flexshard.quant.compiled import set_compile_mode
from flexshard.quant.compiled import stats as compile_stats
from flexshard.runtime.gather import PlainGather
from flexshard.runtime.module import own_buckets
from flexshard.runtime.quantized import QuantizedGather
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed
from flexshard.testing.live_memory import MB, LiveTensors
from flexshard.testing.stats import (
    RULE,
    alternating,
    cell,
    centred,
    paired_ratios,
    range_cell,
    summary,
    verdict_cell,
)

from .common import CollectiveCounter, held_tensors

RESULTS = Path(__file__).parent / "results"
CFG = TransformerConfig(vocab=1024, dim=256, heads=8, hidden=1024, layers=4, seq=64)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
MATRICES = ("qkv", "proj", "up", "down")
CONFIGS: dict[str, Any] = {
    "fsdp2 bf16": "fsdp2",
    "flex fp32": (None, None),
    "flex bf16": (None, BF16),
    "flex fp8 128x128": (FP8Blockwise((128, 128)), BF16),
    "flex mxfp8 32x32": (MXFP8((32, 32)), BF16),
    # the same with the codec forced eager (FLEXSHARD_QUANT_COMPILE=off): what compiling buys
    "flex fp8 128x128 eager": (FP8Blockwise((128, 128)), BF16),
    "flex mxfp8 32x32 eager": (MXFP8((32, 32)), BF16),
}
#: run when --configs is not given (the eager rows only on request)
DEFAULT_CONFIGS = tuple(name for name in CONFIGS if not name.endswith(" eager"))


def _fsdp2(model: TinyTransformer, mesh: DeviceMesh) -> nn.Module:
    for layer in model.layers:
        torch_fully_shard(layer, mesh=mesh, mp_policy=BF16)
    torch_fully_shard(model, mesh=mesh, mp_policy=BF16)
    return model


def _flex(model: TinyTransformer, mesh: DeviceMesh, quant: Any, policy: Any) -> nn.Module:
    """Per block: its matrices in 128 x 128 tiles (quantized or not), the rest apart."""
    tiles = fs.BlockShard((128, 128))
    buckets = []
    for i in range(CFG.layers):
        mats = [f"layers.{i}.{m}.weight" for m in MATRICES]
        buckets.append(fs.BucketSpec(mats, placement=tiles, name=f"mat{i}", quant=quant))
        rest = [f"layers.{i}.{m}.*" for m in ("attn_norm", "mlp_norm")]
        rest += [f"layers.{i}.{m}.bias" for m in ("up", "down", "proj")]
        buckets.append(fs.BucketSpec(rest, name=f"rest{i}"))
    buckets.append(
        fs.BucketSpec(["embed.weight", "head.weight"], placement=tiles, name="emb", quant=quant)
    )
    buckets.append(fs.BucketSpec("norm.*", name="norm"))
    return fs.flex_shard(model, mesh=mesh, buckets=buckets, mp_policy=policy)


class CodecClock:
    """Main-thread CPU time in the gather's per-bucket work: the quantized buckets' encode
    and decode, the plain buckets' cast (payload) and copy-out, wrapped while installed."""

    METHODS = (
        (QuantizedGather, "encode"),
        (QuantizedGather, "decode"),
        (PlainGather, "payload"),
        (PlainGather, "copy_out"),
    )

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(("encode", "decode", "payload", "copy_out"), 0.0)
        self._saved: list[tuple[type, str, Any]] = []

    def install(self) -> None:
        for cls, name in self.METHODS:
            original = cls.__dict__[name]
            self._saved.append((cls, name, original))
            setattr(cls, name, self._timed(original, name))

    def uninstall(self) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()

    def _timed(self, fn: Any, name: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - start

        return timed

    def take(self) -> dict[str, float]:
        """Milliseconds per method since the last take."""
        out = {k: v * 1e3 for k, v in self.seconds.items()}
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return out


def _run(name: str, rank: int, world_size: int, mesh: DeviceMesh, steps: int) -> dict:
    # the quantized rows compile their codec ("auto": from its second call, in the warm-up
    # steps; compiled functions are cached per bucket shape across runs of this process)
    set_compile_mode("off" if name.endswith(" eager") else None)
    torch.manual_seed(0)
    model = TinyTransformer(CFG)
    spec = CONFIGS[name]
    model = _fsdp2(model, mesh) if spec == "fsdp2" else _flex(model, mesh, *spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches(CFG, (steps + 2) * world_size, batch=4, seed=1)
    counter = CollectiveCounter()
    counter.install()
    clock = CodecClock()
    clock.install()
    times, cpu_times, gathered, codec = [], [], [], []
    flex = spec != "fsdp2"
    try:
        for step in range(steps + 2):  # two warm-up steps
            dist.barrier()
            counter.take()
            clock.take()
            if flex:
                model.comm_stats(reset=True)
            start, cpu_start = time.perf_counter(), time.process_time()
            tokens, targets = batches[step * world_size + rank]
            model.loss(tokens, targets).backward()
            opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - start
            cpu = time.process_time() - cpu_start  # all of this rank's threads
            records = counter.take()
            spent = clock.take()
            if step >= 2:
                times.append(elapsed)
                cpu_times.append(cpu)
                gathered.append(sum(r.sent for r in records if r.kind == "all_gather"))
                codec.append(spent)
    finally:
        clock.uninstall()
        counter.uninstall()
    peak = _live_peak(model, opt, batches[rank])
    # over the tiled (quantizable) buckets: bytes per parameter element one rank receives
    per_element = None
    if flex:
        stats = model.comm_stats()
        tiled = [b for b in own_buckets(model) if b.name.startswith(("mat", "emb"))]
        received = sum(stats[b.name]["all_gather_bytes"] for b in tiled)
        elements = sum(
            stats[b.name]["all_gather"] * b.layout.numel * (world_size - 1) / world_size
            for b in tiled
        )
        per_element = received / elements
    return {
        "ms": [t * 1e3 for t in times],
        "cpu_ms": [t * 1e3 for t in cpu_times],
        "codec_ms": {k: statistics.median(c[k] for c in codec) for k in codec[0]},
        "all_gather_bytes": gathered[-1],
        "per_element": per_element,
        "live_peak_MB": peak,
    }


def _live_peak(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> float:
    """MB of live tensors at the peak of one more (untimed) step, the model's, optimizer's
    and the step's (not what the process held before). The codec runs eagerly here, as
    on CUDA: a compiled function does not run under the counting dispatch mode."""
    set_compile_mode("off")
    tokens, targets = batch
    with LiveTensors() as live:
        live.phase = "step"  # unnamed storages made in the step: activations, temporaries
        model.loss(tokens, targets).backward()
        opt.step()
        for what, tensors in held_tensors(model, opt).items():
            live.name(tensors, what)
    opt.zero_grad()
    return (live.peak_bytes - live.breakdown().get("before", 0)) / MB


def _rank(rank: int, world_size: int, steps: int, reps: int, names: tuple[str, ...]) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, list] = {name: [] for name in names}
    centre = "fsdp2 bf16" if "fsdp2 bf16" in names else "flex bf16"
    for rep in range(reps):  # the order reversed on every other repetition
        for name in alternating(centred(names, centre), rep):
            out[name].append(_run(name, rank, world_size, mesh, steps))
    set_compile_mode(None)
    out["_compiled"] = compile_stats()  # each compiled codec function, its first-call time
    return out


def _summarise(per_rank: list[dict], names: tuple[str, ...]) -> dict[str, dict]:
    rows = {}
    for name in names:
        medians, cpu_medians = [], []
        for repeat in range(len(per_rank[0][name])):
            steps = range(len(per_rank[0][name][repeat]["ms"]))
            slowest = [max(r[name][repeat]["ms"][i] for r in per_rank) for i in steps]
            medians.append(statistics.median(slowest))
            # CPU time of all ranks together: less at the mercy of a loaded host's scheduler
            total = [sum(r[name][repeat]["cpu_ms"][i] for r in per_rank) for i in steps]
            cpu_medians.append(statistics.median(total))
        run = per_rank[0][name][0]
        # per rank, per timed step: medians over steps, then over repetitions and ranks
        codec = {
            k: statistics.median(
                r[name][rep]["codec_ms"][k]
                for r in per_rank
                for rep in range(len(per_rank[0][name]))
            )
            for k in run["codec_ms"]
        }
        rows[name] = {
            "codec_ms": codec,
            "median_ms": statistics.median(medians),
            "ms_per_rep": medians,
            "cpu_ms": statistics.median(cpu_medians),
            "cpu_ms_per_rep": cpu_medians,
            "all_gather_MB": run["all_gather_bytes"] / 2**20,
            "bytes_per_element": run["per_element"],
            "live_peak_MB": max(r[name][0]["live_peak_MB"] for r in per_rank),
        }
    bf16 = rows["flex bf16"]
    fsdp2 = rows.get("fsdp2 bf16")
    for name, row in rows.items():
        row["bytes_vs_bf16"] = row["all_gather_MB"] / bf16["all_gather_MB"]
        row["peak_vs_bf16"] = row["live_peak_MB"] / bf16["live_peak_MB"]
        if fsdp2 is not None:
            row["time_vs_fsdp2"] = summary(paired_ratios(row["ms_per_rep"], fsdp2["ms_per_rep"]))
        target = 1.0 if "fp8" in name else None  # the quantized rows: no slower than bf16
        row["time_vs_bf16"] = summary(paired_ratios(row["ms_per_rep"], bf16["ms_per_rep"]), target)
        row["cpu_vs_bf16"] = summary(
            paired_ratios(row["cpu_ms_per_rep"], bf16["cpu_ms_per_rep"]), target
        )
    return rows


def _work_cell(ms: dict[str, float]) -> str:
    parts = [ms[k] for k in ("encode", "decode", "payload", "copy_out")]
    return f"{sum(parts):.1f} (" + " + ".join(f"{p:.1f}" for p in parts) + ")"


def _load() -> str:
    return " / ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--reps", type=int, default=5, help="runs per configuration")
    parser.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=DEFAULT_CONFIGS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    names = tuple(n for n in CONFIGS if n in args.configs or n == "flex bf16")
    started, load_start = time.time(), _load()
    results, compiled = {}, {}
    for w in args.world_sizes:
        per_rank = run_distributed(_rank, w, args.steps, args.reps, names, timeout=3600)
        compiled[w] = [r.pop("_compiled") for r in per_rank]
        results[w] = _summarise(per_rank, names)
    load_end = _load()
    args.out.mkdir(exist_ok=True)
    (args.out / "quant_bench.json").write_text(
        json.dumps({**results, "compiled_codec": compiled}, indent=2)
    )
    notes = [
        "",
        "- B/elem: all-gather bytes per parameter element received in the tiled buckets (block",
        "  matrices, embedding, head), padding and scales included; norms and biases travel in",
        "  buckets of their own (bf16 or fp32). At W = 3 the embedding/head bucket's 32 tiles",
        "  do not divide W: the padding that costs shows in that row.",
        "- On CPU (no fp8 hardware) the quantized rows pay quantize/dequantize time that FP8",
        "  GEMMs on a GPU would not. Their codec is compiled (FLEXSHARD_QUANT_COMPILE=auto:",
        "  from its second call, so in the warm-up steps; flexshard/quant/compiled.py); the",
        '  "eager" rows force the eager codec (flexshard/quant/kernels.py) for comparison.',
        "- gather work: rank CPU ms per step (median over steps, repetitions and ranks) in",
        "  the quantized buckets' encode + decode and the plain buckets' cast + copy-out",
        "  (norms and biases in every row; in the bf16 row all of it).",
    ]
    for w, per_rank in compiled.items():
        firsts = [sum(e["compile_s"] for e in r["entries"]) for r in per_rank]
        count = max(len(r["entries"]) for r in per_rank)
        if count:
            notes.append(
                f"- W = {w}: {count} compiled codec functions per rank, first calls (compile"
                f" and bit check) {max(firsts):.1f} s per rank, spent in the first warm-up"
                " steps; inductor's on-disk cache makes later processes faster."
            )
    configs = " ".join(f'"{n}"' for n in names) if names != DEFAULT_CONFIGS else ""
    lines = [
        "# Quantized all-gather: bytes and step time",
        "",
        f"Command: `.venv/bin/python -m benchmarks.bench_quant --world-sizes "
        f"{' '.join(map(str, args.world_sizes))} --steps {args.steps} --reps {args.reps}"
        + (f" --configs {configs}`  " if configs else "`  "),
        f"Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; "
        f"torch {torch.__version__}; CPU, gloo; {time.time() - started:.0f} s; load average "
        f"(1/5/15 min) {load_start} at the start, {load_end} at the end",
        f"Model: TinyTransformer {CFG}, batch 4, AdamW; block matrices, embedding and head in "
        f"128 x 128 BlockShard tiles; compute in bf16 (fp32 row: fp32); {args.steps} timed "
        f"steps after 2 warm-up per run, median over steps of the slowest rank; {args.reps} "
        "runs per configuration, the order reversed on every other repetition.",
        "",
        RULE,
        "",
        "| W | config | median ms | / FSDP2 bf16 [IQR] | min–max | / flex bf16 [IQR] | min–max "
        "| ≤ flex bf16 | CPU s/step | CPU / flex bf16 [IQR] | ≤ flex bf16 (CPU) "
        "| gather work ms (enc + dec + cast + copy) | all-gather MB/step | / bf16 bytes "
        "| B/elem | live peak MB | / bf16 peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, rows in results.items():
        for name, row in rows.items():
            per_element = row["bytes_per_element"]
            fsdp2 = row.get("time_vs_fsdp2")
            bf16 = row["time_vs_bf16"]
            lines.append(
                f"| {w} | {name} | {row['median_ms']:.1f} | "
                + (f"{cell(fsdp2)} | {range_cell(fsdp2)} | " if fsdp2 else "– | – | ")
                + f"{cell(bf16)} | {range_cell(bf16)} | {verdict_cell(bf16)} | "
                f"{row['cpu_ms'] / 1e3:.2f} | {cell(row['cpu_vs_bf16'])} | "
                f"{verdict_cell(row['cpu_vs_bf16'])} | {_work_cell(row['codec_ms'])} | "
                f"{row['all_gather_MB']:.3f} | {row['bytes_vs_bf16']:.3f} | "
                + (f"{per_element:.4f} |" if per_element else "– |")
                + f" {row['live_peak_MB']:.2f} | {row['peak_vs_bf16']:.3f} |"
            )
    notes += [
        "- CPU s/step: process CPU time of all ranks together (every thread), median over",
        "  steps; on a loaded host it is steadier than the wall clock, though spinning",
        "  threads and cache contention still count.",
        "- live peak: MB of live tensors at the peak of one more (untimed) step, the largest",
        "  over ranks (flexshard/testing/live_memory.py): sharded parameters, optimizer state,",
        "  gathered buffers, activations, gradients. That step runs the codec eagerly, as on",
        "  CUDA (float32 values of at most 2^22 elements at a time); the compiled CPU codec has",
        "  no such temporaries.",
    ]
    lines += notes
    (args.out / "quant_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
