"""torch FSDP2 vs flexshard (fully_shard and flex_shard with every placement), side by
side on one model, one data stream and one world size per process group.

    .venv/bin/python -m benchmarks.bench_dp                # W = 2 and 4
    .venv/bin/python -m benchmarks.bench_dp --quick        # W = 2, fewer steps

Every configuration runs ``--reps`` times (5 by default), the order of the
configurations (FSDP2 in the middle) reversed on every other repetition; each row's
ratio to FSDP2 is the median over repetitions of that repetition's ratio, with its
spread and a verdict against the targets (flexshard/testing/stats.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flexshard.testing import TransformerConfig, run_distributed
from flexshard.testing.stats import paired_ratios, summary

from .common import write_results
from .dp_rank import BenchOptions, config_names, run_rank
from .report import markdown

RESULTS = Path(__file__).parent / "results"
MB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument(
        "--quick", action="store_true", help="smoke run: W=2, 1 warm-up, 2 timed steps, 2 reps"
    )
    p.add_argument("--steps", type=int, default=6, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--reps", type=int, default=5, help="repetitions, order reversed every other one"
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--block", type=int, nargs=2, default=[64, 64], help="BlockShard tile (R, C)")
    p.add_argument("--configs", nargs="+", default=None, help="subset of configurations")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--timeout", type=float, default=600, help="seconds per world size")
    args = p.parse_args(argv)
    if args.quick:
        args.world_sizes, args.warmup, args.steps, args.reps = [2], 1, 2, 2
    return args


def options(args: argparse.Namespace) -> BenchOptions:
    cfg = TransformerConfig(
        vocab=1024, dim=args.dim, heads=8, hidden=4 * args.dim, layers=args.layers, seq=64
    )
    block = (args.block[0], args.block[1])
    names = config_names(block)
    configs = tuple(args.configs or names)
    unknown = sorted(set(configs) - set(names))
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {list(names)}")
    for config, reference in REFERENCES.items():  # a row's own FSDP2 layout runs too
        if config in configs and reference not in configs:
            configs = (*configs, reference)
    if "fsdp2" not in configs:
        configs = ("fsdp2", *configs)  # every ratio is against FSDP2
    return BenchOptions(cfg, args.batch, args.warmup, args.steps, args.reps, configs, block)


# ---------------------------------------------------------------- aggregation
STEP_TARGET = 0.95  # flexshard's step <= 0.95x FSDP2's
MEMORY_TARGET = 1.00  # and its peak memory <= FSDP2's
#: rows compared with FSDP2 in their own grouping rather than one group per block: one
#: Owned bucket over all blocks gathers them all at once by design, as FSDP2 does when
#: ``fully_shard`` is given the list of blocks (one group, one all-gather)
REFERENCES = {"flex/owned_all_layers": "fsdp2/all_layers"}


def _slowest_rank(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """Per step and phase, the slowest rank (the step ends when the last rank does)."""
    return [[max(ph) for ph in zip(*steps)] for steps in zip(*per_rank)]


def _median_ms(steps: list[list[float]], phase: int | None = None) -> float:
    values = [sum(s) if phase is None else s[phase] for s in steps]
    return 1e3 * statistics.median(values)


def summarize(name: str, reps_by_rank: list[list[dict[str, Any]]], world: int) -> dict[str, Any]:
    """One configuration at one world size: per repetition the median step (slowest
    rank) and the peak RSS (max over ranks); their medians; phases over all steps."""
    reps = list(zip(*reps_by_rank))  # per rep, per rank
    steps_per_rep = [_slowest_rank([r["phases_s"] for r in ranks]) for ranks in reps]
    medians = [_median_ms(steps) for steps in steps_per_rep]
    steps = [s for rep in steps_per_rep for s in rep]
    peaks = [max(r["memory"]["peak_mb"] for r in ranks) for ranks in reps]
    first = reps[0][0]
    comms = [r["comm"] for ranks in reps for r in ranks]
    worst_comm = max(comms, key=lambda c: c["bytes_sent"])
    memory = [r["memory"] for ranks in reps for r in ranks]
    model_bytes = sum(b["numel"] for b in first["buckets"]) * 4
    return {
        "world_size": world,
        "config": name,
        "median_ms": statistics.median(medians),
        "median_ms_per_rep": medians,
        "forward_ms": _median_ms(steps, 0),
        "backward_ms": _median_ms(steps, 1),
        "optimizer_ms": _median_ms(steps, 2),
        "step_ms_slowest_rank": [[1e3 * sum(s) for s in rep] for rep in steps_per_rep],
        "peak_rss_mb": statistics.median(peaks),
        "peak_rss_mb_per_rep": peaks,
        "sampled_rss_mb": _peak_over_ranks(reps_by_rank, "sampled_peak_mb"),
        "live_tensor_mb": _peak_over_ranks(reps_by_rank, "live_tensor_mb"),
        "peak_source": memory[0]["peak_source"],
        **_live_peak(reps_by_rank),
        "local_param_mb": [r["local_param_mb"] for r in reps[0]],
        "comm": worst_comm,
        "comm_constant": all(r["comm_constant"] for ranks in reps for r in ranks),
        "comm_stats_agree": first["comm_stats_agree"],
        "bytes_vs_min": worst_comm["bytes_sent"] / worst_comm["min_bytes"],
        "bytes_vs_model": worst_comm["bytes_sent"] / ((world - 1) / world * model_bytes),
        "buckets": first["buckets"],
        "max_padding": max(b["padding"] for b in first["buckets"]),
        "final_loss_rank0": first["losses"][-1],
    }


def _peak_over_ranks(reps_by_rank: list[list[dict[str, Any]]], key: str) -> float:
    """Per rank the min over repetitions (least allocator noise), then the max over ranks."""
    return max(min(rep["memory"][key] for rep in reps) for reps in reps_by_rank)


def _live_peak(reps_by_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The live-tensor step of the rank with the highest peak (min over repetitions:
    the count is deterministic, so the repetitions agree to allocator-free bytes)."""
    per_rank = [
        min((rep["live"] for rep in reps), key=lambda x: x["peak_mb"]) for reps in reps_by_rank
    ]
    worst = max(per_rank, key=lambda x: x["peak_mb"])
    return {
        "peak_live_mb": worst["peak_mb"],
        "peak_live_phase": worst["phase"],
        "at_peak_mb": worst["at_peak_mb"],
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per row, against FSDP2's run of the same repetition (in the row's grouping,
    ``REFERENCES``): the step-time and peak-RSS ratios, their spread over repetitions
    and the verdict against the targets; the peak-live-tensor ratio."""
    by_name = {r["config"]: r for r in rows}
    for row in rows:
        base = by_name.get(REFERENCES.get(row["config"], "fsdp2"), by_name["fsdp2"])
        row["reference"] = base["config"]
        own = row["config"].startswith("fsdp2")  # FSDP2 rows: no verdict
        step = paired_ratios(row["median_ms_per_rep"], base["median_ms_per_rep"])
        rss = paired_ratios(row["peak_rss_mb_per_rep"], base["peak_rss_mb_per_rep"])
        row["step_vs_fsdp2"] = summary(step, None if own else STEP_TARGET)
        row["rss_vs_fsdp2"] = summary(rss, None if own else MEMORY_TARGET)
        row["ratio_vs_fsdp2"] = row["step_vs_fsdp2"]["median"]
        row["live_vs_fsdp2"] = row["peak_live_mb"] / base["peak_live_mb"]
        if base is not by_name["fsdp2"]:  # the same three against per-block FSDP2 too
            block = by_name["fsdp2"]
            row["vs_per_block_fsdp2"] = {
                "step": summary(
                    paired_ratios(row["median_ms_per_rep"], block["median_ms_per_rep"])
                )["median"],
                "rss": summary(
                    paired_ratios(row["peak_rss_mb_per_rep"], block["peak_rss_mb_per_rep"])
                )["median"],
                "live": row["peak_live_mb"] / block["peak_live_mb"],
            }


def run_world(opts: BenchOptions, world: int, timeout: float) -> list[dict[str, Any]]:
    per_rank = run_distributed(run_rank, world, opts, timeout=timeout)
    rows = [summarize(name, [r[name] for r in per_rank], world) for name in opts.configs]
    add_ratios(rows)
    return rows


# ---------------------------------------------------------------- main
def _git_revision() -> str:
    """The flexshard commit measured, marked "+dirty" when the work tree has changes."""
    root = Path(__file__).parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "flexshard"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def environment(argv: list[str]) -> dict[str, Any]:
    return {
        "flexshard_revision": _git_revision(),
        "command": " ".join([".venv/bin/python -m benchmarks.bench_dp", *map(shlex.quote, argv)]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, nproc={os.cpu_count()}, "
        f"{'CUDA' if torch.cuda.is_available() else 'CPU only'}, gloo, 1 thread per rank",
        "load_average_at_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    opts = options(args)
    env = environment(argv)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for world in args.world_sizes:
        began = time.perf_counter()
        rows += run_world(opts, world, args.timeout)
        print(f"W={world}: {time.perf_counter() - began:.0f} s", flush=True)
    meta = env | {
        "options": {
            "model": opts.cfg.__dict__,
            "batch_per_rank": opts.batch,
            "warmup": opts.warmup,
            "steps": opts.steps,
            "reps": opts.reps,
            "block": opts.block,
            "optimizer": "AdamW",
        },
        "runtime_s": time.perf_counter() - start,
        "load_average_at_end": os.getloadavg(),
    }
    stem = "dp_bench_quick" if args.quick else "dp_bench"  # a smoke run keeps the real results
    text = markdown(meta, rows)
    write_results(args.out, stem, meta, rows, text)
    print(text)
    print(f"total runtime {meta['runtime_s']:.0f} s; wrote {args.out}/{stem}.json and .md")


if __name__ == "__main__":
    main()
