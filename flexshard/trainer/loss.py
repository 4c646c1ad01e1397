"""The trainer's loss: its own module, as the pipeline (parallelize) and the loop (train)
both call it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
