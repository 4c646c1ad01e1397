"""Optimizers for flexshard: DistMuon, Muon + AdamW in one optimizer, MatrixOptimizer
(any per-matrix optimizer on sharded storage), and a planner of buckets that make them
communication-free."""

from .dist_muon import DistMuon
from .matrix_optimizer import MatrixOptimizer
from .matrix_proxies import MatrixState, preconditioner_flops
from .muon_adamw import MuonAdamW, muon_and_adamw, split_muon_params
from .newton_schulz import adjust_lr, ns_flops, zeropower, zeropower_batched
from .planner import MuonBalance, matrix_balance, matrix_buckets, muon_balance, muon_buckets

__all__ = [
    "DistMuon",
    "MatrixOptimizer",
    "MatrixState",
    "MuonBalance",
    "MuonAdamW",
    "adjust_lr",
    "matrix_balance",
    "matrix_buckets",
    "muon_and_adamw",
    "muon_balance",
    "muon_buckets",
    "ns_flops",
    "preconditioner_flops",
    "split_muon_params",
    "zeropower",
    "zeropower_batched",
]
