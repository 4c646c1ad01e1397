"""FSDP2 vs flexshard on a client's own model: torchtitan 0.3.0's llama3 debug model
through torchtitan's ``parallelize_llama`` and its train step (forward, its loss,
backward, clipping, AdamW), flexshard's ``fully_shard`` swapped in at torchtitan's
import site; W = 1 and 2 (gloo, CPU), fp32 and bf16 mixed precision.

Both libraries run in one launch per (W, precision): each rank builds both models and
alternates them repetition by repetition (A B, B A, ...) on the same batches. Per step:
CPU time (``time.process_time``: every thread of the rank process, gloo's included) and
wall time; medians and IQRs over the repetitions, and the per-repetition ratio
flexshard / FSDP2 (``stats.paired_ratios``). Peak memory: each library in a launch of
its own (the peak RSS of a rank process, imports included alike); skipped by
``--quick``. The CPU patches torchtitan needs are applied and listed
(``torchtitan_cpu.apply_cpu_patches``).

    python -m benchmarks.bench_clients --quick      # W = 2, fp32 and bf16, < 3 minutes
    python -m benchmarks.bench_clients              # W = 1 and 2, memory too
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.output import write_results
from flexshard.testing import run_distributed
from flexshard.testing.stats import alternating, cell, paired_ratios, spread, summary

LIBRARIES = ("fsdp2", "flexshard")
RESULTS = Path(__file__).parent / "results"


def _timed_steps(run: Any, opt: Any, data: list, warmup: int) -> tuple[list, list]:
    from flexshard.testing.torchtitan_cpu import train_step

    cpu, wall = [], []
    for i, (x, y) in enumerate(data):
        c0, w0 = time.process_time(), time.perf_counter()
        train_step(run, opt, x, y)
        if i >= warmup:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
    return cpu, wall


def _timing(rank: int, world_size: int, bf16: bool, reps: int, steps: int) -> dict:
    """Both libraries in this rank process, alternating; per repetition the median
    step of each (the first step of a library's first repetition is its warm-up)."""
    from flexshard.testing.torchtitan_cpu import apply_cpu_patches, batches, build

    patches = apply_cpu_patches()
    runs = {lib: build(world_size, lib, bf16) for lib in LIBRARIES}
    opts = {lib: torch.optim.AdamW(r.model.parameters(), lr=1e-4) for lib, r in runs.items()}
    out: dict[str, Any] = {lib: {"cpu": [], "wall": []} for lib in LIBRARIES}
    for rep in range(reps):
        data = batches(rank + 100 * rep, steps + (rep == 0))
        for lib in alternating(LIBRARIES, rep):
            cpu, wall = _timed_steps(runs[lib], opts[lib], data, warmup=int(rep == 0))
            out[lib]["cpu"].append(spread(cpu).median)
            out[lib]["wall"].append(spread(wall).median)
    out["patches"] = patches
    return out


def _memory(rank: int, world_size: int, bf16: bool, library: str) -> float:
    """Peak RSS (MiB) of this rank process after two steps of one library alone."""
    from flexshard.testing.torchtitan_cpu import batches, build

    run = build(world_size, library, bf16)
    opt = torch.optim.AdamW(run.model.parameters(), lr=1e-4)
    _timed_steps(run, opt, batches(rank, 2), warmup=0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(world_size: int, bf16: bool, reps: int, steps: int, memory: bool) -> dict:
    ranks = run_distributed(_timing, world_size, bf16, reps, steps, timeout=1800)
    row: dict[str, Any] = {
        "W": world_size,
        "precision": "bf16" if bf16 else "fp32",
        "reps": reps,
        "steps": steps,
        "patches": ranks[0]["patches"],
    }
    for kind in ("cpu", "wall"):
        # a step is as slow as its slowest rank: the max over ranks, per repetition
        per = {lib: [max(r[lib][kind][i] for r in ranks) for i in range(reps)] for lib in LIBRARIES}
        row[kind] = {lib: spread(v).as_dict() for lib, v in per.items()}
        row[f"{kind}_ratio"] = summary(paired_ratios(per["flexshard"], per["fsdp2"]), 1.0)
    if memory:
        row["peak_rss_mib"] = {
            lib: max(run_distributed(_memory, world_size, bf16, lib, timeout=1800))
            for lib in LIBRARIES
        }
    return row


def _ms(entry: dict) -> str:
    scaled = {k: v * 1000 if isinstance(v, float) else v for k, v in entry.items()}
    return cell(scaled, 1)


def markdown(command: str, rows: list[dict]) -> str:
    lines = [
        "# Client benchmark: torchtitan llama3 debug model, FSDP2 vs flexshard",
        "",
        f"Command: `{command}`",
        "",
        "Per step, median [IQR] over repetitions (each repetition's median step, the "
        "slowest rank); ratio = flexshard / FSDP2 per repetition, target <= 1.0.",
        "",
        "| W | precision | CPU ms FSDP2 | CPU ms flexshard | CPU ratio | wall ms FSDP2 "
        "| wall ms flexshard | wall ratio | peak RSS MiB (FSDP2 / flexshard) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = r.get("peak_rss_mib")
        mem_cell = f"{mem['fsdp2']:.0f} / {mem['flexshard']:.0f}" if mem else "not measured"
        lines.append(
            f"| {r['W']} | {r['precision']} | {_ms(r['cpu']['fsdp2'])} "
            f"| {_ms(r['cpu']['flexshard'])} | {cell(r['cpu_ratio'])} ({r['cpu_ratio']['verdict']})"
            f" | {_ms(r['wall']['fsdp2'])} | {_ms(r['wall']['flexshard'])} "
            f"| {cell(r['wall_ratio'])} ({r['wall_ratio']['verdict']}) | {mem_cell} |"
        )
    patches = sorted({p for r in rows for p in r["patches"]})
    lines += [
        "",
        "CPU patches applied to torchtitan (flexshard/testing/torchtitan_cpu.py): "
        + "; ".join(patches)
        + "; gloo SUM instead of PREMUL_SUM(1) "
        "(set_force_sum_reduction_for_comms, both libraries).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="W = 2 only, no memory launches")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repetition")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error("--reps must be >= 5 (medians and IQRs need them)")
    sizes = (2,) if args.quick else (1, 2)
    steps = 1 if args.quick else args.steps
    rows = [
        measure(w, bf16, args.reps, steps, memory=not args.quick)
        for w in sizes
        for bf16 in (False, True)
    ]
    command = "python -m benchmarks.bench_clients " + " ".join(argv or sys.argv[1:])
    text = markdown(command.strip(), rows)
    write_results(RESULTS, "clients_bench", {"command": command.strip()}, rows, text)
    print(text)


if __name__ == "__main__":
    main()
