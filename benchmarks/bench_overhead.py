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

A third side, the floor (benchmarks/overhead_floor.py), issues flexshard's collectives on
the same buckets with no hooks; it is checked first (same collectives and bytes, losses
and shards bit for bit). Above the floor: a library's CPU per step minus the floor's,
per repetition; its ratio is flexshard's over FSDP2's.
Results: benchmarks/results/overhead_bench.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard
from flexshard.runtime.module import own_buckets
from flexshard.testing import run_distributed
from flexshard.testing.live_memory import MB, LiveTensors
from flexshard.testing.stats import alternating, cell, paired_ratios, spread, summary, verdict_cell

from .common import CollectiveCounter, write_results
from .overhead_floor import Floor

RESULTS = Path(__file__).parent / "results"
LIBRARIES = {"fsdp2": torch_fsdp.fully_shard, "flexshard": flexshard.fully_shard}
SIDES = (*LIBRARIES, "floor")
TARGET = 0.8  # CPU time per step: at most 0.8x FSDP2's
ABOVE_TARGET = 0.5  # flexshard's CPU above the floor: at most half of FSDP2's
CHECKED_STEPS = 3  # steps of flexshard and the floor compared (collectives, losses)


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


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


Step = Callable[[torch.Tensor], torch.Tensor]


def timed(step: Step, x: torch.Tensor, steps: int) -> tuple:
    """(CPU seconds, wall seconds) per step over ``steps`` steps."""
    dist.barrier()  # both ranks start together: a wait for the other is not counted
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step(x)
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def peak_step_mb(step: Step, x: torch.Tensor) -> float:
    with LiveTensors() as live:
        before = live.bytes_now()
        step(x)
    return (live.peak_bytes - before) / MB


def check_floor(opts: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
    """Fresh flexshard and floor models run CHECKED_STEPS steps each: their collectives
    (kind, elements, bytes) after the first step, whose order differs (flexshard learns
    its prefetch order there), must be the same; losses and shards compared bit for bit."""
    model, opt = build("flexshard", opts["blocks"], opts["dim"], opts["bf16"])
    floor = Floor(model)
    sides: dict[str, Step] = {"flexshard": lambda t: train_step(model, opt, t), "floor": floor.step}
    seen: dict[str, Any] = {}
    for side, step in sides.items():
        losses, counter = [step(x)], CollectiveCounter()
        counter.install()
        try:
            losses += [step(x) for _ in range(CHECKED_STEPS - 1)]
        finally:
            counter.uninstall()
        records = [(r.kind, r.total_numel, r.element_size, r.sent) for r in counter.take()]
        seen[side] = (torch.stack(losses), records)
    (fs_loss, fs_records), (fl_loss, fl_records) = seen["flexshard"], seen["floor"]
    if fs_records != fl_records:
        raise AssertionError(
            f"the floor's collectives differ from flexshard's: {fl_records} vs {fs_records}"
        )
    shards = [b.storage for block in model for b in own_buckets(block)]
    return {
        "collectives_per_step": len(fs_records) // (CHECKED_STEPS - 1),
        "bytes_sent_per_step": sum(r[3] for r in fs_records) // (CHECKED_STEPS - 1),
        "losses_bitwise": bool(torch.equal(fs_loss, fl_loss)),
        "loss_max_abs_diff": float((fs_loss - fl_loss).abs().max()),
        "shards_bitwise": all(
            torch.equal(a, b.shard.detach()) for a, b in zip(shards, floor.buckets)
        ),
    }


def rank_main(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    x = torch.randn(opts["batch"], opts["dim"], generator=torch.Generator().manual_seed(rank))
    floor_check = check_floor(opts, x)
    steps: dict[str, Step] = {}
    for lib in LIBRARIES:
        model, opt = build(lib, opts["blocks"], opts["dim"], opts["bf16"])
        steps[lib] = functools.partial(train_step, model, opt)
        if lib == "flexshard":
            steps["floor"] = Floor(model).step  # the same buckets, their own shards
    for step in steps.values():
        for _ in range(opts["warmup"]):
            step(x)
    cpu: dict[str, list[float]] = {side: [] for side in SIDES}
    wall: dict[str, list[float]] = {side: [] for side in SIDES}
    for rep in range(opts["reps"]):
        for side in alternating(list(SIDES), rep):
            c, w = timed(steps[side], x, opts["steps"])
            cpu[side].append(c)
            wall[side].append(w)
    peaks = {side: peak_step_mb(steps[side], x) for side in SIDES}
    return {"cpu": cpu, "wall": wall, "peak_mb": peaks, "floor_check": floor_check}


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
        for side in SIDES:
            row[f"{kind}_ms_{side}"] = spread([1e3 * v for v in first[kind][side]]).as_dict()
    cpu = first["cpu"]
    above = {lib: [1e3 * (a - f) for a, f in zip(cpu[lib], cpu["floor"])] for lib in LIBRARIES}
    for lib in LIBRARIES:
        row[f"above_floor_ms_{lib}"] = spread(above[lib]).as_dict()
    # a load spike can put the floor's repetition above FSDP2's: no ratio there
    kept = [(a, b) for a, b in zip(above["flexshard"], above["fsdp2"]) if b > 0]
    if not kept:
        raise RuntimeError(f"FSDP2 never above the floor: {above['fsdp2']} (machine too noisy)")
    row["above_floor_ratio"] = summary(paired_ratios(*zip(*kept)), ABOVE_TARGET)
    row["above_floor_ratio"]["reps_dropped"] = len(above["fsdp2"]) - len(kept)
    row["peak_mb"] = first["peak_mb"]
    row["floor_check"] = first["floor_check"]
    return row


def dropped(row: dict[str, Any]) -> str:
    n = row["above_floor_ratio"]["reps_dropped"]
    return f" ({n} rep(s) without FSDP2 above the floor left out)" if n else ""


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# CPU work per step: flexshard `fully_shard` vs torch FSDP2, compute removed",
        "",
        f"`{meta['command']}` ({meta['date']}, {meta['machine']}, torch {meta['torch']}):",
        f"{meta['blocks']} blocks of `Linear({meta['dim']}, {meta['dim']})` + ReLU, one "
        f"`fully_shard` each, batch {meta['batch']}, AdamW; {meta['reps']} repetitions of "
        f"{meta['steps']} steps per side, alternating. CPU: the rank process's "
        "(`time.process_time`). Median [IQR].",
        "",
        "The floor (benchmarks/overhead_floor.py): flexshard's collectives on the same "
        "buckets, hand-scheduled around a plain forward and a block-by-block "
        "`autograd.grad` backward, AdamW on the flat shards, no hooks. Above the floor: "
        "a library's CPU per step minus the floor's, per repetition.",
        "",
        "| W | dtype | FSDP2 CPU ms/step | flexshard CPU ms/step | floor CPU ms/step "
        "| FSDP2 above floor ms | flexshard above floor ms | above-floor ratio | verdict "
        "| CPU ratio | verdict | wall ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['dtype']} | {cell(r['cpu_ms_fsdp2'])} "
            f"| {cell(r['cpu_ms_flexshard'])} | {cell(r['cpu_ms_floor'])} "
            f"| {cell(r['above_floor_ms_fsdp2'])} | {cell(r['above_floor_ms_flexshard'])} "
            f"| {cell(r['above_floor_ratio'])}{dropped(r)} "
            f"| {verdict_cell(r['above_floor_ratio'])} "
            f"| {cell(r['cpu_ratio'])} | {verdict_cell(r['cpu_ratio'])} "
            f"| {cell(r['wall_ratio'])} |"
        )
    lines += [
        "",
        "The floor against flexshard on fresh models (collectives counted by wrapping "
        f"`torch.distributed`, steps 2-{CHECKED_STEPS}; losses and shards over "
        f"{CHECKED_STEPS} steps), and the peak live-tensor bytes of one step:",
        "",
        "| W | dtype | collectives / step (both) | bytes sent / step (both) "
        "| losses bitwise | shards bitwise | peak live MB (FSDP2 / flexshard / floor) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        check, peaks = r["floor_check"], r["peak_mb"]
        lines.append(
            f"| {r['world']} | {r['dtype']} | {check['collectives_per_step']} "
            f"| {check['bytes_sent_per_step']} | {check['losses_bitwise']} "
            f"| {check['shards_bitwise']} "
            f"| {peaks['fsdp2']:.3f} / {peaks['flexshard']:.3f} / {peaks['floor']:.3f} |"
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
