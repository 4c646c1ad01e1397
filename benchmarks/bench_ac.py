"""Activation checkpointing in the trainer: peak live memory and step time per
``[activation_checkpoint]`` mode, on one model and data stream, W gloo ranks.

    .venv/bin/python -m benchmarks.bench_ac            # W = 2, flexshard, 4 timed steps
    .venv/bin/python -m benchmarks.bench_ac --quick    # 2 timed steps

Each mode builds the trainer's own job (``setup``), runs 2 warm-up steps, times
``--steps`` steps (median; every mode twice, the second pass in reverse order, the
lower median kept), then one more step under ``LiveTensors`` (every CPU
tensor storage alive, flexshard/testing/live_memory.py): the peak above what was alive
before the step (parameters, optimizer state), with the bytes alive at the peak that
forward allocated (the activations). The modes run one after another in one launch;
the losses of each step are checked equal to the plain run's (bit for bit).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flexshard.testing import run_distributed
from flexshard.testing.live_memory import MB, LiveTensors
from flexshard.trainer.config import config_from_dict
from flexshard.trainer.train import loss_fn, setup, train_step

from .common import write_results

RESULTS = Path(__file__).parent / "results"
MODES: dict[str, dict[str, str]] = {
    "none": {"mode": "none"},
    "selective op": {"mode": "selective", "selective_ac_option": "op"},
    "selective 2": {"mode": "selective", "selective_ac_option": "2"},
    "full": {"mode": "full"},
}
MODEL = {"dim": 128, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2}
TRAINING = {"seq_len": 256, "batch_size": 4, "steps": 100, "lr": 1e-3}


def _config(folder: str, mode: str, backend: str) -> Any:
    return config_from_dict(
        {
            "model": MODEL,
            "training": TRAINING,
            "parallelism": {"dp_backend": backend},
            "activation_checkpoint": MODES[mode],
            "job": {"dump_folder": folder, "progress": False, "plot": False},
        }
    )


def _live_step(job: Any, step: int) -> dict[str, float]:
    """One step's forward and backward under LiveTensors (no optimizer step: its state
    is the same in every mode)."""
    inputs, targets = job.sampler.batch(step, 0)
    with LiveTensors() as live:
        base = live.bytes_now()
        live.phase = "forward"
        loss = loss_fn(job.model(inputs), targets)
        live.phase = "backward"
        loss.backward()
    job.optimizer.zero_grad(set_to_none=True)
    parts = live.breakdown()
    return {
        "peak_mb": (live.peak_bytes - base) / MB,
        "activations_mb": parts.get("forward", 0) / MB,
        "phase": live.peak_phase,
    }


def _time_mode(folder: str, mode: str, backend: str, steps: int) -> dict[str, Any]:
    job = setup(_config(folder, mode, backend))
    losses, times = [], []
    for step in range(2 + steps):
        begin = time.perf_counter()
        loss, _, _ = train_step(job, step)
        if step >= 2:
            times.append(time.perf_counter() - begin)
        losses.append(loss)
    return {"losses": losses, "step_s": statistics.median(times), **_live_step(job, 2 + steps)}


def _rank(rank: int, world: int, folder: str, steps: int, backend: str) -> dict[str, Any]:
    """Every mode twice, the second pass in reverse order (a loaded machine drifts):
    the step time is the lower of the two medians, the memory the first pass's."""
    rows = {mode: _time_mode(f"{folder}/{mode}", mode, backend, steps) for mode in MODES}
    for mode in reversed(MODES):
        again = _time_mode(f"{folder}/{mode}_again", mode, backend, steps)
        rows[mode]["step_s"] = min(rows[mode]["step_s"], again["step_s"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--backend", choices=("flexshard", "fsdp2"), default="flexshard")
    p.add_argument("--quick", action="store_true", help="2 timed steps")
    args = p.parse_args(argv)
    steps = 2 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as folder:
        results = run_distributed(_rank, args.world, folder, steps, args.backend, timeout=600)
    rows = results[0]
    for mode, row in rows.items():  # recompute: the same ops in the same order
        assert row["losses"] == rows["none"]["losses"], (mode, row["losses"])
    command = "python -m benchmarks.bench_ac " + " ".join(sys.argv[1:] if argv is None else argv)
    plain = rows["none"]
    lines = [
        f"Activation checkpointing, `{command.strip()}`: W = {args.world} gloo ranks "
        f"({args.backend}), dim {MODEL['dim']}, {MODEL['n_layers']} blocks, "
        f"{TRAINING['batch_size']} x {TRAINING['seq_len']} tokens per rank, fp32, "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}; "
        f"rank 0; step time: the lower of two passes' medians of {steps} steps (the second "
        "pass in reverse order) on a shared machine. Losses equal the plain run's bit for bit.",
        "",
        "| mode | peak live MB | of it, forward's (activations) MB | peak vs none "
        "| step s | step vs none |",
        "|---|---|---|---|---|---|",
    ]
    for mode, row in rows.items():
        lines.append(
            f"| {mode} | {row['peak_mb']:.1f} | {row['activations_mb']:.1f} | "
            f"{row['peak_mb'] / plain['peak_mb']:.2f}x | {row['step_s']:.3f} | "
            f"{row['step_s'] / plain['step_s']:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    meta = {"command": command, "world": args.world, "backend": args.backend, "steps": steps}
    stem = "ac_bench_quick" if args.quick else "ac_bench"  # a smoke run keeps the real results
    write_results(RESULTS, stem, meta, [{"mode": m, **r} for m, r in rows.items()], text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
