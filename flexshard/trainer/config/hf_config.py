"""What a Hugging Face ``config.json`` means as ``[model]`` keys, and back, one family
per ``model_type`` (``FAMILIES``: the transformers class, ``config.json`` -> ``[model]``
and ``[model]`` -> ``config.json``); the state-dict key names of each family are the
models side's (``models/hf_adapter.py``, keyed alike).

A ``config.json`` key that changes what the model computes and that the trainer's model
does not compute is a ConfigError naming it; ``check_matches`` compares a folder's
config.json with ``[model]`` at start-up. DeepSeek-V3 (``deepseek_v3``): MLA sizes,
YaRN RoPE (``rope_interleave = true``: the trainer's pairwise rotation), sigmoid
group-limited routing with the ``"bias"`` balance, and its multi-token prediction
depths (``num_nextn_predict_layers`` -> ``mtp_layers``; ``--model.mtp_layers 0``, or a
layout that trains no MTP with ``mtp_layers`` not given, leaves them out: ``loader``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .schema import ConfigError, ModelConfig, MoEConfig
from .validation import hf_format

if TYPE_CHECKING:
    from flexshard.checkpoint.hf_dequantize import BlockScaled

# what a config.json may carry that changes what the model computes, and the value the
# trainer's model has (other values: a ConfigError naming the key)
_NEEDED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "router_jitter_noise": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
}


def _common_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` keys every family's config.json gives the same way."""
    for key, ok in _NEEDED.items():
        if key == "sliding_window" and not config.get("use_sliding_window", True):
            continue  # Qwen3 keeps a window size it does not use
        if config.get(key, ok) != ok:
            raise ConfigError(f"config.json: {key} = {config[key]!r}: the trainer needs {ok!r}")
    kinds = set(config.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ConfigError(
            f"config.json: layer_types has {sorted(kinds - {'full_attention'})}: the "
            "trainer's attention is fully causal"
        )
    heads = config["num_attention_heads"]
    return {
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "qk_norm": False,
        "attention": "gqa",
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "ffn_hidden": config["intermediate_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(config),
        "moe": {"num_experts": 0},
    }


def _llama_fields(config: dict[str, Any]) -> dict[str, Any]:
    return _common_fields(config)


def _qwen3_fields(config: dict[str, Any]) -> dict[str, Any]:
    return {**_common_fields(config), "qk_norm": True}


def _mixtral_fields(config: dict[str, Any]) -> dict[str, Any]:
    moe = {
        "num_experts": config["num_local_experts"],
        "top_k": config["num_experts_per_tok"],
        "expert_hidden": config["intermediate_size"],
        "num_shared_experts": 0,
        "first_dense_layers": 0,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    return {**_common_fields(config), "moe": moe}


def _qwen3_moe_fields(config: dict[str, Any]) -> dict[str, Any]:
    moe = {
        # the Hub's name; transformers 5 saves its alias num_local_experts
        "num_experts": config.get("num_experts", config.get("num_local_experts")),
        "top_k": config["num_experts_per_tok"],
        "expert_hidden": config["moe_intermediate_size"],
        "num_shared_experts": 0,
        "first_dense_layers": 0,
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "decoder_sparse_step": config.get("decoder_sparse_step", 1),
        "mlp_only_layers": list(config.get("mlp_only_layers") or []),
    }
    return {**_qwen3_fields(config), "moe": moe}


_LAYER_KINDS = ("full_attention", "linear_attention")


def _qwen3_5_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A ``Qwen3_5ForCausalLM`` config.json (``qwen3_5_text``): Gated DeltaNet layers and
    gated full attention as ``layer_types`` says, partial RoPE."""
    for key, ok in _NEEDED.items():
        if config.get(key, ok) != ok:
            raise ConfigError(f"config.json: {key} = {config[key]!r}: the trainer needs {ok!r}")
    layers = config["num_hidden_layers"]
    kinds = list(config.get("layer_types") or [])
    if len(kinds) != layers or set(kinds) - set(_LAYER_KINDS):
        raise ConfigError(
            f"config.json: layer_types = {kinds}: the trainer needs one of {_LAYER_KINDS} "
            f"per layer ({layers})"
        )
    params = dict(config.get("rope_parameters") or {})
    factor = float(params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    # text positions are one row repeated: the multimodal sections rotate as plain RoPE
    params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    heads = config["num_attention_heads"]
    return {
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "n_layers": layers,
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "qk_norm": True,
        "attention": "gated",
        "partial_rotary_factor": factor,
        "layer_types": kinds,
        "linear_attention": {
            "conv_kernel": config["linear_conv_kernel_dim"],
            "key_head_dim": config["linear_key_head_dim"],
            "value_head_dim": config["linear_value_head_dim"],
            "num_key_heads": config["linear_num_key_heads"],
            "num_value_heads": config["linear_num_value_heads"],
        },
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "ffn_hidden": config["intermediate_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta({**config, "rope_parameters": params}),
        "moe": {"num_experts": 0},
    }


def _qwen3_5_moe_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A ``Qwen3_5MoeForCausalLM`` config.json (``qwen3_5_moe_text``): Qwen3.5's layers
    with an MoE block in every one: softmax top-k routing renormalised, one shared
    expert of its own width gated by a sigmoid (no dense feed-forward anywhere)."""
    if config.get("output_router_logits", False):
        raise ConfigError(
            "config.json: output_router_logits = true (transformers adds router_aux_loss_coef "
            "times its load-balancing loss): the trainer needs false (model.moe.balance "
            '"aux" is its own balance)'
        )
    moe = {
        "num_experts": config["num_experts"],
        "top_k": config["num_experts_per_tok"],
        "expert_hidden": config["moe_intermediate_size"],
        "num_shared_experts": 1,
        "shared_expert_hidden": config["shared_expert_intermediate_size"],
        "shared_expert_gate": True,
        "first_dense_layers": 0,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    # no dense layer: ffn_hidden is never built (the experts' width stands in)
    dense = {**config, "intermediate_size": config["moe_intermediate_size"]}
    return {**_qwen3_5_fields(dense), "moe": moe}


def _base_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys of every family (Llama's set)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_size(),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_size(),
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def _llama_config(cfg: ModelConfig) -> dict[str, Any]:
    return {**_base_config(cfg), "mlp_bias": False}


def _qwen3_config(cfg: ModelConfig) -> dict[str, Any]:
    no_window = {"use_sliding_window": False, "sliding_window": None}
    return {**_base_config(cfg), **no_window, "max_window_layers": cfg.n_layers}


def _moe_sizes(cfg: ModelConfig) -> dict[str, Any]:
    return {"num_experts_per_tok": cfg.moe.top_k, "output_router_logits": False}


def _mixtral_config(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return {
        **_base_config(cfg),
        **_moe_sizes(cfg),
        "intermediate_size": moe.expert_hidden or cfg.ffn_hidden_size(),
        "num_local_experts": moe.num_experts,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
    }


def _qwen3_moe_config(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    # the trainer's first dense layers are Qwen3-MoE's mlp-only ones
    dense = sorted(set(moe.mlp_only_layers) | set(range(moe.first_dense_layers)))
    return {
        **_qwen3_config(cfg),
        **_moe_sizes(cfg),
        "moe_intermediate_size": moe.expert_hidden or cfg.ffn_hidden_size(),
        "num_experts": moe.num_experts,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": moe.decoder_sparse_step,
        "mlp_only_layers": dense,
    }


def _qwen3_5_config(cfg: ModelConfig) -> dict[str, Any]:
    la = cfg.linear_attention
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        **_base_config(cfg),
        "rope_parameters": {**rope, "partial_rotary_factor": cfg.partial_rotary_factor},
        "attention_dropout": 0.0,
        "layer_types": list(cfg.layer_types) or ["full_attention"] * cfg.n_layers,
        "linear_conv_kernel_dim": la.conv_kernel,
        "linear_key_head_dim": la.key_head_dim,
        "linear_value_head_dim": la.value_head_dim,
        "linear_num_key_heads": la.num_key_heads,
        "linear_num_value_heads": la.num_value_heads,
    }


def _qwen3_5_moe_config(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    hidden = moe.expert_hidden or cfg.ffn_hidden_size()
    out = {
        **_qwen3_5_config(cfg),
        **_moe_sizes(cfg),
        "moe_intermediate_size": hidden,
        "shared_expert_intermediate_size": moe.shared_width(hidden),
        "num_experts": moe.num_experts,
    }
    del out["intermediate_size"]  # every layer is MoE: Qwen3.5-MoE has no such key
    return out


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(
            f"config.json: rope type '{kind}' (RoPE scaling) is not implemented by the trainer"
        )
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def _yarn_parameters(cfg: ModelConfig) -> dict[str, Any]:
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


def _deepseek_v3_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of a ``DeepseekV3ForCausalLM`` computing what ``Transformer(cfg)``
    does, with its MTP depths as DeepSeek counts them, but the keys every family writes
    alike."""
    moe = cfg.moe
    dense = cfg.ffn_hidden_size()
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
        "num_nextn_predict_layers": cfg.mtp_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": _yarn_parameters(cfg),
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def _yarn_fields(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
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


def _deepseek_v3_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` keys (with ``[model.moe]``, ``[model.rope_scaling]``) that reproduce
    a ``DeepseekV3ForCausalLM`` config.json."""
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("rope_interleave", True)):
        if config.get(key, ok) != ok:
            raise ConfigError(f"config.json: {key} = {config[key]!r}: the trainer needs {ok!r}")
    theta, rope_scaling = _yarn_fields(config)
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
        "mtp_layers": config.get("num_nextn_predict_layers") or 0,
    }


_V4_KINDS = {"compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"}
# what transformers' DeepseekV4ForCausalLM computes, whatever the key says otherwise
_V4_NEEDED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "router_jitter_noise": 0.0,
    "num_key_value_heads": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "output_router_logits": False,
}
# DeepSeek's own config.json: a compression ratio per layer for the attention kind
_V4_RATIO_KINDS = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}
# transformers' default rotated share: 64 of a head's 512 dims, V4's own sizes
_V4_DEFAULT_PARTIAL = 64 / 512
_V4_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_V4_OWN_KEYS = (
    "compress_ratios",
    "compress_rate_csa",
    "compress_rate_hca",
    "num_hash_layers",
    "qk_rope_head_dim",
)


def _deepseek_v4_own_keys(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json in DeepSeek's own keys (as DeepSeek publishes V4) in transformers'
    ``DeepseekV4Config`` keys, folded as that class folds them: ``compress_ratios`` (0, 4
    or 128 per layer; DeepSeek lists its MTP depth's too) -> ``layer_types``;
    ``compress_rate_csa`` / ``_hca`` -> ``compress_rates``; ``num_hash_layers`` (the first
    layers hash-routed) -> ``mlp_layer_types``; ``qk_rope_head_dim`` ->
    ``partial_rotary_factor``; a flat ``rope_scaling`` / ``rope_parameters`` (YaRN, the
    compressed branches' only) -> ``rope_parameters.main`` / ``.compress``. A folder
    transformers saved passes through unchanged."""
    out = {k: v for k, v in config.items() if k not in _V4_OWN_KEYS}
    layers = out["num_hidden_layers"]
    rates = dict(out.get("compress_rates") or _V4_DEFAULT_RATES)
    if "compress_rate_csa" in config:
        rates["compressed_sparse_attention"] = config["compress_rate_csa"]
    if "compress_rate_hca" in config:
        rates["heavily_compressed_attention"] = config["compress_rate_hca"]
    out["compress_rates"] = rates
    ratios = config.get("compress_ratios")
    if not out.get("layer_types") and ratios is not None:
        unknown = sorted(set(ratios) - set(_V4_RATIO_KINDS))
        if unknown:
            raise ConfigError(
                f"config.json: compress_ratios has {unknown}: one of "
                f"{sorted(_V4_RATIO_KINDS)} per layer (sliding, CSA, HCA)"
            )
        out["layer_types"] = [_V4_RATIO_KINDS[r] for r in ratios][:layers]
    if not out.get("mlp_layer_types") and "num_hash_layers" in config:
        hashed = min(layers, config["num_hash_layers"])
        out["mlp_layer_types"] = ["hash_moe"] * hashed + ["moe"] * (layers - hashed)
    if out.get("partial_rotary_factor") is None and "qk_rope_head_dim" in config:
        out["partial_rotary_factor"] = config["qk_rope_head_dim"] / out["head_dim"]
    rope = out.get("rope_parameters") or out.pop("rope_scaling", None) or {}
    if not (isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict)):
        flat = {k: v for k, v in rope.items() if k not in ("main", "compress", "type")}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if out.get("partial_rotary_factor") is None:
            out["partial_rotary_factor"] = _V4_DEFAULT_PARTIAL
        partial = {"partial_rotary_factor": out["partial_rotary_factor"]}
        compress = {**flat, "rope_type": kind, **partial}
        compress["rope_theta"] = out.get("compress_rope_theta", 160000.0)
        if kind == "yarn":
            compress.setdefault("attention_factor", 1.0)
        theta = out.get("rope_theta", 10000.0)
        main = {"rope_type": "default", "rope_theta": theta, **partial}
        out["rope_parameters"] = {"main": main, "compress": compress}
    return out


def quantization_format(config: dict[str, Any]) -> BlockScaled | None:
    """The FP8 format of a folder's config.json (``quantization_config``), dequantized on
    load; a ConfigError naming the key for one that is not read."""
    # imported here: reading a config (``--help`` included) loads no torch
    from flexshard.checkpoint.hf_dequantize import block_scaled

    try:
        return block_scaled(config)
    except ValueError as err:
        raise ConfigError(f"config.json: {err}") from None


def _deepseek_v4_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` keys (``[model.deepseek_v4]``, ``[model.moe]``,
    ``[model.rope_scaling]``) of a ``DeepseekV4ForCausalLM`` config.json, transformers'
    or DeepSeek's own (``_deepseek_v4_own_keys``). Its FP8 weights load dequantized
    (``quantization_format``); its MTP depths (``num_nextn_predict_layers``) do not load:
    the trainer has no DeepSeek-V4 MTP (transformers has none either)."""
    for key, ok in _V4_NEEDED.items():
        if config.get(key, ok) != ok:
            raise ConfigError(f"config.json: {key} = {config[key]!r}: the trainer needs {ok!r}")
    quantization_format(config)
    config = _deepseek_v4_own_keys(config)
    layers = config["num_hidden_layers"]
    for key in ("layer_types", "mlp_layer_types"):
        if not config.get(key):
            raise ConfigError(
                f"config.json: no {key} (nor DeepSeek's "
                f"{'compress_ratios' if key == 'layer_types' else 'num_hash_layers'})"
            )
    kinds, mlp = list(config["layer_types"]), list(config["mlp_layer_types"])
    if len(kinds) != layers or set(kinds) - _V4_KINDS:
        raise ConfigError(
            f"config.json: layer_types = {kinds}: one of {sorted(_V4_KINDS)} per layer"
        )
    if len(mlp) != layers or set(mlp) - {"hash_moe", "moe"}:
        raise ConfigError(f"config.json: mlp_layer_types = {mlp}: 'hash_moe' or 'moe' per layer")
    rope = config.get("rope_parameters") or {}
    main, compress = rope.get("main") or {}, rope.get("compress") or {}
    if main.get("rope_type", "default") != "default":
        raise ConfigError(
            f"config.json: rope_parameters.main.rope_type = {main['rope_type']!r}: the "
            "trainer needs 'default'"
        )
    if (
        compress.get("rope_type", "default") == "yarn"
        and compress.get("attention_factor", 1.0) != 1.0
    ):
        raise ConfigError(
            "config.json: rope_parameters.compress.attention_factor: the trainer needs 1.0"
        )
    theta, scaling = _yarn_fields(
        {
            **config,
            "rope_parameters": {k: v for k, v in compress.items() if k != "attention_factor"},
        }
    )
    factor = float(config.get("partial_rotary_factor") or main.get("partial_rotary_factor", 1.0))
    rates = config["compress_rates"]
    return {
        "attention": "deepseek_v4",
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "n_layers": layers,
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": 1,
        "head_dim": config["head_dim"],
        "q_lora_rank": config["q_lora_rank"],
        "partial_rotary_factor": factor,
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(main.get("rope_theta", config.get("rope_theta", 10000.0))),
        "rope_scaling": scaling,
        "layer_types": kinds,
        "deepseek_v4": {
            "hc_mult": config["hc_mult"],
            "hc_sinkhorn_iters": config["hc_sinkhorn_iters"],
            "hc_eps": float(config["hc_eps"]),
            "sliding_window": config["sliding_window"],
            "o_groups": config["o_groups"],
            "o_lora_rank": config["o_lora_rank"],
            "compress_rate_csa": rates.get("compressed_sparse_attention", 4),
            "compress_rate_hca": rates.get("heavily_compressed_attention", 128),
            "compress_rope_theta": theta,
            "index_n_heads": config["index_n_heads"],
            "index_head_dim": config["index_head_dim"],
            "index_topk": config["index_topk"],
            "swiglu_limit": float(config["swiglu_limit"]),
            "mlp_layer_types": mlp,
        },
        "moe": {
            "num_experts": config["n_routed_experts"],
            "top_k": config["num_experts_per_tok"],
            "num_shared_experts": 1,
            "expert_hidden": config["moe_intermediate_size"],
            "first_dense_layers": 0,
            "balance": "bias",
            "score_func": "sqrtsoftplus",
            "norm_topk_prob": True,
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        },
    }


def _deepseek_v4_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of the ``DeepseekV4ForCausalLM`` computing what the trainer's
    DeepSeek-V4 does."""
    v4, moe = cfg.deepseek_v4, cfg.moe
    compress = {**_yarn_parameters(cfg), "rope_theta": v4.compress_rope_theta}
    if compress["rope_type"] == "yarn":
        compress["attention_factor"] = 1.0
    partial = {"partial_rotary_factor": cfg.partial_rotary_factor}
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "moe_intermediate_size": moe.expert_hidden or cfg.ffn_hidden_size(),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_size(),
        "q_lora_rank": cfg.q_lora_rank,
        "num_experts_per_tok": moe.top_k,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": cfg.rope_theta, **partial},
            "compress": {**compress, **partial},
        },
        "layer_types": list(cfg.layer_types),
        "mlp_layer_types": list(v4.mlp_layer_types),
        "compress_rates": {
            "compressed_sparse_attention": v4.compress_rate_csa,
            "heavily_compressed_attention": v4.compress_rate_hca,
        },
        "compress_rope_theta": v4.compress_rope_theta,
        "hc_mult": v4.hc_mult,
        "hc_sinkhorn_iters": v4.hc_sinkhorn_iters,
        "hc_eps": v4.hc_eps,
        "swiglu_limit": v4.swiglu_limit,
        "sliding_window": v4.sliding_window,
        "o_groups": v4.o_groups,
        "o_lora_rank": v4.o_lora_rank,
        "index_n_heads": v4.index_n_heads,
        "index_head_dim": v4.index_head_dim,
        "index_topk": v4.index_topk,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture the trainer's model computes exactly."""

    architecture: str  # the transformers class
    fields: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> [model]
    config: Callable[[ModelConfig], dict[str, Any]]  # [model] -> config.json


FAMILIES = {
    "llama": Family("LlamaForCausalLM", _llama_fields, _llama_config),
    "qwen3": Family("Qwen3ForCausalLM", _qwen3_fields, _qwen3_config),
    "mixtral": Family("MixtralForCausalLM", _mixtral_fields, _mixtral_config),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", _qwen3_moe_fields, _qwen3_moe_config),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", _deepseek_v3_fields, _deepseek_v3_config),
    "qwen3_5_text": Family("Qwen3_5ForCausalLM", _qwen3_5_fields, _qwen3_5_config),
    "qwen3_5_moe_text": Family("Qwen3_5MoeForCausalLM", _qwen3_5_moe_fields, _qwen3_5_moe_config),
    "deepseek_v4": Family("DeepseekV4ForCausalLM", _deepseek_v4_fields, _deepseek_v4_config),
}


def context_length(cfg: ModelConfig, trained: int) -> int:
    """The positions ``max_position_embeddings`` claims for a model with no source
    folder: YaRN's extended context, ``factor`` times the original (DeepSeek's own
    convention, which transformers reads the factor back from), else ``trained``, the
    sequence length it trained at (RoPE sets no limit of its own)."""
    scaling = cfg.rope_scaling
    if scaling.type == "yarn":
        return round(scaling.factor * scaling.original_max_position_embeddings)
    return trained


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5 or Qwen3.5-MoE with its vision tower (``Qwen3_5ForConditionalGeneration``,
    ``Qwen3_5MoeForConditionalGeneration``): the config.json of its text model (the tower
    is not trained; the export is text-only)."""
    kind = config["model_type"]
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(
            f"config.json: text_config = {text!r}: a model_type '{kind}' folder keeps its "
            "text model's sizes there"
        )
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text_kind = f"{kind}_text"
    return {
        **text,
        "model_type": text_kind,
        "architectures": [FAMILIES[text_kind].architecture],
        "tie_word_embeddings": tied,
    }


# folders read, never written: the config.json of their text model (``{kind}_text``,
# one of FAMILIES), whose keys they keep under TEXT_MODEL_PREFIX
_TEXT_MODEL_CONFIG = {"qwen3_5": _text_config, "qwen3_5_moe": _text_config}
TEXT_MODEL_PREFIX = dict.fromkeys(_TEXT_MODEL_CONFIG, "model.language_model.")


def text_model_prefix(folder: str | Path) -> str:
    """Where a folder keeps its text model's keys: ``model.``, or, for Qwen3.5 with its
    vision tower, ``model.language_model.`` (``lm_head.weight`` stays at the top)."""
    kind = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    return TEXT_MODEL_PREFIX.get(kind, "model.")


def hf_config(cfg: ModelConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """``config.json`` of the transformers model computing what ``Transformer(cfg)`` does."""
    kind = hf_format(cfg, "checkpoint.last_save_in_hf", export=True)
    family = FAMILIES[kind]
    return {
        "architectures": [family.architecture],
        "model_type": kind,
        **family.config(cfg),
        "max_position_embeddings": max_positions,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` keys (with ``[model.moe]``) that reproduce a config.json of one of
    ``FAMILIES``; ConfigError for what the trainer's model cannot compute."""
    kind = config.get("model_type")
    if kind in _TEXT_MODEL_CONFIG:
        config = _TEXT_MODEL_CONFIG[kind](config)
        kind = config["model_type"]
    if kind not in FAMILIES:
        raise ConfigError(
            f"config.json: model_type '{kind}': the trainer supports "
            f"{', '.join(repr(k) for k in FAMILIES)}"
        )
    if config.get("quantization_config") and kind != "deepseek_v4":
        raise ConfigError(
            f"config.json: quantization_config: quantized weights load (dequantized) in "
            f"'deepseek_v4' folders only, not '{kind}'"
        )
    return FAMILIES[kind].fields(config)


def folder_fields(folder: str | Path) -> dict[str, Any]:
    """The ``[model]`` keys of a Hugging Face folder's config.json: the one reading of
    it, for training (the config loader), generation, the start-up checks and the
    Hugging Face load."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"'{folder}' has no config.json: not a Hugging Face model folder")
    fields = model_fields(json.loads(path.read_text()))
    if fields.get("mtp_layers") and not _holds_mtp(folder, fields["n_layers"]):
        # transformers' DeepseekV3Config counts one depth by default, and save_pretrained
        # writes no MTP weights: the depths are the ones the folder holds
        fields["mtp_layers"] = 0
    return fields


def _holds_mtp(folder: str | Path, n_layers: int) -> bool:
    """Whether a DeepSeek-V3 folder holds its first MTP depth (``model.layers.{n_layers}``)."""
    # imported here: reading a config (``--help`` included) loads no torch
    from flexshard.checkpoint.hf_safetensors import tensor_names

    return f"model.layers.{n_layers}.eh_proj.weight" in tensor_names(folder)


def folder_quantization(folder: str | Path) -> BlockScaled | None:
    """The FP8 format of a Hugging Face folder's weights (``quantization_format`` of its
    config.json), which its load dequantizes; None for unquantized weights."""
    return quantization_format(json.loads((Path(folder) / "config.json").read_text()))


def _have(cfg: ModelConfig, key: str) -> Any:
    """The value ``[model]`` key ``key`` ("moe.x" for [model.moe]) has in effect."""
    if key == "ffn_hidden":
        return cfg.ffn_hidden_size()
    if key == "head_dim":
        return cfg.head_size()
    if key == "moe.expert_hidden":
        return cfg.moe.expert_hidden or cfg.ffn_hidden_size()
    if key == "moe.shared_expert_hidden":
        return cfg.moe.shared_width(cfg.moe.expert_hidden or cfg.ffn_hidden_size())
    table, _, name = key.rpartition(".")  # "moe.x", "rope_scaling.x": a sub-table's
    return getattr(getattr(cfg, table) if table else cfg, name)


_LAYER_CHOICE = ("moe.first_dense_layers", "moe.decoder_sparse_step", "moe.mlp_only_layers")


def _mismatches(cfg: ModelConfig, fields: dict[str, Any], loading: bool) -> dict[str, Any]:
    """The ``[model]`` keys (``moe.x``, ``rope_scaling.x`` for the sub-tables) whose value
    in ``fields`` (a config.json's reading) differs from ``cfg``'s, with the fields'
    value. ``loading``: the folder is read into ``cfg``, so a tied config.json may describe
    an untied ``cfg``, and one with MTP depths a ``cfg`` without."""
    wanted = dict(fields)
    moe = wanted.pop("moe")
    wanted.update({f"moe.{k}": v for k, v in moe.items()})
    for table in ("rope_scaling", "linear_attention", "deepseek_v4"):
        values = wanted.pop(table, {})
        wanted.update({f"{table}.{k}": v for k, v in values.items()})
    theirs = [MoEConfig(**moe).is_moe_layer(i) for i in range(wanted["n_layers"])]
    if theirs == [cfg.moe.is_moe_layer(i) for i in range(cfg.n_layers)]:
        for key in _LAYER_CHOICE:  # the same layers are MoE, however it is said
            wanted.pop(key, None)
    if moe["num_experts"] and all(theirs):  # no dense layer: its width does not count
        wanted.pop("ffn_hidden", None)
    if loading and wanted["tie_embeddings"] and not cfg.tie_embeddings:
        del wanted["tie_embeddings"]
    if loading and not cfg.mtp_layers:  # the run leaves the folder's MTP depths out
        wanted.pop("mtp_layers", None)
    return {k: v for k, v in wanted.items() if _have(cfg, k) != v}


def check_matches(cfg: ModelConfig, folder: str | Path) -> dict[str, Any]:
    """The folder's ``[model]`` keys (``folder_fields``), or a ConfigError listing the
    ones that differ from ``cfg`` (with the overrides that would make them match). A
    tied folder loads into an untied model too (the output starts as a copy of the
    embedding), and a folder with MTP depths into a model without (``mtp_layers = 0``)."""
    fields = folder_fields(folder)
    wrong = _mismatches(cfg, fields, loading=True)
    if wrong:
        fix = " ".join(f"--model.{k} {json.dumps(v)}" for k, v in wrong.items())
        raise ConfigError(
            f"checkpoint.initial_load_path '{folder}': config.json differs from [model] in "
            f"{', '.join(f'{k} ({_have(cfg, k)} here, {v} there)' for k, v in wrong.items())}"
            f"; set them: {fix}"
        )
    return fields


# config.json keys an export decides whatever the folder it started from said: the
# head it writes (a tied folder may train untied) and the MTP depths it holds
_EXPORT_DECIDES = ("tie_word_embeddings", "num_nextn_predict_layers")
# what a quantized folder's config.json says of its weights: the export's are not
_QUANTIZATION_KEYS = ("quantization_config", "expert_dtype")


def exported_config(
    cfg: ModelConfig,
    dtype: str,
    trained: int,
    source: dict[str, Any] | None = None,
    token_ids: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``config.json`` of the exported model. Without a ``source`` (the config.json of
    the folder the run started from): ``hf_config`` with ``context_length``. With one:
    ``source`` field for field (context length, window layers, RoPE scaling, token ids,
    architectures, every key transformers or other readers keep), but for what the run
    changed: the dtype of the weights written, ``_EXPORT_DECIDES``, and ``token_ids``
    (a tokenizer of the run's own); a folder with a vision tower gives its text model's.
    A ConfigError if the result would not describe ``cfg``'s model."""
    run = hf_config(cfg, dtype, context_length(cfg, trained))
    if source is None:
        return {**run, **(token_ids or {})}
    if source.get("model_type") in _TEXT_MODEL_CONFIG:
        source = _TEXT_MODEL_CONFIG[source["model_type"]](source)
    out = dict(source)
    for key in _EXPORT_DECIDES:
        if key in run and source.get(key, run[key]) != run[key]:
            out[key] = run[key]
    for key in [k for k in ("torch_dtype", "dtype") if k in source] or ["torch_dtype", "dtype"]:
        out[key] = dtype
    for key in _QUANTIZATION_KEYS:
        out.pop(key, None)
    out.update(token_ids or {})
    wrong = _mismatches(cfg, model_fields(out), loading=False)
    if wrong:
        raise ConfigError(
            "checkpoint.last_save_in_hf: the config.json of checkpoint.initial_load_path "
            "does not describe the trained model in "
            + ", ".join(f"{k} ({_have(cfg, k)} trained, {v} there)" for k, v in wrong.items())
        )
    return out
