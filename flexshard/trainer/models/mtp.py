"""DeepSeek-V3's multi-token prediction (MTP): ``mtp_layers`` sequential depths after
the main model, depth ``k`` predicting the token ``k + 1`` ahead.

Depth ``k`` at position ``i`` takes the previous depth's hidden state ``h_i`` (depth 0:
the last block's output, before the final norm) and the embedding of token ``i + k``
(the embedding table shared with the main model), normalises each (``hnorm``,
``enorm``), projects their concatenation back to ``dim`` (``eh_proj``), runs one
transformer block (causal, RoPE at the same positions) and the shared output head
after its own norm; its cross-entropy is against token ``i + k + 1``. The loss is
``mtp_loss_weight`` times the mean over the depths.

The concatenation is ``[enorm(embedding); hnorm(h)]``, the order of DeepSeek's released
MTP weights (the paper's formula writes the two the other way round). The depths see
the input tokens only: depth ``k`` covers the first ``seq_len - k - 1`` positions (the
last target of a sequence is not among its inputs), so ``seq_len > mtp_layers + 1``.

The MTP term enters the backward through the logits (``Transformer.forward``), only
while gradients are enabled (training): evaluation, validation and generation run the
main model alone. ``loss_scale`` is what the trainer divides each micro-batch's loss
by (``1 / grad_accum``), so the MTP gradient keeps its weight under accumulation.
MTP weights are model state (trained, checkpointed, resumed under ``mtp.*``); a
DeepSeek-V3 Hugging Face folder holds them as DeepSeek publishes them (depth ``k`` as
``model.layers.{n_layers + k}``, ``norm`` as ``shared_head.norm``: ``hf_adapter``),
which its load reads and its export writes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import ModelConfig
from .layers import RMSNorm, _linear, loss_fn

# (cfg, layer index) -> the main model's transformer block for that layer
BlockFactory = Callable[[ModelConfig, int], nn.Module]


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, block: BlockFactory) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = _linear(2 * cfg.dim, cfg.dim, 0.02)
        self.block = block(cfg, layer)  # MoE or dense as layer `layer` would be
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this depth's hidden states, their norm for the head)."""
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        hidden = self.block(self.eh_proj(joined), cos, sin)
        return hidden, self.norm(hidden)


class MultiTokenPrediction(nn.Module):
    def __init__(self, cfg: ModelConfig, block: BlockFactory) -> None:
        """``block``: the main model's block class (``Transformer`` hands its own)."""
        super().__init__()
        depths = range(cfg.mtp_layers)
        self.layers = nn.ModuleList(MTPLayer(cfg, cfg.n_layers + k, block) for k in depths)
        self.weight = cfg.mtp_loss_weight
        self.loss_scale = 1.0  # set by the trainer: 1 / grad_accum
        # the step's mean loss so far (loss_scale-weighted micro-batches), detached
        self.step_loss: torch.Tensor | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        embedding: nn.Module,
        head: nn.Module,
    ) -> torch.Tensor:
        """``weight * loss_scale * mean loss`` of the depths, from the main model's last
        hidden states [b, s, dim] and its input ``tokens`` [b, s]."""
        s = tokens.shape[1]
        total = torch.zeros((), device=hidden.device)
        for k, layer in enumerate(self.layers, start=1):
            n = s - k  # positions whose token k ahead is an input
            hidden, normed = layer(hidden[:, :n], embedding(tokens[:, k:]), cos[:n], sin[:n])
            logits = head(normed)[:, :-1]  # the last position's target is not an input
            total = total + loss_fn(logits, tokens[:, k + 1 :])
        mean = total / len(self.layers)
        part = mean.detach() * self.loss_scale
        self.step_loss = part if self.step_loss is None else self.step_loss + part
        return mean * (self.weight * self.loss_scale)


def take_step_loss(modules: list[nn.Module]) -> torch.Tensor | None:
    """This rank's MTP loss of the step (the mean over its micro-batches and depths),
    its counter reset; None without MTP."""
    for module in modules:
        mtp = getattr(module, "mtp", None)
        if isinstance(mtp, MultiTokenPrediction) and mtp.step_loss is not None:
            loss, mtp.step_loss = mtp.step_loss, None
            return loss
    return None
