"""The building blocks every model family shares: the initialised linear layer
(``_linear``), RMSNorm, RoPE (``rope_tables``, ``apply_rope``), the generation KV cache
(``LayerCache``, ``KVCache``, ``cached_causal_mask``), one attention call (``attend``:
the CP ring, the CP-gathered sequence or SDPA) and the trainer's loss (``loss_fn``,
which the pipeline, the loop and multi-token prediction call)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # the parallel layer hands its ContextParallel in (apply_cp)
    from ..parallel.context_parallel import ContextParallel


def _linear(fan_in: int, fan_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(fan_in, fan_out, bias=False)
    layer.init_stds = {"weight": std}  # read by init_module
    return layer


class RMSNorm(nn.Module):
    """``unit_offset``: Qwen3.5's zero-centred norm, scaled by ``1 + weight`` in fp32
    (the weight starts at zero and is stored so in its folders)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.init_stds = {"weight": "zeros" if unit_offset else None}  # None: ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return normed.type_as(x) * self.weight


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair, [seq_len, head_dim / 2], fp32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x`` [batch, seq, heads, head_dim] (Llama's layout)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class LayerCache:
    """What one token mixer keeps of the tokens already seen: an attention layer its
    keys and values (``tensors``, each [batch, seq, ...], grown along the sequence dim),
    a recurrent layer its fixed-size ``states`` after them. Generation runs the prompt
    once, then one token per forward, through the model's own layers."""

    def __init__(self) -> None:
        self.tensors: tuple[torch.Tensor, ...] = ()
        self.states: tuple[torch.Tensor, ...] = ()
        self.seen = 0  # tokens folded into ``states``

    @property
    def length(self) -> int:
        return self.tensors[0].shape[1] if self.tensors else self.seen

    def carry(self, new_tokens: int, *states: torch.Tensor) -> None:
        """A recurrent layer's ``states`` after ``new_tokens`` more tokens."""
        self.states, self.seen = states, self.seen + new_tokens

    def extend(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The cached tensors with ``new`` appended (and kept)."""
        if self.tensors:
            new = tuple(torch.cat([old, t], dim=1) for old, t in zip(self.tensors, new))
        self.tensors = new
        return new


class KVCache:
    """One ``LayerCache`` per block; ``length``: the tokens already seen."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length


def cached_causal_mask(new: int, start: int, device: torch.device) -> torch.Tensor:
    """[new, start + new]: new token j (position start + j) sees positions 0 .. start + j."""
    return torch.ones(new, start + new, dtype=torch.bool, device=device).tril(diagonal=start)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel | None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of queries [b, s, heads, d] over keys and values [b, n,
    kv_heads, *] (each kv head serving heads / kv_heads queries; v's head dim may differ),
    out [b, s, heads * v_dim]: over the CP ring, over the CP-gathered sequence, or one
    SDPA call (``mask``: a KV cache's; None: plain causal)."""
    b, s = q.shape[:2]
    if cp is not None and cp.method == "ring":  # K/V blocks travel the CP ring
        return cp.ring_attention(q, k, v, scale).reshape(b, s, -1)
    if cp is not None:  # local queries attend to the whole sequence's keys and values
        k, v = cp.gather_kv(k, v)
        mask = cp.causal_mask(s, q.device)
    repeat = q.shape[2] // k.shape[2]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return out.transpose(1, 2).reshape(b, s, -1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
