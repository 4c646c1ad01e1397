"""Optimizers (AdamW; Muon for hidden matrices + AdamW for the rest through DistMuon;
pytorch-optimizer's SOAP or Shampoo on every parameter through MatrixOptimizer); the
learning-rate schedule is ``lr_schedule``'s LambdaLR."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from flexshard.optim import MatrixOptimizer, muon_and_adamw

from ..config import ConfigError, ModelConfig, TrainingConfig
from ..parallel.sharding import muon_row_blocks


class StageView(nn.Module):
    """This rank's pipeline stage modules seen as one model by name, for the Muon/AdamW
    split: the stages keep the whole model's FQNs, so names are not prefixed (param
    groups, and the checkpoints that record them, read the same under every layout).
    Nothing is registered: the stages stay owned by the pipeline."""

    def __init__(self, stages: Iterable[nn.Module]) -> None:
        super().__init__()
        self._stages = list(stages)

    def modules(self) -> Iterator[nn.Module]:
        for stage in self._stages:
            yield from stage.modules()

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for stage in self._stages:
            yield from stage.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters(recurse=recurse):
            yield param


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


def build_optimizer(
    model: nn.Module | Any, cfg: TrainingConfig, model_cfg: ModelConfig
) -> torch.optim.Optimizer:
    """Built after sharding: it sees the sharded parameters (DTensors, both backends).
    ``model`` is one module, or an object with ``.modules`` (the trainer's
    ``Parallelized``: this rank's pipeline stages), whose optimizer covers them all."""
    betas = (cfg.betas[0], cfg.betas[1])
    stages = getattr(model, "modules", None)  # Parallelized: a list; a module: a method
    view = StageView(stages) if isinstance(stages, list) else model
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay
        )
    if cfg.optimizer in ("soap", "shampoo"):
        inner = _third_party(cfg.optimizer)
        options = {"betas": betas} if cfg.optimizer == "soap" else {}
        # the blocks Muon takes (per head, MLA's fused latent + rotated key), each
        # expert of a stack and every other matrix whole
        return MatrixOptimizer(
            view.named_parameters(),
            inner,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            row_blocks=muon_row_blocks(model_cfg),
            **options,
        )
    return muon_and_adamw(
        view,
        lr=cfg.muon_lr,
        adamw_lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adamw_betas=betas,
        row_blocks=muon_row_blocks(model_cfg),
        # the LM head by its name, not as the last Linear: a pipeline stage without the
        # head would hand its own last matrix to AdamW
        # Gated DeltaNet's depthwise conv kernels [channels, 1, taps] are 3-D but no
        # matrix stack (A_log and dt_bias are vectors: AdamW by their shape); Qwen3.5-MoE's
        # shared-expert gate is one row [1, dim], which Newton-Schulz would only rescale
        # DeepSeek-V4's compressor position biases (``ape``) are biases, however 2-D
        adamw_patterns=("output.weight", "*.conv1d.weight", "*.shared_gate.weight", "*.ape"),
        detect_head=False,
        # Moonlight's scaling: Muon's update RMS matches AdamW's at the same rate
        adjust_lr_fn="match_rms_adamw",
    )
