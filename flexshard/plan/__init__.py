"""``flexshard-plan``: per-rank memory, bytes, balance and step time of a run of
thousands of ranks, from one CPU (torch's fake process group, meta tensors).

The package front holds the hardware profiles only (no torch, so ``flexshard-plan
--help`` prints at once); the planner itself is ``flexshard.plan.report.make_plan``."""

from .hardware import H100, H200, Hardware, Profile, load_hardware, load_profile
from .host_costs import NO_HOST_COSTS, HostCosts

__all__ = [
    "H100",
    "H200",
    "NO_HOST_COSTS",
    "Hardware",
    "HostCosts",
    "Profile",
    "load_hardware",
    "load_profile",
]
