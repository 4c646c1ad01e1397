"""Python calls per training step of the tiny-block benchmark, counted with cProfile:
a load-independent measure of the runtime's host work (bench_overhead.py times it).

    .venv/bin/python -m benchmarks.profile_overhead                 # W = 1 and 2, all modes
    .venv/bin/python -m benchmarks.profile_overhead --top 25 --world-sizes 1

Modes: fp32, bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``) and
accum (fp32, two micro-batches per step, the first under
``set_requires_gradient_sync(False)``). Each side (flexshard, FSDP2, the floor) is built
and warmed, then ``--steps`` steps run under cProfile; the counts are per step, rank 0's.
"runtime" counts the calls whose function lives in ``flexshard/runtime/``.
Results: benchmarks/results/overhead_calls.{md,json}.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import pstats
import sys
from pathlib import Path
from typing import Any

import torch

from flexshard.testing import run_distributed

from .bench_overhead import LIBRARIES, RESULTS, build, train_step
from .common import write_results
from .overhead_floor import Floor

_REPO = f"{Path(__file__).resolve().parents[1]}/"  # file names shown relative to it

MODES = ("fp32", "bf16", "accum")


def accum_step(model: Any, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """Two micro-batches: the first without gradient sync, as accumulation loops do."""
    model.set_requires_gradient_sync(False)
    model(x).float().square().mean().backward()
    model.set_requires_gradient_sync(True)
    return train_step(model, opt, x)


def step_of(side: str, mode: str, opts: dict[str, Any]) -> Any:
    model, opt = build(
        "fsdp2" if side == "fsdp2" else "flexshard", opts["blocks"], opts["dim"], mode == "bf16"
    )
    if side == "floor":
        if mode == "accum":
            return None  # the floor has no accumulation path
        return Floor(model).step
    return functools.partial(accum_step if mode == "accum" else train_step, model, opt)


def profile(step: Any, x: torch.Tensor, steps: int, top: int) -> dict[str, Any]:
    for _ in range(3):
        step(x)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(x)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    total = sum(v[1] for v in stats.values())
    runtime = {k: v for k, v in stats.items() if "flexshard/runtime/" in k[0]}
    by_calls = sorted(stats.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "calls": total / steps,
        "runtime_calls": sum(v[1] for v in runtime.values()) / steps,
        "top": [
            (
                f"{k[0].split('site-packages/')[-1].removeprefix(_REPO)}:{k[1]}({k[2]})",
                v[1] / steps,
                1e3 * v[2] / steps,
            )
            for k, v in by_calls
        ],
    }


def rank_main(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    x = torch.randn(opts["batch"], opts["dim"], generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    for mode in opts["modes"]:
        for side in opts["sides"]:
            step = step_of(side, mode, opts)
            if step is not None:
                out[f"{mode}/{side}"] = profile(step, x, opts["steps"], opts["top"])
    return out


def markdown(command: str, args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Python calls per step: flexshard `fully_shard`, torch FSDP2 and the floor",
        "",
        f"`{command}` ({datetime.date.today().isoformat()}, torch {torch.__version__}): "
        f"{args.blocks} blocks of `Linear({args.dim}, {args.dim})` + ReLU, batch "
        f"{args.batch}, AdamW; cProfile over {args.steps} steps after 3, rank 0, per step. "
        "accum: two micro-batches, the first without gradient sync (the floor has none).",
        "",
        "| W | mode | side | Python calls / step | in flexshard/runtime |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['world']} | {r['mode']} | {r['side']} | {r['calls']:.0f} "
        f"| {r['runtime_calls']:.0f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--sides", nargs="+", default=[*LIBRARIES, "floor"])
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=0, help="also list the N most-called functions")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k != "out"}
    rows, tops = [], []
    for world in args.world_sizes:
        result = run_distributed(rank_main, world, opts, timeout=600)[0]
        for key, r in result.items():
            mode, side = key.split("/")
            tops.append((world, key, r.pop("top")))
            rows.append({"world": world, "mode": mode, "side": side, **r})
    command = "python -m benchmarks.profile_overhead" + (" " + " ".join(argv) if argv else "")
    text = markdown(command, args, rows)
    write_results(args.out, "overhead_calls", {"command": command, **opts}, rows, text)
    print(text)
    for world, key, top in tops:
        if top:
            print(f"\nW = {world}, {key}: calls/step, tottime ms/step")
            for name, calls, ms in top:
                print(f"  {calls:8.0f} {ms:8.3f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
