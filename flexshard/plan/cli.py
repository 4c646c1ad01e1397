"""``flexshard-plan CONFIG --world W [--section.key value ...]``: a run of W ranks
planned from one CPU (torch's fake process group, meta tensors). Unrecognised
``--section.key value`` arguments are trainer config overrides.
``flexshard-plan --validate``: the planner against published GPU runs (fitted on the
calibration rows, tested on the held-out rows; ``flexshard/plan/published.py``).

The planner (torch, the trainer's models) is imported after the arguments are parsed,
so ``--help`` prints without it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flexshard.trainer.config import ConfigError, load_config

from .hardware import load_profile
from .host_costs import BACKENDS
from .table import render, render_summary


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="flexshard-plan", description=__doc__)
    p.add_argument("config", nargs="?", help="trainer TOML config, e.g. configs/llama3_70b.toml")
    p.add_argument("--world", type=int, help="number of ranks (GPUs)")
    p.add_argument(
        "--validate",
        action="store_true",
        help="print predicted vs published tokens/s and memory for every published row "
        "(calibration and held-out) and exit",
    )
    p.add_argument(
        "--rows",
        default="",
        help="with --validate: comma-separated row keys (default: all; the calibration "
        "rows are always fitted)",
    )
    p.add_argument(
        "--float8", action="store_true", help="Float8 GEMMs in the blocks' linears (torchao)"
    )
    p.add_argument(
        "--async-tp", action="store_true", help="TP collectives overlapped with their matmuls"
    )
    p.add_argument(
        "--float8-all-gather",
        action="store_true",
        help="with --float8: the linears' weights cast to FP8 before FSDP's all-gather",
    )
    p.add_argument(
        "--loss-parallel",
        action="store_true",
        help="the LM head's logits and loss sharded over tp (torchtitan's default)",
    )
    p.add_argument(
        "--expandable-segments",
        action="store_true",
        help="the memory reserved with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        help="plan this rank only (default: the first rank of every pipeline stage)",
    )
    p.add_argument("--dp-backend", choices=(*BACKENDS, "both"), default="both")
    p.add_argument(
        "--hardware",
        default="h100",
        help="h100, h200 or a JSON profile file: Hardware's fields, and the host's costs "
        "under host_costs (docs/planning.md)",
    )
    p.add_argument("--json", type=Path, help="write the plan as JSON here")
    p.add_argument(
        "--sweep",
        type=str,
        default="",
        help="comma-separated world sizes: plot memory and bytes per rank against W",
    )
    p.add_argument("--plot", type=Path, default=Path("plan.png"), help="the sweep's PNG")
    p.add_argument(
        "--suggest",
        action="store_true",
        help="propose placements and bucket options under --memory-limit",
    )
    p.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="GiB per device (default: the hardware profile's memory_gib, else 80)",
    )
    p.add_argument(
        "--markdown",
        choices=("short", "full"),
        help="print the summary table README.md (short) and docs/planning.md (full) show",
    )
    return p.parse_known_args(argv)


def sweep_worlds(text: str) -> list[int]:
    """``--sweep 256,512``: positive world sizes, each bad value named."""
    worlds = []
    for item in text.split(","):
        try:
            world = int(item.strip())
        except ValueError:
            raise ValueError(
                f"--sweep: {item.strip()!r} is not a world size (an integer)"
            ) from None
        if world < 1:
            raise ValueError(f"--sweep: world size {world} must be positive")
        worlds.append(world)
    return worlds


def check_args(args: argparse.Namespace) -> None:
    """What argparse's types do not check: one line naming the value."""
    if args.validate:
        return
    if args.config is None or args.world is None:
        raise ValueError("a CONFIG and --world are required (or --validate)")
    if args.world < 1:
        raise ValueError(f"--world {args.world}: must be a positive number of ranks")
    if args.memory_limit is not None and not args.memory_limit > 0:  # also NaN
        raise ValueError(f"--memory-limit {args.memory_limit:g}: must be a positive GiB per device")
    if args.sweep:
        sweep_worlds(args.sweep)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.validate:
        return validate(args.rows, overrides)
    try:
        check_args(args)
        if args.dp_backend != "both":
            overrides = [*overrides, "--parallelism.dp_backend", args.dp_backend]
        cfg = load_config(args.config, overrides)
        profile = load_profile(args.hardware)
    except (ConfigError, ValueError) as err:
        print(f"flexshard-plan: {err}", file=sys.stderr)
        return 2
    from .report import make_plan
    from .techniques import Techniques

    try:
        techniques = Techniques(
            float8=args.float8,
            async_tp=args.async_tp,
            loss_parallel=args.loss_parallel,
            float8_all_gather=args.float8_all_gather,
            expandable_segments=args.expandable_segments,
        )
    except ValueError as err:
        print(f"flexshard-plan: {err}", file=sys.stderr)
        return 2
    backends = BACKENDS if args.dp_backend == "both" else (args.dp_backend,)
    if args.suggest:
        from .suggest import suggest

        limit = args.memory_limit or profile.hardware.memory_gib or 80.0
        print(suggest(cfg, args.world, profile.hardware, limit, profile.host))
        return 0
    try:
        plan = make_plan(
            cfg, args.world, profile.hardware, args.rank, backends, profile.host, techniques
        )
    except (ConfigError, ValueError) as err:
        print(f"flexshard-plan: {err}", file=sys.stderr)
        return 2
    if args.markdown:
        print(render_summary(plan, full=args.markdown == "full"))
        return 0
    print(render(plan))
    if args.json:
        args.json.write_text(json.dumps(plan, indent=1))
        print(f"plan: {args.json}")
    if args.sweep:
        from .sweep import sweep_plot

        worlds = sweep_worlds(args.sweep)
        print(sweep_plot(cfg, worlds, profile.hardware, backends, args.plot, profile.host))
    return 0


def validate(rows: str, overrides: list[str]) -> int:
    """``--validate``: fit on the calibration rows, print every chosen row's table."""
    if overrides:
        print(f"flexshard-plan --validate: unexpected arguments {overrides}", file=sys.stderr)
        return 2
    from .published import ROWS, render
    from .published import validate as run

    keys = [k.strip() for k in rows.split(",") if k.strip()]
    unknown = sorted(set(keys) - {r.key for r in ROWS})
    if unknown:
        names = ", ".join(r.key for r in ROWS)
        print(f"flexshard-plan --rows: unknown rows {unknown} (rows: {names})", file=sys.stderr)
        return 2
    chosen = tuple(r for r in ROWS if not keys or r.key in keys or r.role == "calibration")
    print(render(*run(chosen)), end="")
    return 0
