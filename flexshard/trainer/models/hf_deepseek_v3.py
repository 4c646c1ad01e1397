"""The trainer's MLA model's state-dict keys in Hugging Face terms:
``DeepseekV3ForCausalLM`` (``model_type = "deepseek_v3"``; its ``config.json`` both ways:
``config/hf_config.py``).

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
