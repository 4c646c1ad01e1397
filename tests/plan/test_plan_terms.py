"""The step-time model's CPU terms beyond GEMMs, non-GEMM ops and the collectives'
wire time (``docs/planning.md``): blocking collectives, the eager cost per op, the
runtimes' cost per parameter, contention. Each changes the prediction by exactly
what it should, on hand-made schedules or a planned rank; no timing is asserted."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flexshard.plan.calibration import tiny_config
from flexshard.plan.hardware import H100, Hardware, Profile, load_profile
from flexshard.plan.host_costs import NO_HOST_COSTS, HostCosts
from flexshard.plan.opcount import model_ops
from flexshard.plan.oprecord import record_model
from flexshard.plan.report import build_stages, planning_config
from flexshard.plan.steptime import BucketCost, _simulate, step_time
from flexshard.trainer.config import load_config

from .test_plan_model import bucket

TINY = ["--model.dim", "32", "--model.n_layers", "2", "--training.seq_len", "24"]
TINY += ["--training.batch_size", "3", "--model.ffn_hidden", "40"]
#: a CPU-like device: every term on, no stream overlap (its host costs: per test)
CPU = dataclasses.replace(
    H100,
    name="cpu-like",
    peak_tflops=0.05,
    attention_tflops=0.02,
    op_overhead_us=5.0,
    elementwise_gbps=30.0,
    copy_gbps=20.0,
    intra_gbps=0.5,
    inter_gbps=0.5,
    collective_overhead_us=300.0,
    reduce_scatter_gbps=0.3,
    overlap=0.5,
    blocking_collectives=True,
)


def _order():  # type: ignore[no-untyped-def]
    r = bucket("r", [(4, 4)], 2, is_root=True)
    a, b = bucket("a", [(4, 4)], 2), bucket("b", [(4, 4)], 2)
    times = {r: (1.0, 1.0), a: (2.0, 3.0), b: (2.0, 1.0)}  # forward, all-gather
    cost = {id(k): BucketCost(f, 2 * f, g, 1.0, 0.5, 0.25) for k, (f, g) in times.items()}
    return [r, a, b], cost


def test_blocking_collectives_hide_nothing() -> None:
    """Waited for at launch, every collective adds its whole time: compute 15, copies
    6 x 0.5 out (r, a, b; again in backward) + 3 x 0.25 in, all-gathers 2 x (1 + 3 +
    1) (root re-gathered), 3 reduce-scatters of 1; whatever ``overlap`` says and
    whoever prefetches."""
    order, cost = _order()
    serial = 15.0 + 6 * 0.5 + 3 * 0.25 + 2 * 5.0 + 3 * 1.0
    for overlap in (0.0, 0.5, 1.0):
        for prefetch in (False, True):
            span, waited = _simulate(order, cost, True, True, prefetch, overlap, blocking=True)
            assert span == pytest.approx(serial) and waited == pytest.approx(10.0)
    # with streams and full overlap the prefetches hide some of it
    span, _ = _simulate(order, cost, True, True, False, 1.0)
    assert span < serial
    # flexshard on CPU leaves forward's block prefetch in flight: with full overlap it
    # hides behind compute; with none it costs what it did while blocking
    kept = {"blocking": True, "forward_prefetch_blocks": False}
    hidden, _ = _simulate(order, cost, True, True, False, 1.0, **kept)
    assert hidden < serial
    exposed, _ = _simulate(order, cost, True, True, False, 0.0, **kept)
    assert exposed == pytest.approx(serial)


def _plan(  # type: ignore[no-untyped-def]
    hw: Hardware, backend: str = "flexshard", host: HostCosts = NO_HOST_COSTS
):
    cfg = planning_config(load_config("configs/debug.toml", TINY))
    dims, (buckets,) = build_stages(cfg, 2, 0)
    if backend == "fsdp2":
        from flexshard.plan.buckets import fsdp2_equivalent

        buckets = fsdp2_equivalent(buckets)
    return cfg, buckets, step_time(cfg, dims, buckets, hw, None, backend, host)


def test_eager_cost_is_per_forward_and_backward_op() -> None:
    """``eager_op_us`` adds that much per op of every block's and the head's forward
    and backward to the compute (not to the optimizer step)."""
    cfg, _, base = _plan(CPU)
    _, _, eager = _plan(CPU, host=HostCosts(eager_op_us=7.0))
    t = cfg.training
    ops = model_ops(cfg, t.batch_size)
    layers = cfg.model.n_layers
    count = layers * (ops.block_forward.ops + ops.block_backward.ops)
    count += ops.head_forward.ops + ops.head_backward.ops
    assert eager.compute_s - base.compute_s == pytest.approx(count * 7e-6, rel=1e-3)
    assert eager.optimizer_s == base.optimizer_s


@pytest.mark.parametrize("backend", ["flexshard", "fsdp2"])
def test_runtime_cost_per_parameter_gathered_and_reduced(backend: str) -> None:
    """Per parameter and all-gather (forward, and backward where a bucket resharded
    after forward) and per parameter reduced, on the compute stream; the other
    backend's constants change nothing."""
    other = "fsdp2" if backend == "flexshard" else "flexshard"
    _, buckets, base = _plan(CPU, backend)
    gather = HostCosts(**{f"{backend}_gather_param_us": 100.0})
    _, _, g = _plan(CPU, backend, gather)
    gathers = sum(len(b.layout.params) * (1 + b.reshard_after_forward) for b in buckets)
    reduced = sum(len(b.layout.params) for b in buckets)
    # the measured cost replaces the copies' per-parameter op cost
    per_op = CPU.op_overhead_us * 1e-6
    assert g.copy_s - base.copy_s == pytest.approx(gathers * (100e-6 - per_op), rel=1e-6)
    assert g.step_s - base.step_s == pytest.approx(g.copy_s - base.copy_s, rel=1e-6)
    reduce = HostCosts(**{f"{backend}_reduce_param_us": 100.0})
    _, _, r = _plan(CPU, backend, reduce)
    assert r.copy_s - base.copy_s == pytest.approx(reduced * (100e-6 - per_op), rel=1e-6)
    _, _, untouched = _plan(CPU, backend, HostCosts(**{f"{other}_gather_param_us": 100.0}))
    assert untouched.step_s == base.step_s
    with pytest.raises(ValueError, match="backend"):
        NO_HOST_COSTS.runtime_param_s("ddp", "gather")


def test_contention_scales_what_is_timed_op_by_op() -> None:
    """``contention`` multiplies GEMMs, non-GEMM ops, copies' bandwidth and the
    optimizer step; the eager and runtime costs (timed end to end with all ranks
    at once) and the collectives stay."""
    terms = dict(eager_op_us=3.0, flexshard_gather_param_us=50.0, flexshard_reduce_param_us=40.0)
    one = HostCosts(**terms)
    _, buckets, a = _plan(CPU, host=one)
    _, _, b = _plan(CPU, host=dataclasses.replace(one, contention=2.0))
    assert b.gemm_s == pytest.approx(2 * a.gemm_s)
    assert b.optimizer_s == pytest.approx(2 * a.optimizer_s)
    _, _, no_eager = _plan(CPU, host=dataclasses.replace(one, eager_op_us=0.0))
    eager = a.compute_s - no_eager.compute_s
    assert b.compute_s == pytest.approx(2 * (a.compute_s - eager) + eager)
    gathers = sum(len(b.layout.params) * (1 + b.reshard_after_forward) for b in buckets)
    runtime = gathers * 50e-6 + sum(len(b.layout.params) for b in buckets) * 40e-6
    assert b.copy_s == pytest.approx(runtime + 2 * (a.copy_s - runtime))
    # with streams (and overlap) the prefetched all-gathers hide behind compute
    streams = dataclasses.replace(CPU, blocking_collectives=False, overlap=1.0)
    assert _plan(streams, host=one)[2].step_s < a.step_s


def test_collective_wait_is_per_call() -> None:
    """``collective_wait_us`` is added to every data-parallel collective call: with
    blocking collectives, calls x wait on the step (all-gathers forward and where a
    bucket resharded again in backward, one reduce-scatter per bucket; FSDP2 on CPU,
    whose forward prefetches and reduce-scatters block too, so compute hides none)."""
    _, buckets, base = _plan(CPU, "fsdp2")
    _, _, waited = _plan(CPU, "fsdp2", HostCosts(collective_wait_us=500.0))
    calls = sum(2 + b.reshard_after_forward for b in buckets)
    assert waited.step_s - base.step_s == pytest.approx(calls * 500e-6, rel=1e-6)
    assert waited.compute_s == base.compute_s


def test_gpu_profiles_leave_the_new_terms_off() -> None:
    for profile in (load_profile("h100"), load_profile("h200")):
        hw, host = profile.hardware, profile.host
        assert not hw.blocking_collectives and host.contention == 1.0 and host.eager_op_us == 0.0
        assert host.collective_wait_us == 0.0
        for backend in ("flexshard", "fsdp2"):
            assert host.runtime_param_s(backend, "gather") == host.runtime_param_s(
                backend, "reduce"
            )
            assert host.runtime_param_s(backend, "gather") == 0.0


def test_profile_json_round_trip(tmp_path) -> None:
    hw = dataclasses.replace(CPU, blocking_collectives=True)
    profile = Profile(hw, HostCosts(contention=1.5, eager_op_us=2.0))
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(profile.as_dict()))
    assert load_profile(str(path)) == profile


def test_host_costs_live_in_their_own_section(tmp_path) -> None:
    """A profile file keeps the host's costs under "host_costs": one at the top level
    is refused naming the section, as is an unknown field inside it; a file without
    the section has none (the GPU profiles' host)."""
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**CPU.as_dict(), "contention": 1.5}))
    with pytest.raises(ValueError, match="host_costs"):
        load_profile(str(path))
    path.write_text(json.dumps({**CPU.as_dict(), "host_costs": {"cores": 2, "turbo": 1}}))
    with pytest.raises(ValueError, match="turbo"):
        load_profile(str(path))
    path.write_text(json.dumps(CPU.as_dict()))
    assert load_profile(str(path)) == Profile(CPU, NO_HOST_COSTS)


def test_tiny_model_dispatches_the_same_ops() -> None:
    """The eager and runtime costs are measured on a tiny-width copy of the model:
    the same op sequence (count), the same layers and heads."""
    cfg = load_config("configs/debug.toml", ["--training.seq_len", "24"])
    tiny = tiny_config(cfg, "fsdp2")
    assert tiny.model.n_layers == cfg.model.n_layers and tiny.model.n_heads == cfg.model.n_heads
    assert tiny.parallelism.dp_backend == "fsdp2" and tiny.model.dim < cfg.model.dim
    full, small = record_model(cfg), record_model(tiny)
    assert sum(full.counts.values()) == sum(small.counts.values())


def _runtime_costs_rank(rank: int, world: int) -> dict:
    from flexshard.plan.calibration import runtime_costs

    cfg = load_config("configs/debug.toml", ["--training.seq_len", "16", "--job.progress", "false"])
    cfg.job.dump_folder = f"/tmp/flexshard_test_plan_terms/{world}"
    return runtime_costs(cfg, world, contention=1.0)


def test_runtime_costs_on_two_ranks() -> None:
    """The runtime micro-benchmark on 2 gloo ranks: every constant comes out finite and
    >= 0, and the collectives it subtracts are the runtime's own calls (one all-gather
    per bucket in forward, and in backward for each bucket that resharded; one
    reduce-scatter per bucket; both re-gather the root: the trainer passes
    reshard_after_forward = true to FSDP2's root too, and torch then reshards it)."""
    from flexshard.testing import run_distributed

    cfg = load_config("configs/debug.toml")
    buckets = cfg.model.n_layers + 1  # a bucket per block and the root
    for out in run_distributed(_runtime_costs_rank, 2, timeout=240):
        keys = ("eager_op_us", "flexshard_gather_param_us", "fsdp2_reduce_param_us")
        for key in (*keys, "collective_wait_us"):
            assert 0.0 <= out[key] < 1e5
        per_bucket_flex = out["flexshard_calls"][0] / buckets
        assert out["flexshard_calls"] == pytest.approx(
            (buckets * per_bucket_flex, buckets * per_bucket_flex, buckets * per_bucket_flex)
        )
        per_bucket_fsdp = out["fsdp2_calls"][0] / buckets
        assert out["fsdp2_calls"] == pytest.approx(
            (buckets * per_bucket_fsdp, buckets * per_bucket_fsdp, buckets * per_bucket_fsdp)
        )
    # the planner's FSDP2 layout re-gathers the root as well
    from flexshard.plan.buckets import fsdp2_equivalent

    _, (planned,) = build_stages(planning_config(cfg), 2, 0)
    assert all(b.reshard_after_forward for b in fsdp2_equivalent(planned))
