"""Where a measured trainer step goes, next to the step-time model's breakdown.

    .venv/bin/python -m benchmarks.plan_decompose --world 2 --rows 0 2
    .venv/bin/python -m benchmarks.plan_decompose --world 2 --rows 0 --profile

One launch of W gloo processes (one thread each) per row of ``plan_validation``.
Each rank sets the trainer's job up (``train.setup``), times ``train.train_step`` as
the trainer does (the "measured" step), then runs the same step phase by phase
(forward + loss, backward, clipping, AdamW, the rest) with perf_counter wrappers
around the runtime's pieces (flexshard: hooks, all-gather / reduce-scatter calls,
buffer allocation, copy-out, pack, gradient landing; FSDP2: its param group's
unshard / copy-out / reduce), and finally the unsharded model's forward / backward
and AdamW in the same process on the same local batch, all W ranks at once (what
the step costs without sharding on the cores the ranks share). ``--profile`` adds
one torch.profiler step on rank 0 (aten self time by kind; the profiler slows the
step). The plan's prediction for the row comes from a profile calibrated in the
same launch (``plan_launch.calibrate``), as ``plan_validation`` does.

Nothing here feeds the profile: it is the diagnosis the model's terms are checked
against (``docs/planning.md``)."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flexshard.testing import run_distributed
from flexshard.trainer.config import Config
from flexshard.trainer.models.model import Transformer
from flexshard.trainer.parallel.parallelize import local_batch
from flexshard.trainer.train import clip_gradients, loss_fn, setup, train_step

from .plan_launch import calibrate, launch_profile
from .plan_validation import ROWS, _op_configs, predict, row_config, uptime

Timers = dict[str, float]


def _wrap(owner: Any, name: str, timers: Timers, label: str) -> Callable[[], None]:
    """Time every call of ``owner.name`` (inclusive) into ``timers[label]``; returns
    the undo."""
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(_timed_hook(original, timers, label)))
    return lambda: setattr(owner, name, original)


def _instrument(model: torch.nn.Module, backend: str, timers: Timers) -> list[Callable[[], None]]:
    undo = []
    if backend == "flexshard":
        from flexshard.runtime import bucket, collectives, gather, reduce

        for owner, name, label in (
            (collectives.BucketComm, "all_gather", "all-gather call (launch + wait)"),
            (collectives.BucketComm, "reduce_scatter", "reduce-scatter call (launch + wait)"),
            (bucket, "alloc", "gathered buffer alloc"),
            (gather.PlainGather, "copy_out", "all-gather copy-out"),
            (gather, "pack_all", "reduce-scatter copy-in (pack)"),
            (reduce.GradReduction, "finish", "gradient landing"),
            (bucket.Bucket, "unshard", "unshard (inclusive)"),
            (bucket.Bucket, "reshard", "reshard (inclusive)"),
            (bucket.Bucket, "launch_reduce", "launch_reduce (inclusive)"),
            (bucket.Bucket, "_take_grads", "take grads"),
        ):
            undo.append(_wrap(owner, name, timers, label))
    else:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        for owner, name, label in (
            (pg, "foreach_all_gather", "all-gather call (launch + copy-in)"),
            (pg, "foreach_all_gather_copy_out", "all-gather copy-out"),
            (pg, "foreach_reduce", "reduce (copy-in + reduce-scatter + landing)"),
            (pg.FSDPParamGroup, "wait_for_unshard", "wait_for_unshard (inclusive)"),
            (pg.FSDPParamGroup, "reshard", "reshard (inclusive)"),
            (pg.FSDPParamGroup, "pre_backward", "pre_backward (inclusive)"),
            (pg.FSDPParamGroup, "post_backward", "post_backward (inclusive)"),
        ):
            undo.append(_wrap(owner, name, timers, label))
    # every module hook (flexshard's or FSDP2's pre/post forward), inclusive
    for module in model.modules():
        for table, label in (
            (module._forward_pre_hooks, "forward pre-hooks (inclusive)"),
            (module._forward_hooks, "forward post-hooks (inclusive)"),
        ):
            for key, hook in list(table.items()):
                table[key] = _timed_hook(hook, timers, label)
                undo.append(functools.partial(table.__setitem__, key, hook))
    return undo


def _timed_hook(hook: Callable, timers: Timers, label: str) -> Callable:
    """``hook`` with the time of every call (inclusive) added to ``timers[label]``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return hook(*args, **kwargs)
        finally:
            timers[label] += time.perf_counter() - begin

    return call


def _phases(job: Any, step: int) -> dict[str, float]:
    """``train_step``'s data-parallel path (grad_accum 1) with a clock between phases."""
    from flexshard.trainer.parallel import bounded_waits
    from flexshard.trainer.parallel.exchange import configured_timeout

    cfg, model = job.cfg, job.model
    timeout = configured_timeout(cfg.parallelism.timeout_s)
    t = [time.perf_counter()]
    inputs, targets = job.sampler.batch(step, 0)
    inputs, targets = local_batch(inputs, targets, job.meshes)
    model.set_requires_gradient_sync(True)
    loss = loss_fn(model(inputs), targets)
    t.append(time.perf_counter())
    loss.backward()
    t.append(time.perf_counter())
    clip_gradients(job)
    t.append(time.perf_counter())
    job.optimizer.step()
    t.append(time.perf_counter())
    job.lr_scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)
    bounded_waits.all_reduce(loss.detach(), None, "loss", "step", timeout, dist.ReduceOp.AVG)
    t.append(time.perf_counter())
    names = ("forward + loss", "backward", "clip", "optimizer", "rest (lr, zero_grad, loss AR)")
    return {n: b - a for n, a, b in zip(names, t, t[1:])}


def _plain(cfg: Config, steps: int) -> dict[str, float]:
    """The unsharded model's forward + loss, backward, clip + AdamW on this rank's batch."""
    torch.manual_seed(0)
    net = Transformer(cfg.model)
    t = cfg.training
    tokens = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))
    opt = torch.optim.AdamW(net.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    rows = []
    for _ in range(steps):
        dist.barrier()
        a = time.perf_counter()
        loss = loss_fn(net(tokens), tokens)
        b = time.perf_counter()
        loss.backward()
        c = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        d = time.perf_counter()
        rows.append({"forward + loss": b - a, "backward": c - b, "clip + optimizer": d - c})
    rows = rows[2:]
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _profile_step(job: Any, step: int) -> dict[str, float]:
    """aten self CPU time of one step by kind (ms), and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    begin = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(job, step)
    wall = time.perf_counter() - begin
    kinds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.key_averages():
        name = evt.key
        if not name.startswith("aten::"):
            continue
        if name in ("aten::mm", "aten::addmm", "aten::bmm"):
            kind = "GEMM"
        elif "flash_attention" in name:
            kind = "attention"
        elif name in ("aten::copy_", "aten::split_with_sizes_copy", "aten::cat"):
            kind = "copy_ / cat"
        else:
            kind = "other aten"
        kinds[kind] += evt.self_cpu_time_total / 1e3
        counts[kind] += evt.count
    return {
        "wall_ms": wall * 1e3,
        **{f"{k} ms": v for k, v in kinds.items()},
        **{f"{k} calls": float(v) for k, v in counts.items()},
    }


def _rank(rank: int, world: int, row: int, steps: int, profile: bool, folder: str) -> dict:
    configs = _op_configs(steps)
    before = calibrate(rank, world, configs)
    cfg = row_config(ROWS[row], steps + 4, f"{folder}/{row}")
    job = setup(cfg)
    measured = []
    for step in range(steps):
        begin = time.perf_counter()
        train_step(job, step)
        measured.append(time.perf_counter() - begin)
    timers: Timers = defaultdict(float)
    phases = []
    undo = _instrument(job.model, cfg.parallelism.dp_backend, timers)
    marks: list[Timers] = []
    for step in range(steps, steps + 3):
        marks.append(dict(timers))
        phases.append(_phases(job, step))
    for fn in undo:
        fn()
    per_step = {k: (timers[k] - marks[1].get(k, 0.0)) / 2 for k in timers}  # last two steps
    prof: dict[str, float] = {}
    if profile:  # every rank runs the step (its collectives), rank 0 under the profiler
        if rank == 0:
            prof = _profile_step(job, steps + 3)
        else:
            train_step(job, steps + 3)
    dist.barrier()
    plain = _plain(cfg, 6)
    after = calibrate(rank, world, configs)
    return {
        "measured_s": statistics.median(measured[2:]),
        "phases": {k: statistics.median(p[k] for p in phases[1:]) for k in phases[0]},
        "timers": per_step,
        "plain": plain,
        "profile": prof,
        "calibrations": [before, after],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[0], help="indices into ROWS")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the results")
    args = p.parse_args(argv)
    results = []
    for row in args.rows:
        load = uptime()
        per_rank = run_distributed(
            _rank, args.world, row, args.steps, args.profile, "/tmp/plan_decompose", timeout=1800
        )
        profile, _ = launch_profile([[r["calibrations"][k] for r in per_rank] for k in (0, 1)])
        cfg = row_config(ROWS[row], args.steps, "/tmp/plan_decompose")
        predicted = predict(cfg, args.world, profile)
        result = {
            "row": ROWS[row],
            "world": args.world,
            "uptime": [load, uptime()],
            "measured_ms": max(r["measured_s"] for r in per_rank) * 1e3,
            "predicted_ms": {k: v * 1e3 for k, v in predicted.items()},
            "profile": profile.as_dict(),
            "ranks": [{k: v for k, v in r.items() if k != "calibrations"} for r in per_rank],
        }
        results.append(result)
        _print(result)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def _print(result: dict[str, Any]) -> None:
    print(f"\n== W={result['world']} {result['row']}  ({result['uptime'][0]})")
    print(f"measured step (slowest rank): {result['measured_ms']:.1f} ms")
    print("predicted:", {k: round(v, 1) for k, v in result["predicted_ms"].items()})
    for r, rank in enumerate(result["ranks"]):
        print(f"-- rank {r}: measured {rank['measured_s'] * 1e3:.1f} ms")
        print("   phases ms:", {k: round(v * 1e3, 1) for k, v in rank["phases"].items()})
        print("   plain  ms:", {k: round(v * 1e3, 1) for k, v in rank["plain"].items()})
        for k, v in sorted(rank["timers"].items()):
            print(f"   {k:45s} {v * 1e3:8.1f} ms")
        if rank["profile"]:
            print("   profile:", {k: round(v, 1) for k, v in rank["profile"].items()})


if __name__ == "__main__":
    main()
