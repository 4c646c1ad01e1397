"""Distributed Muon: the gather-everything baseline, DistMuon on Shard(0) storage
(redistribution), DistMuon on Owned storage (no communication) and AdamW, side by side
in one launch per world size, on the same matrices and gradients.

    .venv/bin/python -m benchmarks.bench_muon [--world-sizes 2 4] [--steps 5]

Writes benchmarks/results/muon_bench.{json,md}.
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

from .muon_rank import BUCKETS, SHAPES, VARIANTS, MatrixBank, rank_main

RESULTS = Path(__file__).parent / "results"
MB = 2**20


def summarise(per_rank: list[dict]) -> dict[str, dict]:
    rows = {}
    for variant in VARIANTS:
        medians: dict[str, list[float]] = {"ms": [], "cpu_ms": []}
        for key, values in medians.items():
            for repeat in range(2):
                runs = [r[variant][repeat][key] for r in per_rank]
                slowest = [max(run[i] for run in runs) for i in range(len(runs[0]))]
                values.append(statistics.median(slowest))
        first = [r[variant][0] for r in per_rank]
        rows[variant] = {
            "median_ms": min(medians["ms"]),
            "median_cpu_ms": min(medians["cpu_ms"]),
            "collectives_per_step": first[0]["collectives"],
            "MB_sent_per_step_all_ranks": sum(run["bytes_sent"] for run in first) / MB,
            "MB_sent_per_step_max_rank": max(run["bytes_sent"] for run in first) / MB,
            "digest": first[0]["digest"],
        }
    base = rows[VARIANTS[0]]
    for row in rows.values():
        row["time_vs_a"] = row["median_ms"] / base["median_ms"]
        row["cpu_vs_a"] = row["median_cpu_ms"] / base["median_cpu_ms"]
        row["bytes_vs_a"] = row["MB_sent_per_step_all_ranks"] / base["MB_sent_per_step_all_ranks"]
    return rows


def _checks(w: int, rows: dict[str, dict]) -> list[str]:
    a, b, c = (rows[v] for v in VARIANTS[:3])
    same = a["digest"] == b["digest"] == c["digest"]
    return [
        f"- W = {w}: (c) moves {c['MB_sent_per_step_all_ranks']:.3f} MB in the step "
        f"(target 0) and takes {c['time_vs_a']:.2f}x (a)'s step time "
        f"({c['cpu_vs_a']:.2f}x its CPU time)"
        + (" (target <= 0.30x at W = 4)" if w == 4 else "")
        + f"; (b) moves {b['bytes_vs_a']:.3f}x (a)'s bytes (target <= 2/W = {2 / w:.3f}); "
        f"(a), (b), (c) end with {'bit-identical' if same else 'DIFFERENT'} parameters.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    started = time.time()
    load_before = os.getloadavg()[0]
    results = {}
    for w in args.world_sizes:
        results[w] = summarise(run_distributed(rank_main, w, args.steps, timeout=600))
        results[w]["balance"] = {"ns_flops_per_rank": muon_balance(MatrixBank(), w).flops}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "muon_bench.json").write_text(json.dumps(results, indent=2))
    shapes = ", ".join(f"{n} x {s[0]}x{s[1]}" for s, n in _counts().items())
    lines = [
        "# Distributed Muon: optimizer step time and bytes",
        "",
        "Command: `.venv/bin/python -m benchmarks.bench_muon`  ",
        f"Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; "
        f"torch {torch.__version__}; CPU (2 cores), gloo, one thread per rank; "
        f"{time.time() - started:.0f} s; 1-min load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (other jobs share the machine: wall times vary)",
        f"Matrices: {shapes} fp32 ({sum(a * b for a, b in SHAPES) / 1e6:.2f} M elements); "
        f"Muon lr 0.02, 5 Newton–Schulz steps; {args.steps} timed steps after 2 warm-up, "
        "median over steps of the slowest rank, best of 2 interleaved repeats.",
        "",
        "| W | variant | median step ms | / (a) | CPU ms | / (a) | collectives/step "
        "| MB sent/step (all ranks) | max rank MB | bytes / (a) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, rows in results.items():
        for variant in VARIANTS:
            row = rows[variant]
            lines.append(
                f"| {w} | {variant} | {row['median_ms']:.1f} | {row['time_vs_a']:.2f} | "
                f"{row['median_cpu_ms']:.1f} | {row['cpu_vs_a']:.2f} | "
                f"{row['collectives_per_step']} | {row['MB_sent_per_step_all_ranks']:.3f} | "
                f"{row['MB_sent_per_step_max_rank']:.3f} | {row['bytes_vs_a']:.3f} |"
            )
    lines += ["", "Checks:"]
    for w, rows in results.items():
        lines += _checks(w, rows)
    lines += [
        "",
        f"- (a) and (b) store the matrices in {BUCKETS} Shard(0) buckets; (c) uses the",
        "  `muon_buckets` plan (one Owned bucket, owners pinned by LPT on Newton–Schulz",
        "  FLOPs: per rank " + "; ".join(
            f"W = {w}: " + ", ".join(f"{f / 1e9:.2f}" for f in rows["balance"]["ns_flops_per_rank"])
            for w, rows in results.items()
        ) + " GFLOP).",
        "- Bytes: what each rank puts on the wire, summed over ranks (a rank's piece for",
        "  itself excluded; an all-gather counted as the ring algorithm sends it). (a) and",
        "  (b) both send bf16 (Newton–Schulz casts to bf16 first, so no bit changes).",
        "- Step ms: wall time of `optimizer.step()` on the slowest rank; CPU ms: the CPU time",
        "  of the busiest rank's process in the step (gloo's threads included), which other",
        "  load on the machine does not inflate. With W ranks on 2 cores the ranks compete",
        "  for the CPU: (a) runs W copies of every Newton–Schulz, (c) one, spread over the",
        "  ranks; compare rows of one W.",
    ]
    (RESULTS / "muon_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _counts() -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for shape in SHAPES:
        counts[shape] = counts.get(shape, 0) + 1
    return counts


if __name__ == "__main__":
    main()
