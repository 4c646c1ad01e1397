"""FSDP2 vs flexshard through clients' own entry points, flexshard's ``fully_shard``
swapped in where each client imports it, CPU gloo. Three kinds of rows:

* **torchtitan's own Trainer** (``flexshard/testing/torchtitan_trainer.py``): built from
  torchtitan's config registry (llama3, qwen3 and deepseek_v3 debug models,
  deepseek_v3 also with expert parallel) and run by its own ``train()`` loop:
  ``ChunkedLossWrapper`` (8 chunks: 9 backward calls a step, gradient sync off on the
  lm_head until its last chunk), ``default_adamw``, its LR schedule, clipping, gradient
  accumulation, its metrics; W = 1, 2 (3), fp32 and bf16 mixed precision. Per step,
  besides the times: the collectives each library issued, per kind (all-gather /
  reduce-scatter / all-reduce, "other" if any), in the first step (lazy initialisation
  included) and the second; and whether the losses torchtitan logged were bitwise the
  same.
* **accelerate's and Lightning's own loops** (``flexshard/testing/client_loops.py``): a
  transformers Llama through accelerate's FSDP2 plugin and its documented loop, and
  through Lightning's ``Trainer.fit`` with ``ModelParallelStrategy``; W = 1, 2, fp32,
  bf16 and gradient accumulation; counted and compared as the Trainer's rows.
* **a re-implemented step** (``flexshard/testing/torchtitan_cpu.py``): the llama3 debug
  model through torchtitan's ``parallelize_llama`` and this repository's own step (one
  forward, torchtitan's loss, one backward, clipping, AdamW); peak memory too.

``--calls`` counts instead of timing (the Trainer's and the loops' rows): Python calls
per optimizer step with cProfile around each step only, per library, split by the
called function's file (``flexshard/testing/call_profile.py``): load-independent, so
one profiled pass per library, into ``results/clients_calls*``.

Both libraries run in one launch per row: each rank builds both and alternates them
repetition by repetition (A B, B A, ...) on the same batches. Per step: CPU time
(``time.process_time``: every thread of the rank process, gloo's included) and wall
time; medians and IQRs over the repetitions, and the per-repetition ratio flexshard /
FSDP2 (``stats.paired_ratios``). Peak memory (re-implemented rows): each library in a
launch of its own (the peak RSS of a rank process, imports included alike); skipped by
``--quick``. The CPU patches torchtitan needs are applied and listed.

    python -m benchmarks.bench_clients --quick      # W = 2: Trainer llama3 fp32; step fp32, bf16
    python -m benchmarks.bench_clients              # every row, memory too
    python -m benchmarks.bench_clients --only trainer --out /tmp/clients
    python -m benchmarks.bench_clients --only loops --out /tmp/clients
    python -m benchmarks.bench_clients --only loops --calls --top 30   # Python calls per step
"""

from __future__ import annotations

import argparse
import functools
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_results
from flexshard.testing import run_distributed
from flexshard.testing.call_profile import AREAS, OTHER
from flexshard.testing.collectives import KINDS
from flexshard.testing.stats import alternating, cell, paired_ratios, spread, summary

LIBRARIES = ("fsdp2", "flexshard")
RESULTS = Path(__file__).parent / "results"
#: the Trainer's rows, (W, setup); the first steps of each library are counted, not timed
#: (the first includes lazy initialisation and is the warm-up). qwen3_moe (64 experts a
#: layer: minutes a row here) is checked by tests/fsdp2/test_client_torchtitan.py (slow)
TRAINER_ROWS = {
    "quick": ((2, {"model": "llama3"}),),
    "full": (
        (1, {"model": "llama3"}),
        (2, {"model": "llama3"}),
        (2, {"model": "llama3", "bf16": True}),
        (2, {"model": "llama3", "accumulation": 2}),
        (3, {"model": "llama3"}),
        (2, {"model": "qwen3"}),
        (2, {"model": "deepseek_v3"}),
        (2, {"model": "deepseek_v3", "expert_parallel": 2}),
    ),
}
COUNTED_STEPS = 2
#: accelerate's and Lightning's loops, (W, LoopSetup options) per client
LOOP_ROWS = {
    "quick": ((2, {}),),
    "full": ((1, {}), (2, {}), (2, {"bf16": True}), (2, {"accumulation": 2})),
}


def _timed_steps(run: Any, opt: Any, data: list, warmup: int) -> tuple[list, list]:
    from flexshard.testing.torchtitan_cpu import train_step

    cpu, wall = [], []
    for i, (x, y) in enumerate(data):
        c0, w0 = time.process_time(), time.perf_counter()
        train_step(run, opt, x, y)
        if i >= warmup:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
    return cpu, wall


def _timing(rank: int, world_size: int, bf16: bool, reps: int, steps: int) -> dict:
    """Both libraries in this rank process, alternating; per repetition the median
    step of each (the first step of a library's first repetition is its warm-up)."""
    from flexshard.testing.torchtitan_cpu import apply_cpu_patches, batches, build

    patches = apply_cpu_patches()
    runs = {lib: build(world_size, lib, bf16) for lib in LIBRARIES}
    opts = {lib: torch.optim.AdamW(r.model.parameters(), lr=1e-4) for lib, r in runs.items()}
    out: dict[str, Any] = {lib: {"cpu": [], "wall": []} for lib in LIBRARIES}
    for rep in range(reps):
        data = batches(rank + 100 * rep, steps + (rep == 0))
        for lib in alternating(LIBRARIES, rep):
            cpu, wall = _timed_steps(runs[lib], opts[lib], data, warmup=int(rep == 0))
            out[lib]["cpu"].append(spread(cpu).median)
            out[lib]["wall"].append(spread(wall).median)
    out["patches"] = patches
    return out


def _memory(rank: int, world_size: int, bf16: bool, library: str) -> float:
    """Peak RSS (MiB) of this rank process after two steps of one library alone."""
    from flexshard.testing.torchtitan_cpu import batches, build

    run = build(world_size, library, bf16)
    opt = torch.optim.AdamW(run.model.parameters(), lr=1e-4)
    _timed_steps(run, opt, batches(rank, 2), warmup=0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(world_size: int, bf16: bool, reps: int, steps: int, memory: bool) -> dict:
    ranks = run_distributed(_timing, world_size, bf16, reps, steps, timeout=1800)
    row: dict[str, Any] = {
        "path": "re-implemented step",
        "W": world_size,
        "precision": "bf16" if bf16 else "fp32",
        "reps": reps,
        "steps": steps,
        "patches": ranks[0]["patches"],
    }
    _times(row, ranks, reps)
    if memory:
        row["peak_rss_mib"] = {
            lib: max(run_distributed(_memory, world_size, bf16, lib, timeout=1800))
            for lib in LIBRARIES
        }
    return row


def _alternate(runs: dict[str, Any], reps: int, steps: int) -> dict:
    """``runs[lib](n, count)`` trains ``n`` more steps of ``lib`` and returns their
    records: the first ``COUNTED_STEPS`` of each counted (collectives per step, not
    timed), then ``reps`` repetitions of ``steps`` timed steps, alternating; per
    repetition the median step."""
    out: dict[str, Any] = {lib: {"cpu": [], "wall": [], "losses": []} for lib in LIBRARIES}
    for lib, run in runs.items():
        counted = run(COUNTED_STEPS, True)
        out[lib]["collectives"] = [r.by_kind() for r in counted]
        out[lib]["losses"] += [r.loss for r in counted]
    for rep in range(reps):
        for lib in alternating(LIBRARIES, rep):
            timed = runs[lib](steps, False)
            out[lib]["cpu"].append(spread([r.cpu for r in timed]).median)
            out[lib]["wall"].append(spread([r.wall for r in timed]).median)
            out[lib]["losses"] += [r.loss for r in timed]
    return out


def _profile_calls(runs: dict[str, Any], steps: int, top: int) -> dict:
    """``COUNTED_STEPS`` of each library counted (collectives, lazy initialisation
    included), then ``steps`` steps of each profiled (``CallProfile``): Python calls
    per step, load-independent, so one pass per library suffices."""
    from flexshard.testing.call_profile import CallProfile

    out: dict[str, Any] = {}
    for lib, run in runs.items():
        counted = run(COUNTED_STEPS, True)
        profile = CallProfile()
        profiled = run(steps, False, profile)
        out[lib] = {
            "collectives": [r.by_kind() for r in counted],
            "losses": [r.loss for r in counted + profiled],
            **profile.summary(top),
        }
    return out


def _trainer_timing(
    rank: int, world_size: int, setup: Any, reps: int, steps: int, calls_top: int | None
) -> dict:
    """torchtitan's Trainer with each library in this rank process: timed
    (``_alternate``), or with ``calls_top`` set, profiled (``_profile_calls``)."""
    from flexshard.testing.torchtitan_trainer import build_trainer, measure_steps

    harnesses = {lib: build_trainer(setup, lib, world_size) for lib in LIBRARIES}
    try:
        runs = {
            lib: functools.partial(measure_steps, harness) for lib, harness in harnesses.items()
        }
        if calls_top is None:
            out = _alternate(runs, reps, steps)
        else:
            out = _profile_calls(runs, steps, calls_top)
        out["changes"] = harnesses["fsdp2"].changes
    finally:
        for harness in harnesses.values():
            harness.close()
    return out


def _loop_timing(
    rank: int, world_size: int, setup: Any, reps: int, steps: int, calls_top: int | None
) -> dict:
    """A client's loop with each library in this rank process: timed (``_alternate``),
    or with ``calls_top`` set, profiled (``_profile_calls``)."""
    from flexshard.testing.client_loops import accelerator, build_loop

    total = COUNTED_STEPS + (steps if calls_top is not None else reps * steps)
    acc = accelerator(rank, world_size, setup) if setup.client == "accelerate" else None
    loops = {lib: build_loop(rank, world_size, setup, lib, total, acc) for lib in LIBRARIES}
    runs = {lib: loop.run for lib, loop in loops.items()}
    if calls_top is None:
        return _alternate(runs, reps, steps)
    return _profile_calls(runs, steps, calls_top)


def _row(
    path: str, world_size: int, setup: Any, reps: int, steps: int, ranks: list, calls: bool
) -> dict:
    row: dict[str, Any] = {
        "path": path,
        "W": world_size,
        "setup": setup.label(),
        "reps": reps,
        "steps": steps,
        "patches": ranks[0].get("changes", []),
        # SPMD: every rank issues the same collectives; rank 0's
        "collectives": {lib: ranks[0][lib]["collectives"] for lib in LIBRARIES},
        "losses": {lib: ranks[0][lib]["losses"] for lib in LIBRARIES},
    }
    row["losses_equal"] = row["losses"]["fsdp2"] == row["losses"]["flexshard"]
    if calls:  # rank 0's profile (every rank runs the same code path)
        row["calls"] = {
            lib: {k: ranks[0][lib][k] for k in ("calls", "by_area", "top")} for lib in LIBRARIES
        }
    else:
        _times(row, ranks, reps)
    return row


def measure_trainer(
    world_size: int, options: dict, reps: int, steps: int, calls_top: int | None = None
) -> dict:
    from flexshard.testing.torchtitan_trainer import Setup

    total = COUNTED_STEPS + (steps if calls_top is not None else reps * steps)
    setup = Setup(**options, steps=total)
    ranks = run_distributed(
        _trainer_timing, world_size, setup, reps, steps, calls_top, timeout=3600
    )
    return _row("torchtitan Trainer", world_size, setup, reps, steps, ranks, calls_top is not None)


def measure_loop(
    world_size: int, client: str, options: dict, reps: int, steps: int, calls_top: int | None = None
) -> dict:
    from flexshard.testing.client_loops import LoopSetup

    setup = LoopSetup(client, size="bench", **options)
    ranks = run_distributed(_loop_timing, world_size, setup, reps, steps, calls_top, timeout=3600)
    return _row("client loop", world_size, setup, reps, steps, ranks, calls_top is not None)


def _times(row: dict, ranks: list[dict], reps: int) -> None:
    for kind in ("cpu", "wall"):
        # a step is as slow as its slowest rank: the max over ranks, per repetition
        per = {lib: [max(r[lib][kind][i] for r in ranks) for i in range(reps)] for lib in LIBRARIES}
        row[kind] = {lib: spread(v).as_dict() for lib, v in per.items()}
        row[f"{kind}_ratio"] = summary(paired_ratios(per["flexshard"], per["fsdp2"]), 1.0)


def _ms(entry: dict) -> str:
    scaled = {k: v * 1000 if isinstance(v, float) else v for k, v in entry.items()}
    return cell(scaled, 1)


def _counts(per_step: list[dict]) -> str:
    """``16/9/6; 16/9/6``: all-gathers / reduce-scatters / all-reduces per counted step
    (``+N other`` where a step issued any other collective)."""
    out = []
    for counts in per_step:
        text = "/".join(str(counts.get(k, 0)) for k in KINDS)
        other = counts.get("other", 0)
        out.append(text + (f" +{other} other" if other else ""))
    return "; ".join(out)


TRAINER_HEADING = [
    "## torchtitan's own Trainer",
    "",
    "torchtitan's `Trainer` from its config registry, run by its own `train()` loop "
    "(ChunkedLossWrapper, default_adamw, LR schedule, clipping, accumulation); "
    "flexshard's `fully_shard` swapped in at `torchtitan.distributed.fsdp` "
    "(flexshard/testing/torchtitan_trainer.py). Collectives: all-gather / "
    "reduce-scatter / all-reduce issued in step 1 (lazy initialisation included); "
    "step 2, per rank. Losses: whether every step's logged loss was bitwise the same.",
]
LOOP_HEADING = [
    "## accelerate's and Lightning's own loops",
    "",
    "A transformers `LlamaForCausalLM` (4 layers, hidden 256, vocab 1024, 128 tokens, "
    "batch 4 per rank) through accelerate 1.15's FSDP2 plugin and its documented loop "
    "(`accumulate`, `backward`, `clip_grad_norm_`, AdamW, LR schedule), and through "
    "Lightning 2.6's `Trainer.fit` with `ModelParallelStrategy` (`fully_shard` in "
    "`configure_model`; its clipping and accumulation); flexshard's `fully_shard` where "
    "each imports it (flexshard/testing/client_loops.py). Each Lightning repetition is a "
    "`fit` of its own. Collectives and losses as above.",
]


def _trainer_table(rows: list[dict], heading: list[str]) -> list[str]:
    lines = [
        *heading,
        "",
        "| setup | W | CPU ms FSDP2 | CPU ms flexshard | CPU ratio | wall ms FSDP2 "
        "| wall ms flexshard | wall ratio | collectives FSDP2 | collectives flexshard "
        "| losses equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['W']} | {_ms(r['cpu']['fsdp2'])} "
            f"| {_ms(r['cpu']['flexshard'])} | {cell(r['cpu_ratio'])} ({r['cpu_ratio']['verdict']})"
            f" | {_ms(r['wall']['fsdp2'])} | {_ms(r['wall']['flexshard'])} "
            f"| {cell(r['wall_ratio'])} ({r['wall_ratio']['verdict']}) "
            f"| {_counts(r['collectives']['fsdp2'])} | {_counts(r['collectives']['flexshard'])} "
            f"| {'yes' if r['losses_equal'] else 'no'} |"
        )
    patches = sorted({p for r in rows for p in r.get("patches", ())})
    if patches:
        lines += ["", "Changes for CPU, no network (both libraries): " + "; ".join(patches) + "."]
    return lines


def _step_table(rows: list[dict]) -> list[str]:
    lines = [
        "## A re-implemented step",
        "",
        "The llama3 debug model through torchtitan's `parallelize_llama`, stepped by "
        "flexshard/testing/torchtitan_cpu.py's `train_step` (one forward, one backward; "
        "not torchtitan's Trainer).",
        "",
        "| W | precision | CPU ms FSDP2 | CPU ms flexshard | CPU ratio | wall ms FSDP2 "
        "| wall ms flexshard | wall ratio | peak RSS MiB (FSDP2 / flexshard) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = r.get("peak_rss_mib")
        mem_cell = f"{mem['fsdp2']:.0f} / {mem['flexshard']:.0f}" if mem else "not measured"
        lines.append(
            f"| {r['W']} | {r['precision']} | {_ms(r['cpu']['fsdp2'])} "
            f"| {_ms(r['cpu']['flexshard'])} | {cell(r['cpu_ratio'])} ({r['cpu_ratio']['verdict']})"
            f" | {_ms(r['wall']['fsdp2'])} | {_ms(r['wall']['flexshard'])} "
            f"| {cell(r['wall_ratio'])} ({r['wall_ratio']['verdict']}) | {mem_cell} |"
        )
    patches = sorted({p for r in rows for p in r["patches"]})
    lines += [
        "",
        "CPU patches applied to torchtitan (flexshard/testing/torchtitan_cpu.py): "
        + "; ".join(patches)
        + "; gloo SUM instead of PREMUL_SUM(1) "
        "(set_force_sum_reduction_for_comms, both libraries).",
    ]
    return lines


def _calls_table(rows: list[dict], title: str) -> list[str]:
    lines = [
        f"## {title}: Python calls per step",
        "",
        "| setup | W | calls FSDP2 | calls flexshard | ratio | collectives FSDP2 "
        "| collectives flexshard | losses equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fsdp2, flex = r["calls"]["fsdp2"]["calls"], r["calls"]["flexshard"]["calls"]
        lines.append(
            f"| {r['setup']} | {r['W']} | {fsdp2:,.0f} | {flex:,.0f} | {flex / fsdp2:.2f} "
            f"| {_counts(r['collectives']['fsdp2'])} | {_counts(r['collectives']['flexshard'])} "
            f"| {'yes' if r['losses_equal'] else 'no'} |"
        )
    areas = [a for a, _ in AREAS] + [OTHER]
    used = [
        a
        for a in areas
        if any(r["calls"][lib]["by_area"].get(a) for r in rows for lib in LIBRARIES)
    ]
    lines += [
        "",
        "Where the calls are (the called function's file, flexshard/testing/call_profile.py "
        "`AREAS`), FSDP2 / flexshard per step:",
        "",
        "| setup | W | " + " | ".join(used) + " |",
        "|---|---|" + "---|" * len(used),
    ]
    for r in rows:
        cells = [
            f"{r['calls']['fsdp2']['by_area'].get(a, 0):,.0f} / "
            f"{r['calls']['flexshard']['by_area'].get(a, 0):,.0f}"
            for a in used
        ]
        lines.append(f"| {r['setup']} | {r['W']} | " + " | ".join(cells) + " |")
    return lines


CALLS_INTRO = (
    "cProfile around each optimizer step only (the client's loop between steps left "
    "out), rank 0, per step, over the steps after {counted} counted ones (lazy "
    "initialisation included there); each library profiled once: the counts do not "
    "depend on the machine's load. Collectives and losses as in the timed tables."
)


def markdown(command: str, rows: list[dict]) -> str:
    calls = any("calls" in r for r in rows)
    lines = [
        "# Client benchmark: FSDP2 vs flexshard through clients' own entry points",
        "",
        f"Command: `{command}`",
        "",
        CALLS_INTRO.format(counted=COUNTED_STEPS)
        if calls
        else "Per step, median [IQR] over repetitions (each repetition's median step, the "
        "slowest rank); ratio = flexshard / FSDP2 per repetition, target <= 1.0.",
    ]
    tables = (
        ("torchtitan Trainer", TRAINER_HEADING, "torchtitan's own Trainer"),
        ("client loop", LOOP_HEADING, "accelerate's and Lightning's own loops"),
    )
    for path, heading, title in tables:
        chosen = [r for r in rows if r["path"] == path]
        if chosen:
            lines += [
                "",
                *(_calls_table(chosen, title) if calls else _trainer_table(chosen, heading)),
            ]
    chosen = [r for r in rows if r["path"] == "re-implemented step"]
    if chosen:
        lines += ["", *_step_table(chosen)]
    return "\n".join(lines) + "\n"


def _top_functions(rows: list[dict]) -> str:
    """The most-called functions of each row, both libraries (printed, not saved)."""
    out = []
    for r in rows:
        for lib in LIBRARIES:
            top = r["calls"][lib]["top"]
            if top:
                out.append(f"\n{r['setup']}, W = {r['W']}, {lib}: calls/step")
                out += [f"  {n:9.1f}  {name}" for name, n in top]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="W = 2 only, fewer rows, no memory launches"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repetition")
    parser.add_argument(
        "--only",
        choices=("trainer", "loops", "step"),
        help="only torchtitan's Trainer, accelerate's and Lightning's loops, or the "
        "re-implemented step",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="Python calls per step (cProfile, --steps steps per library) instead of times "
        "(the Trainer's and the loops' rows)",
    )
    parser.add_argument(
        "--top", type=int, default=0, help="with --calls: also print the N most-called functions"
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        help="only the rows whose 'setup, W=n' contains one of these (e.g. 'llama3, fp32, W=2')",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error("--reps must be >= 5 (medians and IQRs need them)")
    if args.calls and args.only == "step":
        parser.error("--calls profiles the Trainer's and the loops' rows, not --only step")
    steps = 1 if args.quick else args.steps
    calls_top = args.top if args.calls else None
    mode = "quick" if args.quick else "full"

    def chosen(label: str, world_size: int) -> bool:
        key = f"{label}, W={world_size}"
        return not args.setups or any(s in key for s in args.setups)

    rows = []
    if args.only in (None, "trainer"):
        from flexshard.testing.torchtitan_trainer import Setup

        rows += [
            measure_trainer(w, options, args.reps, steps, calls_top)
            for w, options in TRAINER_ROWS[mode]
            if chosen(Setup(**options).label(), w)
        ]
    if args.only in (None, "loops"):
        from flexshard.testing.client_loops import LoopSetup

        rows += [
            measure_loop(w, client, options, args.reps, steps, calls_top)
            for client in ("accelerate", "lightning")
            for w, options in LOOP_ROWS[mode]
            if chosen(LoopSetup(client, **options).label(), w)
        ]
    if args.only in (None, "step") and not args.calls:
        sizes = (2,) if args.quick else (1, 2)
        rows += [
            measure(w, bf16, args.reps, steps, memory=not args.quick)
            for w in sizes
            for bf16 in (False, True)
        ]
    command = "python -m benchmarks.bench_clients " + " ".join(argv or sys.argv[1:])
    text = markdown(command.strip(), rows)
    name = (
        "clients_" + ("calls" if args.calls else "bench") + (f"_{args.only}" if args.only else "")
    )
    name += "_quick" if args.quick else ""  # a smoke run keeps the real results
    if args.setups:
        name += "_some"  # a subset of the rows keeps the whole table
    write_results(args.out, name, {"command": command.strip()}, rows, text)
    print(text)
    if args.calls and args.top:
        print(_top_functions(rows))


if __name__ == "__main__":
    main()
