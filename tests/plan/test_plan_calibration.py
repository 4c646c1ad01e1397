"""The CPU profile's op-replay calibration (``flexshard.plan.oprecord``,
``flexshard.plan.calibration``) against the planner's own accounting: it records the
ops ``opcount`` counts, its FLOPs are the ones ``steptime`` divides by the rates, its
fit keeps the timed sum; and the step model times attention at the attention rate. No
timing is asserted."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flexshard.plan.calibration import fit_op_costs, op_rates
from flexshard.plan.hardware import H100
from flexshard.plan.opcount import _model_ops
from flexshard.plan.oprecord import Meta, record_model, recorded_flops
from flexshard.plan.report import build_stages, planning_config
from flexshard.plan.steptime import ATTENTION_BACKWARD, attention_flops, step_time
from flexshard.trainer.config import load_config
from flexshard.trainer.models.model import meta_model

TINY = ["--model.dim", "32", "--model.n_layers", "2", "--training.seq_len", "24"]
TINY += ["--training.batch_size", "3", "--model.ffn_hidden", "40"]


def test_recorder_sees_what_opcount_counts() -> None:
    """Same ops and the same non-GEMM bytes as the planner's counter on one rank's
    unsharded forward + backward (a sequence length and widths that divide nothing)."""
    cfg = load_config("configs/debug.toml", TINY)
    recorder = record_model(cfg)
    counts = _model_ops(cfg.model, cfg.model.n_layers, 3, 24, torch.float32)
    counted = counts["forward"] + counts["backward"]
    assert sum(recorder.counts.values()) == counted.ops
    moved = sum(recorder.counts[k] * call[3] for k, call in recorder.calls.items())
    assert moved == counted.bytes


def test_recorded_flops_are_the_planners() -> None:
    """The GEMMs dispatched (forward + both backward products) are 3 x the planner's
    2 x weights x tokens (embedding excluded); attention's are 3 x its causal count."""
    cfg = load_config("configs/debug.toml", TINY)
    flops = recorded_flops(record_model(cfg))
    tokens, m = 3 * 24, cfg.model
    weights = sum(
        p.numel()
        for name, p in meta_model(cfg.model).named_parameters()
        if p.dim() >= 2 and "tok_embeddings" not in name
    )
    assert flops["gemm"] == 3 * 2 * weights * tokens
    per_layer = 4.0 * m.dim * 24 / 2 * tokens
    assert flops["attention"] == pytest.approx(3 * m.n_layers * per_layer)


def test_weighted_fit_keeps_the_sum() -> None:
    exact = [(c, float(b), 2e-6 + b / 5e9) for c, b in ((3, 0), (5, 4096), (2, 1 << 20))]
    per_op, per_byte = fit_op_costs(exact)
    assert per_op == pytest.approx(2e-6) and per_byte == pytest.approx(1 / 5e9)
    noisy = [(c, b, t * (1.3 if i % 2 else 0.8)) for i, (c, b, t) in enumerate(exact)]
    per_op, per_byte = fit_op_costs(noisy)
    fitted = sum(c * (per_op + per_byte * b) for c, b, _ in noisy)
    assert fitted == pytest.approx(sum(c * t for c, _, t in noisy))


def test_meta_builds_expanded_and_strided_tensors() -> None:
    base = torch.randn(4, 1).expand(4, 6)
    real = Meta(tuple(base.shape), tuple(base.stride()), base.dtype).real()
    assert real.shape == base.shape and real.stride() == base.stride()
    t = torch.randn(5, 7).t()
    real = Meta(tuple(t.shape), tuple(t.stride()), torch.int64).real()
    assert real.stride() == t.stride() and int(real.abs().sum()) == 0  # valid indices


@pytest.mark.slow  # times ~100 distinct ops a few times each
def test_every_recorded_op_replays() -> None:
    rates, detail = op_rates([load_config("configs/debug.toml", TINY)], reps=1)
    assert detail["failed"] == []
    assert all(v > 0 for v in rates.values())


def test_attention_is_timed_at_its_own_rate() -> None:
    """Halving the attention rate adds exactly the attention FLOPs (forward, and
    ATTENTION_BACKWARD times them in backward) over it to the compute."""
    cfg = planning_config(load_config("configs/debug.toml", TINY))
    dims, (buckets,) = build_stages(cfg, 2, 0)
    fast = dataclasses.replace(H100, attention_tflops=100.0)
    slow = dataclasses.replace(H100, attention_tflops=50.0)
    a = step_time(cfg, dims, buckets, fast, None, "flexshard")
    b = step_time(cfg, dims, buckets, slow, None, "flexshard")
    tokens = cfg.training.batch_size * cfg.training.seq_len
    passes = 1 + ATTENTION_BACKWARD
    extra = sum(passes * attention_flops(x, cfg, tokens) for x in buckets)
    extra *= 1 / 50e12 - 1 / 100e12
    assert extra > 0
    assert b.compute_s - a.compute_s == pytest.approx(extra, rel=1e-9)
