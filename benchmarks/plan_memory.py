"""The planner's peak memory per rank against the peak of live tensors of a real step.

    .venv/bin/python -m benchmarks.plan_memory                # W = 2, fp32 and bf16
    .venv/bin/python -m benchmarks.plan_memory --world 4

The measurement (the trainer's own job on W gloo ranks, one step under
``LiveTensors``, against the plan of the same config and W) is
``flexshard.testing.plan_memory``, which ``tests/plan/test_plan_peak.py`` runs too.
"""

from __future__ import annotations

import argparse

from flexshard.testing.live_memory import MB
from flexshard.testing.plan_memory import CASES, compare


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cases", nargs="*", default=list(CASES))
    args = p.parse_args(argv)
    print("| case | W | measured peak MB (phase) | planned MB (moment) | gap | parts added MB |")
    print("|---|---|---|---|---|---|")
    for r in compare(args.world, args.cases):
        print(
            f"| {r['case']} | {r['world']} | {r['measured'] / MB:.2f} ({r['measured_phase']}) | "
            f"{r['planned'] / MB:.2f} ({r['planned_moment']}) | {r['gap']:+.1%} | "
            f"{r['sum_of_part_peaks'] / MB:.2f} |"
        )
        phases = ", ".join(f"{k} {v / MB:.2f}" for k, v in r["phase_peaks"].items())
        print(f"  measured per phase (rank 0, MB): {phases}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
