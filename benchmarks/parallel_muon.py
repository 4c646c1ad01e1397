"""``bench_parallel --muon``: ``training.optimizer = "muon"`` (DistMuon for the hidden
matrices + AdamW for the rest, flexshard backend) on the tp / pp layouts, beside the
same layout with AdamW on flexshard and with AdamW on torch FSDP2.

Muon on the FSDP2 backend is refused (a ConfigError), so there is no same-optimizer
peer on FSDP2. The two peers say two different things: Muon against flexshard's AdamW
is what the optimizer step costs on top of AdamW's (the Newton–Schulz iterations and
the optimizer's own all-to-alls / all-gathers, same buckets and layout otherwise);
Muon against FSDP2's AdamW is where a Muon run stands against the torch baseline a
user would otherwise run. flexshard's AdamW against FSDP2's (the main table's ratio,
here in the same launch) tells how much of the second is the backend, not Muon.

All three sides run inside the same processes, same model, data and seed, ``--reps``
times; the order puts Muon between its two peers and flips every repetition
(stats.centred + stats.alternating). Per repetition each ratio is the two sides'
step times, then the median and IQR (flexshard/testing/stats.py). The Muon step's own
communication is DistMuon's ``comm_stats()`` (its all-to-alls, and under TP the dp
all-gathers of the split matrices), per optimizer step, the largest over ranks; it is
not in the trainer's ``comm_bytes`` (the buckets' all-gathers / reduce-scatters).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Iterator
from typing import Any

import torch

from flexshard.testing.stats import (
    RULE,
    alternating,
    cell,
    centred,
    paired_ratios,
    range_cell,
    summary,
)

from .bench_trainer import measured_run, per_rep, timed_row, trainer_table

MB = 2**20
# name: (world size, parallelism)
MUON_LAYOUTS: dict[str, tuple[int, dict]] = {
    "tp2": (2, {"dp_shard": 1, "tp": 2}),
    "pp2": (2, {"dp_shard": 1, "pp": 2}),
    "tp2 x pp2": (4, {"dp_shard": 1, "tp": 2, "pp": 2}),
    "dp2 x tp2": (4, {"dp_shard": 2, "tp": 2}),
}
MUON, ADAMW_FLEX, ADAMW_FSDP2 = "muon/flexshard", "adamw/flexshard", "adamw/fsdp2"
# Muon in the middle, next to both of its peers
SIDES = centred((ADAMW_FLEX, MUON, ADAMW_FSDP2), MUON)
# (numerator, denominator): the numerator's step time over the denominator's
RATIOS = ((MUON, ADAMW_FLEX), (MUON, ADAMW_FSDP2), (ADAMW_FLEX, ADAMW_FSDP2))


@contextlib.contextmanager
def captured_optimizer() -> Iterator[list[torch.optim.Optimizer]]:
    """The optimizers the trainer builds meanwhile (its ``build_optimizer`` wrapped):
    the run's records carry the buckets' bytes, not the optimizer's."""
    from flexshard.trainer import train

    built: list[torch.optim.Optimizer] = []
    saved = train.build_optimizer

    def build(*args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        built.append(saved(*args, **kwargs))
        return built[-1]

    train.build_optimizer = build  # type: ignore[assignment]
    try:
        yield built
    finally:
        train.build_optimizer = saved  # type: ignore[assignment]


def _table(args: argparse.Namespace, name: str, side: str, folder: str) -> dict:
    optimizer, backend = side.split("/")
    model = {"dim": args.dim, "n_layers": args.layers, "n_heads": 4, "n_kv_heads": 2}
    parallelism = {**MUON_LAYOUTS[name][1], "dp_backend": backend}
    table = trainer_table(args, model, parallelism, folder)
    table["training"]["optimizer"] = optimizer
    return table


def _optimizer_comm(optimizer: torch.optim.Optimizer, steps: int) -> dict[str, float]:
    """Per optimizer step: what the optimizer itself sent (DistMuon's counters over
    the whole run, every step alike: its plan is built once); AdamW sends nothing."""
    stats = getattr(optimizer, "comm_stats", None)
    if stats is None:
        return {"bytes_sent": 0.0, "collectives": 0.0, "tp_newton_schulz": 0.0}
    s = stats()
    return {
        "bytes_sent": s["bytes_sent"] / steps,
        "collectives": (s["all_to_all"] + s.get("tp_all_gather", 0)) / steps,
        "tp_newton_schulz": s.get("tp_newton_schulz", 0) / steps,
    }


def muon_rank(
    rank: int, world_size: int, args: argparse.Namespace, names: list[str], folder: str
) -> list[dict]:
    """Every Muon layout of this world size, the three sides, ``reps`` times."""
    out = []
    for name in names:
        for rep in range(args.reps):
            for side in alternating(SIDES, rep):
                table = _table(args, name, side, f"{folder}/m{len(out)}")
                with captured_optimizer() as built:
                    records, peak_rss_mb = measured_run(args, table)
                buckets = (records[-1]["comm_bytes"] or {}).get("total", 0)
                out.append(
                    {
                        "layout": name,
                        "side": side,
                        "rep": rep,
                        **timed_row(records, peak_rss_mb, args.warmup),
                        "bucket_mb_per_step": buckets / MB,
                        "optimizer": _optimizer_comm(built[-1], len(records)),
                    }
                )
    return out


def summarise_muon(world_size: int, per_rank: list[list[dict]]) -> list[dict]:
    """Per layout: each side's median tokens/s (the slowest rank's) and peak RSS, the
    paired step-time ratios of RATIOS, the optimizer's bytes per step (max over ranks)
    and the last losses."""
    rows = []
    for name in dict.fromkeys(r["layout"] for r in per_rank[0]):
        reps, runs = {}, {}
        for side in SIDES:
            runs[side] = [
                sorted(
                    (r for r in rank_runs if r["layout"] == name and r["side"] == side),
                    key=lambda r: r["rep"],
                )
                for rank_runs in per_rank
            ]
            reps[side] = per_rep(runs[side])
        first = {side: [rank[0] for rank in runs[side]] for side in SIDES}  # rep 0, per rank
        muon_comm = [r["optimizer"] for r in first[MUON]]
        flex_losses, fsdp2_losses = first[ADAMW_FLEX][0]["losses"], first[ADAMW_FSDP2][0]["losses"]
        rows.append(
            {
                "layout": name,
                "world_size": world_size,
                "tokens_per_s": {s: statistics.median(reps[s]["tokens_per_s"]) for s in SIDES},
                "peak_rss_mb_per_rank": {
                    s: statistics.median(reps[s]["peak_rss_mb"]) for s in SIDES
                },
                "ratios": {
                    f"{a} vs {b}": summary(
                        paired_ratios(reps[b]["tokens_per_s"], reps[a]["tokens_per_s"])
                    )
                    for a, b in RATIOS
                },
                "muon_optimizer_mb_per_step": max(c["bytes_sent"] for c in muon_comm) / MB,
                "muon_optimizer_collectives_per_step": max(c["collectives"] for c in muon_comm),
                "muon_tp_newton_schulz_per_rank": [c["tp_newton_schulz"] for c in muon_comm],
                "bucket_mb_per_step": {
                    s: max(r["bucket_mb_per_step"] for r in first[s]) for s in SIDES
                },
                "loss_last": {s: first[s][0]["losses"][-1] for s in SIDES},
                "adamw_loss_gap_flexshard_vs_fsdp2": max(
                    abs(x - y) / y for x, y in zip(flex_losses, fsdp2_losses)
                ),
                "per_rep": reps,
            }
        )
    return rows


def muon_markdown(rows: list[dict], meta: dict[str, Any]) -> str:
    lines = [
        "# Muon under tp / pp: Muon (flexshard) vs AdamW on flexshard and on FSDP2 (CPU)",
        "",
        f"`{meta['command']}` on {meta['machine']}, torch {meta['torch']}, {meta['date']}, "
        f"load average {meta['load_start']} at start, {meta['load']} at end.",
        f"Model: dim {meta['dim']}, {meta['layers']} layers, 4 heads / 2 kv heads; "
        f"{meta['batch']} sequences x {meta['seq_len']} tokens per data-parallel rank per "
        f"step; fp32; {meta['steps']} steps per run, the first {meta['warmup']} left out; "
        f"{meta['reps']} runs per side, the order {' / '.join(SIDES)} flipped every "
        "repetition. Muon on dp_backend = fsdp2 is refused, hence the two AdamW peers.",
        "",
        RULE,
        "",
        "| layout | W | tokens/s: Muon, AdamW flexshard, AdamW FSDP2 "
        "| Muon step / AdamW-flexshard step [IQR] | min–max "
        "| Muon step / AdamW-FSDP2 step [IQR] | min–max "
        "| AdamW flexshard / FSDP2 [IQR] | Muon optimizer MB/step (collectives) "
        "| Muon TP matrices orthogonalised per rank "
        "| bucket MB/step (Muon, AdamW) | peak RSS MB/rank (Muon, AdamW fs, FSDP2) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        tps, rss, ratio = row["tokens_per_s"], row["peak_rss_mb_per_rank"], row["ratios"]
        vs_flex, vs_fsdp2 = ratio[f"{MUON} vs {ADAMW_FLEX}"], ratio[f"{MUON} vs {ADAMW_FSDP2}"]
        buckets = row["bucket_mb_per_step"]
        cells = [
            row["layout"],
            row["world_size"],
            ", ".join(f"{tps[s]:,.0f}" for s in (MUON, ADAMW_FLEX, ADAMW_FSDP2)),
            cell(vs_flex),
            range_cell(vs_flex),
            cell(vs_fsdp2),
            range_cell(vs_fsdp2),
            cell(ratio[f"{ADAMW_FLEX} vs {ADAMW_FSDP2}"]),
            f"{row['muon_optimizer_mb_per_step']:.3f} "
            f"({row['muon_optimizer_collectives_per_step']:.0f})",
            ", ".join(f"{n:.0f}" for n in row["muon_tp_newton_schulz_per_rank"]),
            f"{buckets[MUON]:.3f}, {buckets[ADAMW_FLEX]:.3f}",
            ", ".join(f"{rss[s]:.1f}" for s in (MUON, ADAMW_FLEX, ADAMW_FSDP2)),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        "- Ratios: per repetition the denominator side's tokens/s over the numerator "
        "side's (the slowest rank's) = the step-time ratio, then the median; > 1: the "
        "numerator is slower. No target: Muon does more work per step than AdamW.",
        "- Muon optimizer MB/step: what DistMuon's step sent (`comm_stats()`: its "
        "all-to-alls, and under TP the dp all-gathers of split matrices), largest over "
        "ranks; collectives: those issued per step. TP matrices orthogonalised: per "
        "step, the tp-split matrices whose Newton–Schulz each rank ran (the owner plan "
        "over tp; matrices Muon handles otherwise are not counted). Bucket MB/step: the trainer's "
        "`comm_bytes['total']` (the flexshard buckets' all-gathers / reduce-scatters), "
        "largest over ranks; neither includes TP's / PP's activation traffic.",
        "- Loss: the AdamW sides' losses are compared (largest relative gap in the JSON, "
        "`adamw_loss_gap_flexshard_vs_fsdp2`); Muon's differ by design.",
        "- Tiny models on an oversubscribed CPU machine shared with other jobs: the "
        "ratios compare sides within one launch, not absolute speeds.",
    ]
    return "\n".join(lines) + "\n"
