"""GRPO in the trainer: does it learn, and what does batch-invariant mode cost.

    .venv/bin/python -m benchmarks.bench_rl            # W = 2, 5 cost repetitions
    .venv/bin/python -m benchmarks.bench_rl --quick    # fewer steps, 2 repetitions

One launch of W gloo ranks: pre-training with ``configs/rl_pretrain.toml`` (the task's
format, answers included), then ``configs/rl_debug.toml`` from its checkpoint (the
learning curve: mean reward per step, the margin = mean of the last 10 steps minus the
first 10), then the per-step cost of ``rl.batch_invariant`` against the native kernels:
each repetition runs both from the same checkpoint, alternating their order, and
takes each run's median step time; the ratio is per repetition (median, IQR).
Writes benchmarks/results/rl_bench.{json,md} and rl_reward.png."""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from flexshard.testing import run_distributed
from flexshard.testing.stats import alternating, cell, paired_ratios, spread, summary
from flexshard.trainer.config import load_config
from flexshard.trainer.train import run

from .common import write_results

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["--job.progress", "false", "--job.plot", "false", "--job.tensorboard", "false"]


def _ranks(rank: int, world: int, folder: str, args: dict[str, Any]) -> dict[str, Any]:
    pre = ROOT / "configs" / "rl_pretrain.toml"
    pre_steps = load_config(pre).training.steps
    run(load_config(pre, [*QUIET, "--job.dump_folder", f"{folder}/pre"]))
    start = ["--checkpoint.initial_load_path", f"{folder}/pre/checkpoint/step-{pre_steps}"]
    rl = ROOT / "configs" / "rl_debug.toml"
    curve = run(
        load_config(
            rl,
            [
                *QUIET,
                *start,
                "--job.dump_folder",
                f"{folder}/rl",
                "--training.steps",
                str(args["steps"]),
                "--checkpoint.enable",
                "false",
            ],
        )
    )
    costs: dict[str, list[float]] = {"default": [], "invariant": []}
    for rep in range(args["reps"]):
        for mode in alternating(("default", "invariant"), rep):
            records = run(
                load_config(
                    rl,
                    [
                        *QUIET,
                        *start,
                        "--job.dump_folder",
                        f"{folder}/{mode}{rep}",
                        "--training.steps",
                        str(args["cost_steps"]),
                        "--checkpoint.enable",
                        "false",
                        "--rl.batch_invariant",
                        str(mode == "invariant").lower(),
                    ],
                )
            )
            costs[mode].append(statistics.median(r["step_time_s"] for r in records[1:]))
    return {"curve": curve, "costs": costs}


def plot(curve: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward"] for r in curve], label="mean reward", color="tab:blue")
    ax.plot(steps, [r["solved"] for r in curve], label="solved (exact)", color="tab:green")
    ax.set_xlabel("RL step")
    ax.set_ylabel("per step, over all completions")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    opts = parser.parse_args(argv)
    rl_cfg = load_config(ROOT / "configs" / "rl_debug.toml")
    args = {
        "steps": 20 if opts.quick else rl_cfg.training.steps,
        "reps": 2 if opts.quick else 5,
        "cost_steps": 3 if opts.quick else 5,
    }
    with tempfile.TemporaryDirectory() as folder:
        result = run_distributed(_ranks, opts.world, folder, args, timeout=3600)[0]
    curve, costs = result["curve"], result["costs"]
    first, last = curve[:10], curve[-10:]
    before = statistics.mean(r["reward"] for r in first)
    after = statistics.mean(r["reward"] for r in last)
    cost = summary(paired_ratios(costs["invariant"], costs["default"]))
    meta = {
        "command": "python -m benchmarks.bench_rl" + (" --quick" if opts.quick else ""),
        "world": opts.world,
        "seeds": {"training.seed": rl_cfg.training.seed, "pre-training": "the same"},
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        **args,
    }
    out = Path(opts.out)
    png = out / "rl_reward.png"
    out.mkdir(parents=True, exist_ok=True)
    plot(curve, png, f"GRPO, sort letters, W = {opts.world} (batch-invariant)")
    diff = max(r["logprob_max_abs_diff"] for r in curve)
    dev = max(r["ratio_max_abs_dev"] for r in curve)
    lines = [
        "# GRPO on the sort-letters task",
        "",
        f"`{meta['command']}` (W = {opts.world}, seed {rl_cfg.training.seed}; "
        "configs/rl_pretrain.toml, then configs/rl_debug.toml from its checkpoint)",
        "",
        f"- mean reward, first 10 steps: {before:.3f}; last 10 steps: {after:.3f}; "
        f"margin {after - before:+.3f} over {len(curve)} steps",
        f"- solved (exact), first 10 / last 10: "
        f"{statistics.mean(r['solved'] for r in first):.3f} / "
        f"{statistics.mean(r['solved'] for r in last):.3f}",
        f"- generator vs trainer log-probs, max |diff| over every step: {diff}; "
        f"max |ratio - 1|: {dev}",
        f"- step time, batch-invariant / default (per repetition, {args['reps']} reps): "
        f"{cell(cost)} (median [IQR]); default {cell(spread(costs['default']).as_dict(), 3)} s, "
        f"invariant {cell(spread(costs['invariant']).as_dict(), 3)} s",
        f"- curve: {png.name}",
        "",
    ]
    rows = [{"curve": curve, "costs": costs, "cost_ratio": cost}]
    write_results(out, "rl_bench", meta, rows, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
