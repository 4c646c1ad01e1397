"""The trainer's model in Hugging Face ``transformers`` terms: state-dict key names
(``LlamaForCausalLM``), the RoPE projections whose rows change order, and
``config.json`` both ways.

Dense Llama: the same function as ``LlamaForCausalLM`` (RMSNorm, SwiGLU, GQA, RoPE
without scaling, untied output), names as in Meta/torchtitan checkpoints here.

MoE: the DeepSeek-style layers map onto ``transformers``' Qwen-MoE naming only where the
architectures match, which this trainer's MoE does not in three places, so
``hf_keys`` refuses it (naming them) rather than write a checkpoint that loads but
computes something else: (1) experts here are 3-D weights ``[E, R, C]`` per projection,
Qwen2-MoE/DeepSeek-V3 keep one ``nn.Linear`` per expert (``mlp.experts.{e}.gate_proj``)
— a rename plus a split, doable; (2) the router here normalises the top-k softmax
weights (``norm_topk_prob = true`` in Qwen-MoE, fine) but DeepSeek-V3 scores with a
sigmoid and group-limited routing; (3) the shared expert here is added unweighted,
Qwen2-MoE gates it with ``sigmoid(shared_expert_gate(x))``. So the MoE stays in DCP
checkpoints and the plain safetensors export.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from flexshard.checkpoint.hf_safetensors import HFKey

from .config import ConfigError, ModelConfig
from .model import ffn_hidden_size

# trainer name (within a block) -> LlamaForCausalLM name (within model.layers.{i})
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_ROOT = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_key(fqn: str, cfg: ModelConfig) -> HFKey:
    """The ``LlamaForCausalLM`` key of trainer key ``fqn`` (RoPE rows marked)."""
    if cfg.moe.num_experts:
        raise ConfigError(
            "Hugging Face checkpoints are written for the dense Llama only: this MoE "
            "(3-D experts, unweighted shared expert) has no transformers twin; see "
            "flexshard/trainer/hf_adapter.py"
        )
    if fqn in _ROOT:
        return HFKey(_ROOT[fqn])
    match = _LAYER.match(fqn)
    if match is None or match.group(2) not in _BLOCK:
        raise KeyError(f"state-dict key '{fqn}' has no Hugging Face name")
    layer, rest = match.groups()
    heads = {"attention.wq.weight": cfg.n_heads, "attention.wk.weight": cfg.n_kv_heads}
    return HFKey(f"model.layers.{layer}.{_BLOCK[rest]}", heads.get(rest, 0))


def hf_keys(fqns: list[str], cfg: ModelConfig, tied: bool = False) -> dict[str, HFKey]:
    """``hf_key`` of every FQN; ``tied``: the folder keeps the output projection as the
    embedding (``tie_word_embeddings``), so ``output.weight`` reads that."""
    keys = {fqn: hf_key(fqn, cfg) for fqn in fqns}
    if tied and "output.weight" in keys:
        keys["output.weight"] = HFKey(_ROOT["tok_embeddings.weight"])
    return keys


def hf_config(cfg: ModelConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` computing what ``Transformer(cfg)`` does."""
    hf_key("norm.weight", cfg)  # the MoE refusal, before anything is written
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_size(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": max_positions,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(
            f"config.json: rope type '{kind}' (RoPE scaling) is not implemented by the trainer"
        )
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` keys that reproduce a ``LlamaForCausalLM`` ``config.json``;
    ConfigError for what the trainer's model cannot compute."""
    if config.get("model_type") != "llama":
        raise ConfigError(
            f"config.json: model_type '{config.get('model_type')}': only 'llama' is supported"
        )
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, ok) != ok:
            raise ConfigError(f"config.json: {key} = {config[key]!r}: the trainer needs {ok!r}")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", dim // heads) * heads != dim:
        raise ConfigError(
            f"config.json: head_dim = {config['head_dim']} x {heads} heads != hidden_size "
            f"{dim}: the trainer's heads split the model width"
        )
    return {
        "vocab_size": config["vocab_size"],
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads", heads),
        "ffn_hidden": config["intermediate_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(config),
    }


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"'{folder}' has no config.json: not a Hugging Face model folder")
    return json.loads(path.read_text())


def check_matches(cfg: ModelConfig, folder: str | Path) -> dict[str, Any]:
    """The folder's config.json, or a ConfigError listing the ``[model]`` keys that
    differ (with the overrides that would make them match)."""
    config = read_config(folder)
    wanted = model_fields(config)
    have = {k: getattr(cfg, k) for k in wanted}
    have["ffn_hidden"] = ffn_hidden_size(cfg)
    wrong = {k: v for k, v in wanted.items() if have[k] != v}
    if cfg.moe.num_experts:
        raise ConfigError("checkpoint.initial_load_in_hf: the Hugging Face model is dense")
    if wrong:
        fix = " ".join(f"--model.{k} {v}" for k, v in wrong.items())
        raise ConfigError(
            f"checkpoint.initial_load_path '{folder}': config.json differs from [model] in "
            f"{', '.join(f'{k} ({have[k]} here, {v} there)' for k, v in wrong.items())}; "
            f"set them: {fix}"
        )
    return config
