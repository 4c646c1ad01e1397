"""``flexshard-plan``: per-rank memory, bytes, balance and step time of a run of
thousands of ranks, from one CPU (torch's fake process group, meta tensors)."""

from .hardware import H100, H200, Hardware, Profile, load_hardware, load_profile
from .host_costs import NO_HOST_COSTS, HostCosts
from .report import make_plan

__all__ = [
    "H100",
    "H200",
    "NO_HOST_COSTS",
    "Hardware",
    "HostCosts",
    "Profile",
    "load_hardware",
    "load_profile",
    "make_plan",
]
