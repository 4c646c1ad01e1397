"""The plan's activation checkpointing: what a checkpointed block keeps (measured under
fake tensors with the trainer's own ``apply_ac``), the recompute in step time, and
``--suggest`` choosing a mode when only checkpointing fits the memory limit."""

from __future__ import annotations

import pytest

from flexshard.plan.activations import estimate_activations
from flexshard.plan.hardware import H100
from flexshard.plan.recompute import kept_collective_bytes, recompute_parts
from flexshard.plan.report import make_plan
from flexshard.plan.suggest import evaluate, suggest
from flexshard.trainer.config import Config, load_config

DEBUG = "configs/debug.toml"  # dim 64, 2 blocks, seq 64, fp32
MODES = {
    "none": ("none", "op"),
    "full": ("full", "op"),
    "op": ("selective", "op"),
    "every2": ("selective", "2"),
}


def _config(mode: str, *extra: str) -> Config:
    ac_mode, option = MODES[mode]
    return load_config(
        DEBUG,
        [
            "--activation_checkpoint.mode",
            ac_mode,
            "--activation_checkpoint.selective_ac_option",
            option,
            *extra,
        ],
    )


def test_a_fully_checkpointed_block_keeps_its_input_alone() -> None:
    est = {mode: estimate_activations(_config(mode), 4) for mode in MODES}
    cfg = _config("full")
    # the block's input [4, seq, dim] in fp32: all that full recompute saves
    assert est["full"].per_block == 4 * cfg.training.seq_len * cfg.model.dim * 4
    assert est["full"].per_block < est["op"].per_block < est["none"].per_block
    # every 2nd block: the mean of a kept and a recomputed block
    assert est["every2"].per_block == round((est["none"].per_block + est["full"].per_block) / 2)
    # the recompute brings one block's activations back during backward
    assert est["full"].transient > est["none"].transient
    assert {e.head for e in est.values()} == {est["none"].head}


def test_recompute_lengthens_the_backward() -> None:
    assert recompute_parts(_config("none")) == (0.0, 0.0)
    assert recompute_parts(_config("full")) == (1.0, 1.0)
    assert recompute_parts(_config("op")) == (0.0, 1.0)  # matmuls are kept
    assert recompute_parts(_config("every2")) == (0.5, 0.5)
    step = {
        mode: make_plan(_config(mode), 8, H100, None, ("flexshard",))["backends"]["flexshard"]
        for mode in MODES
    }
    compute = {mode: s["step"]["compute_s"] for mode, s in step.items()}
    gemm = {mode: s["step"]["gemm_s"] for mode, s in step.items()}
    assert compute["none"] < compute["op"] < compute["full"]
    assert compute["none"] < compute["every2"] < compute["full"]
    assert gemm["op"] == gemm["none"] < gemm["every2"] < gemm["full"]
    memory = {mode: s["memory"]["activations"] for mode, s in step.items()}
    assert memory["full"] < memory["every2"] < memory["none"]
    assert memory["op"] < memory["none"]


def test_op_level_keeps_tp_collectives_outputs() -> None:
    assert kept_collective_bytes(_config("op"), 4, 4) == 0  # no tp
    tp = _config("op", "--parallelism.tp", "2")
    assert kept_collective_bytes(tp, 4, 4) == 2 * 4 * 64 * 64 * 4
    for mode in ("none", "full", "every2"):  # full recompute runs the TP exchanges again
        assert kept_collective_bytes(_config(mode, "--parallelism.tp", "2"), 4, 4) == 0


def test_suggest_chooses_checkpointing_when_only_it_fits() -> None:
    cfg = _config("none", "--training.batch_size", "16")
    rows = {r["label"]: r for r in evaluate(cfg, 8, H100, 1e9) if "error" not in r}
    full = rows["activation checkpoint full"]["memory_gib"]
    others = [r["memory_gib"] for k, r in rows.items() if "activation" not in k]
    assert full < min(others)
    limit = (full + min(others)) / 2  # fits with recompute only
    text = suggest(cfg, 8, H100, limit)
    assert "suggested: activation checkpoint" in text, text
    assert "no option fits" in suggest(cfg, 8, H100, full / 2)


@pytest.mark.parametrize("option", ["0", "-1", "x", "1.5"])
def test_bad_selective_option_is_one_line(option: str) -> None:
    from flexshard.trainer.config import ConfigError

    with pytest.raises(ConfigError, match="activation_checkpoint.selective_ac_option"):
        load_config(DEBUG, ["--activation_checkpoint.selective_ac_option", option])
