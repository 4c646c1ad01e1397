"""``flexshard-plan``: per-rank memory, bytes, balance and step time of a run of
thousands of ranks, from one CPU (torch's fake process group, meta tensors)."""

from .hardware import H100, H200, Hardware, load_hardware
from .report import make_plan

__all__ = ["H100", "H200", "Hardware", "load_hardware", "make_plan"]
