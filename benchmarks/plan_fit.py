"""A CPU/gloo hardware profile for ``flexshard-plan``, fitted from micro-benchmarks on
this machine, each term from its own (none from the step times it is checked on):

- GEMM, attention, per-op overhead and non-GEMM bandwidth: with ``op_configs``, the
  unsharded models' own forward / backward ops timed one by one at their shapes
  (``flexshard.plan.calibration``, one thread); without, a one-thread GEMM of one linear layer's
  shapes and a norm / SiLU / softmax / residual chain (tiny tensors: seconds per op
  counted by ``flexshard.plan.opcount``; 1 MiB tensors: its bytes over its time less
  the ops' cost), kept in the detail either way for comparison (the chain has no
  attention: on CPU flash attention runs at a fraction of the GEMM rate);
- memory: an in-place add over 64 MiB (the Muon path's bandwidth);
- copies: a 4 MiB ``copy_`` from a cold source into a buffer whose memory was freed
  and is given back (``runtime.storage.free`` / ``alloc``, as the runtime's
  gathered buffers; caches flushed by writing 64 MiB before each run);
- gloo: all-gather and reduce-scatter at W = 2, 3, 4 and four sizes (16 KiB - 4 MiB
  per rank), issued as the runtime issues them (the all-gather into a buffer freed
  and given back, the reduce-scatter from a fresh buffer just filled into a fresh
  one, caches flushed; preallocated warm buffers ran about twice as fast as the
  step's calls), the slowest rank's median of 13 runs; non-negative least squares
  (of the relative error) of t = call + (W - 1) * ring step + sent / bandwidth;
- the cores the W ranks find: the GEMM run by W ranks at once against one alone;
- overlap: a GEMM loop with an all-gather in flight against each alone, per rank
  (moot on CPU, where the runtime waits for every collective at launch);
- DTensor: AdamW's kinds of in-place ops on a sharded DTensor against its local tensor
  (FSDP2's optimizer step runs on DTensors).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor import distribute_tensor

from flexshard.plan.calibration import op_rates
from flexshard.plan.hardware import Hardware, Profile
from flexshard.plan.host_costs import HostCosts
from flexshard.plan.opcount import OpCount, count_ops
from flexshard.runtime.storage import alloc, free
from flexshard.testing import run_distributed
from flexshard.torch_internals import all_gather_single, reduce_scatter_single
from flexshard.trainer.config import Config

SIZES = (1 << 12, 1 << 16, 1 << 18, 1 << 20)  # fp32 elements per rank
REPS = 15  # runs of each collective (the first 2 not counted): the machine is noisy
WORLDS = (2, 3, 4)
OVERLAP_ELEMENTS = 1 << 20  # per rank: an all-gather of a few ms, like a block's


def _timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _gemm(tokens: int = 512, dim: int = 256, hidden: int = 1024) -> tuple[Callable, float]:
    """The forward and both backward products of a ``dim -> hidden`` linear layer."""
    x, w, g = torch.randn(tokens, dim), torch.randn(hidden, dim), torch.randn(tokens, hidden)

    def run() -> None:
        x @ w.t()
        g @ w
        g.t() @ x

    return run, 3 * 2.0 * tokens * dim * hidden


def gemm_tflops(reps: int = 20) -> float:
    torch.set_num_threads(1)
    run, flops = _gemm()
    return flops / _timed(run, reps) / 1e12


def memory_gbps(numel: int = 1 << 24, reps: int = 10) -> float:
    a, b = torch.randn(numel), torch.randn(numel)
    return 3 * 4 * numel / _timed(lambda: a.add_(b), reps) / 1e9


def _chain(rows: int, cols: int) -> Callable[[object], None]:
    """Norm, SiLU-gate, softmax and residual, forward + backward: the non-GEMM kinds of
    a transformer block, on a [rows, cols] activation (not the planned model)."""

    def step(counter: object) -> None:
        counter.phase = "setup"  # type: ignore[attr-defined]
        x = torch.randn(rows, cols, requires_grad=True)
        w = torch.randn(cols, requires_grad=True)
        counter.phase = "step"  # type: ignore[attr-defined]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        h = F.silu(h) * h
        (torch.softmax(h, -1) + x).sum().backward()

    return step


def _chain_time(rows: int, cols: int, reps: int) -> tuple[float, OpCount]:
    step = _chain(rows, cols)
    count = count_ops(step)["step"]
    return _timed(lambda: step(SimpleNamespace(phase="")), reps), count


def op_costs(reps: int = 30) -> tuple[float, float]:
    """(seconds per op, non-GEMM bytes per second)."""
    tiny, tiny_ops = _chain_time(4, 8, reps)
    per_op = tiny / tiny_ops.ops
    big, big_ops = _chain_time(512, 512, reps // 3)
    return per_op, big_ops.bytes / max(big - big_ops.ops * per_op, 1e-9)


#: written over before each timed collective or copy: in the step, compute runs
#: between them, so their buffers are not in the caches (L3 here: 32 MiB)
_FLUSH = torch.empty(1 << 24)


def flush_caches() -> None:
    _FLUSH.fill_(1.0)


def copy_gbps(numel: int = 1 << 20, reps: int = 20, fresh: bool = True) -> float:
    """``fresh``: as the runtime copies out of a landed all-gather: into a buffer whose
    memory was freed and is given back (``runtime.storage.free`` / ``alloc``), from a
    source not in the caches (flushed before each run). Otherwise: warm, preallocated."""
    src, dst = torch.randn(numel), torch.empty(numel)
    if not fresh:
        return 2 * 4 * numel / _timed(lambda: dst.copy_(src), reps) / 1e9
    times = []
    for _ in range(reps):
        free(dst)
        flush_caches()
        begin = time.perf_counter()
        alloc(dst)
        dst.copy_(src)
        times.append(time.perf_counter() - begin)
    return 2 * 4 * numel / statistics.median(times) / 1e9


def _in_step(
    fn: Callable[[], object], reps: int, skip: int = 2, pre: Callable[[], object] | None = None
) -> list[float]:
    """Seconds of each run of ``fn``, started together on every rank (a barrier first;
    ``pre`` before it, not timed)."""
    times = []
    for _ in range(reps):
        if pre is not None:
            pre()
        dist.barrier()
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return times[skip:]


def _slowest(per_rank: list[list[float]]) -> float:
    """The median over the runs of the slowest rank's time (a run ends when it does)."""
    return statistics.median(max(run) for run in zip(*per_rank))


def _dtensor_overhead(world: int, reps: int = 20) -> float:
    """Seconds an op on a DTensor (FSDP2's parameters) costs more than on its local
    tensor: AdamW's kinds of in-place ops on a Shard(0) DTensor of 1,024 rows."""
    mesh = init_device_mesh("cpu", (world,))
    tensors = [distribute_tensor(torch.randn(1024 * world), mesh, [DShard(0)]) for _ in range(3)]
    plain = [t.to_local() for t in tensors]

    def chain(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> None:
        for _ in range(10):
            p.mul_(0.99)
            m.lerp_(g, 0.1)
            p.addcdiv_(m, g, value=-0.01)

    on_dtensor = _timed(lambda: chain(*tensors), reps)
    on_local = _timed(lambda: chain(*plain), reps)
    return max(0.0, on_dtensor - on_local) / 30


def _rank(rank: int, world: int) -> dict:
    """Per rank: collective times at each size, the GEMM's time with all W ranks
    running it, a GEMM loop with an all-gather in flight, DTensor's op overhead."""
    points = []
    for n in SIZES:
        # as the runtime issues them: the all-gather into a buffer whose memory was
        # freed after the last use and is given back (``alloc``), the reduce-scatter
        # from a new buffer the copy-in just filled into a new one; caches flushed
        local, full, src = torch.randn(n), torch.empty(n * world), torch.randn(n * world)
        sent = (world - 1) * n * 4
        inputs: list[torch.Tensor] = []

        def gather_call() -> None:
            free(full)  # noqa: B023
            alloc(full)  # noqa: B023
            all_gather_single(full, local)  # noqa: B023

        def fill() -> None:
            flush_caches()
            inputs[:] = [torch.empty(n * world).copy_(src)]  # noqa: B023

        def reduce_call() -> None:
            reduce_scatter_single(torch.empty(n), inputs[0])  # noqa: B023

        gather = _in_step(gather_call, REPS, pre=flush_caches)
        reduce = _in_step(reduce_call, REPS, pre=fill)
        points += [("all_gather", world, sent, gather), ("reduce_scatter", world, sent, reduce)]
    gemm, _ = _gemm()
    dist.barrier()
    gemm_s = _timed(gemm, 10)
    local = torch.randn(OVERLAP_ELEMENTS)
    full = torch.empty(OVERLAP_ELEMENTS * world)
    loop = 4

    def compute() -> None:
        for _ in range(loop):
            gemm()

    def gather() -> None:
        all_gather_single(full, local)

    def both() -> None:
        work = all_gather_single(full, local, async_op=True)
        compute()
        work.wait()

    timings = {
        name: _in_step(fn, 9)
        for name, fn in (("compute", compute), ("gather", gather), ("both", both))
    }
    return {
        "points": points,
        "gemm_s": gemm_s,
        "dtensor_s": _dtensor_overhead(world),
        **timings,
    }


def _overlap(t: dict) -> float:
    """Share of the shorter of the two that ran hidden beside the other."""
    hidden = t["compute"] + t["gather"] - t["both"]
    return min(1.0, max(0.0, hidden / min(t["compute"], t["gather"])))


def nonnegative_lstsq(a: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Least squares with every coefficient >= 0: the best of the unconstrained fits
    on each subset of the columns whose coefficients all come out >= 0 (few columns)."""
    n = a.shape[1]
    best, best_res = [0.0] * n, float(y.square().sum())
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sol = torch.linalg.lstsq(a[:, cols], y).solution.squeeze(1)
        if (sol < 0).any():
            continue
        res = float((a[:, cols] @ sol.unsqueeze(1) - y).square().sum())
        if res < best_res:
            best, best_res = [0.0] * n, res
            for j, v in zip(cols, sol.tolist()):
                best[j] = v
    return best


def gloo_fit(per_world: dict[int, list[dict]]) -> tuple[float, float, float, float]:
    """(seconds per call, per ring step, all-gather and reduce-scatter bytes/s):
    non-negative least squares of t = call + (W - 1) * step + sent / bw_kind, each
    point the slowest rank's median time, weighted relative (every size counts)."""
    rows, ys = [], []
    for per_rank in per_world.values():
        for i, (kind, w, sent, _) in enumerate(per_rank[0]["points"]):
            ag = kind == "all_gather"
            t = _slowest([r["points"][i][3] for r in per_rank])
            row = [1.0, w - 1.0, float(sent) * ag, float(sent) * (not ag)]
            rows.append([v / t for v in row])
            ys.append(1.0)
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    call, step, inv_ag, inv_rs = nonnegative_lstsq(a, y)
    return call, step, 1 / max(inv_ag, 1e-15), 1 / max(inv_rs, 1e-15)


def fit_cpu_profile(
    worlds: tuple[int, ...] = WORLDS, op_configs: Sequence[Config] = ()
) -> tuple[Profile, dict]:
    """``op_configs``: models whose unsharded forward / backward ops are timed at their
    own shapes (``plan.calibration``) for the GEMM, attention and non-GEMM rates; without
    them, the nominal GEMM and the norm / SiLU / softmax chain above."""
    per_world = {w: run_distributed(_rank, w, timeout=300) for w in worlds}
    gemm, _ = _gemm()
    torch.set_num_threads(1)
    alone = _timed(gemm, 10)
    tflops = nominal_tflops = gemm_tflops()
    per_op, elementwise = chain = op_costs()
    attention, at_shapes = 0.0, {}
    if op_configs:
        rates, at_shapes = op_rates(list(op_configs))
        tflops, attention = rates["gemm_tflops"], rates["attention_tflops"]
        per_op, elementwise = rates["op_overhead_us"] * 1e-6, rates["elementwise_gbps"] * 1e9
        at_shapes["rates"] = rates
    call, step, ag_bw, rs_bw = gloo_fit(per_world)
    # a rank of W finds W / slowdown cores (fewer than the host has under other load)
    cores = statistics.median(
        w / max(1.0, max(r["gemm_s"] for r in rs) / alone) for w, rs in per_world.items()
    )
    timings = {
        w: {k: _slowest([r[k] for r in rs]) for k in ("compute", "gather", "both")}
        for w, rs in per_world.items()
    }
    overlap = statistics.median(_overlap(t) for t in timings.values())
    hw = Hardware(
        name="cpu-gloo (fitted)",
        peak_tflops=tflops,
        gemm_efficiency=1.0,  # the measured rate is already what GEMMs reach
        hbm_gbps=memory_gbps(),
        devices_per_node=64,  # every rank on this host: one link class
        intra_gbps=ag_bw / 1e9,
        intra_latency_us=step * 1e6,
        inter_gbps=ag_bw / 1e9,
        inter_latency_us=step * 1e6,
        op_overhead_us=per_op * 1e6,
        elementwise_gbps=elementwise / 1e9,
        copy_gbps=copy_gbps(),
        collective_overhead_us=call * 1e6,
        reduce_scatter_gbps=rs_bw / 1e9,
        overlap=overlap,
        attention_tflops=attention,
    )
    host = HostCosts(
        cores=cores,
        dtensor_op_overhead_us=statistics.median(
            r["dtensor_s"] for rs in per_world.values() for r in rs
        )
        * 1e6,
    )
    detail = {
        "nominal_gemm_tflops": nominal_tflops,
        "chain_op_us_gbps": (chain[0] * 1e6, chain[1] / 1e9),
        "copy_gbps_preallocated": copy_gbps(fresh=False),
        "ops_at_shapes": at_shapes,
        "gloo_points": [
            (kind, w, sent, _slowest([r["points"][i][3] for r in rs]))
            for rs in per_world.values()
            for i, (kind, w, sent, _) in enumerate(rs[0]["points"])
        ],
        "gemm_alone_s": alone,
        "gemm_with_w_ranks_s": {w: max(r["gemm_s"] for r in rs) for w, rs in per_world.items()},
        "overlap_timings": timings,
    }
    return Profile(hw, host), detail
