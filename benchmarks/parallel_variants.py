"""``bench_parallel --variants``: two implementations of one piece of the 5-D trainer
side by side on the same layout, model, data and seed (flexshard backend): ring CP
against the all-gather CP, and the MoE experts through ``F.grouped_mm`` against the
Python loop of three matmuls per expert (``models.moe.loop_swiglu``, what
``GroupedExperts.grouped = False`` runs). Both sides of a comparison run inside the
same processes, ``--reps`` times, their order flipped every repetition; the ratio is
side B's step time over side A's per repetition (> 1: B is slower).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator
from typing import Any

from flexshard.testing.stats import RULE, alternating, cell, range_cell, summary

from .bench_trainer import measured_run, per_rep, timed_row, trainer_table

MOE = {"num_experts": 4, "top_k": 2, "expert_hidden": 64, "first_dense_layers": 1}
# name: (world size, parallelism, MoE?, what differs, (side A, side B))
VARIANTS: dict[str, tuple[int, dict, bool, str, tuple[str, str]]] = {
    "CP: all-gather vs ring (dp2 x cp2)": (
        4,
        {"dp_shard": 2, "cp": 2},
        False,
        "cp_method",
        ("allgather", "ring"),
    ),
    "MoE experts: grouped_mm vs loop (dp4, ep2)": (
        4,
        {"dp_shard": 4, "ep": 2},
        True,
        "experts",
        ("grouped_mm", "loop"),
    ),
    "MoE experts: grouped_mm vs loop (dp4, no EP)": (
        4,
        {"dp_shard": 4},
        True,
        "experts",
        ("grouped_mm", "loop"),
    ),
}


@contextlib.contextmanager
def experts(impl: str) -> Iterator[None]:
    """Run the MoE experts through ``impl``: "grouped_mm" (the default) or "loop"
    (the model's ``grouped_swiglu`` replaced by the reference loop meanwhile)."""
    from flexshard.trainer.models import model
    from flexshard.trainer.models.moe import loop_swiglu

    saved = model.grouped_swiglu
    if impl == "loop":
        model.grouped_swiglu = loop_swiglu  # type: ignore[assignment]
    try:
        yield
    finally:
        model.grouped_swiglu = saved  # type: ignore[assignment]


def _table(args: argparse.Namespace, name: str, side: str, folder: str) -> dict:
    _, parallelism, moe, what, _ = VARIANTS[name]
    model: dict[str, Any] = {"dim": args.dim, "n_layers": args.layers, "n_heads": 4}
    model["n_kv_heads"] = 2
    if moe:
        model["moe"] = MOE
    par = {**parallelism, "dp_backend": "flexshard"}
    if what == "cp_method":
        par["cp_method"] = side
    return trainer_table(args, model, par, folder)


def variant_rank(
    rank: int, world_size: int, args: argparse.Namespace, names: list[str], folder: str
) -> list[dict]:
    """Every comparison of this world size, both sides, ``reps`` times."""
    out = []
    for name in names:
        what, sides = VARIANTS[name][3], VARIANTS[name][4]
        for rep in range(args.reps):
            for side in alternating(sides, rep):
                table = _table(args, name, side, f"{folder}/v{len(out)}")
                with experts(side if what == "experts" else "grouped_mm"):
                    records, peak_rss_mb = measured_run(args, table)
                out.append(
                    {
                        "variant": name,
                        "side": side,
                        "rep": rep,
                        **timed_row(records, peak_rss_mb, args.warmup),
                    }
                )
    return out


def summarise_variants(world_size: int, per_rank: list[list[dict]]) -> list[dict]:
    """Per comparison: each side's median tokens/s (the slowest rank's), the paired
    ratio B step / A step, and the largest relative loss gap between the sides."""
    rows = []
    for name in dict.fromkeys(r["variant"] for r in per_rank[0]):
        a, b = VARIANTS[name][4]
        reps, losses = {}, {}
        for side in (a, b):
            runs = [
                sorted(
                    (r for r in rank_runs if r["variant"] == name and r["side"] == side),
                    key=lambda r: r["rep"],
                )
                for rank_runs in per_rank
            ]
            reps[side], losses[side] = per_rep(runs), runs[0][0]["losses"]
        step = [x / y for x, y in zip(reps[a]["tokens_per_s"], reps[b]["tokens_per_s"])]
        rows.append(
            {
                "variant": name,
                "world_size": world_size,
                "sides": [a, b],
                "tokens_per_s": {s: statistics.median(reps[s]["tokens_per_s"]) for s in (a, b)},
                "peak_rss_mb_per_rank": {
                    s: statistics.median(reps[s]["peak_rss_mb"]) for s in (a, b)
                },
                "step_b_vs_a": summary(step),
                "loss_gap": max(abs(x - y) / y for x, y in zip(losses[b], losses[a])),
                "per_rep": reps,
            }
        )
    return rows


def variants_markdown(rows: list[dict], meta: dict[str, Any]) -> str:
    lines = [
        "# 5-D trainer pieces: ring vs all-gather CP, grouped_mm vs loop MoE experts (CPU)",
        "",
        f"`{meta['command']}` on {meta['machine']}, torch {meta['torch']}, {meta['date']}, "
        f"load average {meta['load_start']} at start, {meta['load']} at end.",
        f"Model: dim {meta['dim']}, {meta['layers']} layers, 4 heads / 2 kv heads (MoE: 4 "
        f"routed experts, top 2, + 1 shared); {meta['batch']} sequences x {meta['seq_len']} "
        f"tokens per data-parallel rank per step; flexshard backend, AdamW, fp32; "
        f"{meta['steps']} steps per run, the first {meta['warmup']} left out; "
        f"{meta['reps']} runs per side, their order flipped every repetition.",
        "",
        RULE,
        "",
        "| comparison (A vs B) | W | A tokens/s | B tokens/s | B step / A step [IQR] "
        "| min–max | peak RSS MB/rank (A, B) | max loss gap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        a, b = row["sides"]
        tps, rss, step = row["tokens_per_s"], row["peak_rss_mb_per_rank"], row["step_b_vs_a"]
        cells = [
            row["variant"],
            row["world_size"],
            f"{tps[a]:,.0f}",
            f"{tps[b]:,.0f}",
            cell(step),
            range_cell(step),
            f"{rss[a]:.1f}, {rss[b]:.1f}",
            f"{row['loss_gap']:.1e}",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        "- B step / A step: per repetition A's tokens/s over B's (the slowest rank's), "
        "then the median; > 1: B is slower. Loss gap: the largest relative difference of "
        "the per-step losses of the two sides' first runs (same seed and data).",
        "- Tiny models on an oversubscribed CPU machine (W processes on few cores, shared "
        "with other jobs): the ratios compare the two sides within one launch, not "
        "absolute speeds.",
    ]
    return "\n".join(lines) + "\n"
