"""DeepSeek-V4 (``model.attention = "deepseek_v4"``): the embedding copied into
``hc_mult`` residual streams, blocks of ``CompressedAttention`` and an MoE joined to the
streams by hyper-connections, the streams collapsed (``hc_head``) before the final norm.

The MoE: scores sqrt(softplus(router logits)); the experts of a ``"hash_moe"`` layer
are a frozen table's (``gate.tid2eid``: token id -> top_k experts), a ``"moe"`` layer's
the top-k of the scores plus the ``"bias"`` balance's selection bias; the chosen
scores renormalised and scaled by ``routed_scaling_factor``; every SwiGLU (routed and
the shared expert) with its gate clamped above and its up projection on both sides at
``swiglu_limit``. Computes what transformers' ``DeepseekV4ForCausalLM`` does."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .compressed_attention import CompressedAttention, v4_rope_tables
from .hyper_connections import HyperConnection, HyperHead
from .layers import RMSNorm, _linear
from .moe import LoadBalance, gated, grouped_swiglu, loop_swiglu, routed_locally

if TYPE_CHECKING:
    from ..parallel.context_parallel import ContextParallel
    from ..parallel.expert_parallel import ExpertParallel

HASH = "hash_moe"


def clamped_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float
) -> torch.Tensor:
    return F.linear(gated(F.linear(x, w1), F.linear(x, w3), limit), w2)


class ClampedFeedForward(nn.Module):
    """The shared expert: SwiGLU with the clamp."""

    def __init__(self, dim: int, hidden: int, out_std: float, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = _linear(dim, hidden, 0.02)
        self.w2 = _linear(hidden, dim, out_std)
        self.w3 = _linear(dim, hidden, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(x, self.w1.weight, self.w2.weight, self.w3.weight, self.limit)


class ClampedExperts(nn.Module):
    """E clamped SwiGLU experts as [E, R, C] stacks (one parameter per projection), with
    ``GroupedExperts``' surface: grouped GEMMs over the rows sorted by expert, and the
    experts split over an EP group by ``apply_ep``."""

    def __init__(self, num_experts: int, dim: int, hidden: int, out_std: float, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.init_stds = {"w1": 0.02, "w2": out_std, "w3": 0.02}
        # set by apply_ep: the EP group, and (first, total): this rank keeps experts
        # first .. first + len(w1) - 1 of total
        self.expert_parallel: ExpertParallel | None = None
        self.ep_range: tuple[int, int] | None = None
        self.grouped = True  # False: the Python loop over experts (the tests' reference)

    def swiglu(self, rows: torch.Tensor, counts: list[int], w: tuple) -> torch.Tensor:
        """Experts ``0..`` of the weights ``w`` = (w1, w2, w3) on their ``counts[e]``
        consecutive ``rows``, clamped."""
        return (grouped_swiglu if self.grouped else loop_swiglu)(rows, counts, *w, self.limit)

    def forward(
        self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        if self.expert_parallel is not None:  # the experts live on the EP ranks: all-to-all
            return self.expert_parallel.routed(self, flat, weights, chosen)
        return routed_locally(self, flat, weights, chosen)


class Gate(nn.Module):
    """The router's weight, and for a hash layer its token -> experts table (a frozen
    int64 buffer: model state, never trained)."""

    tid2eid: torch.Tensor | None

    def __init__(self, dim: int, num_experts: int, top_k: int, vocab: int, hashed: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.vocab = num_experts, top_k, vocab
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.init_stds = {"weight": 0.02}
        table = self._spread(None) if hashed else None  # on the device being built on
        self.register_buffer("tid2eid", table)

    def _spread(self, device: torch.device | None) -> torch.Tensor:
        """A fixed table for a model not loaded from a folder: token t's experts
        t * top_k + j (mod E), distinct when top_k <= E."""
        ids = torch.arange(self.vocab, device=device)[:, None] * self.top_k
        return (ids + torch.arange(self.top_k, device=device)) % self.num_experts

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # a meta-built model's to_empty leaves the table uninitialised, and
        # fs.init_params initialises parameters only: fill it as an eager build does
        was_meta = self.tid2eid is not None and self.tid2eid.is_meta
        super()._apply(fn, recurse)
        if was_meta and self.tid2eid is not None and not self.tid2eid.is_meta:
            with torch.no_grad():
                self.tid2eid.copy_(self._spread(self.tid2eid.device))
        return self


class V4MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, out_std: float, hashed: bool) -> None:
        super().__init__()
        moe, limit = cfg.moe, cfg.deepseek_v4.swiglu_limit
        hidden = moe.expert_hidden or cfg.ffn_hidden_size()
        self.top_k, self.scale = moe.top_k, moe.routed_scaling_factor
        self.gate = Gate(cfg.dim, moe.num_experts, moe.top_k, cfg.vocab_size, hashed)
        mode = "none" if hashed else moe.balance
        self.balance = LoadBalance(mode, moe.num_experts, moe.bias_update_rate, moe.aux_loss_coef)
        self.experts = ClampedExperts(moe.num_experts, cfg.dim, hidden, out_std, limit)
        self.shared_experts = ClampedFeedForward(cfg.dim, hidden, out_std, limit)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores = F.softplus(F.linear(flat, self.gate.weight)).sqrt()
        if self.gate.tid2eid is not None:
            chosen = self.gate.tid2eid[tokens.reshape(-1)].long()
            weights = scores.gather(-1, chosen)
        else:
            weights, chosen = self.balance.select(scores, self.top_k)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        probs = scores / scores.sum(-1, keepdim=True)
        routed = self.balance.account(self.experts(flat, weights, chosen), probs, chosen)
        return (routed + self.shared_experts(flat)).view(shape)


class V4Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        v4 = cfg.deepseek_v4
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = CompressedAttention(cfg, out_std, cfg.layer_types[layer])
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = V4MoE(cfg, out_std, v4.mlp_layer_types[layer] == HASH)
        n, mixes = v4.hc_mult, (2 + v4.hc_mult) * v4.hc_mult
        self.hc = HyperConnection(n, v4.hc_sinkhorn_iters, v4.hc_eps, cfg.norm_eps)
        for side in ("attn", "ffn"):
            self.register_parameter(f"hc_{side}_fn", nn.Parameter(torch.empty(mixes, n * cfg.dim)))
            self.register_parameter(f"hc_{side}_base", nn.Parameter(torch.empty(mixes)))
            self.register_parameter(f"hc_{side}_scale", nn.Parameter(torch.empty(3)))
        self.init_stds = {
            **{f"hc_{side}_fn": 0.02 for side in ("attn", "ffn")},
            **{f"hc_{side}_base": "zeros" for side in ("attn", "ffn")},
            **{f"hc_{side}_scale": None for side in ("attn", "ffn")},
        }
        # set by apply_ac, as on TransformerBlock: runs ``_block`` so that backward
        # recomputes its activations (an attribute: parameter names stay the same)
        self.checkpoint: Callable[..., torch.Tensor] | None = None

    def forward(
        self,
        streams: torch.Tensor,
        tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
        tokens: torch.Tensor,
    ) -> torch.Tensor:
        if self.checkpoint is not None:
            return self.checkpoint(self._block, streams, tables, tokens)
        return self._block(streams, tables, tokens)

    def _block(
        self,
        streams: torch.Tensor,
        tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
        tokens: torch.Tensor,
    ) -> torch.Tensor:
        hc = self.hc
        post, comb, x = hc.weights(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        streams = hc.merge(streams, self.attn(self.attn_norm(x), tables), post, comb)
        post, comb, x = hc.weights(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        return hc.merge(streams, self.ffn(self.ffn_norm(x), tokens), post, comb)


class DeepseekV4Transformer(nn.Module):
    """``Transformer``'s surface (``tok_embeddings``, ``layers``, ``norm``, ``output``,
    ``forward(tokens)`` -> logits) for DeepSeek-V4; training only (no KV cache)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v4 = cfg.deepseek_v4
        self.cfg, self.streams = cfg, v4.hc_mult
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_embeddings.init_stds = {"weight": 1.0}
        self.layers = nn.ModuleList(V4Block(cfg, i) for i in range(cfg.n_layers))
        self.hc_head = HyperHead(cfg.dim, v4.hc_mult, v4.hc_eps, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = _linear(cfg.dim, cfg.vocab_size, cfg.dim**-0.5)
        self.mtp: nn.Module | None = None  # the trainer's MTP depths: not for this family
        # what pipeline stages exchange: the streams [b, s, hc_mult, dim] (not [b, s, dim]),
        # and every stage takes the batch's token ids besides (hash routing)
        self.stage_state_dims = (v4.hc_mult, cfg.dim)
        self.stages_take_token_ids = True
        self._rope: dict[tuple[int, torch.device], Any] = {}
        # set by apply_cp: the tokens are this rank's zig-zag chunks, the RoPE tables
        # the whole sequence's (each attention reads its tokens' rows)
        self.context_parallel: ContextParallel | None = None

    def forward(
        self, inputs: torch.Tensor, cache: Any = None, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of the tokens ``inputs`` [b, s]; as a pipeline stage after the
        embedding's, ``inputs`` are the streams [b, s, hc_mult, dim] and ``token_ids``
        the tokens (the hash-routed layers pick their experts by id)."""
        if cache is not None:
            raise NotImplementedError(
                'model.attention = "deepseek_v4": no KV cache (generation) in the trainer'
            )
        streams_in = inputs.is_floating_point()
        if streams_in and token_ids is None:
            raise ValueError(
                "DeepseekV4Transformer: a stage given the streams needs the batch's "
                "token_ids (the hash-routed layers route by token id)"
            )
        tokens = inputs if token_ids is None else token_ids
        cp = self.context_parallel
        length = tokens.shape[1] if cp is None else cp.global_len(tokens.shape[1])
        key = (length, tokens.device)
        if key not in self._rope:
            self._rope[key] = v4_rope_tables(self.cfg, length, tokens.device)
        if streams_in:
            streams = self.tok_embeddings(inputs)  # nn.Identity on a later pipeline stage
        else:
            x = self.tok_embeddings(inputs)
            streams = x.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, self._rope[key], tokens)
        return self.output(self.norm(self.hc_head(streams)))
