"""The trainer on each 5-D layout (TP, PP, CP, EP, HSDP and their mixes) with
``dp_backend = "flexshard"`` and ``"fsdp2"`` side by side: tokens/s and peak memory
per rank on CPU (gloo).

    .venv/bin/python -m benchmarks.bench_parallel            # 4- and 8-rank layouts
    .venv/bin/python -m benchmarks.bench_parallel --with-5d  # and the 16-rank 5-D layout
    .venv/bin/python -m benchmarks.bench_parallel --quick    # two 4-rank layouts, 2 reps
    .venv/bin/python -m benchmarks.bench_parallel --variants # ring vs all-gather CP,
                                                   # grouped_mm vs loop MoE experts
    .venv/bin/python -m benchmarks.bench_parallel --muon     # Muon under tp / pp vs
                                                   # AdamW on flexshard and FSDP2

Per world size, all layouts and both backends run inside the same processes, same
model, data and seed; only ``parallelism.dp_backend`` differs. Per layout the two
backends run ``--reps`` times (5 by default), their order flipped every repetition;
the ratio is flexshard's step time over FSDP2's per repetition, then the median with
its spread and a verdict (flexshard/testing/stats.py).
``--only NAME`` (repeatable) picks layouts, or with ``--variants`` / ``--muon`` their
comparisons / layouts.
Results: benchmarks/results/parallel_bench.{json,md,png}; ``--variants`` (see
benchmarks/parallel_variants.py): parallel_variants.{json,md}; ``--muon`` (see
benchmarks/parallel_muon.py): parallel_muon.{json,md}; a run of some rows only (``--only``,
``--quick``) writes ``<stem>_quick``, keeping the full results.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from flexshard.testing import run_distributed
from flexshard.testing.stats import RULE, alternating, cell, range_cell, verdict_cell

from .bench_trainer import compare, measured_run, per_rep, timed_row, trainer_table
from .common import plot_backends, write_results
from .parallel_muon import MUON_LAYOUTS, muon_markdown, muon_rank, summarise_muon
from .parallel_variants import VARIANTS, summarise_variants, variant_rank, variants_markdown

RESULTS = Path(__file__).parent / "results"
BACKENDS = ("flexshard", "fsdp2")
MOE = {"num_experts": 4, "top_k": 2, "expert_hidden": 64, "first_dense_layers": 1}
# name: (world size, [parallelism], MoE?)
LAYOUTS: dict[str, tuple[int, dict, bool]] = {
    "dp2 x tp2": (4, {"dp_shard": 2, "tp": 2}, False),
    "tp2 x pp2": (4, {"dp_shard": 1, "tp": 2, "pp": 2}, False),
    "dp2 x cp2": (4, {"dp_shard": 2, "cp": 2}, False),
    "dp2 x cp2 (ring)": (4, {"dp_shard": 2, "cp": 2, "cp_method": "ring"}, False),
    "dp4, ep2 (MoE)": (4, {"dp_shard": 4, "ep": 2}, True),
    "hsdp 2 x 2": (4, {"dp_replicate": 2, "dp_shard": 2}, False),
    "dp2 x tp2 x pp2": (8, {"dp_shard": 2, "tp": 2, "pp": 2}, False),
    "cp2 x tp2, dp2, ep2 (MoE)": (8, {"dp_shard": 2, "cp": 2, "tp": 2, "ep": 2}, True),
    "5-D: pp2 x dp2 x cp2 x tp2, ep2 (MoE)": (
        16,
        {"dp_shard": 2, "cp": 2, "tp": 2, "pp": 2, "ep": 2, "pp_microbatches": 2},
        True,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--reps", type=int, default=5, help="runs per backend, order flipped each")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences per dp rank per step")
    p.add_argument("--with-5d", action="store_true", help="also the 16-rank 5-D layout")
    p.add_argument("--quick", action="store_true", help="smoke run: two 4-rank layouts, 2 reps")
    p.add_argument("--only", action="append", default=[], help="run this layout alone (repeatable)")
    p.add_argument(
        "--variants",
        action="store_true",
        help="instead: ring vs all-gather CP and grouped_mm vs loop MoE experts (flexshard)",
    )
    p.add_argument(
        "--muon",
        action="store_true",
        help="instead: Muon (flexshard) under tp / pp vs AdamW on flexshard and on FSDP2",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.variants and args.muon:
        p.error("--variants and --muon are two separate benchmarks: pick one")
    if args.quick:
        args.steps, args.warmup, args.reps = 5, 2, 2
    return args


def chosen(args: argparse.Namespace, table: dict[str, tuple], quick: list[str]) -> list[str]:
    """The rows of ``table`` (name: (world size, ...)) this run measures: ``--only``'s,
    ``quick`` with ``--quick``, else all (the 16-rank ones only with ``--with-5d``)."""
    unknown = [n for n in args.only if n not in table]
    if unknown:
        raise SystemExit(f"--only {unknown}: not among {list(table)}")
    if args.only:
        return list(args.only)
    if args.quick:
        return quick
    return [n for n, (w, *_) in table.items() if w < 16 or args.with_5d]


def chosen_layouts(args: argparse.Namespace) -> list[str]:
    return chosen(args, LAYOUTS, ["dp2 x tp2", "hsdp 2 x 2"])


def layout_table(args: argparse.Namespace, name: str, backend: str, folder: str) -> dict:
    _, parallelism, moe = LAYOUTS[name]
    model: dict[str, Any] = {"dim": args.dim, "n_layers": args.layers}
    model.update(n_heads=4, n_kv_heads=2)
    if moe:
        model["moe"] = MOE
    return trainer_table(args, model, {**parallelism, "dp_backend": backend}, folder)


def _rank(rank: int, world_size: int, args: argparse.Namespace, names: list[str], folder: str):
    """Every layout of this world size, both backends, ``reps`` times, their order
    flipped every repetition."""
    out = []
    for name in names:
        for rep in range(args.reps):
            for backend in alternating(BACKENDS, rep):
                where = f"{folder}/{len(out)}"
                records, peak_rss_mb = measured_run(args, layout_table(args, name, backend, where))
                out.append(
                    {
                        "layout": name,
                        "backend": backend,
                        "rep": rep,
                        **timed_row(records, peak_rss_mb, args.warmup),
                    }
                )
    return out


STEP_TARGET = 1.00  # flexshard's step no slower than FSDP2's on every layout


def summarise(world_size: int, per_rank: list[list[dict]]) -> list[dict]:
    """Per layout and backend the medians over repetitions (tokens/s the slowest
    rank's, peak RSS the max over ranks); on flexshard's row its paired ratios to FSDP2
    and the largest loss gap between the backends' first runs."""
    rows = []
    for name in dict.fromkeys(r["layout"] for r in per_rank[0]):
        reps, losses = {}, {}
        for backend in BACKENDS:
            runs = [
                sorted(
                    (r for r in rank_runs if r["layout"] == name and r["backend"] == backend),
                    key=lambda r: r["rep"],
                )
                for rank_runs in per_rank
            ]
            reps[backend], losses[backend] = per_rep(runs), runs[0][0]["losses"]
            tps = statistics.median(reps[backend]["tokens_per_s"])
            rows.append(
                {
                    "layout": name,
                    "world_size": world_size,
                    "backend": backend,
                    "tokens_per_s": tps,
                    "tokens_per_s_per_rank": tps / world_size,
                    "peak_rss_mb_per_rank": statistics.median(reps[backend]["peak_rss_mb"]),
                    "losses": losses[backend],
                    "per_rep": reps[backend],
                }
            )
        flex, fsdp2 = rows[-2], rows[-1]
        flex.update(compare(reps["flexshard"], reps["fsdp2"], STEP_TARGET))
        pairs = zip(losses["flexshard"], losses["fsdp2"])
        gap = max(abs(a - b) / b for a, b in pairs)
        flex["loss_gap_vs_fsdp2"] = fsdp2["loss_gap_vs_fsdp2"] = gap
    return rows


def markdown(rows: list[dict], meta: dict[str, Any]) -> str:
    lines = [
        "# 5-D layouts: flexshard vs torch FSDP2 as the data-parallel backend (CPU, gloo)",
        "",
        f"`{meta['command']}` on {meta['machine']}, torch {meta['torch']}, {meta['date']}, "
        f"load average {meta['load_start']} at start, {meta['load']} at end.",
        f"Model: dim {meta['dim']}, {meta['layers']} layers, 4 heads / 2 kv heads (MoE: 4 "
        f"routed experts, top 2, + 1 shared); {meta['batch']} sequences x {meta['seq_len']} "
        f"tokens per data-parallel rank per step; AdamW, fp32; {meta['steps']} steps per run, "
        f"the first {meta['warmup']} left out; {meta['reps']} runs per backend, their order "
        "flipped every repetition.",
        "",
        RULE,
        "",
        "| layout | W | flexshard tokens/s | FSDP2 tokens/s | step / FSDP2 [IQR] | min–max "
        "| verdict | peak RSS MB/rank (flexshard, FSDP2) | RSS / FSDP2 [IQR] "
        "| max loss gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for flex, fsdp2 in zip(rows[::2], rows[1::2]):
        step, rss = flex["step_vs_fsdp2"], flex["rss_vs_fsdp2"]
        cells = [
            flex["layout"],
            flex["world_size"],
            f"{flex['tokens_per_s']:,.0f}",
            f"{fsdp2['tokens_per_s']:,.0f}",
            cell(step),
            range_cell(step),
            verdict_cell(step),
            f"{flex['peak_rss_mb_per_rank']:.1f}, {fsdp2['peak_rss_mb_per_rank']:.1f}",
            cell(rss, 3),
            f"{flex['loss_gap_vs_fsdp2']:.1e}",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        "- tokens/s: global batch tokens / wall time of one optimizer step, median over the "
        "timed steps, the slowest rank's, then the median over repetitions. step / FSDP2: "
        "per repetition FSDP2's tokens/s over flexshard's (= flexshard's step time over "
        "FSDP2's).",
        "- peak RSS per rank: VmHWM (reset before the run) minus the RSS before the model "
        "was built; max over ranks, median over repetitions. flexshard builds on meta and "
        "initialises its shards; the FSDP2 backend builds the whole (tiny) model on every "
        "rank first.",
        "- Tiny models on an oversubscribed 2-core machine (W processes on 2 cores): the "
        "numbers compare the two backends on one layout, not layouts with each other.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    names = dict.fromkeys(r["layout"] for r in rows)
    groups = {n: [r for r in rows if r["layout"] == n] for n in names}
    title = "flexshard-train 5-D layouts: flexshard vs FSDP2 data parallelism (CPU)"
    plot_backends(groups, BACKENDS, path, title, figsize=(12, 4.2), capsize=3, rotate=True)


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _meta(args: argparse.Namespace, argv: list[str] | None, load_start: str) -> dict[str, Any]:
    return {
        "command": " ".join(
            ["python -m benchmarks.bench_parallel", *map(shlex.quote, argv or sys.argv[1:])]
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_start": load_start,
        "load": _load(),  # at the end
        **{k: getattr(args, k) for k in ("dim", "layers", "seq_len", "batch", "steps")},
        **{k: getattr(args, k) for k in ("warmup", "reps")},
    }


def _stem(args: argparse.Namespace, stem: str) -> str:
    return f"{stem}_quick" if args.quick or args.only else stem  # partial runs keep the full


def main_compared(args: argparse.Namespace, argv: list[str] | None, load_start: str) -> None:
    """``--variants`` or ``--muon``: each world size's rows in one launch (its ratios
    are within that launch)."""
    if args.muon:
        table, rank_fn, summarise_fn = MUON_LAYOUTS, muon_rank, summarise_muon
        stem, write_md, quick = "parallel_muon", muon_markdown, ["tp2"]
    else:
        table, rank_fn, summarise_fn = VARIANTS, variant_rank, summarise_variants
        stem, write_md = "parallel_variants", variants_markdown
        quick = list(VARIANTS)
    names = chosen(args, table, quick)
    rows = []
    for world_size in sorted({table[n][0] for n in names}):
        here = [n for n in names if table[n][0] == world_size]
        folder = f"/tmp/bench_parallel_{os.getpid()}/{stem}_w{world_size}"
        per_rank = run_distributed(rank_fn, world_size, args, here, folder, timeout=3000)
        rows += summarise_fn(world_size, per_rank)
    meta = _meta(args, argv, load_start)
    text = write_md(rows, meta)
    write_results(args.out, _stem(args, stem), meta, rows, text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    load_start = _load()
    args = parse_args(argv)
    if args.variants or args.muon:
        main_compared(args, argv, load_start)
        return
    chosen = chosen_layouts(args)
    sizes = sorted({LAYOUTS[n][0] for n in chosen})
    rows = []
    for world_size in sizes:
        names = [n for n in chosen if LAYOUTS[n][0] == world_size]
        folder = f"/tmp/bench_parallel_{os.getpid()}/w{world_size}"
        per_rank = run_distributed(_rank, world_size, args, names, folder, timeout=3000)
        rows += summarise(world_size, per_rank)
        for r in rows[-2 * len(names) :]:
            print(
                f"{r['layout']:>40} {r['backend']:>9}: {r['tokens_per_s']:8.0f} tok/s", flush=True
            )
    meta = _meta(args, argv, load_start)
    stem = _stem(args, "parallel_bench")
    text = markdown(rows, meta)
    write_results(args.out, stem, meta, rows, text)
    try:
        plot(rows, args.out / f"{stem}.png")
    except ImportError:
        print("matplotlib missing: no PNG")
    print(text)


if __name__ == "__main__":
    main()
