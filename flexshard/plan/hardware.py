"""Hardware profiles for the step-time model: the device (compute rates, memory
bandwidth, the cost of a kernel and of a collective call, whether collectives run on
streams) and the two link classes a collective can run on; with, apart, what the host
adds around them (:class:`~flexshard.plan.host_costs.HostCosts`, off by default).

Built-ins come from vendor data sheets and published kernel rates (not fitted to any
figure the model is compared against). ``--hardware file.json`` takes a profile file:
the fields of :class:`Hardware` at its top level and, optionally, the host's under
``"host_costs"`` (the fields of ``HostCosts``), e.g. the CPU/gloo profile
``benchmarks/plan_validation.py`` fits (``benchmarks/results/cpu_gloo_profile.json``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .host_costs import NO_HOST_COSTS, HostCosts

#: the section of a profile file that holds the host's costs
HOST_SECTION = "host_costs"


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
    # what the step does besides GEMMs and the collectives' wire time (0: not modelled)
    op_overhead_us: float = 0.0  # per aten op the compute stream cannot hide
    elementwise_gbps: float = 0.0  # bytes the non-GEMM ops read + write, per second
    copy_gbps: float = 0.0  # copy-in / copy-out of the all-gather, reduce-scatter buffers
    collective_overhead_us: float = 0.0  # per collective call, on top of its ring steps
    reduce_scatter_gbps: float = 0.0  # when it differs from the all-gather's (0: the same)
    overlap: float = 1.0  # share of a collective's time that truly runs beside compute
    attention_tflops: float = 0.0  # causal attention's achieved rate (0: the GEMMs')
    # the runtime's schedule on this device: without streams (CPU) each data-parallel
    # collective is waited for at launch (runtime/collectives.py's Note on collectives
    # without streams, and FSDP2's unshard_async_op = False): ``overlap`` is moot
    blocking_collectives: bool = False
    memory_gib: float = 0.0  # device memory; a plan needing more says so first (0: unknown)
    # the SM clock GEMMs sustain over the data sheet's (its peaks are quoted at boost;
    # a power cap holds tensor-core work below it): scales every compute rate
    sustained_clock: float = 1.0
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak (0: no Float8 GEMMs here)
    fp8_gemm_efficiency: float = 0.0  # share of fp8_tflops a Float8 GEMM reaches (0: gemm's)
    # share of peak the routed experts' grouped GEMMs reach (torch._grouped_mm, bf16:
    # one kernel over every local expert's tokens; 0: gemm_efficiency's)
    grouped_gemm_efficiency: float = 0.0
    # torch.compile's fusion: the share of the non-GEMM ops' kernels and bytes left
    # once Inductor fuses the elementwise / norm chains (1: nothing fused)
    fused_share: float = 1.0
    async_tp_overlap: float = 1.0  # share of the TP collectives async TP hides

    def gemm_flops_per_s(self) -> float:
        """A bf16 GEMM's achieved rate at the sustained clock."""
        return self.peak_tflops * 1e12 * self.gemm_efficiency * self.sustained_clock

    def fp8_flops_per_s(self) -> float:
        """A Float8 GEMM's achieved rate at the sustained clock; a clear error where the
        profile has no FP8 tensor cores."""
        if not self.fp8_tflops:
            raise ValueError(f"hardware {self.name!r}: fp8_tflops is 0, no Float8 GEMMs to plan")
        efficiency = self.fp8_gemm_efficiency or self.gemm_efficiency
        return self.fp8_tflops * 1e12 * efficiency * self.sustained_clock

    def grouped_gemm_flops_per_s(self) -> float:
        """The routed experts' grouped bf16 GEMM's achieved rate at the sustained clock."""
        efficiency = self.grouped_gemm_efficiency or self.gemm_efficiency
        return self.peak_tflops * 1e12 * efficiency * self.sustained_clock

    def non_gemm_s(self, ops: int, moved: float) -> float:
        """Seconds of ``ops`` dispatched ops moving ``moved`` non-GEMM bytes."""
        bw = self.elementwise_gbps or self.hbm_gbps
        return ops * self.op_overhead_us * 1e-6 + moved / (bw * 1e9)

    def copy_s(self, moved: float) -> float:
        return moved / ((self.copy_gbps or self.elementwise_gbps or self.hbm_gbps) * 1e9)

    def as_dict(self) -> dict[str, float | int | str]:
        return dataclasses.asdict(self)


# H100 SXM5 80GB: 989 dense bf16 TFLOPs (at its 1.83 GHz boost: 132 SMs x 4,096 FLOP
# per clock; at the 700 W TDP GEMMs are taken to hold it, sustained_clock 1; 1,979
# dense FP8), 3.35 TB/s HBM3, NVLink 4 (900 GB/s total,
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
# GEMMs' peak. NCCL runs on its own streams (no blocking collectives). The host's
# costs fitted on CPU take no time on top of the kernels here (a built-in profile's
# host is NO_HOST_COSTS): the eager autograd / nn.Module cost per op (~10-20 us of CPU) and
# the runtimes' per-parameter hook / bookkeeping Python run ahead of kernels that
# take longer (the 2 us gap per op above stays; the per-parameter copy kernels are
# charged by the copies' per-op term); one GPU per rank (contention 1); no wait for
# a slower rank per collective (stragglers are not modelled on GPUs). Estimates,
# not fitted. The routed experts' grouped GEMMs: torch._grouped_mm in bf16 on H100 at
# 0.54 of the dense peak, the mean of torchao's published benchmark (pytorch/ao PR
# 2490, benchmarks/float8/bench_grouped_mm.py on an H100: Llama 4 17Bx16E's expert
# shapes, 8,192 tokens over 16 experts, 2 x 8,192 x 5,120 x 8,192 FLOPs in 1.31 ms and
# 1.26 ms: 0.530 and 0.551 of 989 TFLOP/s), below a dense GEMM's (the 0.7 above) from
# the per-expert tile quantisation and its group scheduling.
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
    memory_gib=80.0,
    fp8_tflops=1979.0,
    grouped_gemm_efficiency=0.54,
)
H200 = dataclasses.replace(
    H100,
    name="h200",
    hbm_gbps=4800.0,
    elementwise_gbps=0.8 * 4800.0,
    copy_gbps=0.8 * 4800.0,
    memory_gib=141.0,
)
# torchtitan's published Llama 3.1 runs (docs/performance.md): Meta's Grand Teton hosts,
# H100 with 96 GB HBM2e at 2.4 TB/s, the default 500 W power limit, 400 Gb/s RDMA per
# GPU. Its peak "is between SXM and NVL" (835 dense bf16 TFLOP/s; the same ratio for FP8,
# 1,671 of 1,979), value unknown: the sustained clock is taken as the midpoint of that
# range, (835 / 989 + 1) / 2 of the SXM data sheet's (whose peak is at its 1.83 GHz
# boost: 132 SMs x 4,096 FLOP per clock). Its GEMM, Float8 and attention rates,
# compile's fusion and async TP's overlap are fitted on the calibration rows of
# flexshard/plan/published.py.
H100_GT500 = dataclasses.replace(
    H100,
    name="h100-gt500",
    hbm_gbps=2400.0,
    elementwise_gbps=0.8 * 2400.0,
    copy_gbps=0.8 * 2400.0,
    memory_gib=95.0,
    sustained_clock=(835.0 / 989.0 + 1.0) / 2,
    # fitted (``flexshard-plan --validate``; tests/plan/test_plan_validate.py checks them)
    gemm_efficiency=0.775,
    fused_share=0.558,
    fp8_gemm_efficiency=0.915,
    attention_tflops=240.1,
    async_tp_overlap=0.0266,
)
BUILTIN = {"h100": H100, "h200": H200, "h100-gt500": H100_GT500}


@dataclass(frozen=True)
class Profile:
    """What ``--hardware`` names: the device and its links, and what the host adds
    around them (nothing, for the built-in GPU profiles)."""

    hardware: Hardware
    host: HostCosts = NO_HOST_COSTS

    def as_dict(self) -> dict[str, Any]:
        """The profile file's layout: :class:`Hardware`'s fields, the host's apart."""
        return {**self.hardware.as_dict(), HOST_SECTION: self.host.as_dict()}

    @classmethod
    def from_dict(cls, table: dict[str, Any], source: str = "profile") -> Profile:
        """A profile file's table: every required :class:`Hardware` field, no unknown
        field (a host's field belongs under ``"host_costs"``)."""
        table = dict(table)
        host = table.pop(HOST_SECTION, {})
        device = _checked(Hardware, table, source)
        return cls(Hardware(**device), HostCosts(**_checked(HostCosts, host, source)))


def _checked(kind: type, table: dict[str, Any], source: str) -> dict[str, Any]:
    """``table`` if it holds every required field of the dataclass ``kind`` and no other."""
    names = {f.name for f in dataclasses.fields(kind)}
    required = {f.name for f in dataclasses.fields(kind) if f.default is dataclasses.MISSING}
    unknown, missing = set(table) - names, required - set(table)
    if not unknown and not missing:
        return table
    hint = ""
    if kind is Hardware and unknown & {f.name for f in dataclasses.fields(HostCosts)}:
        hint = f" (a host's costs go under {HOST_SECTION!r})"
    section = f" {HOST_SECTION!r}" if kind is HostCosts else ""
    raise ValueError(
        f"hardware file {source}{section}: unknown fields {sorted(unknown)}, "
        f"missing {sorted(missing)}{hint}"
    )


def load_profile(spec: str) -> Profile:
    """``h100``, ``h200`` (no host costs) or a profile file (JSON): the fields of
    :class:`Hardware`, and optionally ``"host_costs"`` with those of ``HostCosts``."""
    if spec in BUILTIN:
        return Profile(BUILTIN[spec])
    path = Path(spec)
    if not path.exists():
        raise ValueError(
            f"--hardware {spec!r}: not a built-in profile ({', '.join(BUILTIN)}) nor a JSON file"
        )
    return Profile.from_dict(json.loads(path.read_text()), spec)


def load_hardware(spec: str) -> Hardware:
    """The device and links of :func:`load_profile`'s profile."""
    return load_profile(spec).hardware
