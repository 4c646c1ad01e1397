"""Any matrix optimizer on sharded parameters: torch.optim.Muon and pytorch-optimizer's
SOAP, four ways, on the same matrices and gradients:

(a) gather everything (what one does on FSDP2): all-gather every full gradient and
    parameter, step the optimizer on full tensors on every rank, keep one's shard;
(b) MatrixOptimizer on Shard(0) storage: each matrix to one owner (LPT on the
    optimizer's cost), one packed all-to-all per bucket each way; (b2) the same with
    ``overlap=True`` (one inner step per bucket while later buckets' gathers fly);
(c) MatrixOptimizer on ``matrix_buckets`` storage: every matrix whole on one rank,
    no communication in the optimizer.

``optimizer.step()`` alone is timed (wall, slowest rank, median over steps), with the
collectives it issued and the bytes it put on the wire. Each variant runs ``--reps``
times (5 by default), the order alternating; ratios to (a) per repetition, then median and spread
(flexshard/testing/stats.py). All end with the same parameters (checked by digest).

    .venv/bin/python -m benchmarks.bench_matrix_optim [--world-sizes 2 4] [--reps 5]

Writes benchmarks/results/matrix_optim_bench.{json,md}.

``--conv-dim C`` (one process) instead: SOAP and Shampoo through MatrixOptimizer on a
Gated DeltaNet depthwise conv kernel ``[C, 1, K]`` (C matrices ``[1, K]``), one matrix
at a time (``batched=False``: the inner optimizer's loop) against one batched call per
stack, alternating: the step's CPU time (``time.process_time``) and its Python function
calls (cProfile), and how far the two end apart (SOAP: Shampoo keeps the loop on such
small matrices). Writes matrix_optim_conv_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import hashlib
import json
import os
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.optim import MatrixOptimizer, matrix_buckets, ns_flops, preconditioner_flops
from flexshard.runtime.bucket import slot_of
from flexshard.runtime.dtensor.region_dtensor import wrap
from flexshard.testing import run_distributed
from flexshard.testing.collectives import record_collectives
from flexshard.testing.stats import RULE, alternating, cell, paired_ratios, range_cell, summary

RESULTS = Path(__file__).parent / "results"
MB = 2**20
DIM = 96
BUCKETS = 4
VARIANTS = (
    "a gather everything",
    "b adapter Shard(0)",
    "b2 adapter Shard(0) overlap",
    "c adapter planner buckets",
)


def _optimizers() -> dict[str, tuple[Any, dict, Any]]:
    import pytorch_optimizer

    return {
        "muon": (torch.optim.Muon, {"lr": 0.02}, lambda s: ns_flops(s, 5)),
        "soap": (pytorch_optimizer.SOAP, {"lr": 3e-3, "precondition_frequency": 1}, None),
    }


def shapes(dim: int) -> list[tuple[int, int]]:
    return [(dim, dim)] * 8 + [(dim, dim // 2)] * 4 + [(dim // 2, dim)] * 4


class Bank(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for i, shape in enumerate(shapes(dim)):
            self.register_parameter(f"w{i}", nn.Parameter(torch.randn(shape, generator=gen)))


def _full_grad(shape: tuple[int, ...], step: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(shape, generator=gen)


def _set_grads(model: nn.Module, step: int) -> None:
    for i, (_, param) in enumerate(model.named_parameters()):
        bucket, index = slot_of(param)
        full = _full_grad(bucket.layout.params[index].shape, step, i)
        regions = bucket.layout.params[index].regions[bucket.store.rank]
        flat = torch.cat([r.view_of(full).reshape(-1) for r in regions] or [full.new_empty(0)])
        param.grad = wrap(flat.view(bucket.local_tensor(index).shape), bucket.specs[index])


class GatherAll:
    """(a): the full gradient and parameter of every matrix on every rank (DTensor's
    ``full_tensor``: an all-gather each), the optimizer on full tensors everywhere,
    each rank keeping its shard."""

    def __init__(self, model: nn.Module, cls: Any, kwargs: dict) -> None:
        self.params = list(model.parameters())
        self.fulls = [nn.Parameter(p.full_tensor()) for p in self.params]
        self.inner = cls(self.fulls, **kwargs)
        self.bytes_sent = 0

    @torch.no_grad()
    def step(self) -> None:
        for param, full in zip(self.params, self.fulls):
            full.copy_(param.full_tensor())
            full.grad = param.grad.full_tensor()
            bucket, _ = slot_of(param)
            local = param.to_local()
            w = bucket.layout.world_size
            self.bytes_sent += 2 * (w - 1) * max(local.numel(), 1) * local.element_size()
        self.inner.step()
        for param, full in zip(self.params, self.fulls):
            bucket, index = slot_of(param)
            regions = bucket.layout.params[index].regions[bucket.store.rank]
            if regions:
                mine = torch.cat([r.view_of(full).reshape(-1) for r in regions])
                param.to_local().copy_(mine.view(param.to_local().shape))


def _build(variant: str, mesh: Any, dim: int, optimizer: str) -> tuple[nn.Module, Any]:
    cls, kwargs, cost = _optimizers()[optimizer]
    count = len(shapes(dim))
    per = count // BUCKETS
    if variant.startswith("c"):
        buckets = matrix_buckets(Bank(dim), mesh.size(), cost or preconditioner_flops)
    else:
        buckets = [
            fs.BucketSpec([f"w{i}" for i in range(b * per, (b + 1) * per)], fs.Shard(0))
            for b in range(BUCKETS)
        ]
    model = fs.flex_shard(Bank(dim), mesh=mesh, buckets=buckets)
    if variant.startswith("a"):
        return model, GatherAll(model, cls, kwargs)
    overlap = variant.endswith("overlap")
    return model, MatrixOptimizer(model.parameters(), cls, cost=cost, overlap=overlap, **kwargs)


def _run(variant: str, mesh: Any, dim: int, optimizer: str, steps: int) -> dict:
    model, opt = _build(variant, mesh, dim, optimizer)
    times, collectives = [], 0
    for step in range(steps + 2):  # two warm-up steps
        _set_grads(model, step)
        torch.distributed.barrier()
        with record_collectives() as log:
            start = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - start
        if step >= 2:
            times.append(elapsed * 1e3)
            collectives = len(log)
    sent = opt.bytes_sent if isinstance(opt, GatherAll) else opt.comm_stats()["bytes_sent"]
    full = fs.full_state_dict(model)
    digest = hashlib.sha1(b"".join(full[k].numpy().tobytes() for k in sorted(full)))
    return {
        "ms": times,
        "collectives": collectives,
        "bytes_per_step": sent / (steps + 2),
        "digest": digest.hexdigest()[:12],
    }


def rank_main(rank: int, world: int, steps: int, reps: int, dim: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, dict[str, list]] = {}
    for optimizer in _optimizers():
        out[optimizer] = {v: [] for v in VARIANTS}
        for rep in range(reps):
            for variant in alternating(VARIANTS, rep):
                out[optimizer][variant].append(_run(variant, mesh, dim, optimizer, steps))
    return out


def _summarise(per_rank: list[dict]) -> dict:
    rows: dict[str, dict] = {}
    for optimizer in per_rank[0]:
        rows[optimizer] = {}
        for variant in VARIANTS:
            runs = [r[optimizer][variant] for r in per_rank]
            reps = len(runs[0])
            ms = [
                statistics.median(max(z) for z in zip(*(run[rep]["ms"] for run in runs)))
                for rep in range(reps)
            ]
            first = [run[0] for run in runs]
            rows[optimizer][variant] = {
                "median_ms": statistics.median(ms),
                "ms_per_rep": ms,
                "collectives_per_step": first[0]["collectives"],
                "MB_sent_per_step_all_ranks": sum(f["bytes_per_step"] for f in first) / MB,
                "digest": first[0]["digest"],
            }
        base = rows[optimizer][VARIANTS[0]]
        for row in rows[optimizer].values():
            row["time_vs_a"] = summary(paired_ratios(row["ms_per_rep"], base["ms_per_rep"]))
    return rows


def _conv_run(optimizer: str, batched: bool, conv: tuple[int, int], steps: int) -> dict:
    """``steps`` timed steps (after two: SOAP's first only gathers statistics) of one
    optimizer on a ``[C, 1, K]`` kernel, then one profiled step."""
    cls, kwargs = _conv_optimizers()[optimizer]
    gen = torch.Generator().manual_seed(0)
    weight = nn.Parameter(torch.randn(conv[0], 1, conv[1], generator=gen))
    opt = MatrixOptimizer([weight], cls, batched=batched, **kwargs)
    cpu_ms = []
    for step in range(steps + 3):
        weight.grad = torch.randn(weight.shape, generator=gen)
        if step == steps + 2:  # the last one profiled: Python calls per step
            profile = cProfile.Profile()
            profile.runcall(opt.step)
            calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
            continue
        start = time.process_time()
        opt.step()
        if step >= 2:
            cpu_ms.append((time.process_time() - start) * 1e3)
    return {"cpu_ms": statistics.median(cpu_ms), "calls": calls, "weight": weight.detach()}


def _conv_optimizers() -> dict[str, tuple[Any, dict]]:
    import pytorch_optimizer

    # the trainer's settings (training.optimizer): its lr, betas and weight decay.
    # Shampoo keeps the per-matrix loop on [1, K] (batched_steps: it would magnify the
    # small-matrix bmm's rounding): both sides would be the loop
    return {
        "soap": (pytorch_optimizer.SOAP, {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}),
    }


def conv_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    conv = (args.conv_dim, args.conv_kernel)
    sides = ("per matrix", "batched")
    started, load_before = time.time(), os.getloadavg()[0]
    results: dict[str, dict] = {}
    for optimizer in _conv_optimizers():
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for rep in range(args.reps):
            for side in alternating(sides, rep):
                runs[side].append(_conv_run(optimizer, side == "batched", conv, args.steps))
        loop, batch = runs["per matrix"][0]["weight"], runs["batched"][0]["weight"]
        start = torch.randn(conv[0], 1, conv[1], generator=torch.Generator().manual_seed(0))
        moved = float((loop - start).abs().max())  # the kernel's first draw in _conv_run
        results[optimizer] = {
            side: {
                "cpu_ms_per_rep": [r["cpu_ms"] for r in runs[side]],
                "calls_per_step": runs[side][0]["calls"],
            }
            for side in sides
        }
        results[optimizer]["batched_vs_per_matrix"] = summary(
            paired_ratios(
                results[optimizer]["batched"]["cpu_ms_per_rep"],
                results[optimizer]["per matrix"]["cpu_ms_per_rep"],
            )
        )
        results[optimizer]["relative_gap"] = float((batch - loop).abs().max()) / moved
    lines = [
        "# A depthwise conv kernel's channels: one matrix at a time vs one batched call",
        "",
        f"Command: `.venv/bin/python -m benchmarks.bench_matrix_optim --conv-dim {conv[0]} "
        f"--conv-kernel {conv[1]} --steps {args.steps} --reps {args.reps}`  ",
        f"Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; "
        f"torch {torch.__version__}; CPU, one process, one thread; "
        f"{time.time() - started:.0f} s; 1-min load {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (the machine is shared: times vary)",
        f"One parameter [{conv[0]}, 1, {conv[1]}] fp32 (each channel a [1, {conv[1]}] matrix), "
        "pytorch-optimizer 4.1.0 SOAP at the trainer's settings (lr 3e-3, betas (0.9, 0.95), "
        "weight decay 0.1) through "
        f"MatrixOptimizer; {args.steps} steps timed after 2, CPU time per step (median), "
        "Python function calls of one more step (cProfile).",
        "",
        RULE,
        "",
        "| optimizer | per matrix: CPU ms/step | batched: CPU ms/step | batched / per matrix "
        "[IQR] | calls/step per matrix | calls/step batched | max gap / max move |",
        "|---|---|---|---|---|---|---|",
    ]
    for optimizer, row in results.items():
        loop_ms = statistics.median(row["per matrix"]["cpu_ms_per_rep"])
        batch_ms = statistics.median(row["batched"]["cpu_ms_per_rep"])
        lines.append(
            f"| {optimizer} | {loop_ms:.1f} | {batch_ms:.1f} | "
            f"{cell(row['batched_vs_per_matrix'], 4)} | {row['per matrix']['calls_per_step']} | "
            f"{row['batched']['calls_per_step']} | {row['relative_gap']:.1e} |"
        )
    lines += [
        "",
        "- gap: the largest difference between the two sides' final parameters over the",
        "  largest distance the parameters moved (torch's small-matrix bmm rounds otherwise",
        "  than mm: the last bits differ).",
    ]
    _write(args.out, "matrix_optim_conv_bench", results, lines)


def _write(out: Path, stem: str, results: dict, lines: list[str]) -> None:
    """The raw rows as ``<stem>.json`` and the table as ``<stem>.md`` (printed too)."""
    out.mkdir(exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="runs per variant (order alternating)")
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--conv-dim", type=int, help="channels C of a [C, 1, K] conv kernel")
    parser.add_argument("--conv-kernel", type=int, default=4, help="its taps K")
    args = parser.parse_args()
    if args.conv_dim:
        return conv_main(args)
    started, load_before = time.time(), os.getloadavg()[0]
    results = {}
    for w in args.world_sizes:
        per_rank = run_distributed(rank_main, w, args.steps, args.reps, args.dim, timeout=3000)
        results[w] = _summarise(per_rank)
    lines = [
        "# Any matrix optimizer: gather everything vs MatrixOptimizer, optimizer step",
        "",
        f"Command: `.venv/bin/python -m benchmarks.bench_matrix_optim --world-sizes "
        f"{' '.join(map(str, args.world_sizes))} --steps {args.steps} --reps {args.reps} "
        f"--dim {args.dim}`  ",
        f"Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}; "
        f"torch {torch.__version__}; CPU (2 cores), gloo, one thread per rank; "
        f"{time.time() - started:.0f} s; 1-min load {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (the machine is shared: wall times vary)",
        f"Matrices: 8 x {args.dim}x{args.dim}, 4 x {args.dim}x{args.dim // 2}, "
        f"4 x {args.dim // 2}x{args.dim} fp32 in {BUCKETS} Shard(0) buckets for (a), (b), (b2); "
        "torch.optim.Muon (lr 0.02) and pytorch-optimizer 4.1.0 SOAP "
        "(precondition_frequency 1: an eigenbasis update every step).",
        "",
        RULE,
        "",
        "| W | optimizer | variant | median ms | / (a) [IQR] | min–max | collectives/step "
        "| MB sent/step (all ranks) | same params as (a) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w, by_opt in results.items():
        for optimizer, rows in by_opt.items():
            base = rows[VARIANTS[0]]["digest"]
            for variant, row in rows.items():
                lines.append(
                    f"| {w} | {optimizer} | {variant} | {row['median_ms']:.1f} | "
                    f"{cell(row['time_vs_a'])} | {range_cell(row['time_vs_a'])} | "
                    f"{row['collectives_per_step']} | "
                    f"{row['MB_sent_per_step_all_ranks']:.3f} | "
                    f"{'yes' if row['digest'] == base else 'NO'} |"
                )
    lines += [
        "",
        "- (a) is written here for the benchmark (DTensor `full_tensor()` of every gradient",
        "  and parameter, the optimizer on every rank); its bytes are the ring all-gathers'.",
        "- (b) sends gradient and parameter (fp32) to each matrix's owner and the stepped",
        "  parameter back; (b2) the same bytes, the inner step run bucket by bucket",
        "  (`overlap=True`); (c) holds every matrix whole on one rank and sends nothing.",
        "- ms: `optimizer.step()` wall time on the slowest rank. With W ranks on 2 cores",
        "  the ranks compete for the CPU; (a) runs W copies of every matrix's step.",
    ]
    _write(args.out, "matrix_optim_bench", results, lines)


if __name__ == "__main__":
    main()
