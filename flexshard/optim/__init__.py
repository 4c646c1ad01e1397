"""Optimizers for flexshard: DistMuon, Muon + AdamW in one optimizer, and a planner of
buckets that make Muon communication-free."""

from .dist_muon import DistMuon
from .newton_schulz import adjust_lr, ns_flops, zeropower, zeropower_batched

__all__ = [
    "DistMuon",
    "adjust_lr",
    "ns_flops",
    "zeropower",
    "zeropower_batched",
]
