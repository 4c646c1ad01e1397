"""``flexshard-demo``'s command line. torch and the training are imported after the
arguments are parsed, so ``--help`` prints without them."""

from __future__ import annotations

import argparse
import time

#: the ``--placement`` choices: the keys of ``train.PLACEMENTS``
PLACEMENT_NAMES = ("block", "flat", "mixed", "owned", "shard0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="flexshard-demo",
        description="Train a small transformer on N local gloo ranks with flexshard and "
        "show what moves.",
    )
    parser.add_argument("--nproc", type=int, default=3, help="local gloo ranks (default 3)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--placement", choices=PLACEMENT_NAMES, default="mixed")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.steps < 1:
        parser.error("--nproc and --steps must be at least 1")

    from .train import CFG, print_summary, run_ranks

    print(
        f"flexshard demo: {args.nproc} gloo ranks, placement '{args.placement}', "
        f"{CFG.layers + 1} buckets ({CFG.layers} layers + outer), {args.steps} steps",
        flush=True,
    )
    start = time.perf_counter()
    results = run_ranks(args.nproc, args.placement, args.steps)
    print_summary(results, args.placement, time.perf_counter() - start)


if __name__ == "__main__":
    main()
