"""A Llama-3-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) with
optional DeepSeek-style MoE layers (top-k router, shared expert, 3-D expert weights
``[E, R, C]``), built from ``ModelConfig``.

Initialisation is one function per module (``init_module``), applied in module order,
so that ``fs.init_params(model, init_module)`` on a meta-built, sharded model draws
exactly the values an eagerly built model gets from ``init_weights``. The pieces every
family shares are in ``layers``, DeepSeek's MLA attention in ``mla`` and its
multi-token prediction in ``mtp``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .deepseek_v4 import ClampedExperts, DeepseekV4Transformer
from .gated_attention import GatedAttention
from .layers import (
    KVCache,
    LayerCache,
    RMSNorm,
    _linear,
    apply_rope,
    attend,
    cached_causal_mask,
    rope_tables,
)
from .linear_attention import GatedDeltaNet, init_decay, per_row_arithmetic, whole_vectors
from .mla import MLA, mla_rope_tables
from .moe import LoadBalance, _AddAuxGrad, grouped_swiglu, loop_swiglu, routed_locally
from .mtp import MultiTokenPrediction

if TYPE_CHECKING:
    from ..parallel.context_parallel import ContextParallel
    from ..parallel.expert_parallel import ExpertParallel


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, out_std: float) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_size()
        self.wq = _linear(cfg.dim, cfg.n_heads * self.head_dim, 0.02)
        self.wk = _linear(cfg.dim, cfg.n_kv_heads * self.head_dim, 0.02)
        self.wv = _linear(cfg.dim, cfg.n_kv_heads * self.head_dim, 0.02)
        self.wo = _linear(cfg.n_heads * self.head_dim, cfg.dim, out_std)
        # Qwen3: each head's queries and keys RMS-normalised over head_dim before RoPE
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.context_parallel: ContextParallel | None = None  # set by apply_cp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        cp, mask = self.context_parallel, None
        if cache is not None:  # generation: after the cached tokens (no CP there)
            start = cache.length
            k, v = cache.extend(k, v)
            mask = cached_causal_mask(s, start, x.device)
        return self.wo(attend(q, k, v, cp, mask))


def _attention(cfg: ModelConfig, out_std: float, layer: int) -> nn.Module:
    if cfg.is_linear_attention(layer):
        return GatedDeltaNet(cfg, out_std)
    if cfg.attention == "gated":
        return GatedAttention(cfg, out_std)
    if cfg.attention == "mla":
        return MLA(cfg, out_std)
    return Attention(cfg, out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, out_std: float) -> None:
        super().__init__()
        self.w1 = _linear(dim, hidden, 0.02)
        self.w2 = _linear(hidden, dim, out_std)
        self.w3 = _linear(dim, hidden, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights [E, R, C] (rows = outputs, as nn.Linear): one
    parameter per projection, so a placement sees whole expert matrices as a batch."""

    def __init__(self, num_experts: int, dim: int, hidden: int, out_std: float) -> None:
        super().__init__()
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
        consecutive ``rows``."""
        return (grouped_swiglu if self.grouped else loop_swiglu)(rows, counts, *w)

    def forward(
        self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        """Per token, the router-weighted sum of its ``chosen`` experts' outputs (a
        module call, so that a data-parallel wrapper of the experts sees it run)."""
        if self.expert_parallel is not None:  # the experts live on the EP ranks: all-to-all
            return self.expert_parallel.routed(self, flat, weights, chosen)
        return routed_locally(self, flat, weights, chosen)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Per-row arithmetic (``token_by_token``): no element in the sigmoid's scalar tail,
    so a token's router scores and shared-expert gate have the same bits in any batch."""
    return whole_vectors(torch.sigmoid, x) if per_row_arithmetic() else x.sigmoid()


class MoE(nn.Module):
    """Token-choice top-k routing over routed experts plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig, out_std: float) -> None:
        super().__init__()
        moe = cfg.moe
        hidden = moe.expert_hidden or cfg.ffn_hidden_size()
        self.top_k = moe.top_k
        self.score_func, self.norm_topk_prob = moe.score_func, moe.norm_topk_prob
        self.groups = (moe.n_group, moe.topk_group)
        self.routed_scaling_factor = moe.routed_scaling_factor
        self.balance = LoadBalance(
            moe.balance, moe.num_experts, moe.bias_update_rate, moe.aux_loss_coef
        )
        self.router = _linear(cfg.dim, moe.num_experts, 0.02)
        self.experts = GroupedExperts(moe.num_experts, cfg.dim, hidden, out_std)
        shared = moe.shared_width(hidden)
        self.shared = FeedForward(cfg.dim, shared, out_std) if shared else None
        # Qwen3.5-MoE: the shared output scaled per token by sigmoid(shared_gate(x))
        self.shared_gate = _linear(cfg.dim, 1, 0.02) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat).float()
        sigmoid = self.score_func == "sigmoid"
        scores = _sigmoid(logits) if sigmoid else logits.softmax(dim=-1)
        weights, chosen = self.balance.select(scores, self.top_k, *self.groups)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        weights = weights.type_as(x)
        # the aux loss's P: probabilities, so sigmoid scores normalised per token
        probs = scores / scores.sum(-1, keepdim=True) if sigmoid else scores
        out = self.balance.account(self.experts(flat, weights, chosen), probs, chosen)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = _sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.view(shape)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # residual branches scaled with depth
        unit_offset = cfg.attention == "gated"  # Qwen3.5's norms
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, unit_offset)
        self.attention = _attention(cfg, out_std, layer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, unit_offset)
        self.feed_forward: nn.Module = (
            MoE(cfg, out_std)
            if cfg.moe.is_moe_layer(layer)
            else FeedForward(cfg.dim, cfg.ffn_hidden_size(), out_std)
        )
        # set by apply_ac: runs ``_block`` so that backward recomputes its activations.
        # An attribute, not a wrapper module, so parameter names (buckets, checkpoints,
        # Hugging Face export) stay those of the plain model
        self.checkpoint: Callable[..., torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        if self.checkpoint is not None and cache is None:
            return self.checkpoint(self._block, x, cos, sin)
        return self._block(x, cos, sin, cache)

    def _block(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.attention == "deepseek_v4":  # another model altogether: never a stand-in
            raise ValueError(
                'model.attention = "deepseek_v4" is DeepseekV4Transformer\'s (build_model)'
            )
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.tok_embeddings.init_stds = {"weight": 1.0}
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.attention == "gated")
        self.output = _linear(cfg.dim, cfg.vocab_size, cfg.dim**-0.5)
        if cfg.tie_embeddings:
            # one parameter, drawn once, at the output's scale: the embedding's std of 1
            # would give logits of std sqrt(dim)
            self.output.weight = self.tok_embeddings.weight
            self.tok_embeddings.init_stds = self.output.init_stds
            self.output.init_stds = {}
        self.mtp: nn.Module | None = None
        if cfg.mtp_layers:
            self.mtp = MultiTokenPrediction(cfg, TransformerBlock)
        # RoPE tables are recomputed per device and length, not stored: a meta-built
        # model then needs no buffer re-initialisation after to_empty
        self._rope: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.context_parallel: ContextParallel | None = None  # set by apply_cp
        # sequence-parallel TP (set by apply_tp): the hidden states a later pipeline
        # stage receives hold 1 / sequence_shards of the sequence RoPE must cover
        self.sequence_shards = 1

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cp = self.context_parallel
        total = cp.global_len(seq_len) if cp is not None else seq_len
        key = (total, device)
        if key not in self._rope and self.cfg.attention == "mla":
            self._rope[key] = mla_rope_tables(self.cfg, total, device)
        if key not in self._rope:
            self._rope[key] = rope_tables(total, self.cfg.rotary_dim(), self.cfg.rope_theta, device)
        if cp is not None:  # this rank's tokens sit at zig-zag global positions
            index = cp.positions(seq_len, device)
            return self._rope[key][0][index], self._rope[key][1][index]
        return self._rope[key]

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits of ``tokens``; with a ``cache``, of ``tokens`` placed after the cached
        ones (the cache grows)."""
        x = self.tok_embeddings(tokens)
        hidden = tokens.is_floating_point()  # a pipeline stage after the embedding's
        seq = tokens.shape[1] * (self.sequence_shards if hidden else 1)
        start = 0 if cache is None else cache.length
        # decoding: one table per power of two (a position's angles do not depend on the
        # table's length), not a new one for every length the cache reaches
        length = start + seq if cache is None else 1 << (start + seq - 1).bit_length()
        cos, sin = self.rope(length, tokens.device)
        cos, sin = cos[start : start + seq], sin[start : start + seq]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache=None if cache is None else cache.layers[i])
        logits = self.output(self.norm(x))
        if self.mtp is not None and torch.is_grad_enabled() and not hidden and cache is None:
            # the MTP loss joins the backward through the logits, so the backward
            # reaches the shared embedding and head after data parallelism re-gathers them
            extra = self.mtp(x, tokens, cos, sin, self.tok_embeddings, self.output)
            logits = _AddAuxGrad.apply(logits, extra)
        return logits


def init_module(module: nn.Module) -> None:
    """Initialise the parameters ``module`` holds directly (not its children's)."""
    stds = getattr(module, "init_stds", None)
    if stds is None:
        return
    # EP keeps a slice of the experts: draw all of them (the single process's random
    # stream) and keep the slice
    ep_range = getattr(module, "ep_range", None)
    with torch.no_grad():
        for name, param in module.named_parameters(recurse=False):
            if name not in stds:  # tied: drawn by the module that owns it
                continue
            std = stds[name]
            drawn = param if ep_range is None else param.new_empty(ep_range[1], *param.shape[1:])
            if std is None:
                drawn.fill_(1.0)
            elif std == "zeros":
                drawn.zero_()
            elif std == "decay":
                init_decay(drawn)
            else:
                nn.init.trunc_normal_(drawn, std=std, a=-3 * std, b=3 * std)
            if ep_range is not None:
                param.copy_(drawn[ep_range[0] : ep_range[0] + param.shape[0]])


def init_weights(model: nn.Module, seed: int) -> None:
    """Seeded initialisation of an unsharded model, module by module (the order
    ``fs.init_params`` follows, so a sharded model gets the same values)."""
    torch.manual_seed(seed)
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            init_module(module)


def build_model(cfg: ModelConfig) -> Transformer | DeepseekV4Transformer:
    """The trainer's model of ``cfg``: DeepSeek-V4's own, else the Transformer."""
    if cfg.attention == "deepseek_v4":
        return DeepseekV4Transformer(cfg)
    return Transformer(cfg)


def meta_model(cfg: ModelConfig) -> Transformer | DeepseekV4Transformer:
    """The model built on meta, for its names and shapes: no memory, nothing
    initialised, no collective."""
    with torch.device("meta"):
        return build_model(cfg)


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters, parameters active per token without the embedding table)."""
    model = meta_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    # the table is looked up, not multiplied, unless it is also the output projection
    active = total - (0 if cfg.tie_embeddings else model.tok_embeddings.weight.numel())
    moe = cfg.moe
    if moe.num_experts:
        for module in model.modules():
            if isinstance(module, (GroupedExperts, ClampedExperts)):
                routed = sum(p.numel() for p in module.parameters())
                active -= routed - routed * moe.top_k // moe.num_experts
    return total, active


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per active weight plus causal attention scores
    (12 * layers * heads * head_dim * seq_len, as in the PaLM/torchtitan estimate; MLA's
    heads: 6 * layers * heads * (qk + v head dims) * seq_len)."""
    _, active = count_params(cfg)
    if cfg.attention == "mla":
        head_dims = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
        return 6.0 * active + 6.0 * cfg.n_layers * cfg.n_heads * head_dims * seq_len
    # Gated DeltaNet layers have no scores over the sequence (their projections are in
    # the active weights; the delta rule's chunked products are left out)
    full = cfg.n_layers - sum(cfg.is_linear_attention(i) for i in range(cfg.n_layers))
    return 6.0 * active + 12.0 * full * cfg.n_heads * cfg.head_size() * seq_len
