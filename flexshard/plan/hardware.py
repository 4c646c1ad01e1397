"""Hardware profiles for the step-time model: compute, memory bandwidth and the two
link classes a collective can run on. Built-ins come from vendor data sheets (not
fitted to any figure the model is compared against); ``--hardware file.json`` takes
the same fields, e.g. the CPU/gloo profile ``benchmarks/plan_validation.py`` fits."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float  # per device, dense, in the compute dtype (bf16 on GPUs)
    gemm_efficiency: float  # share of peak a large GEMM reaches (cuBLAS ~0.7 on H100)
    hbm_gbps: float  # memory bandwidth per device, GB/s (the optimizer step is bound by it)
    devices_per_node: int
    intra_gbps: float  # per device, inside a node (NVLink bus bandwidth), GB/s
    intra_latency_us: float  # per ring step
    inter_gbps: float  # per device, between nodes (one NIC per GPU), GB/s
    inter_latency_us: float
    # CPU profiles: the cores the ranks on one host share, as the ranks found them
    # (fitted: fewer than the host has when other jobs run; 0: one device per rank)
    cores: float = 0
    # what the step does besides GEMMs and the collectives' wire time (0: not modelled)
    op_overhead_us: float = 0.0  # per aten op the compute stream cannot hide
    elementwise_gbps: float = 0.0  # bytes the non-GEMM ops read + write, per second
    copy_gbps: float = 0.0  # copy-in / copy-out of the all-gather, reduce-scatter buffers
    collective_overhead_us: float = 0.0  # per collective call, on top of its ring steps
    reduce_scatter_gbps: float = 0.0  # when it differs from the all-gather's (0: the same)
    overlap: float = 1.0  # share of a collective's time that truly runs beside compute
    dtensor_op_overhead_us: float = 0.0  # per op on a DTensor (the optimizer step)
    attention_tflops: float = 0.0  # causal attention's achieved rate (0: the GEMMs')
    # the runtime's schedule on this device: without streams (CPU) each data-parallel
    # collective is waited for at launch (runtime/collectives.py's Note on collectives
    # without streams, and FSDP2's unshard_async_op = False): ``overlap`` is moot
    blocking_collectives: bool = False
    # eager autograd + nn.Module cost per forward / backward op beyond the op itself
    eager_op_us: float = 0.0
    # the sharding runtime's own cost on the compute stream, per parameter of a bucket:
    # per all-gather (pre-forward / pre-backward hooks, unshard, copy-out loop, views)
    # and per gradient reduction (post-backward hooks, pack loop, landing on .grad)
    flexshard_gather_param_us: float = 0.0
    flexshard_reduce_param_us: float = 0.0
    fsdp2_gather_param_us: float = 0.0
    fsdp2_reduce_param_us: float = 0.0
    # compute time of a rank among W ranks sharing the host's cores over what the ops
    # timed one by one (median) add up to: time slicing, shared caches, the slowest rank
    contention: float = 1.0
    # per data-parallel collective call, the wait for the slower rank (ranks drift
    # apart between two collectives; the collectives' fit starts them together)
    collective_wait_us: float = 0.0

    def compute_slowdown(self, ranks_per_node: int) -> float:
        """Ranks that share the host's cores run that much slower (CPU profiles)."""
        if not self.cores:
            return 1.0
        return max(1.0, ranks_per_node / self.cores)

    def non_gemm_s(self, ops: int, moved: float, eager: bool = False) -> float:
        """Seconds of ``ops`` dispatched ops moving ``moved`` non-GEMM bytes (``eager``:
        ops of an autograd forward / backward, each at ``eager_op_us`` more)."""
        bw = self.elementwise_gbps or self.hbm_gbps
        per_op = self.op_overhead_us + (self.eager_op_us if eager else 0.0)
        return ops * per_op * 1e-6 + moved / (bw * 1e9)

    def runtime_param_s(self, backend: str, kind: str) -> float:
        """Seconds the sharding runtime spends per parameter per all-gather
        (``kind="gather"``) or per gradient reduction (``"reduce"``)."""
        if backend not in ("flexshard", "fsdp2") or kind not in ("gather", "reduce"):
            raise ValueError(f"runtime_param_s: unknown backend {backend!r} or kind {kind!r}")
        return getattr(self, f"{backend}_{kind}_param_us") * 1e-6

    def copy_s(self, moved: float) -> float:
        return moved / ((self.copy_gbps or self.elementwise_gbps or self.hbm_gbps) * 1e9)

    def as_dict(self) -> dict[str, float | int | str]:
        return dataclasses.asdict(self)


# H100 SXM5 80GB: 989 dense bf16 TFLOPs, 3.35 TB/s HBM3, NVLink 4 (900 GB/s total,
# ~450 GB/s each way; NCCL's all-gather bus bandwidth ~370 GB/s), one 400 Gb/s NIC
# (50 GB/s) per GPU. H200: the same compute and links, 4.8 TB/s HBM3e.
# Besides GEMMs: elementwise kernels and copies reach ~80% of HBM bandwidth (what a
# STREAM-style copy reaches on these parts); eager launches are asynchronous, so
# per op only the ~2 us gap between dependent kernels on one stream is counted (the
# CPU's ~5-10 us dispatch runs ahead of kernels that take longer); NCCL's ~5 us
# launch per collective; collectives on their own stream overlap compute fully (the
# SMs NCCL's kernels take are not modelled); DTensor's per-op Python cost in FSDP2's
# optimizer step runs ahead of the kernels as well (0); attention at the 335 TFLOP/s
# FlashAttention-2 reports on H100 (forward + backward, Dao 2023), a third of the
# GEMMs' peak. The terms fitted on CPU for what the CPU runs between kernels take
# no time on top of the kernels here: NCCL runs on its own streams (no blocking
# collectives); the eager autograd / nn.Module cost per op (~10-20 us of CPU) and
# the runtimes' per-parameter hook / bookkeeping Python run ahead of kernels that
# take longer (the 2 us gap per op above stays; the per-parameter copy kernels are
# charged by the copies' per-op term); one GPU per rank (contention 1); no wait for
# a slower rank per collective (stragglers are not modelled on GPUs). Estimates,
# not fitted.
H100 = Hardware(
    "h100",
    989.0,
    0.7,
    3350.0,
    8,
    370.0,
    3.0,
    45.0,
    8.0,
    op_overhead_us=2.0,
    elementwise_gbps=0.8 * 3350.0,
    copy_gbps=0.8 * 3350.0,
    collective_overhead_us=5.0,
    attention_tflops=335.0,
)
H200 = dataclasses.replace(
    H100, name="h200", hbm_gbps=4800.0, elementwise_gbps=0.8 * 4800.0, copy_gbps=0.8 * 4800.0
)
BUILTIN = {"h100": H100, "h200": H200}


def load_hardware(spec: str) -> Hardware:
    """``h100``, ``h200`` or a JSON file with the fields of :class:`Hardware`."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec)
    if not path.exists():
        raise ValueError(
            f"--hardware {spec!r}: not a built-in profile ({', '.join(BUILTIN)}) nor a JSON file"
        )
    table = json.loads(path.read_text())
    names = {f.name for f in dataclasses.fields(Hardware)}
    unknown = set(table) - names
    required = {f.name for f in dataclasses.fields(Hardware) if f.default is dataclasses.MISSING}
    missing = required - set(table)
    if unknown or missing:
        raise ValueError(
            f"hardware file {spec}: unknown fields {sorted(unknown)}, missing {sorted(missing)}"
        )
    return Hardware(**table)
