"""GRPO in the trainer: does it learn, and what does batch-invariant mode cost.

    .venv/bin/python -m benchmarks.bench_rl            # W = 2, seeds 0 and 1, 5 cost reps
    .venv/bin/python -m benchmarks.bench_rl --quick    # fewer steps, one seed, 2 reps

One launch of W gloo ranks: pre-training with ``configs/rl_pretrain.toml`` (the task's
format, answers included), then ``configs/rl_debug.toml`` from its checkpoint once per
RL seed (``training.seed``: the steps' prompts and samples; the learning curve: mean
reward per step, the margin = mean of the last 10 steps minus the first 10) and once
more as the control, the first seed with lr 1e-12 (the same prompts and samples, the
weights in effect held: the config refuses lr 0), then the per-step cost of
``rl.batch_invariant`` against the native kernels: each repetition runs both from the
same checkpoint, alternating their order, and takes each run's median step time; the
ratio is per repetition (median, IQR); then the batch-invariant kernels' own cost per
op (``rl_op_costs``).
Writes benchmarks/results/rl_bench.{json,md} and rl_reward.png."""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from flexshard.testing import run_distributed
from flexshard.testing.stats import (
    alternating,
    cell,
    paired_ratios,
    spread,
    summary,
    verdict_cell,
)
from flexshard.trainer.config import load_config
from flexshard.trainer.train import run

from .common import write_results
from .rl_op_costs import recording, replay

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.25  # batch-invariant step / default step
CONTROL_LR = "1e-12"  # the control run's: the weights in effect held (lr 0 is refused)
QUIET = ["--job.progress", "false", "--job.plot", "false", "--job.tensorboard", "false"]


def _ranks(rank: int, world: int, folder: str, args: dict[str, Any]) -> dict[str, Any]:
    pre = ROOT / "configs" / "rl_pretrain.toml"
    pre_steps = load_config(pre).training.steps
    run(load_config(pre, [*QUIET, "--job.dump_folder", f"{folder}/pre"]))
    start = ["--checkpoint.initial_load_path", f"{folder}/pre/checkpoint/step-{pre_steps}"]
    rl = ROOT / "configs" / "rl_debug.toml"
    runs = {f"seed {seed}": ["--training.seed", str(seed)] for seed in args["seeds"]}
    # the control: the first seed's prompts and samples, the weights in effect held
    runs[_control(args["seeds"])] = [*runs[f"seed {args['seeds'][0]}"], "--training.lr", CONTROL_LR]
    curves = {}
    for i, (name, overrides) in enumerate(runs.items()):
        curves[name] = run(
            load_config(
                rl,
                [
                    *QUIET,
                    *start,
                    *overrides,
                    "--training.steps",
                    str(args["steps"]),
                    "--job.dump_folder",
                    f"{folder}/rl{i}",
                    "--checkpoint.enable",
                    "false",
                ],
            )
        )

    def cost_run(mode: str, name: str, steps: int) -> list[dict]:
        overrides = ["--job.dump_folder", f"{folder}/{name}", "--training.steps", str(steps)]
        invariant = ["--rl.batch_invariant", str(mode == "invariant").lower()]
        return run(
            load_config(
                rl, [*QUIET, *start, *overrides, "--checkpoint.enable", "false", *invariant]
            )
        )

    costs: dict[str, list[float]] = {"default": [], "invariant": []}
    invariant_diff = 0.0  # the cost runs' generator vs trainer log-probs
    for rep in range(args["reps"]):
        for mode in alternating(("default", "invariant"), rep):
            records = cost_run(mode, f"{mode}{rep}", args["cost_steps"])
            costs[mode].append(statistics.median(r["step_time_s"] for r in records[1:]))
            if mode == "invariant":
                invariant_diff = max(
                    [invariant_diff, *(r["logprob_max_abs_diff"] for r in records)]
                )
    calls: dict[str, list] = defaultdict(list)
    with recording(calls):
        cost_run("invariant", "recorded", args["op_steps"])
    ops = replay(calls, args["op_steps"], args["reps"]) if rank == 0 else []
    return {"curves": curves, "costs": costs, "invariant_diff": invariant_diff, "ops": ops}


def plot(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, curve) in enumerate(curves.items()):
        steps = [r["step"] for r in curve]
        style = ("-", "--", ":", "-.")[i % 4]
        for key, color, label in (
            ("reward", "tab:blue", "mean reward"),
            ("solved", "tab:green", "solved (exact)"),
        ):
            ax.plot(steps, [r[key] for r in curve], style, color=color, label=f"{label}, {name}")
    ax.set_xlabel("RL step")
    ax.set_ylabel("per step, over all completions")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _control(seeds: list[int]) -> str:
    return f"seed {seeds[0]}, lr {CONTROL_LR}"


def _learned(curve: list[dict]) -> dict[str, float]:
    """Mean reward and solved share over the first and the last 10 steps."""
    first, last = curve[:10], curve[-10:]
    out = {}
    for key in ("reward", "solved"):
        out[f"{key}_first"] = statistics.mean(r[key] for r in first)
        out[f"{key}_last"] = statistics.mean(r[key] for r in last)
    out["margin"] = out["reward_last"] - out["reward_first"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="RL seeds")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    opts = parser.parse_args(argv)
    rl_cfg = load_config(ROOT / "configs" / "rl_debug.toml")
    args = {
        "seeds": opts.seeds[:1] if opts.quick else opts.seeds,
        "steps": 20 if opts.quick else rl_cfg.training.steps,
        "reps": 2 if opts.quick else 5,
        "cost_steps": 3 if opts.quick else 5,
        "op_steps": 2 if opts.quick else 3,
    }
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        result = run_distributed(_ranks, opts.world, folder, args, timeout=3600)[0]
    wall = time.perf_counter() - began
    curves, costs = result["curves"], result["costs"]
    learned = {name: _learned(curve) for name, curve in curves.items()}
    held = learned[_control(args["seeds"])]["reward_last"]
    for v in learned.values():  # the last 10 steps against the held weights' last 10
        v["over_control"] = v["reward_last"] - held
    cost = summary(paired_ratios(costs["invariant"], costs["default"]), TARGET)
    ops = result["ops"]
    pre_cfg = load_config(ROOT / "configs" / "rl_pretrain.toml")
    meta = {
        "command": "python -m benchmarks.bench_rl" + (" --quick" if opts.quick else ""),
        "world": opts.world,
        "seeds": {"rl training.seed": args["seeds"], "pre-training": pre_cfg.training.seed},
        "pre_steps": pre_cfg.training.steps,
        "wall_s": round(wall, 1),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        **args,
    }
    out = Path(opts.out)
    quick = "_quick" if opts.quick else ""  # a smoke run keeps the real results
    png = out / f"rl_reward{quick}.png"
    out.mkdir(parents=True, exist_ok=True)
    plot(curves, png, f"GRPO, sort letters, W = {opts.world} (batch-invariant)")
    every = [r for curve in curves.values() for r in curve]  # the control's too
    diff = max(r["logprob_max_abs_diff"] for r in every)
    dev = max(r["ratio_max_abs_dev"] for r in every)
    lines = [
        "# GRPO on the sort-letters task",
        "",
        f"`{meta['command']}` (W = {opts.world}; configs/rl_pretrain.toml, "
        f"{pre_cfg.training.steps} steps, seed {pre_cfg.training.seed}, then "
        f"configs/rl_debug.toml from its checkpoint, {args['steps']} RL steps per run "
        "(`training.seed`: each step's prompts and samples; lr 1e-12: the weights in effect held); "
        f"{wall:.0f} s in all)",
        "",
        "| RL run | reward, first 10 steps | last 10 steps | margin | over the control "
        "| solved, first 10 | last 10 |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {v['reward_first']:.3f} | {v['reward_last']:.3f} | "
            f"{v['margin']:+.3f} | {v['over_control']:+.3f} | {v['solved_first']:.3f} | "
            f"{v['solved_last']:.3f} |"
            for name, v in learned.items()
        ),
        "",
        f"- generator vs trainer log-probs, max |diff| over every step: {diff}; "
        f"max |ratio - 1|: {dev}",
        f"- step time, batch-invariant / default (per repetition, {args['reps']} reps): "
        f"{cell(cost)} (median [IQR]); default {cell(spread(costs['default']).as_dict(), 3)} s, "
        f"invariant {cell(spread(costs['invariant']).as_dict(), 3)} s; "
        f"{verdict_cell(cost)}; the cost runs' max |log-prob diff|: {result['invariant_diff']}",
        f"- curve: {png.name}",
        "",
        f"The batch-invariant kernels' own cost per op (rank 0's calls over {args['op_steps']} "
        "steps replayed through each kernel, alternating, thread CPU time per step, "
        f"medians of {args['reps']} reps; the sdpa row: its routing only):",
        "",
        "| op | calls / step | native ms / step | batch-invariant ms / step | ratio "
        "| extra ms / step |",
        "|---|---|---|---|---|---|",
        *(
            f"| `{o['op']}` | {o['calls_per_step']:.0f} | {o['native_ms']:.1f} | "
            f"{o['invariant_ms']:.1f} | {cell(o['ratio'])} | {cell(o['extra_ms'], 1)} |"
            for o in ops
        ),
        "",
    ]
    rows = [{"curves": curves, "learned": learned, "costs": costs, "cost_ratio": cost, "ops": ops}]
    write_results(out, f"rl_bench{quick}", meta, rows, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
