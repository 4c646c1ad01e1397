"""The runtime's CPU work per step with compute taken away: many tiny blocks, torch
FSDP2 vs flexshard's ``fully_shard`` (the import swapped), both built in the same rank
processes and alternating step batches, so machine load falls on both alike.

    .venv/bin/python -m benchmarks.bench_overhead            # W = 1 and 2, fp32 and bf16
    .venv/bin/python -m benchmarks.bench_overhead --quick    # W = 1 and 2, fp32, 3 reps

Per repetition each library runs ``--steps`` training steps (forward, backward, AdamW,
``zero_grad``) on ``--blocks`` blocks of ``Linear(dim, dim)`` + ReLU, each block its own
``fully_shard`` call (one bucket), as FSDP2 users wrap transformer blocks. CPU time is
the rank process's (``time.process_time``: every thread, gloo's included), wall time the
step's; ratios are flexshard over FSDP2 per repetition, summarised as median [IQR]
(flexshard/testing/stats.py). Peak live-tensor bytes of one more step
(flexshard/testing/live_memory.py) above what was alive before it.
Results: benchmarks/results/overhead_bench.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard
from flexshard.testing import run_distributed
from flexshard.testing.live_memory import MB, LiveTensors
from flexshard.testing.stats import alternating, cell, paired_ratios, spread, summary, verdict_cell

from .common import write_results

RESULTS = Path(__file__).parent / "results"
LIBRARIES = {"fsdp2": torch_fsdp.fully_shard, "flexshard": flexshard.fully_shard}
TARGET = 1.0  # CPU time per step at or below FSDP2's


def build(library: str, blocks: int, dim: int, bf16: bool) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(blocks)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = torch_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32 if bf16 else None
    )
    shard = LIBRARIES[library]
    for block in model:
        shard(block, mesh=mesh, mp_policy=policy)
    shard(model, mesh=mesh, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def timed(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> tuple:
    """(CPU seconds, wall seconds) per step over ``steps`` steps."""
    dist.barrier()  # both ranks start together: a wait for the other is not counted
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        train_step(model, opt, x)
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def peak_step_mb(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    with LiveTensors() as live:
        before = live.bytes_now()
        train_step(model, opt, x)
    return (live.peak_bytes - before) / MB


def rank_main(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    models = {lib: build(lib, opts["blocks"], opts["dim"], opts["bf16"]) for lib in LIBRARIES}
    x = torch.randn(opts["batch"], opts["dim"], generator=torch.Generator().manual_seed(rank))
    for model, opt in models.values():
        for _ in range(opts["warmup"]):
            train_step(model, opt, x)
    cpu: dict[str, list[float]] = {lib: [] for lib in LIBRARIES}
    wall: dict[str, list[float]] = {lib: [] for lib in LIBRARIES}
    for rep in range(opts["reps"]):
        for lib in alternating(list(LIBRARIES), rep):
            c, w = timed(*models[lib], x, opts["steps"])
            cpu[lib].append(c)
            wall[lib].append(w)
    peaks = {lib: peak_step_mb(*models[lib], x) for lib in LIBRARIES}
    return {"cpu": cpu, "wall": wall, "peak_mb": peaks}


def run(world: int, bf16: bool, args: argparse.Namespace) -> dict[str, Any]:
    opts = {**vars(args), "bf16": bf16}
    opts.pop("out")
    per_rank = run_distributed(rank_main, world, opts, timeout=args.timeout)
    first = per_rank[0]  # rank 0's figures; the ranks run in lock step
    row: dict[str, Any] = {"world": world, "dtype": "bf16" if bf16 else "fp32"}
    for kind, target in (("cpu", TARGET), ("wall", None)):
        row[f"{kind}_ratio"] = summary(
            paired_ratios(first[kind]["flexshard"], first[kind]["fsdp2"]), target
        )
        for lib in LIBRARIES:
            row[f"{kind}_ms_{lib}"] = spread([1e3 * v for v in first[kind][lib]]).as_dict()
    row["peak_mb"] = first["peak_mb"]
    return row


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# CPU work per step: flexshard `fully_shard` vs torch FSDP2, compute removed",
        "",
        f"`{meta['command']}` ({meta['date']}, {meta['machine']}, torch {meta['torch']}):",
        f"{meta['blocks']} blocks of `Linear({meta['dim']}, {meta['dim']})` + ReLU, one "
        f"`fully_shard` each, batch {meta['batch']}, AdamW; {meta['reps']} repetitions of "
        f"{meta['steps']} steps per library, alternating. Median [IQR].",
        "",
        "| W | dtype | FSDP2 CPU ms/step | flexshard CPU ms/step | CPU ratio | verdict "
        "| wall ratio | peak live MB (FSDP2 / flexshard) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peaks = r["peak_mb"]
        lines.append(
            f"| {r['world']} | {r['dtype']} | {cell(r['cpu_ms_fsdp2'])} "
            f"| {cell(r['cpu_ms_flexshard'])} | {cell(r['cpu_ratio'])} "
            f"| {verdict_cell(r['cpu_ratio'])} | {cell(r['wall_ratio'])} "
            f"| {peaks['fsdp2']:.3f} / {peaks['flexshard']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fp32 only, 3 repetitions")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    dtypes = [False] if args.quick else [False, True]
    if args.quick:
        args.reps = 3
    rows = [run(w, bf16, args) for w in args.world_sizes for bf16 in dtypes]
    meta = {
        "command": "python -m benchmarks.bench_overhead" + (" --quick" if args.quick else ""),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        **{k: v for k, v in vars(args).items() if k != "out"},
    }
    text = markdown(meta, rows)
    stem = "overhead_bench_quick" if args.quick else "overhead_bench"  # keep the real results
    write_results(args.out, stem, meta, rows, text)
    print(text)


if __name__ == "__main__":
    main()
