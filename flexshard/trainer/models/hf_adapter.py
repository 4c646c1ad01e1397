"""The trainer's model in Hugging Face ``transformers`` terms: state-dict key names, the
RoPE projections whose rows change order, and ``config.json`` both ways.

Dense: ``LlamaForCausalLM`` — the same function (RMSNorm, SwiGLU, GQA, RoPE without
scaling, untied output), names as in Meta/torchtitan checkpoints here.

MoE: ``MixtralForCausalLM``, whose layers are the same attention and a sparse block
computing what ``model.MoE`` does: router logits -> fp32 softmax over all experts ->
top-k -> the k weights renormalised to sum 1 -> the weighted sum of the chosen
SwiGLU experts (w1 gate, w3 up, w2 down). The trainer's ``[E, R, C]`` stacks are
stored as Mixtral's per-expert ``block_sparse_moe.experts.{e}.w1.weight`` (what
``save_pretrained`` writes, transformers 5 fuses them on load). The twin holds only
for ``num_shared_experts = 0``, ``first_dense_layers = 0`` and, on export, a balance
other than ``"bias"``; ``hf_format`` refuses the rest, naming why, rather than write a
checkpoint that loads but computes something else. The other HF MoE formats do not
match: Qwen2-MoE gates its shared expert with ``sigmoid(shared_expert_gate(x))`` (never
exactly 1, as the trainer adds its own), Qwen3-MoE and OLMoE normalise q and k,
DeepSeek-V2/V3 use latent (MLA) attention and V3 sigmoid, group-limited routing,
MiniMax-M2 a sigmoid router.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from flexshard.checkpoint.hf_safetensors import HFKey

from ..config import ConfigError, ModelConfig
from ..config.validation import hf_format
from .model import ffn_hidden_size

# trainer name (within a block) -> HF name (within model.layers.{i})
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
# Mixtral's sparse block; "{}" is the expert index of a stack's per-expert tensors
_MIXTRAL = {
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
    "feed_forward.experts.w1": "block_sparse_moe.experts.{}.w1.weight",
    "feed_forward.experts.w2": "block_sparse_moe.experts.{}.w2.weight",
    "feed_forward.experts.w3": "block_sparse_moe.experts.{}.w3.weight",
}
_ROOT = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# model state no Hugging Face format holds: the "bias" balance's selection bias (a run
# loading a folder starts it at zero, which routes as Mixtral does; exporting it is
# refused by hf_format)
_TRAINER_ONLY = re.compile(r"^layers\.\d+\.feed_forward\.balance\.bias$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_key(fqn: str, cfg: ModelConfig) -> HFKey:
    """The Hugging Face key of trainer key ``fqn`` (RoPE rows marked, expert stacks
    named per expert)."""
    moe = hf_format(cfg) == "mixtral"
    if fqn in _ROOT:
        return HFKey(_ROOT[fqn])
    match = _LAYER.match(fqn)
    rest = match.group(2) if match else ""
    if match is None or (rest not in _BLOCK and not (moe and rest in _MIXTRAL)):
        raise KeyError(f"state-dict key '{fqn}' has no Hugging Face name")
    layer = match.group(1)
    if rest in _MIXTRAL:
        experts = cfg.moe.num_experts if ".experts." in rest else 0
        return HFKey(f"model.layers.{layer}.{_MIXTRAL[rest]}", experts=experts)
    heads = {"attention.wq.weight": cfg.n_heads, "attention.wk.weight": cfg.n_kv_heads}
    return HFKey(f"model.layers.{layer}.{_BLOCK[rest]}", heads.get(rest, 0))


def in_hf(fqn: str) -> bool:
    """Whether state-dict key ``fqn`` is stored in a Hugging Face folder at all."""
    return _TRAINER_ONLY.match(fqn) is None


def hf_keys(fqns: list[str], cfg: ModelConfig, tied: bool = False) -> dict[str, HFKey]:
    """``hf_key`` of every FQN; ``tied``: the folder keeps the output projection as the
    embedding (``tie_word_embeddings``), so ``output.weight`` reads that."""
    keys = {fqn: hf_key(fqn, cfg) for fqn in fqns}
    if tied and "output.weight" in keys:
        keys["output.weight"] = HFKey(_ROOT["tok_embeddings.weight"])
    return keys


def hf_config(cfg: ModelConfig, dtype: str, max_positions: int) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` / ``MixtralForCausalLM`` computing what
    ``Transformer(cfg)`` does."""
    kind = hf_format(cfg, "checkpoint.last_save_in_hf", export=True)
    config: dict[str, Any] = {
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
    if kind == "mixtral":
        moe = cfg.moe
        for key in ("attention_bias", "mlp_bias"):
            del config[key]
        config.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            intermediate_size=moe.expert_hidden or ffn_hidden_size(cfg),
            num_local_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
    return config


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(
            f"config.json: rope type '{kind}' (RoPE scaling) is not implemented by the trainer"
        )
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` keys (with ``[model.moe]``) that reproduce a ``LlamaForCausalLM``
    or ``MixtralForCausalLM`` ``config.json``; ConfigError for what the trainer's model
    cannot compute."""
    kind = config.get("model_type")
    if kind not in ("llama", "mixtral"):
        raise ConfigError(
            f"config.json: model_type '{kind}': only 'llama' and 'mixtral' are supported"
        )
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, ok) != ok:
            raise ConfigError(f"config.json: {key} = {config[key]!r}: the trainer needs {ok!r}")
    if config.get("sliding_window") is not None:
        raise ConfigError(
            f"config.json: sliding_window = {config['sliding_window']}: the trainer's "
            "attention is fully causal"
        )
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // heads
    if head_dim * heads != dim:
        raise ConfigError(
            f"config.json: head_dim = {head_dim} x {heads} heads != hidden_size "
            f"{dim}: the trainer's heads split the model width"
        )
    moe: dict[str, Any] = {"num_experts": 0}
    if kind == "mixtral":
        moe = {
            "num_experts": config["num_local_experts"],
            "top_k": config["num_experts_per_tok"],
            "expert_hidden": config["intermediate_size"],
            "num_shared_experts": 0,
            "first_dense_layers": 0,
        }
    return {
        "vocab_size": config["vocab_size"],
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "ffn_hidden": config["intermediate_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(config),
        "moe": moe,
    }


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"'{folder}' has no config.json: not a Hugging Face model folder")
    return json.loads(path.read_text())


def _have(cfg: ModelConfig, key: str) -> Any:
    """The value ``[model]`` key ``key`` ("moe.x" for [model.moe]) has in effect."""
    if key == "ffn_hidden":
        return ffn_hidden_size(cfg)
    if key == "moe.expert_hidden":
        return cfg.moe.expert_hidden or ffn_hidden_size(cfg)
    if key.startswith("moe."):
        return getattr(cfg.moe, key[len("moe.") :])
    return getattr(cfg, key)


def check_matches(cfg: ModelConfig, folder: str | Path) -> dict[str, Any]:
    """The folder's config.json, or a ConfigError listing the ``[model]`` keys that
    differ (with the overrides that would make them match)."""
    config = read_config(folder)
    wanted = model_fields(config)
    moe = wanted.pop("moe")
    if moe["num_experts"]:  # Mixtral: no dense layer, the experts' width is what counts
        del wanted["ffn_hidden"]
    wanted.update({f"moe.{k}": v for k, v in moe.items()})
    wrong = {k: v for k, v in wanted.items() if _have(cfg, k) != v}
    if wrong:
        fix = " ".join(f"--model.{k} {v}" for k, v in wrong.items())
        raise ConfigError(
            f"checkpoint.initial_load_path '{folder}': config.json differs from [model] in "
            f"{', '.join(f'{k} ({_have(cfg, k)} here, {v} there)' for k, v in wrong.items())}"
            f"; set them: {fix}"
        )
    return config
