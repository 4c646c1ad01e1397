"""The trainer's model in Hugging Face ``transformers`` terms, one family per
``model_type``: its state-dict key names, the RoPE projections whose rows change order,
and ``config.json`` both ways (``FAMILIES``).

- ``llama`` (``LlamaForCausalLM``): RMSNorm, SwiGLU, GQA, RoPE without scaling, the
  output tied or not; names as in Meta/torchtitan checkpoints here.
- ``qwen3`` (``Qwen3ForCausalLM``): the same with each query and key head
  RMS-normalised before RoPE (``qk_norm``) and a ``head_dim`` of its own.
- ``mixtral`` (``MixtralForCausalLM``): Llama's attention and a sparse block computing
  what ``model.MoE`` does: router logits -> fp32 softmax over all experts -> top-k ->
  the k weights renormalised to sum 1 -> the weighted sum of the chosen SwiGLU experts
  (w1 gate, w3 up, w2 down), in every layer.
- ``qwen3_moe`` (``Qwen3MoeForCausalLM``): Qwen3's attention and the same sparse block
  with the renormalisation optional (``norm_topk_prob``) and dense layers where
  ``decoder_sparse_step`` / ``mlp_only_layers`` say.
- ``deepseek_v3`` (``DeepseekV3ForCausalLM``): MLA attention, DeepSeek's MoE
  (``hf_deepseek_v3``).

The trainer's ``[E, R, C]`` stacks are stored per expert (``...experts.{e}.w1.weight``,
what ``save_pretrained`` writes; transformers 5 fuses them on load). The MoE twins hold
only for ``num_shared_experts = 0`` and, on export, a balance other than ``"bias"``
(``hf_format`` refuses the rest, naming why, rather than write a checkpoint that loads
but computes something else). RoPE: the trainer rotates adjacent pairs, Hugging Face
the two halves of each head, so wq / wk rows and the q / k norms' weights (one head of
``head_dim``) are permuted on the way (``HFKey(..., rope_heads)``). The other HF MoE
formats do not match: Qwen2-MoE gates its shared expert with
``sigmoid(shared_expert_gate(x))`` (never exactly 1, as the trainer adds its own),
DeepSeek-V2/V3 use latent (MLA) attention and V3 sigmoid, group-limited routing,
MiniMax-M2 a sigmoid router.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flexshard.checkpoint.hf_safetensors import HFKey

from ..config import ConfigError, ModelConfig, MoEConfig
from ..config.validation import hf_format
from . import hf_deepseek_v3
from .model import ffn_hidden_size

# trainer name (within a block) -> HF name (within model.layers.{i})
_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_QK_NORM = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_DENSE = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
# sparse blocks; "{}" is the expert index of a stack's per-expert tensors
_MIXTRAL = {
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
    "feed_forward.experts.w1": "block_sparse_moe.experts.{}.w1.weight",
    "feed_forward.experts.w2": "block_sparse_moe.experts.{}.w2.weight",
    "feed_forward.experts.w3": "block_sparse_moe.experts.{}.w3.weight",
}
_QWEN3_MOE = {
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.experts.w1": "mlp.experts.{}.gate_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{}.down_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{}.up_proj.weight",
}
_ROOT = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# model state no Hugging Face format holds: the "bias" balance's selection bias (a run
# loading a folder starts it at zero, which routes as the folder's model does;
# exporting it is refused by hf_format)
_TRAINER_ONLY = re.compile(r"^layers\.\d+\.feed_forward\.balance\.bias$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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


def _base_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys of every family (Llama's set)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": ffn_hidden_size(cfg),
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
        "intermediate_size": moe.expert_hidden or ffn_hidden_size(cfg),
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
        "moe_intermediate_size": moe.expert_hidden or ffn_hidden_size(cfg),
        "num_experts": moe.num_experts,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": moe.decoder_sparse_step,
        "mlp_only_layers": dense,
    }


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture the trainer's model computes exactly."""

    architecture: str  # the transformers class
    block: dict[str, str]  # trainer -> HF names within a block (every layer)
    sparse: dict[str, str]  # the MoE layers' sparse block ({} for a dense family)
    fields: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> [model]
    config: Callable[[ModelConfig], dict[str, Any]]  # [model] -> config.json


FAMILIES = {
    "llama": Family("LlamaForCausalLM", {**_ATTENTION, **_DENSE}, {}, _llama_fields, _llama_config),
    "qwen3": Family(
        "Qwen3ForCausalLM", {**_ATTENTION, **_QK_NORM, **_DENSE}, {}, _qwen3_fields, _qwen3_config
    ),
    "mixtral": Family(
        "MixtralForCausalLM", {**_ATTENTION, **_DENSE}, _MIXTRAL, _mixtral_fields, _mixtral_config
    ),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        {**_ATTENTION, **_QK_NORM, **_DENSE},
        _QWEN3_MOE,
        _qwen3_moe_fields,
        _qwen3_moe_config,
    ),
    "deepseek_v3": Family(
        "DeepseekV3ForCausalLM",
        hf_deepseek_v3.BLOCK,
        hf_deepseek_v3.SPARSE,
        hf_deepseek_v3.model_fields,
        hf_deepseek_v3.hf_config,
    ),
}


def hf_key(fqn: str, cfg: ModelConfig) -> HFKey:
    """The Hugging Face key of trainer key ``fqn`` (RoPE rows marked, expert stacks
    named per expert)."""
    family = FAMILIES[hf_format(cfg)]
    if fqn in _ROOT:
        return HFKey(_ROOT[fqn])
    match = _LAYER.match(fqn)
    rest = match.group(2) if match else ""
    if match is None or (rest not in family.block and rest not in family.sparse):
        raise KeyError(f"state-dict key '{fqn}' has no Hugging Face name")
    layer = match.group(1)
    if rest in family.sparse:
        experts = cfg.moe.num_experts if ".experts." in rest else 0
        return HFKey(f"model.layers.{layer}.{family.sparse[rest]}", experts=experts)
    # RoPE's row order within each head: the projections' rows, the norms' one head
    heads = {
        "attention.wq.weight": cfg.n_heads,
        "attention.wk.weight": cfg.n_kv_heads,
        "attention.q_norm.weight": 1,
        "attention.k_norm.weight": 1,
    }
    return HFKey(f"model.layers.{layer}.{family.block[rest]}", heads.get(rest, 0))


def in_hf(fqn: str, cfg: ModelConfig) -> bool:
    """Whether state-dict key ``fqn`` is stored in a Hugging Face folder at all (a tied
    output projection is stored once, as the embedding)."""
    if cfg.tie_embeddings and fqn == "output.weight":
        return False
    if fqn.startswith("mtp."):  # multi-token prediction: no format here holds it
        return False
    # DeepSeek-V3's format holds the selection bias (e_score_correction_bias)
    return cfg.attention == "mla" or _TRAINER_ONLY.match(fqn) is None


def hf_keys(fqns: list[str], cfg: ModelConfig, tied: bool = False) -> dict[str, HFKey]:
    """``hf_key`` of every FQN; ``tied``: the folder keeps the output projection as the
    embedding (``tie_word_embeddings``), so ``output.weight`` reads that."""
    keys = {fqn: hf_key(fqn, cfg) for fqn in fqns}
    if tied and "output.weight" in keys:
        keys["output.weight"] = HFKey(_ROOT["tok_embeddings.weight"])
    return keys


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


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(
            f"config.json: rope type '{kind}' (RoPE scaling) is not implemented by the trainer"
        )
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``[model]`` keys (with ``[model.moe]``) that reproduce a config.json of one of
    ``FAMILIES``; ConfigError for what the trainer's model cannot compute."""
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ConfigError(
            f"config.json: model_type '{kind}': the trainer supports "
            f"{', '.join(repr(k) for k in FAMILIES)}"
        )
    return FAMILIES[kind].fields(config)


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"'{folder}' has no config.json: not a Hugging Face model folder")
    return json.loads(path.read_text())


def _have(cfg: ModelConfig, key: str) -> Any:
    """The value ``[model]`` key ``key`` ("moe.x" for [model.moe]) has in effect."""
    if key == "ffn_hidden":
        return ffn_hidden_size(cfg)
    if key == "head_dim":
        return cfg.head_size()
    if key == "moe.expert_hidden":
        return cfg.moe.expert_hidden or ffn_hidden_size(cfg)
    table, _, name = key.rpartition(".")  # "moe.x", "rope_scaling.x": a sub-table's
    return getattr(getattr(cfg, table) if table else cfg, name)


_LAYER_CHOICE = ("moe.first_dense_layers", "moe.decoder_sparse_step", "moe.mlp_only_layers")


def check_matches(cfg: ModelConfig, folder: str | Path) -> dict[str, Any]:
    """The folder's config.json, or a ConfigError listing the ``[model]`` keys that
    differ (with the overrides that would make them match). A tied folder loads into an
    untied model too (the output starts as a copy of the embedding)."""
    config = read_config(folder)
    wanted = model_fields(config)
    moe = wanted.pop("moe")
    wanted.update({f"moe.{k}": v for k, v in moe.items()})
    rope = wanted.pop("rope_scaling", {})
    wanted.update({f"rope_scaling.{k}": v for k, v in rope.items()})
    theirs = [MoEConfig(**moe).is_moe_layer(i) for i in range(wanted["n_layers"])]
    if theirs == [cfg.moe.is_moe_layer(i) for i in range(cfg.n_layers)]:
        for key in _LAYER_CHOICE:  # the same layers are MoE, however it is said
            wanted.pop(key, None)
    if moe["num_experts"] and all(theirs):  # no dense layer: its width does not count
        del wanted["ffn_hidden"]
    if wanted["tie_embeddings"] and not cfg.tie_embeddings:
        del wanted["tie_embeddings"]
    wrong = {k: v for k, v in wanted.items() if _have(cfg, k) != v}
    if wrong:
        fix = " ".join(f"--model.{k} {json.dumps(v)}" for k, v in wrong.items())
        raise ConfigError(
            f"checkpoint.initial_load_path '{folder}': config.json differs from [model] in "
            f"{', '.join(f'{k} ({_have(cfg, k)} here, {v} there)' for k, v in wrong.items())}"
            f"; set them: {fix}"
        )
    return config
