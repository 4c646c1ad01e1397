"""The effects the planner models for published runs, each term on its own: the MoE
layers' token movement, their all-to-all rerun by a recompute and their experts'
grouped GEMMs below a dense GEMM's rate, ring attention's fp32 merges, FSDP's Float8
all-gather, loss parallel's sharded head, torchtitan's op-level checkpoint policy, and
a pipeline's gradient reduction after its last backward and sends per virtual stage."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flexshard.plan.cli import main
from flexshard.plan.hardware import H100
from flexshard.plan.report import activation_timeline, build_stages, planning_config
from flexshard.plan.steptime import (
    ROUTED_ELEMENTS_BACKWARD,
    ROUTED_ELEMENTS_FORWARD,
    BucketCost,
    _other_collectives,
    bucket_costs,
    bucket_flops,
    expert_flops,
    gathered_share,
    link,
    reduce_after_pipeline_backward,
    ring_merge_bytes,
    ring_time,
    routed_copies,
    step_time,
)
from flexshard.plan.techniques import Techniques, float8_scale_bytes
from flexshard.plan.timeline import measure_timeline
from flexshard.trainer.config import ModelConfig, load_config

MOE = ["--parallelism.ep", "2", "--model.n_layers", "3", "--training.mixed_precision", "bf16"]


def _moe(*extra: str):  # type: ignore[no-untyped-def]
    cfg = planning_config(load_config("configs/moe_debug.toml", [*MOE, *extra]))
    dims, (buckets,) = build_stages(cfg, 4, 0)
    return cfg, dims, buckets


def test_routed_tokens_move_in_expert_buckets_only() -> None:
    cfg, _, buckets = _moe()
    tokens = 512
    experts = [b for b in buckets if any(len(p.shape) == 3 for p in b.layout.params)]
    assert len(experts) == 2  # layers 1 and 2 (the first is dense)
    per_layer = tokens * cfg.model.moe.top_k * cfg.model.dim * 2  # bf16
    for b in buckets:
        expected = (
            (ROUTED_ELEMENTS_FORWARD * per_layer, ROUTED_ELEMENTS_BACKWARD * per_layer)
            if b in experts
            else (0.0, 0.0)
        )
        assert routed_copies(b, cfg, tokens) == expected, b.name


def test_a_block_recompute_reruns_the_expert_all_to_all() -> None:
    plain, dims, _ = _moe()
    full, _, _ = _moe("--activation_checkpoint.mode", "full")
    op, _, _ = _moe("--activation_checkpoint.mode", "selective")
    none = _other_collectives(plain, dims, H100, 512)
    assert none > 0
    assert _other_collectives(full, dims, H100, 512) == pytest.approx(1.5 * none)
    # op-level checkpointing keeps the all-to-all's output
    assert _other_collectives(op, dims, H100, 512) == pytest.approx(none)


def test_h100_grouped_gemm_share_is_torchaos_published_benchmark() -> None:
    # pytorch/ao PR 2490 (bench_grouped_mm.py, H100, bf16 torch._grouped_mm): 8,192 tokens
    # x 5,120 x 8,192 over 16 experts in 1.31 ms and 1.26 ms, against 989 TFLOP/s
    flops = 2 * 8192 * 5120 * 8192
    shares = [flops / seconds / 989e12 for seconds in (1.31e-3, 1.26e-3)]
    assert H100.grouped_gemm_efficiency == round(sum(shares) / len(shares), 2)
    assert H100.grouped_gemm_efficiency < H100.gemm_efficiency
    plain = dataclasses.replace(H100, grouped_gemm_efficiency=0.0)  # 0: the GEMMs' rate
    assert plain.grouped_gemm_flops_per_s() == plain.gemm_flops_per_s()


def test_routed_experts_run_at_the_grouped_gemm_rate() -> None:
    """Only the expert stacks' top_k FLOPs move to the grouped rate: forward once,
    backward twice, and again in a full recompute; every other bucket is unchanged."""
    cfg, dims, buckets = _moe("--activation_checkpoint.mode", "full")
    tokens = 512
    dense = dataclasses.replace(H100, grouped_gemm_efficiency=H100.gemm_efficiency)
    slow, fast = (bucket_costs(cfg, dims, buckets, hw, tokens) for hw in (H100, dense))
    moe = cfg.model.moe
    stacks = 0
    for b in buckets:
        routed = expert_flops(b, cfg, tokens)
        assert routed <= bucket_flops(b, cfg, tokens)
        extra = routed / H100.grouped_gemm_flops_per_s() - routed / H100.gemm_flops_per_s()
        assert slow[id(b)].forward - fast[id(b)].forward == pytest.approx(extra, abs=1e-15)
        # backward: its two GEMMs and the recompute's forward
        assert slow[id(b)].backward - fast[id(b)].backward == pytest.approx(3 * extra, abs=1e-15)
        for p in b.layout.params:
            if len(p.shape) == 3:
                stacks += 1
                assert routed >= 2.0 * p.shape[-2] * p.shape[-1] * moe.top_k * tokens
    assert stacks == 6  # w1, w2, w3 of the two MoE layers


def test_float8_all_gather_halves_the_linears_bytes() -> None:
    # the weight arrives cast: forward scales the input alone, backward transposes the
    # fp8 weight (2 B per element) beside the input's and the gradient's work
    assert float8_scale_bytes(10, 3, 4, compiled=True, weight_gathered_fp8=True) == (
        3 * 40,
        1 * 40 + 2 * 12 + 4 * 30,
    )
    _, _, buckets = _moe()
    block = next(b for b in buckets if b.name == "layers.0")
    total = sum(math.prod(p.shape) for p in block.layout.params)
    linear = sum(math.prod(p.shape) for p in block.layout.params if len(p.shape) == 2)
    on = Techniques(float8=True, float8_all_gather=True)
    assert gathered_share(block, on) == pytest.approx(1 - linear / total / 2)
    assert gathered_share(block, Techniques(float8=True)) == 1.0
    root = next(b for b in buckets if b.is_root)
    assert gathered_share(root, on) == 1.0  # the embedding and LM head stay bf16
    with pytest.raises(ValueError, match="float8_all_gather"):
        Techniques(float8_all_gather=True)


def test_cli_refuses_a_float8_all_gather_without_float8(capsys) -> None:
    assert main(["configs/debug.toml", "--world", "2", "--float8-all-gather"]) == 2
    assert "--float8-all-gather) needs float8 (--float8)" in capsys.readouterr().err


def test_loss_parallel_shards_the_head_over_tp() -> None:
    cfg = planning_config(load_config("configs/debug.toml", ["--parallelism.tp", "2"]))
    whole = activation_timeline(cfg, 2)
    sharded = activation_timeline(cfg, 2, Techniques(loss_parallel=True))
    assert sharded.head_rest == round(whole.head_rest / 2)
    assert sharded.per_block == whole.per_block


def test_torchtitans_op_policy_keeps_half_the_matmuls() -> None:
    model = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=1, ffn_hidden=896)
    kept = {
        ac: measure_timeline(model, 2, 128, torch.bfloat16, ac).per_block
        for ac in ("full", "op_every_second_mm", "op")
    }
    assert kept["full"] < kept["op_every_second_mm"] < kept["op"]
    # of the 7 matmuls (q, k, v, o, w1, w3, w2) torchtitan recomputes k, o and w3:
    # 64 + 256 + 896 of every token's 2,688 matmul outputs
    dropped = 2 * 128 * (64 + 256 + 896) * 2
    assert kept["op"] - kept["op_every_second_mm"] == dropped


PIPELINE = ["--model.n_layers", "4", "--parallelism.pp", "2", "--training.batch_size", "4"]


def _pipeline(*extra: str):  # type: ignore[no-untyped-def]
    cfg = planning_config(load_config("configs/debug.toml", [*PIPELINE, *extra]))
    dims, stages = build_stages(cfg, 6, None)  # dp 3 per stage
    return cfg, dims, stages


def test_a_pipeline_stage_reduces_after_its_last_backward() -> None:
    """torch's pipelining reduces a stage's gradients only once its last microbatch's
    backward is done: each copy-in, then the reduce-scatters one after another."""
    one, two = object(), object()
    cost = {
        id(one): BucketCost(0, 0, 0, reduce_scatter=3.0, reduce_copy=1.0),
        id(two): BucketCost(0, 0, 0, reduce_scatter=5.0, reduce_copy=2.0),
    }
    # backward order: two (copy 2, reduce 2..7), then one (copy 2..3, reduce 7..10)
    assert reduce_after_pipeline_backward([one, two], cost) == 10.0  # type: ignore[list-item]
    cfg, dims, stages = _pipeline()
    for buckets in stages:
        costs = bucket_costs(cfg, dims, buckets, H100, 2 * cfg.training.seq_len)
        after = reduce_after_pipeline_backward(buckets, costs)
        assert after >= sum(costs[id(b)].reduce_scatter for b in buckets) > 0
        # none of it hides behind backward compute: the stage's exposed time holds all of it
        step = step_time(cfg, dims, buckets, H100, None, "flexshard")
        assert step.exposed_dp_s >= after - sum(costs[id(b)].reduce_copy for b in buckets)


def test_interleaved_stages_send_per_virtual_stage() -> None:
    """A rank with v virtual stages sends and receives a microbatch's activations v times
    each way: only the pipeline term of the other collectives grows, by v."""
    flat, dims, _ = _pipeline("--parallelism.pp_microbatches", "2")
    looped, looped_dims, _ = _pipeline(
        "--parallelism.pp_schedule", "interleaved_1f1b", "--parallelism.pp_virtual_stages", "2",
        "--parallelism.pp_microbatches", "2",
    )  # fmt: skip
    tokens = 2 * flat.training.seq_len
    hidden = tokens * flat.model.dim * 4  # fp32
    one_send = ring_time(hidden / dims.tp, 2, link(H100, dims.world_size // dims.pp, 2))
    extra = _other_collectives(looped, looped_dims, H100, tokens) - _other_collectives(
        flat, dims, H100, tokens
    )
    assert one_send > 0 and extra == pytest.approx(2 * one_send)


def _cp(*extra: str):  # type: ignore[no-untyped-def]
    overrides = [
        "--parallelism.cp",
        "3",
        "--training.seq_len",
        "96",
        "--training.mixed_precision",
        "bf16",
    ]
    overrides += extra
    cfg = planning_config(load_config("configs/debug.toml", overrides))
    dims, (buckets,) = build_stages(cfg, 3, 0)
    return cfg, dims, buckets


def test_ring_attention_merges_each_step_in_fp32() -> None:
    """torch's ring attention (``cp_method = "ring"``) merges cp - 1 partial outputs per
    attention layer into fp32 and copies keys and values into send buffers: bytes per
    query element 38 forward, 10 backward, per key / value element 4 and 22 (bf16)."""
    ring, dims, buckets = _cp("--parallelism.cp_method", "ring")
    gathered, _, _ = _cp()
    tokens = ring.training.seq_len // dims.cp
    m = ring.model
    query = tokens * m.n_heads * m.head_size()
    kv = 2 * tokens * m.n_kv_heads * m.head_size()
    attention_buckets = 0
    for b in buckets:
        layers = sum(p.fqn.endswith("attention.wq.weight") for p in b.layout.params)
        attention_buckets += layers > 0
        expected = (2 * layers * (38 * query + 4 * kv), 2 * layers * (10 * query + 22 * kv))
        assert ring_merge_bytes(b, ring, dims, tokens) == pytest.approx(expected), b.name
        assert ring_merge_bytes(b, gathered, dims, tokens) == (0.0, 0.0)
    assert attention_buckets == ring.model.n_layers
    one, one_dims, one_buckets = _cp("--parallelism.cp", "1", "--parallelism.cp_method", "ring")
    assert all(ring_merge_bytes(b, one, one_dims, tokens) == (0.0, 0.0) for b in one_buckets)


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_the_ring_merges_are_compute_rerun_with_attention(ac: str) -> None:
    """The merges join each attention bucket's forward and backward; a full recompute
    runs them again, an op-level policy (which keeps attention's output) does not."""
    ring, dims, buckets = _cp("--parallelism.cp_method", "ring", "--activation_checkpoint.mode", ac)
    gathered, _, _ = _cp("--activation_checkpoint.mode", ac)
    tokens = ring.training.seq_len // dims.cp
    with_ring = bucket_costs(ring, dims, buckets, H100, tokens)
    without = bucket_costs(gathered, dims, buckets, H100, tokens)
    for b in buckets:
        fwd, bwd = (H100.non_gemm_s(0, x) for x in ring_merge_bytes(b, ring, dims, tokens))
        rerun = fwd if ac == "full" else 0.0
        assert with_ring[id(b)].forward - without[id(b)].forward == pytest.approx(fwd, abs=1e-15)
        assert with_ring[id(b)].backward - without[id(b)].backward == pytest.approx(
            bwd + rerun, abs=1e-15
        )
