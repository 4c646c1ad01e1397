"""The plan's pieces against hand-computed schedules and against the code they model:
the step-time simulation, the gathered-buffer peak, Muon's balance (flexshard's own
planner), the FSDP2 layout (torch's fully_shard under the fake backend), the
activation estimate's scaling."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from flexshard.optim.newton_schulz import ns_flops
from flexshard.optim.planner import muon_balance
from flexshard.placements import Owned, Shard
from flexshard.placements.layout import plan_bucket
from flexshard.plan.activations import estimate_activations
from flexshard.plan.buckets import BucketInfo, fsdp2_equivalent
from flexshard.plan.comm import bucket_comm, gather_all_muon, is_muon_matrix, muon_work
from flexshard.plan.hardware import H100, load_hardware, load_profile
from flexshard.plan.memory import gathered_in_flight
from flexshard.plan.opcount import OpCount, OpCounter, count_ops, optimizer_ops, optimizer_step
from flexshard.plan.report import build_stages, planning_config
from flexshard.plan.steptime import BucketCost, _simulate, link, ring_time
from flexshard.plan.world import build_rank, fake_world
from flexshard.trainer.config import load_config
from flexshard.trainer.models.model import meta_model
from flexshard.trainer.parallel.sharding import muon_row_blocks


def bucket(
    name: str, shapes: list[tuple[int, ...]], world: int, placement=None, **kw
) -> BucketInfo:
    placement = placement or Shard(0)
    entries = [(f"{name}.w{i}", s, placement) for i, s in enumerate(shapes)]
    layout = plan_bucket(entries, world, bucket=name)
    fields = dict(
        storage_itemsize=4,
        gather_itemsize=2,
        reduce_itemsize=4,
        replicas=1,
        reshard_after_forward=True,
        is_root=False,
    )
    fields.update(kw)
    return BucketInfo(name, layout, tuple(placement for _ in shapes), **fields)


def test_schedule_by_hand() -> None:
    """root r, blocks a, b; forward times r 1, a 2, b 2; all-gathers r 1, a 3, b 1;
    reduce-scatters 1. Forward: r gathered at 1, a's gather (issued at 1) lands at 4,
    b's (issued at 4) at 5, blocks end at 8, the head at 9. Backward: r re-gathered
    by 10, head backward to 12; flexshard's root does not prefetch in backward, so b
    waits its gather to 13, a's lands at 14 under b's backward (to 17); b's
    reduce-scatter ends at 18, a's backward ends at 21, its reduce-scatter at 22, the
    root's at 23. FSDP2's root prefetches b at 10: one unit less."""
    r = bucket("r", [(4, 4)], 2, is_root=True)
    a, b = bucket("a", [(4, 4)], 2), bucket("b", [(4, 4)], 2)
    order = [r, a, b]
    times = {r: (1.0, 1.0), a: (2.0, 3.0), b: (2.0, 1.0)}  # forward, all-gather
    cost = {id(k): BucketCost(f, 2 * f, g, 1.0) for k, (f, g) in times.items()}
    assert _simulate(order, cost, True, True, root_prefetches=False) == (23.0, 6.0)
    assert _simulate(order, cost, True, True, root_prefetches=True) == (22.0, 5.0)
    # no communication at all: the step is the compute (3 x forward)
    zero = {k: BucketCost(c.forward, c.backward, 0.0, 0.0) for k, c in cost.items()}
    assert _simulate(order, zero, True, True, False) == (15.0, 0.0)
    # copies are on the compute stream: each gather's copy-out (r, a, b in forward;
    # r, b, a again in backward) and each reduce-scatter's copy-in, 0.5 each
    copied = {k: BucketCost(c.forward, c.backward, 0.0, 0.0, 0.5, 0.5) for k, c in cost.items()}
    assert _simulate(order, copied, True, True, False) == (15.0 + 9 * 0.5, 0.0)
    # with no overlap, what the queue ran while compute ran is added back: it carried
    # 13 (6 all-gathers, 3 reduce-scatters), compute sat idle for 8 of them (23 - 15)
    busy = sum(2 * c.all_gather + c.reduce_scatter for c in cost.values())
    span, waited = _simulate(order, cost, True, True, False, overlap=0.0)
    assert busy == 13.0 and waited == 6.0 and span == pytest.approx(23.0 + 13.0 - 8.0)


def test_gathered_peak_by_hand() -> None:
    """Every moment of the schedule by hand: forward of a block (root kept, it and the
    prefetched next), backward of a block (it, the prefetched previous one, its
    gradients in the compute dtype, the reduce-scatter inputs still in flight)."""
    world = 2
    r = bucket("r", [(2, 8)], world, is_root=True, reshard_after_forward=False)
    blocks = [bucket(f"l{i}", [(8 * (i + 1), 8)], world) for i in range(3)]
    peak, detail = gathered_in_flight([r, *blocks])
    g = [b.gathered_bytes for b in blocks]
    grads_l1 = blocks[1].world * blocks[1].shard_numel * 2
    backward_l1 = r.gathered_bytes + g[1] + g[0] + grads_l1 + blocks[2].unsharded_grad_bytes
    forward_l1 = r.gathered_bytes + g[1] + g[2]
    backward_l2 = r.gathered_bytes + g[2] + g[1] + blocks[2].world * blocks[2].shard_numel * 2
    # one reduce-scatter input in flight (MAX_PENDING_REDUCTIONS): l1's, not l2's too
    grads_l0 = blocks[0].world * blocks[0].shard_numel * 2
    backward_l0 = r.gathered_bytes + g[0] + grads_l0 + blocks[1].unsharded_grad_bytes
    assert peak == max(backward_l0, backward_l1, forward_l1, backward_l2)
    assert "backward" in detail


def test_bucket_comm_counts() -> None:
    info = bucket("x", [(17, 5)], 3)  # 17 rows over 3 ranks: 6 per rank, padded
    assert info.shard_numel == 6 * 5
    c = bucket_comm(info, microbatches=2, keep_between_micro=False)
    assert c.all_gathers == 4  # forward and backward of two microbatches
    assert c.all_gather == 4 * 2 * 30 * 2 and c.reduce_scatter == 2 * 30 * 4
    assert c.padding == pytest.approx(1 - 85 / 90)
    pipe = bucket_comm(info, microbatches=4, keep_between_micro=True)
    assert pipe.all_gathers == 1 + 4  # first forward, then each backward


def test_muon_work_matches_the_optimizer_planner() -> None:
    """On the trainer's "muon" buckets the plan's per-rank Newton–Schulz FLOPs are those
    flexshard.optim's planner balanced, with nothing to redistribute; on Shard(0) the
    same matrices must travel."""
    cfg = load_config(
        "configs/debug.toml",
        [
            "--parallelism.placement",
            "muon",
            "--training.optimizer",
            "muon",
            "--model.n_layers",
            "3",
        ],
    )
    cfg = planning_config(cfg)
    _, (buckets,) = build_stages(cfg, 3, 0)
    rows = muon_row_blocks(cfg.model)
    work = muon_work(buckets, rows)
    expected = muon_balance(meta_model(cfg.model), 3, row_blocks=rows)
    assert work.flops == pytest.approx(expected.flops)
    # what the plan splits travels, and nothing else
    split = sum(p.numel for b in buckets for p in b.layout.params if p.fqn in expected.split)
    assert work.all_to_all_bytes == int(2 * split * 2 * 2 / 3 / 3)
    # on Shard(0) every matrix travels whole to one owner: whole-matrix Newton–Schulz
    shard = muon_work(fsdp2_equivalent(buckets))
    assert shard.all_to_all_bytes > 0
    whole = [
        ns_flops(p.shape, 5)
        for b in buckets
        for p in b.layout.params
        if is_muon_matrix(p.fqn, p.shape)
    ]
    assert sum(shard.flops) == pytest.approx(sum(whole))


def test_owned_muon_balance_bound() -> None:
    shapes = [(64, 64), (64, 32), (32, 32), (16, 64), (17, 23)]
    info = bucket("m", shapes, 3, placement=Owned())
    work = muon_work([info])
    assert work.all_to_all_bytes == 0
    costs = [ns_flops(s, 5) for s in shapes]
    assert sum(work.flops) == pytest.approx(sum(costs))
    assert max(work.flops) <= sum(costs) / 3 + max(costs)  # LPT's bound


def test_gather_all_muon_runs_every_matrix_on_every_rank() -> None:
    """The baseline: each rank all-gathers every matrix (bf16, (W - 1) / W of it arrives
    from the others) and runs all of Newton–Schulz; 1-D parameters are not Muon's."""
    shapes = [(64, 64), (17, 23), (40,)]
    info = bucket("m", shapes, 3)
    work = gather_all_muon([info])
    every = ns_flops((64, 64), 5) + ns_flops((17, 23), 5)
    assert work.flops == pytest.approx((every,) * 3)
    assert work.all_to_all_bytes == (64 * 64 * 2 * 2) // 3 + (17 * 23 * 2 * 2) // 3
    assert sum(work.flops) > sum(muon_work([info]).flops)  # DistMuon runs each matrix once


def test_fsdp2_layout_equals_torch_fully_shard() -> None:
    """The FSDP2 column is planned with Shard(0); torch's own fully_shard, built by the
    trainer under the fake backend, pads every parameter the same way."""
    overrides = ["--parallelism.dp_backend", "fsdp2", "--model.ffn_hidden", "17"]
    cfg = load_config("configs/debug.toml", overrides)
    with fake_world(3, 1):
        model = build_rank(cfg, 3, 1).modules[0]
        torch_groups = []
        for module in [*model.layers, model]:
            group = module._get_fsdp_state()._fsdp_param_group
            torch_groups.append(
                sorted(
                    (tuple(p._orig_size), math.prod(p.padded_sharded_param_size))
                    for p in group.fsdp_params
                )
            )
    _, (buckets,) = build_stages(planning_config(cfg), 3, 1)
    ours = []
    for info in fsdp2_equivalent(buckets):
        slots = [max(p.local_numel(r) for r in range(3)) for p in info.layout.params]
        ours.append(sorted((p.shape, s) for p, s in zip(info.layout.params, slots)))
    assert ours[:-1] == torch_groups[:-1] and ours[-1] == torch_groups[-1]


@pytest.mark.slow  # ~10 s of FakeTensorMode tracing on this machine
def test_activations_scale_with_the_microbatch() -> None:
    cfg = load_config("configs/debug.toml", ["--training.seq_len", "128"])
    one, two = estimate_activations(cfg, 1), estimate_activations(cfg, 2)
    assert one.per_block > 0 and one.head > 0
    assert two.per_block == pytest.approx(2 * one.per_block, rel=0.05)


def test_links_and_profiles(tmp_path) -> None:
    assert link(H100, 1, 8)[0] == H100.intra_gbps * 1e9  # one node
    assert link(H100, 8, 2)[0] == H100.inter_gbps * 1e9  # dp ranks a node apart
    assert ring_time(0, 1024, link(H100, 8, 1024)) == 0.0
    assert ring_time(1e9, 2, (1e9, 0.0)) == pytest.approx(1.0)
    path = tmp_path / "hw.json"
    path.write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="missing"):
        load_hardware(str(path))
    with pytest.raises(ValueError, match="h100"):
        load_hardware("b300")
    fitted_profile = load_profile("benchmarks/results/cpu_gloo_profile.json")
    fitted, fitted_host = fitted_profile.hardware, fitted_profile.host
    # calibrated with the W ranks running at once: no further slowdown for sharing cores
    assert fitted_host.cores == 0 and fitted_host.compute_slowdown(4) == 1.0
    shared = dataclasses.replace(fitted_host, cores=2.0)
    assert shared.compute_slowdown(8) == pytest.approx(4.0) and shared.compute_slowdown(1) == 1.0
    assert fitted.op_overhead_us > 0 and fitted.elementwise_gbps > 0 and 0 <= fitted.overlap <= 1
    assert 0 < fitted.attention_tflops < fitted.peak_tflops  # CPU attention: below the GEMMs
    # a profile written before the non-GEMM terms still loads: they default to off
    old = {k: v for k, v in H100.as_dict().items() if k in OLD_FIELDS}
    path.write_text(json.dumps(old))
    assert load_hardware(str(path)).op_overhead_us == 0.0


OLD_FIELDS = (
    "name peak_tflops gemm_efficiency hbm_gbps devices_per_node intra_gbps "
    "intra_latency_us inter_gbps inter_latency_us"
).split()


def _chain(counter) -> None:
    counter.phase = "setup"
    x = torch.randn(17, 9, requires_grad=True)
    counter.phase = "step"
    h = torch.nn.functional.silu(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    (torch.softmax(h @ x.t(), -1) + 1).sum().backward()


def test_op_count_under_fake_tensors_is_the_eager_count() -> None:
    """The counter sees the same ops and bytes on shapes alone as on real tensors; a
    GEMM's bytes are left to its FLOPs, views move none."""
    counter = OpCounter()
    with counter:
        _chain(counter)
    fake = count_ops(_chain)["step"]
    assert fake == counter.counts["step"] and fake.ops > 20
    mm = count_ops(lambda c: torch.randn(17, 9) @ torch.randn(9, 5))
    assert mm["forward"] == OpCount(3, 0)  # two creations (ignored as torch does) and a GEMM


def test_optimizer_count_scales_exactly() -> None:
    """Clipping + AdamW counted on 1 and 2 small parameters and scaled equals the count
    on the real sizes (13 parameters that do not divide anything)."""
    training = load_config("configs/debug.toml").training
    numels = [17 * (i + 1) for i in range(13)]
    scaled = optimizer_ops(numels, training)
    step = optimizer_step(numels, training.lr, training.weight_decay)
    assert count_ops(step)["step"] == scaled


def test_tp_optimizer_steps_dtensors_on_both_backends() -> None:
    """Under TP flexshard's parameters are DTensors too: its optimizer step pays
    DTensor's per-op dispatch as FSDP2's does (the CPU profile's calibrated cost)."""
    import dataclasses

    from flexshard.plan.report import make_plan
    from flexshard.trainer.config import load_config

    cpu = load_profile("benchmarks/results/cpu_gloo_profile.json")
    assert cpu.host.dtensor_op_overhead_us > 0
    cfg = load_config("configs/debug.toml", ["--parallelism.tp", "2"])

    def optimizer_s(host) -> dict[str, float]:
        plan = make_plan(cfg, 4, cpu.hardware, host=host)
        return {b: p["step"]["optimizer_s"] for b, p in plan["backends"].items()}

    with_cost = optimizer_s(cpu.host)
    without = optimizer_s(dataclasses.replace(cpu.host, dtensor_op_overhead_us=0.0))
    for backend in ("flexshard", "fsdp2"):
        assert with_cost[backend] > without[backend], backend
