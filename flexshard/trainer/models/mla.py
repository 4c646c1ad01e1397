"""DeepSeek-V2/V3's multi-head latent attention (MLA) and its YaRN RoPE, as the paper
and transformers' ``DeepseekV3Attention`` define them.

Queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (a ``q_lora_rank`` latent), or one
``q_proj`` when ``q_lora_rank = 0``. Keys and values: ``kv_a_proj_with_mqa(x)`` gives a
``kv_lora_rank`` latent (normalised, then ``kv_b_proj`` expands it to every head's
``qk_nope_head_dim`` key part and ``v_head_dim`` value) and one ``qk_rope_head_dim``
rotated key shared by all heads (decoupled RoPE). Each head's query / key is its
``nope`` part followed by its ``rope`` part; only the latter is rotated.

RoPE rotates adjacent pairs (``layers.apply_rope``), the layout of DeepSeek's released
weights (transformers' ``rope_interleave = True``), so the weights need no row
permutation either way. YaRN (``rope_scaling.type = "yarn"``) interpolates the low
frequencies by ``factor``, keeps the high ones, ramps between ``beta_fast`` and
``beta_slow`` rotations over ``original_max_position_embeddings``, and multiplies cos
and sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (both set;
else ``mscale(factor, 1)``); the softmax
scale gains ``mscale(factor, mscale_all_dim) ** 2``.

Generation caches what MLA's inference caches: per token the normalised latent and
the rotated key (``kv_lora_rank + qk_rope_head_dim`` values, not the heads' keys and
values); each step expands the cached latents through ``kv_b_proj``, as transformers'
``DeepseekV3Attention`` does.

Under context parallelism the expanded keys and values travel (all-gathered or around
the ring), so CP needs nothing MLA-specific beyond key and value head dims that differ.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..config import ModelConfig, RopeScalingConfig
from .layers import LayerCache, RMSNorm, _linear, apply_rope, attend, cached_causal_mask

if TYPE_CHECKING:
    from ..parallel.context_parallel import ContextParallel

# transformers' DeepseekV3 builds q_a_layernorm and kv_a_layernorm with this eps,
# whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(rope_dim: int, theta: float, scaling: RopeScalingConfig) -> torch.Tensor:
    """YaRN's inverse frequencies [rope_dim / 2]: extrapolated (the plain ones) above
    ``beta_fast`` rotations over the original context, interpolated (/ factor) below
    ``beta_slow``, a linear ramp between."""
    plain = 1.0 / theta ** (torch.arange(0, rope_dim, 2).float() / rope_dim)

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times
        original = scaling.original_max_position_embeddings
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_of(scaling.beta_slow)), rope_dim - 1)
    span = high - low if high != low else 0.001
    ramp = ((torch.arange(rope_dim // 2).float() - low) / span).clamp(0, 1)
    extrapolated = 1 - ramp
    return plain / scaling.factor * (1 - extrapolated) + plain * extrapolated


def mla_rope_tables(
    cfg: ModelConfig, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq_len, qk_rope_head_dim / 2] of MLA's rotated part (YaRN's
    attention factor folded in)."""
    scaling = cfg.rope_scaling
    rope_dim, factor = cfg.qk_rope_head_dim, 1.0
    if scaling.type == "yarn":
        freqs = yarn_frequencies(rope_dim, cfg.rope_theta, scaling).to(device)
        # transformers' rule: mscale counts only beside mscale_all_dim
        factor = yarn_mscale(scaling.factor, 1.0)
        if scaling.mscale and scaling.mscale_all_dim:
            factor = yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
                scaling.factor, scaling.mscale_all_dim
            )
    else:
        freqs = 1.0 / cfg.rope_theta ** (
            torch.arange(0, rope_dim, 2, device=device).float() / rope_dim
        )
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
    return angles.cos() * factor, angles.sin() * factor


def softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling
    if scaling.type == "yarn" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def _all_reduce_grad(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; the backward sums the gradient over ``mesh`` (Megatron's "copy
    to the tensor-parallel region"), through DTensor's own collectives."""
    replicated = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return replicated.to_local(grad_placements=[Partial()])


class MLA(nn.Module):
    """Multi-head latent attention; parameter names are transformers' (``q_a_proj``,
    ``kv_b_proj``, ...), so the Hugging Face mapping renames the module only."""

    def __init__(self, cfg: ModelConfig, out_std: float) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope + self.rope_dim
        self.q_proj: nn.Linear | None = None
        if cfg.q_lora_rank:
            self.q_a_proj = _linear(cfg.dim, cfg.q_lora_rank, 0.02)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = _linear(cfg.q_lora_rank, cfg.n_heads * qk_dim, 0.02)
        else:
            self.q_proj = _linear(cfg.dim, cfg.n_heads * qk_dim, 0.02)
        self.kv_a_proj_with_mqa = _linear(cfg.dim, cfg.kv_lora_rank + self.rope_dim, 0.02)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope + self.v_dim), 0.02)
        self.o_proj = _linear(cfg.n_heads * self.v_dim, cfg.dim, out_std)
        self.scale = softmax_scale(cfg)
        self.context_parallel: ContextParallel | None = None  # set by apply_cp
        # set by apply_tp: the rotated key is shared by every head, and a tp rank's
        # heads give only their part of its gradient
        self.tp_mesh: DeviceMesh | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, s, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        if self.tp_mesh is not None:
            k_rot = _all_reduce_grad(k_rot, self.tp_mesh)
        latent = self.kv_a_layernorm(latent)
        k_rot = apply_rope(k_rot.view(b, s, 1, self.rope_dim), cos, sin)
        mask = None
        if cache is not None:  # generation: the compressed latent and rotated key cached
            mask = cached_causal_mask(s, cache.length, x.device)
            latent, k_rot = cache.extend(latent, k_rot)
        n = latent.shape[1]  # keys: the cached ones too
        kv = self.kv_b_proj(latent).view(b, n, self.n_heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rot, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, self.n_heads, -1)], dim=-1)
        return self.o_proj(attend(q, k, v, self.context_parallel, mask, self.scale))
