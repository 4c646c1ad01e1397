"""Compute rates at the shapes a model really runs, for the CPU profile of
``benchmarks/plan_fit.py``: the aten ops of one unsharded forward + backward are
recorded under ``FakeTensorMode`` (as ``flexshard.plan.opcount`` counts them), then
each distinct op (same function, shapes, strides, dtypes, arguments) is run on real
random tensors on this machine, one thread, and timed. From the timings:

- GEMM rate: the GEMMs' FLOPs over their time (the nominal micro-benchmark GEMM of
  ``plan_fit`` is one shape; the model's are several, some narrow);
- attention rate: causal flash attention's FLOPs, as ``steptime.bucket_flops``
  counts them (forward 4 * S/2 * D per query, backward twice that), over its time
  (on CPU far below the GEMM rate; the planner counted it at the GEMM rate);
- non-GEMM ops: t = per-op cost + bytes / bandwidth, least squares over the ops
  weighted by how often each runs (the bytes as ``opcount`` counts them), so that on
  the recorded model the planner's non-GEMM sum is the timed sum.

This measures the machine on the ops of the unsharded model's forward / backward
only: no sharding, hooks, collectives, copies of the runtime or optimizer step, and
none of the step times the plan is checked against (``plan_validation`` measures the
sharded trainer's step on W processes; those times are not read here)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._runtime_estimation import _IGNORE_OPS, get_num_bytes

from flexshard.plan.opcount import _FLOP_OPS
from flexshard.trainer.config import Config
from flexshard.trainer.model import Transformer

aten = torch.ops.aten
GEMMS = {aten.mm, aten.addmm, aten.bmm}
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
}


@dataclass(frozen=True)
class Meta:
    """A tensor argument as recorded: enough to build a real one of the same layout."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def real(self) -> torch.Tensor:
        # storage big enough for the strides (expanded views included), filled once
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride) if s > 0)
        if any(s == 0 for s in self.shape):
            extent = 0
        if self.dtype.is_floating_point or self.dtype.is_complex:
            base = torch.randn(extent, dtype=self.dtype)
        else:  # indices (embedding, loss targets): 0 is valid everywhere
            base = torch.zeros(extent, dtype=self.dtype)
        return base.as_strided(self.shape, self.stride)


class OpRecorder(TorchDispatchMode):
    """Counts each distinct op: (function, arguments with tensors as ``Meta``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[tuple, int] = {}
        self.calls: dict[tuple, tuple[Any, Any, Any, int]] = {}  # key -> func, args, kwargs, bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out

        def meta(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                return Meta(tuple(t.shape), tuple(t.stride()), t.dtype)
            return t

        margs, mkwargs = pytree.tree_map(meta, args), pytree.tree_map(meta, kwargs)
        key = (func, repr(margs), repr(mkwargs))
        if key not in self.calls:
            packet = func._overloadpacket
            moved = 0
            if packet not in _IGNORE_OPS and packet not in _FLOP_OPS:  # as opcount counts
                tensors = [
                    t
                    for t in pytree.tree_leaves((args, kwargs, out))
                    if isinstance(t, torch.Tensor)
                ]
                moved = sum(get_num_bytes(t) for t in tensors)
            self.calls[key] = (func, margs, mkwargs, moved)
        self.counts[key] = self.counts.get(key, 0) + 1
        return out


def record_model(cfg: Config) -> OpRecorder:
    """The ops of one rank's unsharded forward + backward (its local batch), fp32."""
    recorder = OpRecorder()
    with FakeTensorMode():
        net = Transformer(cfg.model)
        t = cfg.training
        tokens = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))
        with recorder:
            logits = net(tokens)
            F.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), tokens.reshape(-1)
            ).backward()
    return recorder


def _flops(func: Any, args: tuple) -> tuple[str, float]:
    """(kind, FLOPs): a GEMM's 2 m k n, attention's causal count, else ("op", 0)."""
    packet = func._overloadpacket
    if packet in GEMMS:
        a, b = args[-2].shape, args[-1].shape
        batch = a[0] if len(a) == 3 else 1
        return "gemm", 2.0 * batch * a[-2] * a[-1] * b[-1]
    if packet in ATTENTION:
        # forward: q [B, H, S, D]; backward: grad_out first, q second (the same shape)
        b, h, s, d = args[1].shape if "backward" in packet.__name__ else args[0].shape
        forward = 4.0 * b * h * s * (s / 2) * d
        return "attention", forward * (2 if "backward" in packet.__name__ else 1)
    return "op", 0.0


def recorded_flops(recorder: OpRecorder) -> dict[str, float]:
    """FLOPs of the recorded GEMMs and attention (as the rates divide them)."""
    total = {"gemm": 0.0, "attention": 0.0, "op": 0.0}
    for key, (func, margs, _, _) in recorder.calls.items():
        kind, flops = _flops(func, margs)
        total[kind] += recorder.counts[key] * flops
    return total


def _time(func: Any, margs: Any, mkwargs: Any, reps: int) -> float:
    real = lambda m: m.real() if isinstance(m, Meta) else m  # noqa: E731
    args, kwargs = pytree.tree_map(real, margs), pytree.tree_map(real, mkwargs)
    func(*args, **kwargs)  # warm-up
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        func(*args, **kwargs)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _weighted_fit(points: list[tuple[int, float, float]]) -> tuple[float, float]:
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
            kind, flops = _flops(func, margs)
            if kind == "op":
                points.append((count, float(moved), seconds))
            else:
                sums[kind][0] += count * seconds
                sums[kind][1] += count * flops
    per_op, per_byte = _weighted_fit(points)
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
