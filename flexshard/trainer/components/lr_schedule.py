"""The learning-rate schedule: linear warm-up, then cosine or linear decay to
``lr * min_lr_ratio``, as a ``torch.optim.lr_scheduler.LambdaLR`` whose state the
trainer's checkpoints carry.

One ``LambdaLR`` over the closed-form factor rather than ``SequentialLR(LinearLR,
CosineAnnealingLR)``: torch's cosine scheduler updates the lr recursively from the
previous one, which drifts from the closed form by rounding and makes the lr depend on
the path (a resumed run, a changed step count); the closed form is a pure function of
the step, equal on every rank and after any resume."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..config import TrainingConfig


def lr_factor(step: int, cfg: TrainingConfig) -> float:
    """Multiplier of ``cfg.lr`` for 0-based ``step``: warm-up from lr/warmup to lr, then
    decay to ``lr * min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "none":
        return 1.0
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig) -> LambdaLR:
    """Every param group at ``its lr * lr_factor(step)``; built right after the
    optimizer, it sets step 0's lr at once. Call ``step()`` after each optimizer step.
    The factor is a plain function, which ``LambdaLR.state_dict`` leaves out: the state
    is the step count (and base lrs), the shape comes from the config of the run."""

    def factor(step: int) -> float:
        return lr_factor(step, cfg)

    return LambdaLR(optimizer, factor)


def current_lr(scheduler: LambdaLR) -> float:
    """``training.lr``'s value for the coming step: the last param group's (under Muon the
    AdamW group follows the ones at ``muon_lr``)."""
    return scheduler.get_last_lr()[-1]
