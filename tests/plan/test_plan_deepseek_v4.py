"""DeepSeek-V4 in the planner: the parameter count of ``flexshard/plan/deepseek_v4.py``
against transformers' own ``DeepseekV4ForCausalLM`` (built on meta), its preset
against transformers' defaults, and the trainer stand-in the plan runs
(``configs/deepseek_v4_flash.toml``) against V4's count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexshard.plan.deepseek_v4 import (
    CSA,
    HCA,
    V4_FLASH,
    active_per_token,
    parameter_counts,
    stand_in_gap,
)
from flexshard.trainer.config import load_config
from flexshard.trainer.models.model import count_params

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
SHRUNK = {
    "vocab_size": 97,
    "hidden_size": 48,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 20,
    "num_experts_per_tok": 2,
    "n_routed_experts": 6,
    "n_shared_experts": 1,
    "hc_mult": 3,
    "o_groups": 2,
    "o_lora_rank": 12,
    "index_n_heads": 3,
    "index_head_dim": 8,
    "compress_rates": {CSA: 4, HCA: 8},
    "layer_types": [HCA, CSA, "sliding_attention", CSA, HCA],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe"],
    "index_topk": 2,
    "sliding_window": 8,
}


def _transformers_count(config: object) -> int:
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def test_count_equals_transformers_on_a_shrunk_config() -> None:
    config = transformers.DeepseekV4Config(**SHRUNK)
    assert sum(parameter_counts(SHRUNK).values()) == _transformers_count(config)
    tied = {**SHRUNK, "tie_word_embeddings": True}
    assert sum(parameter_counts(tied).values()) == _transformers_count(
        transformers.DeepseekV4Config(**tied)
    )


def test_preset_is_transformers_defaults() -> None:
    defaults = transformers.DeepseekV4Config().to_dict()
    assert {k: defaults[k] for k in V4_FLASH} == V4_FLASH
    assert sum(parameter_counts(V4_FLASH).values()) == 284_325_869_015  # meta build, 5.24


def test_unknown_layer_type_is_refused() -> None:
    with pytest.raises(ValueError, match="layer_types"):
        parameter_counts({**SHRUNK, "layer_types": ["full_attention"] * 5})


def test_stand_in_config_is_v4_sized() -> None:
    cfg = load_config(str(ROOT / "configs/deepseek_v4_flash.toml"), [])
    total, active = count_params(cfg.model)
    assert abs(stand_in_gap(total)) < 0.005
    assert abs(active / active_per_token(V4_FLASH) - 1) < 0.03
