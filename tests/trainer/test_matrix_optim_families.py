"""SOAP and Shampoo (pytorch-optimizer's, through MatrixOptimizer: ``training.optimizer``)
on the 2026 families: Qwen3.5 (Gated DeltaNet and gated attention), Qwen3.5-MoE and
DeepSeek-V4 (hyper-connections, sinks, compressors, hash routing).

- the rule for their parameter kinds, read from the optimizer's own state after a step
  (one process): which are preconditioned as matrices (Kronecker factors per side),
  which fall back to SOAP's diagonal Adam, which get no state;
- W = 2 and W = 3 on the trainer's placement ("auto": the "muon" buckets) and one
  other, against one process (slow): the same losses on every rank and on both
  placements, within SOAP's bounds of the single process; Shampoo at W = 2 on Qwen3.5
  and DeepSeek-V4 (slow).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flexshard.testing import run_distributed
from flexshard.trainer.components.optimizers import build_optimizer
from flexshard.trainer.config import Config
from flexshard.trainer.models.layers import loss_fn
from flexshard.trainer.models.model import build_model, init_weights
from flexshard.trainer.train import setup

from .test_deepseek_layouts import SOAP_BOUNDS
from .test_deepseek_v4 import V4_MODEL
from .test_parallel_layouts import compare_with_single_process, layout_config, trained
from .test_qwen3_5 import QWEN3_5_MODEL
from .test_qwen3_5_moe import QWEN3_5_MOE_MODEL

pytest.importorskip("pytorch_optimizer")

FAMILIES = {"qwen3_5": QWEN3_5_MODEL, "qwen3_5_moe": QWEN3_5_MOE_MODEL, "deepseek_v4": V4_MODEL}
SOAP = {"optimizer": "soap", "max_norm": 0.0}

Factors = list[tuple[int, ...]]


def _config(folder: str, family: str, parallelism: dict | None = None) -> Config:
    return layout_config(folder, parallelism or {}, None, model=FAMILIES[family], training=SOAP)


def _factors(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Factors]:
    """Each matrix MatrixOptimizer made of ``param`` (its state key) and the shapes of
    SOAP's Kronecker factors on it (none: SOAP's Adam on the diagonal)."""
    entries = optimizer.state.get(param, {})
    return {
        key: [tuple(f.shape) for f in entry.state["GG"] if isinstance(f, torch.Tensor)]
        for key, entry in entries.items()
        if key != "inner"
    }


def _matrix(rows: int, cols: int) -> Factors:
    return [(rows, rows), (cols, cols)]


# family: {parameter: its matrices (state key -> SOAP's factors)}, the kinds each brings
RULE: dict[str, dict[str, dict[str, Factors]]] = {
    "qwen3_5": {
        # a depthwise conv kernel [C, 1, K] is a 3-D stack: each channel's K taps a
        # [1, K] matrix (a K x K factor; the 1 x 1 one is a scalar)
        "layers.0.attention.conv1d.weight": {f"expert{c}": _matrix(1, 3) for c in range(88)},
        "layers.0.attention.A_log": {"matrix": []},  # per-head vectors: diagonal Adam
        "layers.0.attention.dt_bias": {"matrix": []},
        "layers.0.attention.in_proj_qkv.weight": {"matrix": _matrix(88, 32)},
        "layers.0.attention.in_proj_a.weight": {"matrix": _matrix(4, 32)},
        "layers.0.attention.norm.weight": {"matrix": []},
        "layers.3.attention.q_proj.weight": {"matrix": _matrix(128, 32)},
        "tok_embeddings.weight": {"matrix": _matrix(256, 32)},
    },
    "qwen3_5_moe": {
        "layers.0.feed_forward.experts.w1": {f"expert{e}": _matrix(24, 32) for e in range(4)},
        "layers.0.feed_forward.router.weight": {"matrix": _matrix(4, 32)},
        "layers.0.feed_forward.shared_gate.weight": {"matrix": _matrix(1, 32)},
    },
    "deepseek_v4": {
        # Muon's blocks: per head for wq_b, per output group for wo_a
        "layers.1.attn.wq_b.weight": {
            f"rows{r}-{r + 16}": _matrix(16, 24) for r in (0, 16, 32, 48)
        },
        "layers.1.attn.wo_a.weight": {f"rows{r}-{r + 12}": _matrix(12, 32) for r in (0, 12)},
        "layers.1.hc_attn_fn": {"matrix": _matrix(15, 96)},  # hyper-connection projection
        "layers.1.hc_attn_base": {"matrix": []},  # its offsets and scales: diagonal Adam
        "layers.1.hc_attn_scale": {"matrix": []},
        "hc_head.hc_fn": {"matrix": _matrix(3, 96)},
        "layers.1.attn.attn_sink": {"matrix": []},
        # a position bias [rate, width] is a matrix to SOAP (Muon leaves it to AdamW)
        "layers.1.attn.compressor.ape": {"matrix": _matrix(4, 32)},
        "layers.0.ffn.experts.w2": {f"expert{e}": _matrix(32, 16) for e in range(5)},
        "layers.0.ffn.gate.weight": {"matrix": _matrix(5, 32)},
    },
}


@pytest.mark.parametrize("family", FAMILIES)
def test_soap_rule_for_the_families_parameter_kinds(family: str) -> None:
    cfg = _config("-", family)
    model = build_model(cfg.model)
    init_weights(model, 0)
    optimizer = build_optimizer(model, cfg.training, cfg.model)
    batch = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    optimizer.step()
    params = dict(model.named_parameters())
    factors = {name: _factors(optimizer, p) for name, p in params.items()}
    for name, expected in RULE[family].items():
        assert factors[name] == expected, name
    for name, param in params.items():
        if param.grad is None:  # DeepSeek-V4's indexer: its top-k passes no gradient
            assert factors[name] == {}, name
        elif param.ndim == 1:  # every vector falls back
            assert factors[name] == {"matrix": []}, name
        else:  # every matrix and every matrix of a stack is preconditioned on both sides
            assert all(len(f) == 2 for f in factors[name].values()), name
    without_grad = {n for n, p in params.items() if p.grad is None}
    assert all(".indexer." in n for n in without_grad), without_grad
    if family == "deepseek_v4":  # the hash table and the selection bias are buffers
        assert without_grad
        buffers = dict(model.named_buffers())
        assert "layers.0.ffn.gate.tid2eid" in buffers and "layers.1.ffn.balance.bias" in buffers


# world size: (the trainer's placement, one other)
PLACEMENTS = {2: ("auto", "shard0"), 3: ("auto", "flat")}


def _case_config(folder: str, family: str, world_size: int, placement: str) -> Config:
    parallelism: dict[str, Any] = {"dp_shard": world_size}
    if placement != "auto":
        parallelism["placement"] = placement
    return _config(f"{folder}/{family}_{placement}", family, parallelism)


def _cases(rank: int, world_size: int, folder: str) -> dict[tuple[str, str], dict]:
    return {
        (family, placement): trained(setup(_case_config(folder, family, world_size, placement)))
        for family in FAMILIES
        for placement in PLACEMENTS[world_size]
    }


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_soap_on_the_families_matches_one_process(world_size: int, tmp_path) -> None:
    results = run_distributed(_cases, world_size, str(tmp_path), timeout=1800)
    planned, other = PLACEMENTS[world_size]
    for family in FAMILIES:
        for by_case in results:  # every rank logs the same losses
            assert by_case[(family, planned)]["losses"] == results[0][(family, planned)]["losses"]
        if world_size == 2:  # a sum of two gradients rounds alike in every layout, and
            # both placements step the same whole matrices: the same losses, bit for bit
            assert results[0][(family, planned)]["losses"] == results[0][(family, other)]["losses"]
        for placement in (planned, other):
            cfg = _case_config("-", family, world_size, placement)
            result = results[0][(family, placement)]
            gaps = compare_with_single_process(family, cfg, result, *SOAP_BOUNDS)
            print(f"{family} W={world_size} {placement}: {gaps}")


# Shampoo's inverse roots damp what SOAP's eigenbases magnify: measured (10 steps, W = 2)
# loss 1.5e-7, norm 2.1e-7, parameters 3.0e-5 (DeepSeek-V4; Qwen3.5 below)
SHAMPOO_PARAM_ATOL = {"param_atol": 3e-4}
SHAMPOO_FAMILIES = ("qwen3_5", "qwen3_5_moe", "deepseek_v4")
# Shampoo's update (no grafting) is about (rows x cols)^(-1/4) of the lr per element, a
# fifth of Adam's on these 24 x 32 experts: at lr 3e-3 (or 3e-4, or without weight
# decay) Qwen3.5-MoE's losses move by under 1e-3 in 10 steps, below the batches' spread;
# at 3e-2 it learns (later half's mean 5.89 below the first loss 5.91) and matches one
# process: loss 2.4e-7, norm 2.7e-7, parameters 1.3e-4
SHAMPOO_LR = {"qwen3_5_moe": 3e-2}


def _shampoo_config(folder: str, family: str) -> Config:
    return layout_config(
        f"{folder}/{family}",
        {"dp_shard": 2},
        None,
        model=FAMILIES[family],
        training={**SOAP, "optimizer": "shampoo", "lr": SHAMPOO_LR.get(family, 3e-3)},
    )


def _shampoo_cases(
    rank: int, world_size: int, folder: str, families: tuple[str, ...] = SHAMPOO_FAMILIES
) -> dict[str, dict]:
    return {family: trained(setup(_shampoo_config(folder, family))) for family in families}


@pytest.mark.slow
def test_shampoo_on_the_families_matches_one_process(tmp_path) -> None:
    """Shampoo on the trainer's placement at W = 2 (its rule is SOAP's by shape; its
    vectors get a factor too)."""
    results = run_distributed(_shampoo_cases, 2, str(tmp_path), timeout=1200)
    for family in SHAMPOO_FAMILIES:
        assert results[1][family]["losses"] == results[0][family]["losses"], family
        cfg = _shampoo_config("-", family)
        gaps = compare_with_single_process(family, cfg, results[0][family], **SHAMPOO_PARAM_ATOL)
        print(f"{family} W=2 shampoo: {gaps}")
