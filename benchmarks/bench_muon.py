"""Distributed Muon: this project's gather-everything baseline (GatherMuon, a DistMuon
subclass that all-gathers every matrix as Moonlight's ZeRO-1 recipe does), DistMuon on
Shard(0) storage (redistribution), DistMuon on Owned storage (no communication in the
optimizer) and AdamW, side by side in one launch per world size, on the same matrices.

Two rows per variant: ``opt`` times ``optimizer.step()`` alone on gradients drawn alike
for every variant; ``whole`` times forward + backward + ``optimizer.step()``, so that
the all-gathers and reduce-scatters of each storage layout count too. Each variant
runs ``--reps`` times (5 by default), the order reversed on every other repetition;
ratios to (a) are per repetition, then the median with its spread (flexshard/testing/stats.py).

    .venv/bin/python -m benchmarks.bench_muon [--world-sizes 2 4] [--steps 5] [--reps 5]
    .venv/bin/python -m benchmarks.bench_muon --model deepseek_v3  # its matrices, scaled

Writes benchmarks/results/muon_bench.{json,md} (muon_bench_deepseek_v3.* for the second).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

from flexshard.optim import muon_balance
from flexshard.testing import run_distributed
from flexshard.testing.stats import RULE, cell, paired_ratios, range_cell, summary, verdict_cell

from .muon_rank import (
    BATCH,
    BUCKETS,
    DIM,
    MODELS,
    MODES,
    VARIANTS,
    MatrixBank,
    bank_shapes,
    rank_main,
)

RESULTS = Path(__file__).parent / "results"
MB = 2**20
OWNED_TARGET = 0.30  # (c)'s optimizer step <= 0.30x (a)'s at W = 4


def _per_rep(per_rank: list[dict], mode: str, variant: str, key: str) -> list[float]:
    """Per repetition: the median over steps of the slowest rank's time."""
    reps = len(per_rank[0][mode][variant])
    out = []
    for rep in range(reps):
        runs = [r[mode][variant][rep][key] for r in per_rank]
        out.append(statistics.median(max(run[i] for run in runs) for i in range(len(runs[0]))))
    return out


def summarise(per_rank: list[dict], world: int) -> dict[str, dict[str, dict]]:
    """``rows[mode][variant]``: medians over repetitions and paired ratios to (a)."""
    rows: dict[str, dict[str, dict]] = {}
    for mode in MODES:
        rows[mode] = {}
        for variant in VARIANTS:
            first = [r[mode][variant][0] for r in per_rank]
            ms, cpu = (_per_rep(per_rank, mode, variant, k) for k in ("ms", "cpu_ms"))
            rows[mode][variant] = {
                "median_ms": statistics.median(ms),
                "median_cpu_ms": statistics.median(cpu),
                "ms_per_rep": ms,
                "cpu_ms_per_rep": cpu,
                "collectives_per_step": first[0]["collectives"],
                "MB_sent_per_step_all_ranks": sum(run["bytes_sent"] for run in first) / MB,
                "MB_sent_per_step_max_rank": max(run["bytes_sent"] for run in first) / MB,
                "digest": first[0]["digest"],
            }
        base = rows[mode][VARIANTS[0]]
        for variant, row in rows[mode].items():
            target = OWNED_TARGET if (mode, variant[0], world) == ("opt", "c", 4) else None
            row["time_vs_a"] = summary(paired_ratios(row["ms_per_rep"], base["ms_per_rep"]), target)
            row["cpu_vs_a"] = summary(paired_ratios(row["cpu_ms_per_rep"], base["cpu_ms_per_rep"]))
            sent = base["MB_sent_per_step_all_ranks"]
            row["bytes_vs_a"] = row["MB_sent_per_step_all_ranks"] / sent if sent else None
    return rows


def _checks(w: int, rows: dict[str, dict[str, dict]]) -> list[str]:
    a, b, c = (rows["opt"][v] for v in VARIANTS[:3])
    wa, wb, wc = (rows["whole"][v] for v in VARIANTS[:3])
    same = a["digest"] == b["digest"] == c["digest"]
    return [
        f"- W = {w}, optimizer step: (c) moves {c['MB_sent_per_step_all_ranks']:.3f} MB "
        f"(target 0) and takes {cell(c['time_vs_a'])} x (a)'s time "
        f"({cell(c['cpu_vs_a'])} x its CPU time)"
        + (f", verdict {verdict_cell(c['time_vs_a'])}" if w == 4 else "")
        + f"; (b) moves {b['bytes_vs_a']:.3f}x (a)'s bytes (target <= 2/W = {2 / w:.3f}); "
        f"(a), (b), (c) end with {'bit-identical' if same else 'DIFFERENT'} parameters.",
        f"- W = {w}, whole step: (a) {wa['median_ms']:.1f} ms, (b) {cell(wb['time_vs_a'])} x, "
        f"(c) {cell(wc['time_vs_a'])} x (a); (c)'s layout moves "
        f"{wc['MB_sent_per_step_all_ranks']:.3f} MB a step against (b)'s "
        f"{wb['MB_sent_per_step_all_ranks']:.3f} MB.",
    ]


def _table(results: dict[int, dict]) -> list[str]:
    lines = [
        "| W | step | variant | median ms | / (a) [IQR] | min–max | verdict | CPU ms "
        "| CPU / (a) [IQR] | collectives/step | MB sent/step (all ranks) | max rank MB "
        "| bytes / (a) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, rows in results.items():
        for mode in MODES:
            for variant in VARIANTS:
                row = rows[mode][variant]
                ratio = row["bytes_vs_a"]
                lines.append(
                    f"| {w} | {mode} | {variant} | {row['median_ms']:.1f} | "
                    f"{cell(row['time_vs_a'])} | {range_cell(row['time_vs_a'])} | "
                    f"{verdict_cell(row['time_vs_a'])} | {row['median_cpu_ms']:.1f} | "
                    f"{cell(row['cpu_vs_a'])} | {row['collectives_per_step']} | "
                    f"{row['MB_sent_per_step_all_ranks']:.3f} | "
                    f"{row['MB_sent_per_step_max_rank']:.3f} | "
                    + (f"{ratio:.3f} |" if ratio is not None else "– |")
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--reps", type=int, default=5, help="runs per variant and step kind")
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="square",
        help="the matrices: 16 squares and rectangles, or DeepSeek-V3's (MLA, dense and "
        "MoE blocks) scaled to hidden size --dim",
    )
    parser.add_argument(
        "--dim",
        type=int,
        help=f"side of the square matrices ({DIM}), or DeepSeek-V3's hidden (224)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.dim is None:
        args.dim = 224 if args.model == "deepseek_v3" else DIM
    stem = "muon_bench" if args.model == "square" else f"muon_bench_{args.model}"
    started = time.time()
    load_before = os.getloadavg()[0]
    results: dict[int, dict] = {}
    balance = {}
    for w in args.world_sizes:
        per_rank = run_distributed(
            rank_main, w, args.steps, args.reps, args.dim, args.model, timeout=3000
        )
        results[w] = summarise(per_rank, w)
        balance[w] = muon_balance(MatrixBank(args.dim, args.model), w).flops
    args.out.mkdir(exist_ok=True)
    (args.out / f"{stem}.json").write_text(
        json.dumps({"rows": results, "ns_flops_per_rank": balance}, indent=2)
    )
    bank = bank_shapes(args.model, args.dim)
    listed = ", ".join(f"{n} x {s[0]}x{s[1]}" for s, n in _counts(bank).items())
    lines = [
        "# Distributed Muon: optimizer step and whole step, time and bytes",
        "",
        f"Command: `.venv/bin/python -m benchmarks.bench_muon --world-sizes "
        f"{' '.join(map(str, args.world_sizes))} --steps {args.steps} --reps {args.reps} "
        f"--model {args.model} --dim {args.dim}`  ",
        f"Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; "
        f"torch {torch.__version__}; CPU (2 cores), gloo, one thread per rank; "
        f"{time.time() - started:.0f} s; 1-min load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (other jobs share the machine: wall times vary)",
        f"Matrices: {listed} fp32 ({sum(a * b for a, b in bank) / 1e6:.2f} M elements); "
        f"Muon lr 0.02, 5 Newton–Schulz steps; {args.steps} timed steps after 2 warm-up "
        f"per run, median over steps of the slowest rank; {args.reps} runs per variant "
        "and step kind, the order reversed on every other repetition.",
        "",
        RULE,
        "",
        *_table(results),
        "",
        "Checks:",
    ]
    for w, rows in results.items():
        lines += _checks(w, rows)
    lines += [
        "",
        "- (a) is this project's own gather-everything baseline "
        "(`benchmarks/muon_gather.py`: a `DistMuon` subclass with the same update rule that",
        "  all-gathers every full matrix in bf16 and runs every Newton–Schulz on every rank,",
        "  as Moonlight's ZeRO-1 recipe does), not a third-party implementation.",
        f"- (a), (b) and (d) store the matrices in {BUCKETS} Shard(0) buckets; (c) uses the",
        "  `muon_buckets` plan (one Owned bucket, owners pinned by LPT on Newton–Schulz",
        "  FLOPs: per rank "
        + "; ".join(
            f"W = {w}: " + ", ".join(f"{f / 1e9:.2f}" for f in flops)
            for w, flops in balance.items()
        )
        + " GFLOP).",
        "- `opt`: `optimizer.step()` alone, on gradients drawn alike for every variant.",
        f"  `whole`: forward ({BATCH} input rows per rank through every matrix) + backward +",
        "  `optimizer.step()`: the all-gathers of the storage layout (an Owned bucket is",
        "  gathered whole, padding included) and the gradient reduce-scatter count here.",
        "- Bytes: what each rank puts on the wire (optimizer and parameter collectives),",
        "  summed over ranks (a rank's piece for itself excluded; an all-gather counted as",
        "  the ring algorithm sends it). (a) and (b) both send bf16 in the optimizer.",
        "- ms: wall time on the slowest rank; CPU ms: the CPU time of the busiest rank's",
        "  process (gloo's threads included), which other load on the machine inflates",
        "  less. With W ranks on 2 cores the ranks compete for the CPU: (a) runs W copies",
        "  of every Newton–Schulz, (c) one, spread over the ranks; compare rows of one W.",
    ]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _counts(bank: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for shape in bank:
        counts[shape] = counts.get(shape, 0) + 1
    return counts


if __name__ == "__main__":
    main()
