"""Step time from the runtime's schedule: compute per bucket from its parameters'
FLOPs, collectives from their bytes and a ring's cost (latency per step + bytes over
the link's bandwidth) on one communication queue per rank, overlapped exactly as the
hooks overlap them: in forward, the next bucket's all-gather is issued when a bucket
starts (prefetch depth 1); in backward, the previous one's, a bucket's reduce-scatter
is issued when its gradients are complete and the oldest is waited for once more
than ``MAX_PENDING_REDUCTIONS`` are in flight; the end of backward waits for all.
What compute does not cover is exposed communication."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexshard.runtime.hooks import MAX_PENDING_REDUCTIONS
from flexshard.trainer.config import Config
from flexshard.trainer.parallel import ParallelDims

from .buckets import BucketInfo
from .comm import MatrixWork
from .hardware import Hardware

#: AdamW's step reads and writes param, grad and two fp32 moments: ~28 bytes per element
ADAMW_BYTES = 28
MUON_BYTES = 20  # one momentum buffer


@dataclass
class StepTime:
    step_s: float
    compute_s: float  # forward + backward (+ pipeline bubble) on the busiest path
    optimizer_s: float
    exposed_dp_s: float  # data-parallel all-gather / reduce-scatter not hidden by compute
    exposed_other_s: float  # tp / cp / ep / pp collectives (on the critical path)
    exposed_all_gather_s: float  # of exposed_dp_s, the part spent waiting on all-gathers
    tokens_per_s_per_device: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def link(hw: Hardware, stride: int, size: int) -> tuple[float, float]:
    """(bytes/s, seconds per ring step) of a group of ``size`` ranks ``stride`` apart."""
    if size * stride <= hw.devices_per_node:
        return hw.intra_gbps * 1e9, hw.intra_latency_us * 1e-6
    return hw.inter_gbps * 1e9, hw.inter_latency_us * 1e-6


def ring_time(sent: float, ranks: int, bw_lat: tuple[float, float]) -> float:
    if ranks <= 1 or sent <= 0:
        return 0.0
    bw, lat = bw_lat
    return (ranks - 1) * lat + sent / bw


def bucket_flops(info: BucketInfo, cfg: Config, tokens: int) -> float:
    """Forward FLOPs of a bucket's parameters over ``tokens`` tokens: 2 per weight that
    a token touches (a routed expert stack only top_k of its experts; the embedding
    none), plus causal attention's 4 * dim * seq per token for an attention bucket."""
    m = cfg.model
    flops = 0.0
    for param in info.layout.params:
        if param.fqn.endswith("tok_embeddings.weight") or len(param.shape) < 2:
            continue
        per_token = math.prod(param.shape)
        if len(param.shape) == 3:  # [experts, R, C]: top_k experts per token, over all EP ranks
            per_token = param.shape[-2] * param.shape[-1] * m.moe.top_k
        flops += 2.0 * per_token * tokens
        if param.fqn.endswith("attention.wq.weight"):
            # causal: each query meets seq/2 keys on average (flash attention skips the rest)
            flops += 4.0 * param.shape[0] * cfg.training.seq_len / 2 * tokens
    return flops


def _simulate(
    order: list[BucketInfo],
    fwd: dict[int, float],
    ag: dict[int, float],
    rs: dict[int, float],
    gather: bool,
    reduce: bool,
    root_prefetches: bool,
) -> tuple[float, float]:
    """One microbatch's forward (all-gathers when ``gather``) and backward (re-gathers
    what forward resharded); returns (time, time spent waiting on all-gathers)."""
    root = [b for b in order if b.is_root]
    blocks = [b for b in order if not b.is_root]
    t = comm = waited = 0.0
    done: dict[int, float] = {}

    def issue(b: BucketInfo, at: float, cost: float) -> float:
        nonlocal comm
        comm = max(at, comm) + cost
        return comm

    def wait(until: float) -> None:
        nonlocal t, waited
        if until > t:
            waited += until - t
            t = until

    for b in root:
        if gather:
            wait(issue(b, t, ag[id(b)]))
    if blocks and gather:
        done[id(blocks[0])] = issue(blocks[0], t, ag[id(blocks[0])])
    for i, b in enumerate(blocks):
        wait(done.get(id(b), t))
        if i + 1 < len(blocks) and gather:
            done[id(blocks[i + 1])] = issue(blocks[i + 1], t, ag[id(blocks[i + 1])])
        t += fwd[id(b)]
    t += sum(fwd[id(b)] for b in root)
    # backward: the root (LM head) first, then the blocks in reverse
    done = {}
    back = list(reversed(blocks))
    for b in root:
        if b.reshard_after_forward:
            wait(issue(b, t, ag[id(b)]))
    # FSDP2's root prefetches the last block before its own backward; flexshard's
    # root comes first in the forward order and has nothing before it to prefetch
    if back and root_prefetches and back[0].reshard_after_forward:
        done[id(back[0])] = issue(back[0], t, ag[id(back[0])])
    t += sum(2 * fwd[id(b)] for b in root)
    pending: list[float] = []
    for i, b in enumerate(back):
        if b.reshard_after_forward:
            wait(done.get(id(b)) or issue(b, t, ag[id(b)]))
        if i + 1 < len(back) and back[i + 1].reshard_after_forward:
            done[id(back[i + 1])] = issue(back[i + 1], t, ag[id(back[i + 1])])
        t += 2 * fwd[id(b)]
        if reduce:
            pending.append(issue(b, t, rs[id(b)]))
            if len(pending) > MAX_PENDING_REDUCTIONS:
                t = max(t, pending.pop(0))
    if reduce:
        for b in root:
            pending.append(issue(b, t, rs[id(b)]))
        t = max([t, *pending])
    return t, waited


def step_time(
    cfg: Config,
    dims: ParallelDims,
    buckets: list[BucketInfo],
    hw: Hardware,
    muon: MatrixWork | None,
    backend: str,
) -> StepTime:
    t, par = cfg.training, cfg.parallelism
    micro = par.pp_microbatches or dims.pp if dims.pp > 1 else t.grad_accum
    seqs = t.batch_size // micro if dims.pp > 1 else t.batch_size
    tokens = seqs * t.seq_len // dims.cp  # per rank per microbatch
    per_node = min(dims.world_size, hw.devices_per_node)
    rate = hw.peak_tflops * 1e12 * hw.gemm_efficiency / hw.compute_slowdown(per_node)
    fwd = {id(b): bucket_flops(b, cfg, tokens) / rate for b in buckets}
    ag, rs = {}, {}
    for b in buckets:
        # EP's expert buckets shard over dp_shard_mod_ep: ranks tp * ep apart
        experts = b.world != dims.dp_shard * dims.cp
        dp_link = link(hw, dims.tp * (dims.ep if experts else 1), b.world)
        ag[id(b)] = ring_time((b.world - 1) * b.shard_numel * b.gather_itemsize, b.world, dp_link)
        rs_bytes = (b.world - 1) * b.shard_numel * b.reduce_itemsize
        rs[id(b)] = ring_time(rs_bytes, b.world, dp_link)
        if b.replicas > 1:  # HSDP: the all-reduce over replicas follows on the same queue
            rep = link(hw, dims.tp * dims.dp_shard * dims.cp, b.replicas)
            ar = 2 * (b.replicas - 1) * b.shard_numel * b.reduce_itemsize / b.replicas
            rs[id(b)] += ring_time(ar, b.replicas, rep)
        if b.layout.replicated:
            ag[id(b)] = 0.0
            rs[id(b)] = ring_time(
                2 * (b.world - 1) * b.numel * b.reduce_itemsize / b.world, b.world, dp_link
            )
    root_prefetches = backend == "fsdp2"
    compute_micro = 3 * sum(fwd.values())
    keep = dims.pp > 1  # stages stay gathered after backward until the last microbatch
    total, waited = 0.0, 0.0
    for i in range(micro):
        gather = not keep or i == 0
        span, w = _simulate(buckets, fwd, ag, rs, gather, i == micro - 1, root_prefetches)
        total += span
        waited += w
    bubble = (dims.pp - 1) / par.pp_virtual_stages * compute_micro if dims.pp > 1 else 0.0
    other = _other_collectives(cfg, dims, hw, tokens) * micro
    compute = compute_micro * micro + bubble
    exposed_dp = total - compute_micro * micro
    optimizer = _optimizer_time(cfg, buckets, hw, muon, link(hw, dims.tp, dims.dp_shard), rate)
    step = total + bubble + other + optimizer
    global_tokens = dims.dp_size * t.batch_size * t.grad_accum * t.seq_len
    return StepTime(
        step_s=step,
        compute_s=compute,
        optimizer_s=optimizer,
        exposed_dp_s=max(0.0, exposed_dp),
        exposed_other_s=other,
        exposed_all_gather_s=waited,
        tokens_per_s_per_device=global_tokens / step / dims.world_size,
    )


def _optimizer_time(
    cfg: Config,
    buckets: list[BucketInfo],
    hw: Hardware,
    muon: MatrixWork | None,
    dp_link: tuple[float, float],
    rate: float,
) -> float:
    elements = sum(b.shard_numel for b in buckets)
    slowdown = hw.compute_slowdown(min(max(b.world for b in buckets), hw.devices_per_node))
    if cfg.training.optimizer != "muon" or muon is None:
        return elements * ADAMW_BYTES / (hw.hbm_gbps * 1e9) * slowdown
    world = len(muon.flops)
    a2a = ring_time(muon.all_to_all_bytes, world, dp_link) if muon.all_to_all_bytes else 0.0
    return elements * MUON_BYTES / (hw.hbm_gbps * 1e9) * slowdown + muon.busiest / rate + a2a


def _other_collectives(cfg: Config, dims: ParallelDims, hw: Hardware, tokens: int) -> float:
    """Per microbatch, forward + backward, on the critical path: TP's activation
    collectives (all-gather + reduce-scatter with sequence parallelism, all-reduce
    without: the same bytes), EP's token all-to-all (dispatch + combine), CP's key/value
    all-gather, PP's activation send/receive."""
    m = cfg.model
    act = 2 if cfg.training.mixed_precision == "bf16" else 4
    hidden = tokens * m.dim * act
    layers = m.n_layers // dims.pp
    total = 0.0
    if dims.tp > 1:
        tp_link = link(hw, 1, dims.tp)
        per = ring_time(hidden * (dims.tp - 1) / dims.tp, dims.tp, tp_link)
        total += layers * 2 * 2 * 2 * per  # 2 sublayers x (AG + RS) x (forward + backward)
    if dims.ep > 1 and m.moe.num_experts:
        moe_layers = max(0, layers - m.moe.first_dense_layers // dims.pp)
        ep_link = link(hw, dims.tp, dims.ep)
        sent = hidden * m.moe.top_k * (dims.ep - 1) / dims.ep
        total += moe_layers * 2 * 2 * ring_time(sent, dims.ep, ep_link)
    if dims.cp > 1:
        kv = tokens * 2 * m.dim * m.n_kv_heads // m.n_heads * act // dims.tp
        cp_link = link(hw, dims.tp, dims.cp)
        total += layers * 2 * ring_time(kv * (dims.cp - 1), dims.cp, cp_link)
    if dims.pp > 1:
        pp_link = link(hw, dims.world_size // dims.pp, 2)
        total += 2 * ring_time(hidden / dims.tp, 2, pp_link)
    return total
