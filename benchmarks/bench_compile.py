"""torch.compile per block (``block.compile()`` after sharding, as torchtitan does):
step time and first-step (compile) time, flexshard's ``fully_shard`` vs torch FSDP2's,
side by side on one model, one data stream and one world size.

    .venv/bin/python -m benchmarks.bench_compile              # W = 2, 5 reps
    .venv/bin/python -m benchmarks.bench_compile --quick      # 2 reps, 2 timed steps

Every side runs in every repetition, the order reversed on every other one; each
flexshard row's ratio to FSDP2 (same mode) is the median over repetitions of that
repetition's ratio, with its spread (flexshard/testing/stats.py). Inductor's caches are off,
so every repetition compiles cold: the first step's time is the compile time's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed
from flexshard.testing.stats import RULE, alternating, cell, paired_ratios, range_cell, summary

from .common import write_results

RESULTS = Path(__file__).parent / "results"
IMPLS = ("fsdp2", "flexshard")


@dataclass(frozen=True)
class Options:
    cfg: TransformerConfig
    batch: int
    warmup: int
    steps: int
    reps: int
    modes: tuple[str, ...]  # "eager", "blocks" (each block compiled), "whole"
    backend: str


def _one_run(impl: str, mode: str, opts: Options, rank: int, world: int) -> dict[str, Any]:
    """Build, shard, compile and train one side; per step the wall time (barrier first)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TinyTransformer(opts.cfg)
    shard = torch_fully_shard if impl == "fsdp2" else fs.fully_shard
    for layer in model.layers:
        shard(layer, mesh=mesh)
        if mode == "blocks":
            layer.compile(backend=opts.backend)
    shard(model, mesh=mesh)
    run = torch.compile(model.loss, backend=opts.backend) if mode == "whole" else model.loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = make_batches(opts.cfg, 1 + opts.warmup + opts.steps, opts.batch, seed=rank)
    times, losses = [], []
    for tokens, targets in batches:
        dist.barrier()
        began = time.perf_counter()
        loss = run(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - began)
    return {
        "first_step_s": times[0],
        "step_s": times[1 + opts.warmup :],
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "losses": losses,
    }


def run_rank(rank: int, world: int, opts: Options) -> list[dict[str, dict[str, Any]]]:
    """Per repetition, every (impl, mode) side, in alternating order."""
    import torch._inductor.config as inductor

    inductor.force_disable_caches = True  # every repetition compiles cold
    inductor.compile_threads = 1  # W ranks share the cores
    sides = [(impl, mode) for mode in opts.modes for impl in IMPLS]
    reps = []
    for rep in range(opts.reps):
        reps.append(
            {f"{i}/{m}": _one_run(i, m, opts, rank, world) for i, m in alternating(sides, rep)}
        )
    return reps


def summarize(per_rank: list[list[dict[str, dict[str, Any]]]], opts: Options) -> list[dict]:
    """Per side: per repetition the slowest rank's first step and median step; medians;
    flexshard's ratios to FSDP2's in the same repetition and mode."""
    rows: dict[str, dict[str, Any]] = {}
    for key in per_rank[0][0]:
        first = [max(rank[r][key]["first_step_s"] for rank in per_rank) for r in range(opts.reps)]
        step = [
            1e3
            * statistics.median(max(s) for s in zip(*(rank[r][key]["step_s"] for rank in per_rank)))
            for r in range(opts.reps)
        ]
        last = per_rank[0][-1][key]
        rows[key] = {
            "side": key,
            "first_step_s_per_rep": first,
            "first_step_s": statistics.median(first),
            "step_ms_per_rep": step,
            "step_ms": statistics.median(step),
            "graph_breaks": max(
                rank[r][key]["breaks"] for rank in per_rank for r in range(opts.reps)
            ),
            "graphs": last["graphs"],
            "final_loss_rank0": last["losses"][-1],
        }
    for mode in opts.modes:
        ours, ref = rows[f"flexshard/{mode}"], rows[f"fsdp2/{mode}"]
        ours["step_vs_fsdp2"] = summary(
            paired_ratios(ours["step_ms_per_rep"], ref["step_ms_per_rep"])
        )
        ours["first_step_vs_fsdp2"] = summary(
            paired_ratios(ours["first_step_s_per_rep"], ref["first_step_s_per_rep"])
        )
    return list(rows.values())


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# torch.compile: flexshard vs torch FSDP2",
        "",
        f"`{meta['command']}` — {meta['date']}, torch {meta['torch']}, {meta['machine']}, "
        f"W = {meta['world_size']}, backend {meta['options']['backend']}, "
        f"{meta['options']['reps']} reps, flexshard {meta['flexshard_revision']}.",
        "",
        "| side | step ms | step / FSDP2 | min–max | first step s | first / FSDP2 | min–max "
        "| graph breaks | graphs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step, first = r.get("step_vs_fsdp2"), r.get("first_step_vs_fsdp2")
        cells = [
            r["side"],
            f"{r['step_ms']:.1f}",
            cell(step) if step else "1",
            range_cell(step) if step else "",
            f"{r['first_step_s']:.2f}",
            cell(first) if first else "1",
            range_cell(first) if first else "",
            r["graph_breaks"],
            r["graphs"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        "step ms: per timed step the slowest rank's forward+backward+`optimizer.step()` "
        "(a barrier before each), median over the steps of a repetition, then over "
        "repetitions. first step s: the first step (compiles forward and backward, "
        "inductor caches off), slowest rank, median over repetitions. graph breaks: "
        "`torch._dynamo.utils.counters['graph_break']`, the most any rank saw; graphs: "
        "dynamo's unique graphs in the last repetition.",
        "",
        RULE,
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 reps, 2 timed steps")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument(
        "--modes", nargs="+", default=["eager", "blocks"], choices=["eager", "blocks", "whole"]
    )
    p.add_argument("--backend", default="inductor")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.warmup, args.steps = 2, 1, 2
    cfg = TransformerConfig(
        vocab=1024, dim=args.dim, heads=8, hidden=4 * args.dim, layers=args.layers, seq=64
    )
    opts = Options(
        cfg, args.batch, args.warmup, args.steps, args.reps, tuple(args.modes), args.backend
    )
    start = time.perf_counter()
    per_rank = run_distributed(run_rank, args.world_size, opts, timeout=3600)
    rows = summarize(per_rank, opts)
    meta = {
        "command": " ".join([".venv/bin/python -m benchmarks.bench_compile", *argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "flexshard_revision": os.popen("git rev-parse --short HEAD").read().strip(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, nproc={os.cpu_count()}, CPU, gloo, 1 thread per rank",
        "world_size": args.world_size,
        "options": {"model": cfg.__dict__, **vars(opts) | {"cfg": None}},
        "runtime_s": time.perf_counter() - start,
        "load_average": os.getloadavg(),
    }
    stem = "compile_bench_quick" if args.quick else "compile_bench"
    text = markdown(meta, rows)
    write_results(args.out, stem, meta, rows, text)
    print(text)
    print(f"total runtime {meta['runtime_s']:.0f} s; wrote {args.out}/{stem}.json and .md")


if __name__ == "__main__":
    main()
