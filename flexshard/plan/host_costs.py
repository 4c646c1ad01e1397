"""What the host adds around a device's kernels and collectives, for the step-time model.

A step runs Python on the host besides the device's work: autograd and nn.Module per
op, DTensor's dispatch per op, the sharding runtime's hooks and bookkeeping per
parameter; ranks sharing a host's cores slow one another, and a rank that drifted
ahead waits for the slower one at each collective. On a GPU all of this runs ahead of
kernels that take longer, so the built-in profiles leave it out
(:data:`NO_HOST_COSTS`); on a CPU it is on the critical path.

None of it is a data-sheet figure: the values are fitted by the benchmarks
(``benchmarks/plan_launch.py`` with ``flexshard.plan.calibration``) and carried by a
profile file under ``"host_costs"`` (``flexshard.plan.hardware.load_profile``). Every
default means "not modelled"."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

BACKENDS = ("flexshard", "fsdp2")
KINDS = ("gather", "reduce")


@dataclass(frozen=True)
class HostCosts:
    # the cores the ranks on one host share, as the ranks found them (fitted: fewer
    # than the host has when other jobs run; 0: one device per rank)
    cores: float = 0
    dtensor_op_overhead_us: float = 0.0  # per op on a DTensor (the optimizer step)
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

    def runtime_param_s(self, backend: str, kind: str) -> float:
        """Seconds the sharding runtime spends per parameter per all-gather
        (``kind="gather"``) or per gradient reduction (``"reduce"``)."""
        if backend not in BACKENDS or kind not in KINDS:
            raise ValueError(f"runtime_param_s: unknown backend {backend!r} or kind {kind!r}")
        return getattr(self, f"{backend}_{kind}_param_us") * 1e-6

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


#: the built-in GPU profiles' host: nothing modelled
NO_HOST_COSTS = HostCosts()
