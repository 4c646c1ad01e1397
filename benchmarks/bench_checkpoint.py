"""Trainer checkpoints, synchronous against asynchronous (``[checkpoint] async_mode``),
in one launch: the trainer's blocking time per save (median, P99), the save's wall time
(until the checkpoint is complete), collectives per save, and the training step time
while a background write runs against a step without one.

    .venv/bin/python -m benchmarks.bench_checkpoint            # W = 2, 3 modes, ~3 min
    .venv/bin/python -m benchmarks.bench_checkpoint --quick    # a smaller model, fewer steps

The same W processes run the trainer once per mode ("disabled", "async",
"async_with_pinned_mem"), same model, data and seed, a save every ``--interval`` steps.
Blocking time is what ``checkpointing.save`` takes on the training thread (for async:
waiting for the previous save if it still runs, building the state dict, staging);
wall time runs from the save call until the checkpoint is renamed into place.
Collectives: those the save call issues (torch.distributed calls, every group), and
for async the backend operations the background issued on the checkpointer's own gloo
group. The last checkpoint of each async run is compared byte for byte with the
synchronous run's. Results: benchmarks/results/checkpoint_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from flexshard.testing import run_distributed
from flexshard.testing.collectives import record_collectives
from flexshard.testing.stats import alternating, cell, summary, verdict_cell
from flexshard.trainer import train
from flexshard.trainer.checkpointing import checkpoints as checkpointing
from flexshard.trainer.config import config_from_dict
from flexshard.trainer.models.model import count_params

from .common import write_results

RESULTS = Path(__file__).parent / "results"
MODES = ("disabled", "async", "async_with_pinned_mem")
COMMAND = ".venv/bin/python -m benchmarks.bench_checkpoint"
BLOCKING_TARGET = 0.10  # async blocking time per save over the synchronous save's
STEP_TARGET = 1.10  # a step during a background write over a step without one
NOTES = [
    "Blocking: the time `checkpointing.save` holds the training thread (async: waiting for",
    "the previous save if it still runs, the state dict, the copy to host memory). Wall:",
    "from that call until the checkpoint is renamed into place. P99 is the nearest-rank",
    "quantile, with 12 saves per mode their largest. Collectives on the training groups:",
    "torch.distributed calls during the save call on any group but the checkpointer's own",
    "(the first async save: its `new_group`); background ops: the gloo operations the",
    "background issued on that group per save (what DCP's four object collectives and",
    'the two of the checksum and completion need). A step is "during a write" when the',
    "background save was running as it began; its ratio compares it with the steps of the",
    "same run that began without one.",
    "Same bytes: the last checkpoint's chunk files and extras equal the synchronous run's.",
    "The machine is two cores shared with other jobs (see the load average): two training",
    "ranks leave no idle core for the background writer (serialisation, fsync, SHA-256",
    "of every chunk), so a step during a write slows down; `async_with_pinned_mem` reuses",
    "its staging buffers (no allocation per save). Pinned memory needs CUDA: not measured.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--reps", type=int, default=2, help="repetitions of every mode")
    p.add_argument("--interval", type=int, default=5, help="steps between saves")
    p.add_argument("--folder", default="/tmp/flexshard_bench_checkpoint")
    p.add_argument("--quick", action="store_true", help="dim 128, 4 layers, 12 steps")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.steps, args.interval, args.reps = 128, 4, 12, 4, 1
    return args


def _config(args: dict[str, Any], mode: str) -> Any:
    return config_from_dict(
        {
            "model": {
                "dim": args["dim"],
                "n_layers": args["layers"],
                "n_heads": 8,
                "n_kv_heads": 4,
            },
            "training": {"steps": args["steps"], "seq_len": 64, "batch_size": 2, "seed": 1},
            "checkpoint": {"enable": True, "interval": args["interval"], "async_mode": mode},
            "job": {
                "dump_folder": f"{args['folder']}/{mode}",
                "progress": False,
                "plot": False,
                "tensorboard": False,
                "log_every": 1000,
            },
        }
    )


def _sequence(saver: Any) -> int:
    group = getattr(saver, "_group", None)
    return 0 if group is None else group._get_sequence_number_for_group()


def _group_name(saver: Any) -> str | None:
    group = getattr(saver, "_group", None)
    return None if group is None else group.group_name


def _run_once(args: dict[str, Any], mode: str) -> dict[str, Any]:
    """One training run in ``mode``: per save and per step, what the docstring lists."""
    real_save, real_step = checkpointing.save, train.train_step
    saves: list[dict[str, Any]] = []
    steps: list[tuple[float, bool]] = []
    savers: list[Any] = []

    def save(job: Any, step: int) -> Any:
        before = _sequence(job.checkpointer)
        begin = time.perf_counter()
        with record_collectives() as log:
            path = real_save(job, step)
        blocking = time.perf_counter() - begin
        if job.checkpointer is not None and not savers:
            savers.append(job.checkpointer)
        # the training groups' (and new_group); the background's own group is counted
        # apart (its thread may start while the call is still open)
        ours = _group_name(job.checkpointer)
        calls = [r.name for r in log.records if not r.groups or set(r.groups) - {ours}]
        saves.append({"blocking_s": blocking, "calls": calls, "seq_before": before})
        return path

    def step_fn(job: Any, step: int) -> Any:
        busy = job.checkpointer is not None and job.checkpointer.busy()
        begin = time.perf_counter()
        result = real_step(job, step)
        steps.append((time.perf_counter() - begin, busy))
        return result

    checkpointing.save, train.train_step = save, step_fn
    try:
        train.run(_config(args, mode))
    finally:
        checkpointing.save, train.train_step = real_save, real_step
    if savers:  # the background's operations on the saver's group, per save
        saver = savers[0]
        ends = [s["seq_before"] for s in saves[1:]] + [_sequence(saver)]
        for s, record, end in zip(saves, saver.records, ends):
            s["wall_s"] = record.wall_s
            s["staged_mb"] = record.staged_bytes / 2**20
            s["background_ops"] = end - s["seq_before"] if s["seq_before"] else None
    return {"saves": saves, "steps": steps[2:]}  # the first two steps warm up


def _measure(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, list]:
    """``reps`` repetitions of every mode, their order flipped each repetition."""
    import shutil

    torch.set_num_threads(1)
    out: dict[str, list] = {mode: [] for mode in MODES}
    for rep in range(args["reps"]):
        for mode in alternating(MODES, rep):
            if rank == 0:
                shutil.rmtree(f"{args['folder']}/{mode}", ignore_errors=True)
            torch.distributed.barrier()
            out[mode].append(_run_once(args, mode))
    return out


def _pct(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank (P99 of a few saves is their maximum)."""
    data = sorted(values)
    return data[min(len(data) - 1, max(0, round(q * len(data) + 0.5) - 1))]


def _same_bytes(folder: str, mode: str, step: int) -> bool:
    a, b = Path(folder) / "disabled" / "checkpoint", Path(folder) / mode / "checkpoint"
    files = sorted(p.name for p in (a / f"step-{step}").iterdir() if p.suffix in (".distcp", ".pt"))
    return bool(files) and all(
        (a / f"step-{step}" / f).read_bytes() == (b / f"step-{step}" / f).read_bytes()
        for f in files
    )


def _median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(s[key] for run in runs for s in run["saves"])


def summarise(results: list[dict[str, list]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per mode, over every rank's saves and steps; per repetition, async's blocking
    median over sync's and the median step during a write over one without (the same
    run), judged against the targets (flexshard/testing/stats.py)."""
    rows = []
    runs = {m: [r[m][rep] for rep in range(args.reps) for r in results] for m in MODES}
    for mode in MODES:
        saves = [s for run in runs[mode] for s in run["saves"]]
        steps = [s for run in runs[mode] for s in run["steps"]]
        blocking = [s["blocking_s"] for s in saves]
        walls = [s.get("wall_s") or s["blocking_s"] for s in saves]
        later = [s for run in runs[mode] for s in run["saves"][1:]]
        during = [t for t, busy in steps if busy]
        without = [t for t, busy in steps if not busy]
        row: dict[str, Any] = {
            "mode": mode,
            "saves": len(saves),
            "blocking_median_s": statistics.median(blocking),
            "blocking_p99_s": _pct(blocking, 0.99),
            "wall_median_s": statistics.median(walls),
            "wall_p99_s": _pct(walls, 0.99),
            "calls_first": max(len(run["saves"][0]["calls"]) for run in runs[mode]),
            "calls_later": max((len(s["calls"]) for s in later), default=0),
            "background_ops_later": statistics.median(s.get("background_ops") or 0 for s in later)
            if later
            else 0,
            "step_without_s": statistics.median(without) if without else None,
            "step_during_s": statistics.median(during) if during else None,
            "steps_during": len(during),
            "staged_mb": max((s.get("staged_mb", 0.0) for s in saves), default=0.0),
        }
        if mode != "disabled":
            per_rep_blocking, per_rep_step = [], []
            for rep in range(args.reps):
                mine = [r[mode][rep] for r in results]
                sync = [r["disabled"][rep] for r in results]
                per_rep_blocking.append(
                    _median_of(mine, "blocking_s") / _median_of(sync, "blocking_s")
                )
                rep_steps = [s for run in mine for s in run["steps"]]
                busy = [t for t, b in rep_steps if b]
                idle = [t for t, b in rep_steps if not b]
                if busy and idle:
                    per_rep_step.append(statistics.median(busy) / statistics.median(idle))
            row["blocking_vs_sync"] = summary(per_rep_blocking, BLOCKING_TARGET)
            if per_rep_step:
                row["during_vs_without"] = summary(per_rep_step, STEP_TARGET)
            row["same_bytes_as_sync"] = _same_bytes(args.folder, mode, args.steps)
        rows.append(row)
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    def f(v: Any, digits: int = 3) -> str:
        return "–" if v is None else f"{v:.{digits}f}"

    lines = [
        "# Checkpoint saves: synchronous vs asynchronous",
        "",
        f"Command: `{meta['command']}`  ",
        f"{meta['when']}, {meta['machine']}, torch {meta['torch']}, W = {meta['world']} gloo "
        f"processes; model dim {meta['dim']}, {meta['layers']} layers, {meta['params']:,} "
        f"parameters; {meta['steps']} steps with a save every {meta['interval']}, "
        f"{meta['reps']} repetitions of every mode in alternating order; "
        f"{meta['state_mb']:.0f} MB of state staged per rank; load average at start "
        f"{meta['load']}.",
        "",
        "| mode | saves | blocking median / P99 (s) | wall median / P99 (s) | "
        "collectives on the training groups, first / later save | background ops on "
        "its own group, later save | step without / during a write (s) | same bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        background = r["background_ops_later"] if r["mode"] != "disabled" else "–"
        lines.append(
            f"| {r['mode']} | {r['saves']} | {f(r['blocking_median_s'])} / "
            f"{f(r['blocking_p99_s'])} | {f(r['wall_median_s'])} / {f(r['wall_p99_s'])} | "
            f"{r['calls_first']} / {r['calls_later']} | {background} | "
            f"{f(r['step_without_s'])} / {f(r['step_during_s'])} ({r['steps_during']} during) | "
            f"{r.get('same_bytes_as_sync', '–')} |"
        )
    lines += [
        "",
        "Per repetition (median [IQR] over repetitions; verdicts judged on the IQR):",
        "",
        "| mode | blocking ÷ sync blocking | verdict | step during ÷ step without a write "
        "| verdict |",
        "|---|---|---|---|---|",
    ]
    for r in rows[1:]:
        step = r.get("during_vs_without")
        lines.append(
            f"| {r['mode']} | {cell(r['blocking_vs_sync'])} | "
            f"{verdict_cell(r['blocking_vs_sync'])} | {cell(step) if step else '–'} | "
            f"{verdict_cell(step) if step else '–'} |"
        )
    lines += ["", *meta["notes"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import os

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    config = vars(args).copy()
    config.pop("out")
    results = run_distributed(_measure, args.world, config, timeout=900)
    rows = summarise(results, args)
    cfg = _config(config, "disabled")
    total, _ = count_params(cfg.model)
    state_mb = max(r["staged_mb"] for r in rows)
    flags = [a for a in (argv if argv is not None else __import__("sys").argv[1:])]
    meta = {
        "command": " ".join([COMMAND, *flags]),
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "world": args.world,
        "dim": args.dim,
        "layers": args.layers,
        "params": total,
        "steps": args.steps,
        "interval": args.interval,
        "reps": args.reps,
        "state_mb": state_mb,
        "load": load,
        "notes": NOTES,
    }
    text = markdown(meta, rows)
    write_results(args.out, "checkpoint_bench" + ("_quick" if args.quick else ""), meta, rows, text)
    print(text)


if __name__ == "__main__":
    main()
