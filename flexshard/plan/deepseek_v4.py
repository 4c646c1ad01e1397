"""DeepSeek-V4 in the planner: its parameters counted from a Hugging Face
``config.json`` (``model_type`` ``deepseek_v4``), and the trainer config the plan
runs in its place (``configs/deepseek_v4_flash.toml``).

The trainer has no DeepSeek-V4 blocks, so the plan runs a stand-in of the same sizes:
the MoE exactly (256 routed experts of 2,048, top 6, one shared expert, a router per
layer, every one of the 43 layers MoE), the attention as the trainer's MLA sized to
V4's: the query latent (``q_lora_rank`` 1,024 to 64 heads of 512), one 512-wide
key/value projection from the model width, a 256-wide value per head so that the
output projection holds about what V4's grouped low-rank one holds (8 groups of
4,096 to 1,024, then 8,192 to 4,096). What the stand-in leaves out, and the plan
therefore does not count: the compressors and the Lightning Indexer's projections
(about 6% of the attention's parameters), the hyper-connections' four residual
streams (``hc_mult``: their mixing weights are 0.3% of a block; their activations,
four times the residual's, are not in the memory), and the compressed attention's
own arithmetic (V4 attends to a 128-token window plus compressed entries; the
stand-in's MLA core is not timed by the planner either). :func:`stand_in_gap` says
how far the stand-in's parameter count is from V4's.

Source of the sizes: transformers 5.24's ``DeepseekV4Config`` defaults
(``transformers/models/deepseek_v4/configuration_deepseek_v4.py``, documented there
against the ``deepseek-ai/DeepSeek-V4-Flash-Base`` checkpoint):
:data:`V4_FLASH`."""

from __future__ import annotations

from typing import Any

CSA, HCA, SWA = (
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
)

#: transformers 5.24's DeepseekV4Config defaults (DeepSeek-V4-Flash), as its
#: ``__post_init__`` resolves them: two heavily compressed layers, then CSA / HCA alternating
V4_FLASH: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "hc_mult": 4,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "compress_rates": {CSA: 4, HCA: 128},
    "layer_types": [HCA, HCA] + [HCA if i % 2 else CSA for i in range(1, 42)],
    "tie_word_embeddings": False,
}


def _attention(cfg: dict[str, Any], kind: str) -> int:
    """One attention layer's parameters (``DeepseekV4Attention``) of type ``kind``."""
    d, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q, groups, o_rank = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    n = d * q + q + q * heads * hd  # q_a_proj, q_a_norm, q_b_proj
    n += d * hd + hd  # kv_proj (one key/value head), kv_norm
    n += (heads * hd // groups) * groups * o_rank  # o_a_proj: per group [o_rank, heads*hd/g]
    n += groups * o_rank * d + heads  # o_b_proj, sinks
    rate = cfg["compress_rates"].get(kind, 0)
    if kind == HCA:  # kv and gate projections, position bias, kv_norm
        n += 2 * d * hd + rate * hd + hd
    elif kind == CSA:  # two overlapping series: twice the width
        n += 2 * d * 2 * hd + rate * 2 * hd + hd
        ihd, iheads = cfg["index_head_dim"], cfg["index_n_heads"]
        n += 2 * d * 2 * ihd + rate * 2 * ihd + ihd  # the indexer's own compressor
        n += q * iheads * ihd + d * iheads  # its q_b_proj and head weights
    return n


def _hyper_connection(cfg: dict[str, Any]) -> int:
    """One mHC (``DeepseekV4HyperConnection``): ``fn``, ``base``, ``scale``."""
    streams = cfg["hc_mult"]
    mixes = (2 + streams) * streams
    return mixes * streams * cfg["hidden_size"] + mixes + 3


def parameter_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameters of ``DeepseekV4ForCausalLM`` built from ``cfg`` (a ``config.json``'s
    fields), by part: what transformers instantiates (no MTP layers: it leaves them out)."""
    d, vocab = cfg["hidden_size"], cfg["vocab_size"]
    experts, inner = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    kinds = cfg["layer_types"]
    unknown = sorted(set(kinds) - {CSA, HCA, SWA})
    if unknown:
        raise ValueError(f"layer_types: {unknown} are not DeepSeek-V4 attention types")
    streams = cfg["hc_mult"]
    return {
        "embedding": vocab * d,
        "attention": sum(_attention(cfg, k) for k in kinds),
        "routed_experts": len(kinds) * experts * 3 * inner * d,
        "shared_experts": len(kinds) * 3 * d * inner * cfg["n_shared_experts"],
        "routers": len(kinds) * experts * d,
        "norms": len(kinds) * 2 * d + d,
        "hyper_connections": len(kinds) * 2 * _hyper_connection(cfg)
        + streams * streams * d
        + streams
        + 1,
        "head": 0 if cfg.get("tie_word_embeddings") else vocab * d,
    }


def active_per_token(cfg: dict[str, Any]) -> int:
    """Parameters a token's forward multiplies by: all but the routed experts it skips
    and the embedding (a lookup)."""
    parts = parameter_counts(cfg)
    routed = parts["routed_experts"] * cfg["num_experts_per_tok"] // cfg["n_routed_experts"]
    return sum(parts.values()) - parts["routed_experts"] - parts["embedding"] + routed


def stand_in_gap(planned_params: int, cfg: dict[str, Any] = V4_FLASH) -> float:
    """The stand-in's parameter count relative to V4's, minus 1."""
    return planned_params / sum(parameter_counts(cfg).values()) - 1
