"""The trainer's MLA model in Hugging Face terms: ``DeepseekV3ForCausalLM``
(``model_type = "deepseek_v3"``), state-dict keys and ``config.json`` both ways.

MLA's parameters carry transformers' names (``attention.q_a_proj`` ->
``self_attn.q_a_proj``); its rotated rows are in DeepSeek's pairwise order, which is
what ``rope_interleave = true`` (written on export, required on load) reads, so no row
moves. The MoE block is DeepSeek's: ``mlp.gate`` (the router and, as
``e_score_correction_bias``, the ``"bias"`` balance's selection bias, hence that balance
is required both ways), ``mlp.shared_experts`` and the routed experts one tensor per
expert (``mlp.experts.{e}.gate_proj.weight``: what DeepSeek's released checkpoints and
``save_pretrained`` write; transformers fuses them on load). Dense blocks (the first
``first_dense_layers``; all of them without experts) are ``mlp.gate_proj`` / ... .

The multi-token prediction depths (``mtp.*``) are not exported: ``DeepseekV3ForCausalLM``
has no such weights (it ignores DeepSeek's layer 61 on load), and a folder loads with
``mtp_layers = 0``."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, ModelConfig
from .model import ffn_hidden_size

_MLA = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)
# trainer name (within a block) -> HF name (within model.layers.{i}): every block
BLOCK = {
    **{f"attention.{name}.weight": f"self_attn.{name}.weight" for name in _MLA},
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
# the MoE blocks
SPARSE = {
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.balance.bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
    # "{}": the expert index of a stack's per-expert tensors
    "feed_forward.experts.w1": "mlp.experts.{}.gate_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{}.up_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{}.down_proj.weight",
}


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    scaling = cfg.rope_scaling
    if scaling.type == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "mscale": scaling.mscale,
        "mscale_all_dim": scaling.mscale_all_dim,
    }


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of a ``DeepseekV3ForCausalLM`` computing what ``Transformer(cfg)``
    does (its main model: no MTP), but the keys every family writes alike."""
    moe = cfg.moe
    dense = ffn_hidden_size(cfg)
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": dense,
        "moe_intermediate_size": moe.expert_hidden or dense,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.num_shared_experts,
        "num_experts_per_tok": moe.top_k,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.routed_scaling_factor,
        # every block dense without routed experts
        "first_k_dense_replace": moe.first_dense_layers if moe.num_experts else cfg.n_layers,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": _rope_parameters(cfg),
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def _rope_fields(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, the [model.rope_scaling] table) of a config.json, read as
    transformers reads it; ConfigError for what the trainer does not compute."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, {"type": "none"}
    if kind != "yarn":
        raise ConfigError(f"config.json: rope type '{kind}': the trainer's MLA runs YaRN only")
    for key, ok in (("attention_factor", None), ("truncate", True)):
        if params.get(key, ok) != ok:
            raise ConfigError(f"config.json: rope {key} = {params[key]!r}: the trainer needs {ok}")
    original = params.get("original_max_position_embeddings", config["max_position_embeddings"])
    factor = params.get("factor") or config["max_position_embeddings"] / original
    return theta, {
        "type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "mscale": float(params.get("mscale") or 0),
        "mscale_all_dim": float(params.get("mscale_all_dim") or 0),
    }


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` keys (with ``[model.moe]``, ``[model.rope_scaling]``) that reproduce
    a ``DeepseekV3ForCausalLM`` config.json."""
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("rope_interleave", True)):
        if config.get(key, ok) != ok:
            raise ConfigError(f"config.json: {key} = {config[key]!r}: the trainer needs {ok!r}")
    theta, rope_scaling = _rope_fields(config)
    layers = config["num_hidden_layers"]
    dense = config.get("first_k_dense_replace") or 0
    moe: dict[str, Any] = {"num_experts": 0}
    if dense < layers:
        moe = {
            "num_experts": config["n_routed_experts"],
            "top_k": config["num_experts_per_tok"],
            "num_shared_experts": config["n_shared_experts"],
            "expert_hidden": config["moe_intermediate_size"],
            "first_dense_layers": dense,
            "balance": "bias",
            "score_func": "sigmoid",
            "n_group": config.get("n_group") or 1,
            "topk_group": config.get("topk_group") or 1,
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        }
    return {
        "attention": "mla",
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "n_layers": layers,
        "n_heads": config["num_attention_heads"],
        "ffn_hidden": config["intermediate_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "q_lora_rank": config.get("q_lora_rank") or 0,
        "kv_lora_rank": config["kv_lora_rank"],
        "qk_nope_head_dim": config["qk_nope_head_dim"],
        "qk_rope_head_dim": config["qk_rope_head_dim"],
        "v_head_dim": config["v_head_dim"],
        "rope_scaling": rope_scaling,
        "moe": moe,
    }
