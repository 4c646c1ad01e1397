"""Qwen3.5's full-attention layer: grouped-query attention whose ``q_proj`` gives each
head its queries and, beside them, an output gate (``o_proj(attn * sigmoid(gate))``);
queries and keys RMS-normalised per head (``(1 + weight)``, as every Qwen3.5 norm) and
rotated on their first ``rotary_dim`` dims only, in Hugging Face's halves layout, so the
folder's rows load as they are. Parameter names are the folder's (``self_attn.*``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ModelConfig
from .layers import LayerCache, RMSNorm, _linear, attend, cached_causal_mask

if TYPE_CHECKING:
    from ..parallel.context_parallel import ContextParallel


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of ``x`` [b, s, heads, head_dim] as
    Hugging Face does (dim i with dim i + half); the rest pass through."""
    half = cos.shape[-1]
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin, rest), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, out_std: float) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_size()
        # per head: head_dim query rows, then head_dim gate rows
        self.q_proj = _linear(cfg.dim, 2 * cfg.n_heads * self.head_dim, 0.02)
        self.k_proj = _linear(cfg.dim, cfg.n_kv_heads * self.head_dim, 0.02)
        self.v_proj = _linear(cfg.dim, cfg.n_kv_heads * self.head_dim, 0.02)
        self.o_proj = _linear(cfg.n_heads * self.head_dim, cfg.dim, out_std)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, unit_offset=True)
        self.context_parallel: ContextParallel | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q, gate = self.q_proj(x).view(b, s, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim))
        k = apply_partial_rope(k, cos, sin)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        mask = None
        if cache is not None:  # generation: after the cached tokens
            start = cache.length
            k, v = cache.extend(k, v)
            mask = cached_causal_mask(s, start, x.device)
        out = attend(q, k, v, self.context_parallel, mask)
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, s, -1)))
