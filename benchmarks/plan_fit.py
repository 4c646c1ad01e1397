"""A CPU/gloo hardware profile for ``flexshard-plan``, fitted from micro-benchmarks on
this machine: one-thread fp32 GEMM rate, memory bandwidth (an in-place add), and the
gloo all-gather's latency per ring step and bandwidth (least squares over W = 2, 3, 4
and three sizes)."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from flexshard.plan.hardware import Hardware
from flexshard.testing import run_distributed

SIZES = (1 << 10, 1 << 16, 1 << 20)  # fp32 elements per rank


def gemm_tflops(tokens: int = 512, dim: int = 256, hidden: int = 1024, reps: int = 20) -> float:
    """fp32, one thread, the benchmark models' GEMM shapes (forward and both backward
    products of a ``dim -> hidden`` linear layer)."""
    torch.set_num_threads(1)
    x, w, g = torch.randn(tokens, dim), torch.randn(hidden, dim), torch.randn(tokens, hidden)
    rates = []
    for _ in range(reps):
        begin = time.perf_counter()
        x @ w.t()
        g @ w
        g.t() @ x
        rates.append(3 * 2 * tokens * dim * hidden / (time.perf_counter() - begin))
    return statistics.median(rates) / 1e12


def memory_gbps(numel: int = 1 << 24, reps: int = 10) -> float:
    a, b = torch.randn(numel), torch.randn(numel)
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - begin)
    return 3 * 4 * numel / statistics.median(times) / 1e9


def _gloo_rank(rank: int, world: int) -> list[tuple[int, int, float]]:
    out = []
    for n in SIZES:
        local = torch.randn(n)
        full = torch.empty(n * world)
        times = []
        for _ in range(7):
            dist.barrier()
            begin = time.perf_counter()
            dist.all_gather_single(full, local)
            times.append(time.perf_counter() - begin)
        out.append((world, (world - 1) * n * 4, statistics.median(times[2:])))
    return out


def gloo_fit(worlds: tuple[int, ...] = (2, 3, 4)) -> tuple[float, float, list]:
    """(seconds per ring step, bytes/s) fitting t = (W - 1) * lat + sent / bw."""
    points = []
    for world in worlds:
        per_rank = run_distributed(_gloo_rank, world, timeout=300)
        for i in range(len(SIZES)):  # the slowest rank's time
            w, sent, _ = per_rank[0][i]
            points.append((w, sent, max(r[i][2] for r in per_rank)))
    a = torch.tensor([[w - 1.0, float(sent)] for w, sent, _ in points], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in points], dtype=torch.float64)
    lat, inv_bw = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1).tolist()
    return max(lat, 1e-7), 1.0 / max(inv_bw, 1e-15), points


def fit_cpu_profile() -> tuple[Hardware, dict]:
    lat, bw, points = gloo_fit()
    tflops = gemm_tflops()
    hbm = memory_gbps()
    hw = Hardware(
        name="cpu-gloo (fitted)",
        peak_tflops=tflops,
        gemm_efficiency=1.0,  # the measured rate is already what GEMMs reach
        hbm_gbps=hbm,
        devices_per_node=64,  # every rank on this host: one link class
        intra_gbps=bw / 1e9,
        intra_latency_us=lat * 1e6,
        inter_gbps=bw / 1e9,
        inter_latency_us=lat * 1e6,
        cores=os.cpu_count() or 1,
    )
    return hw, {"gloo_points": points}
