"""Optimizers (AdamW; Muon for hidden matrices + AdamW for the rest through DistMuon;
pytorch-optimizer's SOAP or Shampoo on every parameter through MatrixOptimizer); the
learning-rate schedule is ``lr_schedule``'s LambdaLR."""

from __future__ import annotations

import torch
from torch import nn

from .config import ConfigError, ModelConfig, TrainingConfig


def muon_row_blocks(model_cfg: ModelConfig) -> dict[str, int]:
    """Muon orthogonalises attention projections per head: rows per block by FQN glob."""
    head_dim = model_cfg.dim // model_cfg.n_heads
    return {"*.wq.weight": head_dim, "*.wk.weight": head_dim, "*.wv.weight": head_dim}


def _third_party(name: str) -> type[torch.optim.Optimizer]:
    """pytorch-optimizer's SOAP or Shampoo (an optional dependency)."""
    try:
        import pytorch_optimizer
    except ImportError:
        raise ConfigError(
            f'training.optimizer = "{name}" needs the pytorch-optimizer package '
            "(pip install pytorch-optimizer==4.1.0)"
        ) from None
    return {"soap": pytorch_optimizer.SOAP, "shampoo": pytorch_optimizer.Shampoo}[name]


def matrix_optimizer_buckets(model: nn.Module, dp_shard: int) -> list:
    """``placement = "muon"`` with SOAP/Shampoo: every parameter whole on one rank,
    balanced on the preconditioner's cost, so the optimizer step moves no byte."""
    from flexshard.optim import matrix_buckets

    return matrix_buckets(model, dp_shard)


def build_optimizer(
    model: nn.Module, cfg: TrainingConfig, model_cfg: ModelConfig
) -> torch.optim.Optimizer:
    """Built after sharding: it sees this rank's local shards (flexshard) or DTensors."""
    betas = (cfg.betas[0], cfg.betas[1])
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay
        )
    if cfg.optimizer in ("soap", "shampoo"):
        from flexshard.optim import MatrixOptimizer

        inner = _third_party(cfg.optimizer)
        options = {"betas": betas} if cfg.optimizer == "soap" else {}
        return MatrixOptimizer(
            model.parameters(), inner, lr=cfg.lr, weight_decay=cfg.weight_decay, **options
        )
    try:
        from flexshard.optim import muon_and_adamw  # the DistMuon issue provides it
    except ImportError:
        raise ConfigError(
            'training.optimizer = "muon" needs flexshard.optim (DistMuon), which is not in '
            'this installation; use optimizer = "adamw"'
        ) from None
    return muon_and_adamw(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adamw_betas=betas,
        row_blocks=muon_row_blocks(model_cfg),
        # Moonlight's scaling: Muon's update RMS matches AdamW's, so one lr serves both
        adjust_lr_fn="match_rms_adamw",
    )
