"""Muon layouts measured on CPU / gloo: the trainer's ``placement = "muon"`` (ragged
per-block buckets, matrices whole on balanced owners) against FSDP2's layout with a
redistributing DistMuon (``placement = "shard0"``), both ``training.optimizer =
"muon"``, fp32, dp only; next to the plan of the same config and W.

    .venv/bin/python -m benchmarks.muon_layouts                    # W = 4 and 8
    .venv/bin/python -m benchmarks.muon_layouts --worlds 4 --steps 4

Per (model, W) one launch runs both sides in the same processes, same seed and data,
the side that goes first alternating by case. The measurement is
``flexshard.testing.muon_layouts`` (which tests/optim/test_muon_layouts_measured.py
runs too). Memory and bytes are exact counts, not timings. Writes
benchmarks/results/muon_layouts.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch

from flexshard.testing.muon_layouts import MODELS, SIDES, compare

RESULTS = Path(__file__).parent / "results"
KiB = 1024


def _kib(n: float) -> str:
    return f"{n / KiB:,.1f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b else "-"


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        '# Muon layouts, measured: placement = "muon" vs FSDP2 layout + redistributing DistMuon',
        "",
        f"`{command}`, torch {torch.__version__}, gloo CPU, {now}. Models: "
        + "; ".join(
            f"{name}: "
            + ", ".join(f"{k} {v}" for k, v in cfg.items() if k != "moe")
            + (f", moe {cfg['moe']}" if "moe" in cfg else "")
            for name, cfg in MODELS.items()
        )
        + ". Per rank, step 3 (after the optimizer state exists). KiB; measured (planned).",
        "",
        "| model | W | side | gathered params peak | all live tensors peak (phase) "
        "| bucket bytes/step mean [max rank] | DistMuon step bytes (collectives) "
        "| bytes/step mean (planned) | agreement all-reduce (not planned) "
        "| plan gathered_peak incl. unsharded grads | max loss gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["planned"]
        lines.append(
            f"| {r['model']} | {r['world']} | {r['side']} "
            f"| {_kib(r['gathered_params_peak'])} ({_kib(p['gathered_params_peak'])}, "
            f"{r['gap_gathered_params']:+.1%}) "
            f"| {_kib(r['total_peak'])} ({r['total_peak_phase']}) ({_kib(p['total'])}, "
            f"{r['gap_total']:+.1%}) "
            f"| {_kib(r['bucket_bytes_mean'])} [{_kib(max(r['bucket_bytes_per_rank']))}] "
            f"| {_kib(max(r['optimizer_bytes_per_rank']))} ({r['optimizer_collectives']}) "
            f"| {_kib(r['bytes_per_step_mean'])} ({_kib(p['bytes_per_step'])}, "
            f"{r['gap_bytes']:+.3%}) | {r['agreement_bytes_mean']:,.0f} B "
            f"| {_kib(p['gathered_peak'])} | {r['max_loss_gap']:.1e} |"
        )
    lines += [
        "",
        "muon / shard0, per (model, W):",
        "",
        "| model | W | gathered params peak | all live peak (max rank) | bytes/step mean "
        "| bucket bytes, max rank |",
        "|---|---|---|---|---|---|",
    ]
    for muon, shard0 in zip(rows[::2], rows[1::2]):
        busiest = max(muon["bucket_bytes_per_rank"]), max(shard0["bucket_bytes_per_rank"])
        lines.append(
            f"| {muon['model']} | {muon['world']} "
            f"| {_ratio(muon['gathered_params_peak'], shard0['gathered_params_peak'])} "
            f"| {_ratio(muon['total_peak'], shard0['total_peak'])} "
            f"| {_ratio(muon['bytes_per_step_mean'], shard0['bytes_per_step_mean'])} "
            f"| {_ratio(*busiest)} |"
        )
    lines += [
        "",
        "- Gathered params peak: the buckets' all-gather outputs and full parameters with "
        "memory of their own, the largest sum alive at any allocation of the step (every "
        "rank alike). Planned: the plan's step moments without the unsharded gradients. "
        "The plan's own `gathered_peak` (last column) also counts the unsharded gradients "
        "and reduce-scatter inputs in flight, which are not measured apart here.",
        "- All live tensors peak: `flexshard.testing.plan_memory`'s count (the model's "
        "state and what the step allocates), the largest rank; planned: the plan's "
        "`total` (its busiest rank).",
        "- Bytes: what the buckets' `comm_stats()` and DistMuon's `comm_stats()` count "
        "for the measured step, averaged over ranks as the plan counts them (ragged "
        "buckets send each rank's own extent: the max rank is in brackets). DistMuon "
        "collectives: its all-to-alls (and TP all-gathers) in that step. Bytes/step: "
        "buckets + DistMuon, less the backward's all-reduce agreeing on unused "
        "parameters (its own column: the plan does not count it; it is in the bucket "
        "bytes).",
        "- Max loss gap: the largest relative gap between the two sides' losses over the "
        "steps (rank 0's global loss).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS / "muon_layouts")
    args = p.parse_args(argv)
    command = " ".join([".venv/bin/python -m benchmarks.muon_layouts", *sys.argv[1:]]).strip()
    rows: list[dict[str, Any]] = []
    case = 0
    for model in args.models:
        for world in args.worlds:
            rows += compare(model, world, args.steps, first=SIDES[case % 2])
            case += 1
    text = markdown(rows, command)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": command, "torch": torch.__version__, "rows": rows}, indent=1)
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
