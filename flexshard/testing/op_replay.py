"""The ops a model really runs, replayed on this machine for the CPU profile
(``benchmarks/plan_launch.py``): the aten ops of one unsharded forward + backward are
recorded under ``FakeTensorMode`` (``flexshard.plan.oprecord``, as ``opcount`` counts
them), then each distinct op (same function, shapes, strides, dtypes, arguments) is run
on real random tensors, one thread.

- :func:`op_rates`, each op timed one by one: the GEMM rate (the GEMMs' FLOPs over
  their time, at the model's own shapes, some narrow), the causal attention rate (its
  FLOPs as ``steptime.bucket_flops`` counts them; on CPU far below the GEMM rate), and
  for the other ops t = per-op cost + bytes / bandwidth (:func:`fit_op_costs`: least
  squares weighted by how often each op runs, so that on the recorded model the
  planner's non-GEMM sum is the timed sum);
- :func:`op_window`, the ``contention`` of W ranks: the same ops run end to end as one
  window (each as often as the step runs it, inputs made first) on every rank at
  once, the slowest rank's time over what the one-by-one medians add up to (time
  slicing of W ranks on fewer cores, caches shared and flushed, the slowest rank).

This measures the machine on the unsharded model's ops only: no sharding, hooks,
collectives, copies of the runtime or optimizer step, and none of the step times the
plan is checked against (``benchmarks/plan_validation.py``)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from flexshard.plan.oprecord import op_flops, real_arguments, record_model
from flexshard.trainer.config import Config

WINDOW_REPS = 3  # op windows per rank (the median is kept)


def _time(func: Any, margs: Any, mkwargs: Any, reps: int) -> float:
    args, kwargs = real_arguments(margs, mkwargs)
    func(*args, **kwargs)  # warm-up
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        func(*args, **kwargs)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def fit_op_costs(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(seconds per op, seconds per byte) >= 0 of t = a + b * bytes, each point
    (count, bytes, seconds) weighted by its count (so the sums agree)."""
    n = sum(c for c, _, _ in points)
    mean_x = sum(c * x for c, x, _ in points) / n
    mean_y = sum(c * y for c, _, y in points) / n
    var = sum(c * (x - mean_x) ** 2 for c, x, _ in points)
    slope = sum(c * (x - mean_x) * (y - mean_y) for c, x, y in points) / var if var else 0.0
    slope = max(slope, 0.0)
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # no fixed cost: the bytes alone, through the origin
        intercept = 0.0
        slope = sum(c * x * y for c, x, y in points) / max(
            sum(c * x * x for c, x, _ in points), 1e-30
        )
    return intercept, slope


def op_rates(configs: list[Config], reps: int = 3) -> tuple[dict[str, float], dict[str, Any]]:
    """Rates for the profile (GEMM and attention TFLOP/s, per-op us, non-GEMM GB/s) from
    the ops of these models, and the detail (per kind: ops run, seconds, FLOPs)."""
    torch.set_num_threads(1)
    sums = {"gemm": [0.0, 0.0], "attention": [0.0, 0.0]}  # seconds, FLOPs
    points: list[tuple[int, float, float]] = []
    failed: list[str] = []
    for cfg in configs:
        recorder = record_model(cfg)
        for key, (func, margs, mkwargs, moved) in recorder.calls.items():
            count = recorder.counts[key]
            try:
                seconds = _time(func, margs, mkwargs, reps)
            except Exception as err:  # an op that cannot run on random inputs
                failed.append(f"{func}: {type(err).__name__}")
                continue
            kind, flops = op_flops(func, margs)
            if kind == "op":
                points.append((count, float(moved), seconds))
            else:
                sums[kind][0] += count * seconds
                sums[kind][1] += count * flops
    per_op, per_byte = fit_op_costs(points)
    rates = {
        "gemm_tflops": sums["gemm"][1] / max(sums["gemm"][0], 1e-12) / 1e12,
        "attention_tflops": sums["attention"][1] / max(sums["attention"][0], 1e-12) / 1e12,
        "op_overhead_us": per_op * 1e6,
        "elementwise_gbps": 1 / max(per_byte, 1e-30) / 1e9,
    }
    detail = {
        "gemm_s": sums["gemm"][0],
        "attention_s": sums["attention"][0],
        "non_gemm_s": sum(c * t for c, _, t in points),
        "non_gemm_ops": sum(c for c, _, _ in points),
        "failed": failed,
    }
    return rates, detail


def op_window(configs: list[Config], medians: float) -> float:
    """``contention``: the slowest rank's median elapsed time of the models' recorded
    ops run end to end, over ``medians`` (the same ops' one-by-one medians summed).
    Every rank of the launch calls it."""
    calls: list[tuple[Any, Any, Any, int]] = []
    for cfg in configs:
        recorder = record_model(cfg)
        for key, (func, margs, mkwargs, _) in recorder.calls.items():
            args, kwargs = real_arguments(margs, mkwargs)
            try:
                func(*args, **kwargs)
            except Exception:  # as op_rates: an op that cannot run on random inputs
                continue
            calls.append((func, args, kwargs, recorder.counts[key]))

    def window() -> None:
        for func, args, kwargs, count in calls:
            for _ in range(count):
                func(*args, **kwargs)

    times = []
    for _ in range(WINDOW_REPS):
        dist.barrier()
        begin = time.perf_counter()
        window()
        times.append(time.perf_counter() - begin)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return max(1.0, float(slowest) / max(medians, 1e-9))
