"""The CPU/gloo profile calibrated inside the launch that measures the step times:
the same W processes run the micro-benchmarks right before and right after the
trainer's steps, all W at once, so the machine's load of that moment (other jobs on
the shared cores, the W ranks among themselves) hits the calibration as it hits the
measurement. What each term comes from (never a step time of the trainer):

- GEMM, causal attention, per-op cost, non-GEMM bandwidth:
  ``flexshard.plan.calibration.op_rates`` — the unsharded models' own forward /
  backward ops, timed one by one at their shapes;
- gloo all-gather / reduce-scatter: cost per call, per ring step and per byte, fitted
  on this W's collectives of four sizes (``plan_fit.gloo_fit``);
- overlap: a GEMM loop with an all-gather in flight against each alone;
- DTensor's per-op cost, copy-in / copy-out bandwidth into new buffers, memory
  bandwidth: ``plan_fit``'s micro-benchmarks;
- contention (the ops run end to end on all ranks against their one-by-one
  medians: ``calibration.op_window``), the eager autograd cost per op and the runtimes'
  cost per parameter gathered / reduced (a tiny-width copy of the model:
  ``flexshard.plan.calibration``);
- blocking collectives: not measured, the runtime's own rule on a device without
  streams (runtime/collectives.py's Note on collectives without streams; FSDP2 on CPU
  calls its all-gathers synchronously too).

The compute rates are measured with the W ranks running at once, so the profile
needs no core count (``cores = 0``: no further slowdown for W ranks on the host).
The device's terms make the profile's ``Hardware``, the host's its ``HostCosts``."""

from __future__ import annotations

import statistics
from typing import Any

import torch.distributed as dist

from flexshard.plan.calibration import op_rates, op_window, runtime_costs
from flexshard.plan.hardware import Hardware, Profile
from flexshard.plan.host_costs import HostCosts
from flexshard.trainer.config import Config

from .plan_fit import _overlap, _rank, _slowest, copy_gbps, gloo_fit, memory_gbps

RATES = ("gemm_tflops", "attention_tflops", "op_overhead_us", "elementwise_gbps")
RUNTIME = (
    "eager_op_us",
    "collective_wait_us",
    "flexshard_gather_param_us",
    "flexshard_reduce_param_us",
    "fsdp2_gather_param_us",
    "fsdp2_reduce_param_us",
)


def calibrate(rank: int, world: int, op_configs: list[Config]) -> dict[str, Any]:
    """This rank's share of one calibration (every rank of the launch calls it)."""
    raw = _rank(rank, world)
    dist.barrier()
    raw["rates"], detail = op_rates(op_configs, reps=2)
    medians = detail["gemm_s"] + detail["attention_s"] + detail["non_gemm_s"]
    raw["contention"] = op_window(op_configs, medians)
    raw["memory_gbps"] = memory_gbps()
    raw["copy_gbps"] = copy_gbps()
    raw["runtime"] = runtime_costs(op_configs[0], world, raw["contention"])
    dist.barrier()
    return raw


def launch_profile(calibrations: list[list[dict[str, Any]]]) -> tuple[Profile, dict[str, Any]]:
    """The profile of one launch from its calibrations (each: one dict per rank)."""
    everyone = [r for per_rank in calibrations for r in per_rank]
    rate = {k: statistics.median(r["rates"][k] for r in everyone) for k in RATES}
    call, step, ag_bw, rs_bw = gloo_fit(dict(enumerate(calibrations)))
    timings = [
        {k: _slowest([r[k] for r in per_rank]) for k in ("compute", "gather", "both")}
        for per_rank in calibrations
    ]
    hw = Hardware(
        name="cpu-gloo (calibrated in the launch)",
        peak_tflops=rate["gemm_tflops"],
        gemm_efficiency=1.0,  # the measured rate is what the GEMMs reach
        hbm_gbps=statistics.median(r["memory_gbps"] for r in everyone),
        devices_per_node=64,  # every rank on this host: one link class
        intra_gbps=ag_bw / 1e9,
        intra_latency_us=step * 1e6,
        inter_gbps=ag_bw / 1e9,
        inter_latency_us=step * 1e6,
        op_overhead_us=rate["op_overhead_us"],
        elementwise_gbps=rate["elementwise_gbps"],
        copy_gbps=statistics.median(r["copy_gbps"] for r in everyone),
        collective_overhead_us=call * 1e6,
        reduce_scatter_gbps=rs_bw / 1e9,
        overlap=statistics.median(_overlap(t) for t in timings),
        attention_tflops=rate["attention_tflops"],
        blocking_collectives=True,  # no streams on CPU: waited for at launch
    )
    host = HostCosts(
        cores=0,  # measured with the W ranks at once: no further slowdown
        dtensor_op_overhead_us=statistics.median(r["dtensor_s"] for r in everyone) * 1e6,
        contention=statistics.median(r["contention"] for r in everyone),
        **{k: statistics.median(r["runtime"][k] for r in everyone) for k in RUNTIME},
    )
    detail = {
        "rates_per_calibration": [
            {
                **{k: statistics.median(r["rates"][k] for r in per_rank) for k in RATES},
                "contention": statistics.median(r["contention"] for r in per_rank),
                **{k: statistics.median(r["runtime"][k] for r in per_rank) for k in RUNTIME},
            }
            for per_rank in calibrations
        ],
        "overlap_timings": timings,
    }
    return Profile(hw, host), detail
