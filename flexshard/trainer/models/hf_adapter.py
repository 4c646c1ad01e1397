"""The trainer's state dict in Hugging Face ``transformers`` terms, one family per
``model_type``: its key names and the RoPE projections whose rows change order
(``FAMILY_KEYS``). What each family's ``config.json`` means as ``[model]``, and back,
is the config side's (``config/hf_config.py``: ``FAMILIES``, keyed alike).

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
- ``qwen3_5_text`` (``Qwen3_5ForCausalLM``): Gated DeltaNet layers (``linear_attn.*``:
  the conv kernel, ``A_log``, ``dt_bias``, the gated norm) and gated full attention
  (``self_attn.*``, ``q_proj`` rows per head: queries then the gate) as ``layer_types``
  says, under the folder's names and row order (RoPE already in halves: no permutation);
  every other norm is zero-centred (``1 + weight``), stored as the folder stores it.
- ``qwen3_5_moe_text`` (``Qwen3_5MoeForCausalLM``): Qwen3.5's layers, each with Qwen3-MoE's
  sparse block (``norm_topk_prob`` always) plus one shared expert of its own width whose
  output is scaled per token by ``sigmoid(mlp.shared_expert_gate(x))`` (``shared_gate``);
  routed experts one tensor per expert, as ``save_pretrained`` writes them.
- ``deepseek_v3`` (``DeepseekV3ForCausalLM``): MLA's parameters under transformers'
  names, its rotated rows in DeepSeek's pairwise order (``rope_interleave = true``,
  written on export, required on load: no row moves); DeepSeek's MoE block (``mlp.gate``
  with the ``"bias"`` balance's selection bias as ``e_score_correction_bias``, hence that
  balance both ways; ``mlp.shared_experts``; routed experts one tensor per expert). Its
  multi-token prediction depths under DeepSeek's names (``_DEEPSEEK_V3_MTP``).

The trainer's ``[E, R, C]`` stacks are stored per expert (``...experts.{e}.w1.weight``,
what ``save_pretrained`` writes; transformers 5 fuses them on load), or, in a folder
saved fused (``save_pretrained(..., save_original_format=False)``: ``mlp.experts.
gate_up_proj`` [E, 2 * hidden, dim], the gate's rows then the up projection's, and
``mlp.experts.down_proj`` [E, dim, hidden]), as that folder has them: ``hf_keys(...,
fused=True)``, read and written at their rows, no copy between the layouts. Mixtral's and
Qwen3-MoE's twins hold only for ``num_shared_experts = 0``, Qwen3.5-MoE's for one gated
shared expert, and on export all three for a balance other than ``"bias"`` (``hf_format``
refuses the rest, naming why, rather than write a checkpoint that loads but computes
something else). RoPE: the trainer rotates adjacent pairs, Hugging Face
the two halves of each head, so wq / wk rows and the q / k norms' weights (one head of
``head_dim``) are permuted on the way (``HFKey(..., rope_heads)``). The other HF MoE
formats do not match: Qwen2-MoE has biased q/k/v projections,
DeepSeek-V2/V3 use latent (MLA) attention and V3 sigmoid, group-limited routing,
MiniMax-M2 a sigmoid router.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from flexshard.checkpoint.hf_safetensors import HFKey, tensor_names

from ..config import ModelConfig
from ..config.hf_config import folder_fields
from ..config.validation import hf_format

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
_MTP_DEPTH = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
# model state no Hugging Face format holds: the "bias" balance's selection bias (a run
# loading a folder starts it at zero, which routes as the folder's model does;
# exporting it is refused by hf_format)
_TRAINER_ONLY = re.compile(r"^layers\.\d+\.feed_forward\.balance\.bias$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_MLA_NAMES = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)
# DeepSeek-V3: every block
_DEEPSEEK_V3 = {
    **{f"attention.{name}.weight": f"self_attn.{name}.weight" for name in _MLA_NAMES},
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
# DeepSeek-V3's MoE blocks
_DEEPSEEK_V3_MOE = {
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


# DeepSeek-V3's multi-token prediction depth k is ``model.layers.{n_layers + k}.*``, as
# DeepSeek publishes it (README_WEIGHTS.md): its own norms and projection, a whole
# decoder block under the main blocks' names, and copies of the main model's embedding
# and head, which it shares (``shared_copies``); transformers' class ignores them all
_DEEPSEEK_V3_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_MTP_SHARED = {
    "tok_embeddings.weight": "embed_tokens.weight",
    "output.weight": "shared_head.head.weight",
}


# Qwen3.5: the full-attention layers' and the Gated DeltaNet layers' names (a block has
# one kind); both modules keep the folder's own names and row order (RoPE in halves)
_GATED_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_DELTA_NET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj")
_QWEN3_5 = {
    **{f"attention.{name}.weight": f"self_attn.{name}.weight" for name in _GATED_ATTENTION},
    **{f"attention.{name}.weight": f"linear_attn.{name}.weight" for name in _DELTA_NET},
    "attention.A_log": "linear_attn.A_log",
    "attention.dt_bias": "linear_attn.dt_bias",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **_DENSE,
}


# Qwen3.5-MoE's sparse block (every layer): Qwen3-MoE's router and experts, one shared
# expert and its sigmoid gate (a [1, dim] row)
_QWEN3_5_MOE = {
    **_QWEN3_MOE,
    "feed_forward.shared.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}


# DeepSeek-V4: the trainer's modules carry DeepSeek's own names, as transformers saves
# them; the learned layers' selection bias is ``ffn.gate.bias``, a hash layer's table
# ``ffn.gate.tid2eid``
_V4_ATTENTION = ("wq_a", "q_norm", "wq_b", "wkv", "norm", "wo_a", "wo_b")
_V4_COMPRESSOR = ("compressor.wkv.weight", "compressor.wgate.weight", "compressor.ape")
_V4_COMPRESSOR += ("compressor.norm.weight",)
_V4_NAMES = (
    *(f"attn.{name}.weight" for name in _V4_ATTENTION),
    "attn.attn_sink",
    *(f"attn.{name}" for name in _V4_COMPRESSOR),
    *(f"attn.indexer.{name}" for name in _V4_COMPRESSOR),
    "attn.indexer.wq_b.weight",
    "attn.indexer.weights_proj.weight",
    "attn_norm.weight",
    "ffn_norm.weight",
    *(f"hc_{side}_{part}" for side in ("attn", "ffn") for part in ("fn", "base", "scale")),
    "ffn.gate.weight",
    "ffn.gate.tid2eid",
    *(f"ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")),
)
_DEEPSEEK_V4 = {
    **{name: name for name in _V4_NAMES},
    "ffn.balance.bias": "ffn.gate.bias",
    **{f"ffn.experts.{w}": f"ffn.experts.{{}}.{w}.weight" for w in ("w1", "w2", "w3")},
}
_DEEPSEEK_V4_ROOT = {
    **_ROOT,
    "output.weight": "head.weight",
    **{f"hc_head.{name}": f"model.hc_head.{name}" for name in ("hc_fn", "hc_base", "hc_scale")},
}
# as DeepSeek publishes it: blocks as ``layers.{i}.*`` (no ``model.``), its own root names
_DEEPSEEK_V4_PUBLISHED_ROOT = {
    "tok_embeddings.weight": "embed.weight",
    "norm.weight": "norm.weight",
    "output.weight": "head.weight",
    **{f"hc_head.hc_{part}": f"hc_head_{part}" for part in ("fn", "base", "scale")},
}


@dataclass(frozen=True)
class FamilyKeys:
    """One family's state-dict names (``config.hf_config.FAMILIES`` has its config.json)."""

    block: dict[str, str]  # trainer -> HF names within a block (every layer)
    sparse: dict[str, str]  # the MoE layers' sparse block ({} for a dense family)
    root: dict[str, str] = dataclasses.field(default_factory=lambda: dict(_ROOT))
    # the root names of the folder as the model's authors publish it, whose blocks are
    # ``layers.{i}.*`` with no ``model.`` prefix (None: no such layout)
    published_root: dict[str, str] | None = None
    # a multi-token-prediction depth's own names (trainer -> HF, within its block's
    # ``model.layers.{n_layers + k}``), None: the format holds no MTP depth
    mtp: dict[str, str] | None = None


FAMILY_KEYS = {
    "llama": FamilyKeys({**_ATTENTION, **_DENSE}, {}),
    "qwen3": FamilyKeys({**_ATTENTION, **_QK_NORM, **_DENSE}, {}),
    "mixtral": FamilyKeys({**_ATTENTION, **_DENSE}, _MIXTRAL),
    "qwen3_moe": FamilyKeys({**_ATTENTION, **_QK_NORM, **_DENSE}, _QWEN3_MOE),
    "deepseek_v3": FamilyKeys(_DEEPSEEK_V3, _DEEPSEEK_V3_MOE, mtp=_DEEPSEEK_V3_MTP),
    "qwen3_5_text": FamilyKeys(_QWEN3_5, {}),
    "qwen3_5_moe_text": FamilyKeys(_QWEN3_5, _QWEN3_5_MOE),
    "deepseek_v4": FamilyKeys({}, _DEEPSEEK_V4, _DEEPSEEK_V4_ROOT, _DEEPSEEK_V4_PUBLISHED_ROOT),
}


def hf_key(fqn: str, cfg: ModelConfig) -> HFKey:
    """The Hugging Face key of trainer key ``fqn`` (RoPE rows marked, expert stacks
    named per expert)."""
    family = FAMILY_KEYS[hf_format(cfg)]
    if fqn in family.root:
        return HFKey(family.root[fqn])
    depth = _MTP_DEPTH.match(fqn)
    if depth is not None and family.mtp is not None:
        layer, rest = cfg.n_layers + int(depth.group(1)), depth.group(2)
        if rest in family.mtp:
            return HFKey(f"model.layers.{layer}.{family.mtp[rest]}")
        if rest.startswith("block."):  # a decoder block named as the main model's
            return hf_key(f"layers.{layer}.{rest.removeprefix('block.')}", cfg)
    match = _LAYER.match(fqn)
    rest = match.group(2) if match else ""
    if match is None or (rest not in family.block and rest not in family.sparse):
        raise KeyError(f"state-dict key '{fqn}' has no Hugging Face name")
    layer = match.group(1)
    if rest in family.sparse:
        experts = cfg.moe.num_experts if ".experts." in rest else 0
        return HFKey(f"model.layers.{layer}.{family.sparse[rest]}", experts=experts)
    if cfg.attention == "gated":  # Qwen3.5's modules keep the folder's row order
        return HFKey(f"model.layers.{layer}.{family.block[rest]}")
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
    if fqn.startswith("mtp."):  # multi-token prediction: DeepSeek-V3's format holds it
        return cfg.attention == "mla"
    # DeepSeek-V3's format holds the selection bias (e_score_correction_bias)
    return cfg.attention in ("mla", "deepseek_v4") or _TRAINER_ONLY.match(fqn) is None


# transformers' per-expert names and where each lives in its fused stacks
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\{\}\.(gate|up|down)_proj\.weight$")
_FUSED_NAME = re.compile(r"\.experts\.gate_up_proj$")


def fused_experts(folder: str | Path) -> bool:
    """Whether a Hugging Face folder keeps its routed experts fused
    (``experts.gate_up_proj`` / ``experts.down_proj``)."""
    return any(_FUSED_NAME.search(name) for name in tensor_names(folder))


def _fused(key: HFKey, cfg: ModelConfig) -> HFKey:
    """A per-expert stack's key in the fused layout: the gate's rows then the up
    projection's in ``gate_up_proj``, the down projection as ``down_proj``."""
    match = _PER_EXPERT.match(key.name)
    if match is None:
        raise KeyError(
            f"'{key.name}': this family's experts have no fused Hugging Face layout here "
            "(experts.{e}.gate_proj / up_proj / down_proj are fused)"
        )
    stack, kind = match.groups()
    if kind == "down":
        return HFKey(f"{stack}.down_proj")
    hidden = cfg.moe.expert_hidden or cfg.ffn_hidden_size()
    return HFKey(f"{stack}.gate_up_proj", rows=(0 if kind == "gate" else hidden, 2 * hidden))


def published_layout(folder: str | Path, cfg: ModelConfig) -> bool:
    """Whether a Hugging Face folder holds ``cfg``'s family as its authors publish it
    (DeepSeek-V4: ``embed.weight``, ``layers.{i}.*``) rather than as transformers saves it."""
    root = FAMILY_KEYS[hf_format(cfg)].published_root
    return root is not None and root["tok_embeddings.weight"] in tensor_names(folder)


_MTP = re.compile(r"(^|\.)mtp\.")
_FOLDER_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def shared_copies(cfg: ModelConfig) -> dict[str, str]:
    """The MTP depths' copies of the main model's embedding and head in DeepSeek-V3's
    layout (HF name -> the trainer key it copies): the depths share those two, as in
    DeepSeek's training, so a load reads the main ones and an export writes them again
    under each depth's names. Empty for a model or format without MTP depths."""
    if not cfg.mtp_layers or FAMILY_KEYS[hf_format(cfg)].mtp is None:
        return {}
    tied = {"output.weight": "tok_embeddings.weight"} if cfg.tie_embeddings else {}
    return {
        f"model.layers.{cfg.n_layers + k}.{name}": tied.get(fqn, fqn)
        for k in range(cfg.mtp_layers)
        for fqn, name in _MTP_SHARED.items()
    }


def mtp_tensors(folder: str | Path) -> list[str]:
    """A folder's multi-token-prediction tensors: DeepSeek-V3's blocks past
    ``num_hidden_layers``, DeepSeek-V4's ``mtp.*``."""
    layers = folder_fields(folder)["n_layers"]
    names = []
    for name in sorted(tensor_names(folder)):
        block = _FOLDER_LAYER.match(name)
        if _MTP.search(name) or (block is not None and int(block.group(1)) >= layers):
            names.append(name)
    return names


def unloaded_mtp(folder: str | Path, mtp_layers: int = 0, layout: Sequence[str] = ()) -> str | None:
    """The line to say when a folder holds multi-token-prediction depths that the run
    does not load: ``mtp_layers`` (the run's) is 0, since ``layout`` (the run's settings
    that train no MTP: ``config.validation.layout_without_mtp``) or by choice, or the
    family has no MTP here (DeepSeek-V4); None when there are none or they load."""
    names = mtp_tensors(folder)
    if not names:
        return None
    kind = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    if kind == "deepseek_v3":
        if mtp_layers:
            return None
        tensors = f"{folder}: its {len(names)} multi-token-prediction tensors ({names[0]}, ...)"
        if layout:
            return (
                f"{tensors} are not loaded: {', '.join(layout)} trains no MTP (data and "
                "expert parallelism only); the export will not carry them (to keep them, "
                "train with parallelism.tp, pp and cp 1 and rl off)"
            )
        return f"{tensors} are not loaded: model.mtp_layers = 0; the export has none"
    return (
        f"{folder}: its {len(names)} multi-token-prediction tensors (mtp.*) are not loaded: "
        "the trainer has no MTP for this family; the export has none"
    )


def hf_keys(
    fqns: list[str],
    cfg: ModelConfig,
    tied: bool = False,
    prefix: str = "model.",
    fused: bool = False,
    published: bool = False,
) -> dict[str, HFKey]:
    """``hf_key`` of every FQN; ``tied``: the folder keeps the output projection as the
    embedding (``tie_word_embeddings``), so ``output.weight`` reads that; ``prefix``:
    where the folder keeps the text model (``config.hf_config.text_model_prefix``);
    ``fused``: the routed experts in transformers' fused layout (``fused_experts``);
    ``published``: the names of the family's published layout (``published_layout``)."""
    keys = {fqn: hf_key(fqn, cfg) for fqn in fqns}
    if fused:
        keys = {fqn: _fused(key, cfg) if key.experts else key for fqn, key in keys.items()}
    if tied and "output.weight" in keys:
        keys["output.weight"] = HFKey(_ROOT["tok_embeddings.weight"])
    if prefix != "model.":
        for fqn, key in keys.items():
            if key.name.startswith("model."):
                keys[fqn] = dataclasses.replace(key, name=prefix + key.name.removeprefix("model."))
    if published:
        root = dict(FAMILY_KEYS[hf_format(cfg)].published_root or {})
        if tied:
            root["output.weight"] = root["tok_embeddings.weight"]
        for fqn, key in keys.items():
            name = root[fqn] if fqn in root else key.name.removeprefix("model.")
            keys[fqn] = dataclasses.replace(key, name=name)
    return keys
