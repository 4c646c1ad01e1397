"""Which Hugging Face architecture a model config maps to, or why none does: a check
on the config alone, so the start-up validation (layout_checks) runs it without
importing the model and the adapter (hf_adapter)."""

from __future__ import annotations

from .config_schema import ConfigError, ModelConfig

HF_OPTIONS = "checkpoint.initial_load_in_hf / last_save_in_hf"


def hf_format(cfg: ModelConfig, option: str = HF_OPTIONS, export: bool = False) -> str:
    """``"llama"`` (dense) or ``"mixtral"`` (MoE); a ConfigError naming ``option`` and
    every reason when the MoE has no Hugging Face twin. ``export``: the model is written
    (a ``"bias"`` balance changes the routing, and Mixtral has no bias to hold it)."""
    moe = cfg.moe
    if not moe.num_experts:
        return "llama"
    problems = []
    if moe.num_shared_experts:
        problems.append(
            f"model.moe.num_shared_experts = {moe.num_shared_experts} (Mixtral has no shared "
            "expert; Qwen2-MoE gates its shared expert with a sigmoid, DeepSeek's come "
            "with MLA attention): set 0"
        )
    if moe.first_dense_layers:
        problems.append(
            f"model.moe.first_dense_layers = {moe.first_dense_layers} (every Mixtral layer "
            "is MoE; Qwen3-MoE's dense layers come with q/k norms the trainer has not): set 0"
        )
    if export and moe.balance == "bias":
        problems.append(
            'model.moe.balance = "bias" (the learned selection bias picks the experts; '
            "Mixtral routes by the softmax alone and has no tensor for the bias)"
        )
    if problems:
        raise ConfigError(
            f"{option}: this MoE has no Hugging Face twin (Mixtral is the one whose routing "
            f"matches the trainer's): {'; '.join(problems)}"
        )
    return "mixtral"
