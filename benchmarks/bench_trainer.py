"""The LLM trainer with flexshard against the same trainer with dp_backend = "fsdp2":
tokens/s and peak memory per rank on CPU (gloo), W = 2 and 4, side by side.

    .venv/bin/python -m benchmarks.bench_trainer              # W = 2 and 4
    .venv/bin/python -m benchmarks.bench_trainer --quick      # W = 2, fewer steps
    .venv/bin/python -m benchmarks.bench_trainer --exact-rss  # peak RSS of live buffers only
    .venv/bin/python -m benchmarks.bench_trainer --exact-rss --malloc-arenas 1  # and one arena

Both backends run inside the same W processes, ``--reps`` times (5 by default), their
order flipped every repetition (flexshard, fsdp2, fsdp2, flexshard, ...), on the same
model, data, seed and config; only ``parallelism.dp_backend`` differs. Per repetition
flexshard's step time over FSDP2's, then the median over repetitions with its spread
and a verdict against the target (flexshard/testing/stats.py).
An untimed 2-step run of each backend comes first (the first run in a process makes
one-time allocations). Results: benchmarks/results/trainer_bench.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from flexshard.testing import run_distributed
from flexshard.testing.stats import (
    RULE,
    alternating,
    cell,
    paired_ratios,
    range_cell,
    summary,
    verdict_cell,
)
from flexshard.trainer.config import config_from_dict
from flexshard.trainer.models.model import count_params
from flexshard.trainer.train import run

from .common import (
    peak_rss_bytes,
    plot_backends,
    release_free_memory,
    reset_peak_rss,
    rss_bytes,
    write_results,
)

RESULTS = Path(__file__).parent / "results"
BACKENDS = ("flexshard", "fsdp2")
MB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=10, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--reps", type=int, default=5, help="runs per backend, order flipped each")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--quick", action="store_true", help="W = 2, 5 steps, 2 reps")
    p.add_argument(
        "--exact-rss",
        action="store_true",
        help="every buffer of 64 KiB or more its own mapping (MALLOC_MMAP_THRESHOLD_), "
        "returned to the OS when freed: peak RSS then follows the live buffers, not "
        "glibc's cache",
    )
    p.add_argument(
        "--malloc-arenas",
        type=int,
        default=None,
        help="glibc malloc arenas per rank (MALLOC_ARENA_MAX; default: glibc's, up to 8 per "
        "core): 1 keeps gloo's threads, which allocate while compute runs, from growing "
        "arenas of their own",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.world_sizes, args.steps, args.warmup, args.reps = [2], 5, 2, 2
    return args


def trainer_table(
    args: argparse.Namespace, model: dict[str, Any], parallelism: dict[str, Any], folder: str
) -> dict[str, Any]:
    """A trainer config for one benchmark run: ``args``' steps and batch, no progress
    bar, plot or TensorBoard."""
    return {
        "model": model,
        "parallelism": parallelism,
        "training": {
            "steps": args.steps,
            "seq_len": args.seq_len,
            "batch_size": args.batch,
            "warmup_steps": 2,
        },
        "job": {
            "dump_folder": folder,
            "progress": False,
            "plot": False,
            "tensorboard": False,
            "peak_tflops": 1.0,  # a fixed reference, so MFU columns compare across runs
        },
    }


def model_table(args: argparse.Namespace) -> dict[str, Any]:
    heads = max(1, args.dim // 32)
    return {
        "dim": args.dim,
        "n_layers": args.layers,
        "n_heads": heads,
        "n_kv_heads": max(1, heads // 2),
    }


def timed_row(records: list[dict], peak_rss_mb: float, warmup: int) -> dict[str, Any]:
    """One run's figures: median tokens/s and step time over the steps after ``warmup``,
    its peak RSS and every step's loss."""
    timed = records[warmup:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_ms": 1000 * statistics.median(r["step_time_s"] for r in timed),
        "peak_rss_mb": peak_rss_mb,
        "losses": [r["loss"] for r in records],
    }


def measured_run(args: argparse.Namespace, table: dict[str, Any]) -> tuple[list[dict], float]:
    """Train with ``table``: every step's metrics and this rank's peak RSS (MB) above
    the RSS before the model was built."""
    release_free_memory()
    base = rss_bytes()
    reset_peak_rss()
    records = run(config_from_dict(table))
    return records, (peak_rss_bytes() - base) / MB


def _rank(rank: int, world_size: int, args: argparse.Namespace, folder: str) -> list[dict]:
    """Both backends, ``reps`` times, their order flipped every repetition; per run this
    rank's median tokens/s and its peak RSS above the RSS before the model was built."""
    # one untimed 2-step run of each backend first: the first run in a process makes
    # one-time allocations (~26 MB here) that would count against whichever runs first
    warm = argparse.Namespace(**{**vars(args), "steps": 2})
    for backend in BACKENDS:
        run(
            config_from_dict(
                trainer_table(
                    warm, model_table(args), {"dp_backend": backend}, f"{folder}/warm-{backend}"
                )
            )
        )
    out = []
    for rep in range(args.reps):
        for backend in alternating(BACKENDS, rep):
            parallelism = {"dp_backend": backend}
            table = trainer_table(args, model_table(args), parallelism, f"{folder}/{backend}{rep}")
            records, peak_rss_mb = measured_run(args, table)
            records = records[args.warmup :]
            out.append(
                {
                    "backend": backend,
                    "rep": rep,
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
                    "step_ms": 1000 * statistics.median(r["step_time_s"] for r in records),
                    "peak_rss_mb": peak_rss_mb,
                    "loss_last": records[-1]["loss"],
                    "comm_mb_per_step": (records[-1]["comm_bytes"] or {}).get("total", 0) / MB,
                }
            )
    return out


def per_rep(runs: list[list[dict]]) -> dict[str, list[float]]:
    """``runs[rank][rep]`` -> per repetition the slowest rank's tokens/s and step ms
    (the step ends when the last rank's does) and the largest peak RSS over ranks."""
    reps = range(len(runs[0]))
    return {
        "tokens_per_s": [min(rank[i]["tokens_per_s"] for rank in runs) for i in reps],
        "step_ms": [max(rank[i]["step_ms"] for rank in runs) for i in reps],
        "peak_rss_mb": [max(rank[i]["peak_rss_mb"] for rank in runs) for i in reps],
    }


def compare(
    flex: dict[str, list[float]], fsdp2: dict[str, list[float]], step_target: float | None
) -> dict[str, dict]:
    """flexshard against FSDP2, repetition by repetition: the step-time ratio (FSDP2's
    tokens/s over flexshard's) and the peak-RSS ratio, each with spread and verdict."""
    step = paired_ratios(fsdp2["tokens_per_s"], flex["tokens_per_s"])
    rss = paired_ratios(flex["peak_rss_mb"], fsdp2["peak_rss_mb"])
    return {"step_vs_fsdp2": summary(step, step_target), "rss_vs_fsdp2": summary(rss, 1.0)}


STEP_TARGET = 0.95  # flexshard's step <= 0.95x FSDP2's


def summarise(world_size: int, per_rank: list[list[dict]]) -> list[dict]:
    """Per backend the medians over repetitions; on flexshard's row its ratios to FSDP2."""
    rows, reps = [], {}
    for backend in BACKENDS:
        runs = [
            sorted((r for r in rank_runs if r["backend"] == backend), key=lambda r: r["rep"])
            for rank_runs in per_rank
        ]
        reps[backend] = per_rep(runs)
        tps = statistics.median(reps[backend]["tokens_per_s"])
        rows.append(
            {
                "world_size": world_size,
                "backend": backend,
                "tokens_per_s": tps,
                "tokens_per_s_per_rank": tps / world_size,
                "step_ms": statistics.median(reps[backend]["step_ms"]),
                "peak_rss_mb_per_rank": statistics.median(reps[backend]["peak_rss_mb"]),
                "comm_mb_per_step": runs[0][0]["comm_mb_per_step"],
                "loss_last": runs[0][0]["loss_last"],
                "per_rep": reps[backend],
            }
        )
    rows[0].update(compare(reps["flexshard"], reps["fsdp2"], STEP_TARGET))
    return rows


def markdown(rows: list[dict], meta: dict[str, Any]) -> str:
    lines = [
        "# Trainer benchmark: flexshard vs torch FSDP2 (CPU, gloo)",
        "",
        f"`{meta['command']}` on {meta['machine']}, torch {meta['torch']}, {meta['date']}, "
        f"{meta['runtime_s']:.0f} s, load average {meta['load_start']} at start, "
        f"{meta['load_end']} at end (other jobs share the machine).",
        f"Model: {meta['model']}; {meta['batch']} sequences x {meta['seq_len']} tokens per rank"
        f" per step; AdamW, fp32; {meta['steps']} steps per run, the first {meta['warmup']} "
        f"left out; {meta['reps']} runs per backend, their order flipped every repetition.",
        "",
        RULE,
        "",
        "| W | backend | tokens/s | tokens/s per rank | step ms | step / FSDP2 [IQR] | min–max"
        " | step verdict | peak RSS MB per rank | RSS / FSDP2 [IQR] | RSS verdict"
        " | comm MB/step (rank 0) | loss at last step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flex = r["backend"] == "flexshard"
        step, rss = r.get("step_vs_fsdp2"), r.get("rss_vs_fsdp2")
        ratios = [cell(step), range_cell(step), verdict_cell(step)] if step else ["1.00", "–", "–"]
        mem = [cell(rss, 3), verdict_cell(rss)] if rss else ["1.000", "–"]
        cells = [
            r["world_size"],
            r["backend"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s_per_rank']:,.0f}",
            f"{r['step_ms']:.1f}",
            *ratios,
            f"{r['peak_rss_mb_per_rank']:.1f}",
            *mem,
            f"{r['comm_mb_per_step']:.2f}" if flex else "–",
            f"{r['loss_last']:.4f}",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        "- tokens/s: global batch tokens / wall time of one optimizer step (forward, "
        "backward, clipping, AdamW, loss all-reduce), median over the timed steps, the "
        "slowest rank's, then the median over repetitions; per rank = / W. step ms: the "
        "same, as a time.",
        "- step / FSDP2: per repetition FSDP2's tokens/s over flexshard's (= flexshard's "
        "step time over FSDP2's); target <= 0.95.",
        "- peak RSS per rank: VmHWM (reset through /proc/self/clear_refs before the run) "
        "minus the RSS before the model was built; max over ranks, median over "
        "repetitions; RSS / FSDP2 paired per repetition, target <= 1.00. It includes "
        "glibc's cached free memory and gloo buffers.",
        "- The machine is shared and noisy: compare rows of one W, not runs.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    sizes = sorted({r["world_size"] for r in rows})
    groups = {f"W = {w}": [r for r in rows if r["world_size"] == w] for w in sizes}
    title = "flexshard-train vs dp_backend = fsdp2 (CPU, gloo)"
    plot_backends(groups, BACKENDS, path, title, figsize=(9, 3.6), capsize=4)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.exact_rss:  # glibc reads it at start: the spawned ranks inherit it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    if args.malloc_arenas is not None:
        os.environ["MALLOC_ARENA_MAX"] = str(args.malloc_arenas)
    args.out.mkdir(parents=True, exist_ok=True)
    started, load_start = time.perf_counter(), os.getloadavg()
    rows = []
    for world_size in args.world_sizes:
        folder = f"/tmp/flexshard_bench_trainer/w{world_size}"
        per_rank = run_distributed(_rank, world_size, args, folder, timeout=1200)
        rows += summarise(world_size, per_rank)
        flex, fsdp2 = rows[-2:]
        print(
            f"W={world_size}: flexshard {flex['tokens_per_s']:,.0f} tok/s, fsdp2 "
            f"{fsdp2['tokens_per_s']:,.0f} tok/s; step / FSDP2 {cell(flex['step_vs_fsdp2'])} "
            f"{flex['step_vs_fsdp2']['verdict']}; RSS / FSDP2 {cell(flex['rss_vs_fsdp2'])}",
            flush=True,
        )
    model_cfg = config_from_dict({"model": model_table(args)}).model
    total, _ = count_params(model_cfg)
    load = ", ".join
    meta = {
        "command": "python -m benchmarks.bench_trainer"
        + (" --quick" if args.quick else "")
        + (" --exact-rss" if args.exact_rss else "")
        + (f" --malloc-arenas {args.malloc_arenas}" if args.malloc_arenas is not None else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "runtime_s": time.perf_counter() - started,
        "load_start": load(f"{x:.1f}" for x in load_start),
        "load_end": load(f"{x:.1f}" for x in os.getloadavg()),
        "model": f"dim {model_cfg.dim}, {model_cfg.n_layers} layers, {model_cfg.n_heads} heads "
        f"({model_cfg.n_kv_heads} kv), {total:,} parameters, byte vocabulary",
        "batch": args.batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "reps": args.reps,
    }
    stem = "trainer_bench_quick" if args.quick else "trainer_bench"  # keep the real results
    text = markdown(rows, meta)
    write_results(args.out, stem, meta, rows, text)
    plot(rows, args.out / f"{stem}.png")
    print(text)
    print(f"wrote {args.out}/{stem}.{{json,md,png}}")


if __name__ == "__main__":
    main()
