"""Step time from the runtime's schedule: compute per bucket from its parameters' FLOPs
(causal attention's at its own rate) plus the non-GEMM work of its share of the blocks
(ops dispatched and bytes moved, counted by ``opcount``), the copy-in / copy-out of
its all-gather and reduce-scatter buffers on the compute stream, collectives from
their bytes and a ring's cost (a fixed cost per call + latency per step + bytes over
the link's bandwidth) on one communication queue per rank, overlapped exactly as the
hooks overlap them: in forward, the next bucket's all-gather is issued when a bucket
starts (prefetch depth 1); in backward, the previous one's, a bucket's reduce-scatter
is issued when its gradients are complete and the oldest is waited for once more than
``MAX_PENDING_REDUCTIONS`` are in flight; the end of backward waits for all. What
compute does not cover is exposed communication; of what it covers, the share ``1 -
hw.overlap`` still takes the compute's time (CPU: gloo's threads share the cores). The
optimizer step (with gradient clipping) is counted op by op as well; what the host adds
(``host``: Python per op and per parameter, shared cores, stragglers) only when given."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexshard.runtime.hooks import MAX_PENDING_REDUCTIONS
from flexshard.trainer.config import Config
from flexshard.trainer.parallel.dims import ParallelDims

from .activations import tp_share
from .buckets import BucketInfo
from .comm import MatrixWork, gather_all_muon
from .hardware import Hardware
from .host_costs import NO_HOST_COSTS, HostCosts
from .opcount import OpCount, model_ops, optimizer_ops
from .recompute import op_level, recompute_parts, recomputed_share
from .techniques import FLOAT8_SCALE_OPS, TRAINER, Techniques, float8_scale_bytes

MUON_BYTES = 20  # one momentum buffer
# An MoE layer's token movement, per routed copy of a token (top_k per token) and per
# element of the model width, in activation-dtype elements read + written, forward: the
# permutation into expert order (read, write), the regrouping by local expert after the
# dispatch all-to-all and its inverse before the combine (2 x read, write), the weighted
# sum of the top_k outputs (read): 7 elements. Backward: each copy's gradient is a copy
# and the weighted sum's gives the outputs' and the scores' gradients: twice. The plan
# measures a dense equivalent of the block (shapes are data-dependent), which has none
# of these.
ROUTED_ELEMENTS_FORWARD = 7
ROUTED_ELEMENTS_BACKWARD = 14
# Ring attention (``cp_method = "ring"``; torch's ``context_parallel``, as torchtitan runs
# CP) merges each ring step's partial output into an fp32 accumulator: per step after
# the first, per query element (``_SDPAMerger``: the output cast to fp32, ``out -
# sigmoid(lse diff) * (out - block_out)`` in three passes: 4 + act, 12, 8, 12 bytes read +
# written), and copies the keys and values into the send buffer (2 x act per element).
# Backward (``_templated_ring_attention_backward``, fp32 accumulators): the query
# gradient accumulated (4 + act + 4 per query element); per key / value element the
# send copy (2 x act), the gradient accumulated (8 + act) and copied into its fp32
# send buffer (8). The steps that update half the rows count whole (their partial
# update copies the accumulator); the log-sum-exp's bytes (one per row) are left out.
RING_MERGE_QUERY_FIXED, RING_MERGE_QUERY_PER_ACT = 36, 1  # forward: 36 + act per element
RING_GRAD_QUERY_FIXED, RING_GRAD_QUERY_PER_ACT = 8, 1
RING_GRAD_KV_FIXED, RING_GRAD_KV_PER_ACT = 16, 3
# flash attention's backward runs 5 matmuls to the forward's 2 (it recomputes the
# scores): 2.5 times the forward's FLOPs (Dao, FlashAttention-2, 2023, section 4.1)
ATTENTION_BACKWARD = 2.5


@dataclass
class StepTime:
    step_s: float
    compute_s: float  # forward + backward (+ pipeline bubble) on the busiest path
    gemm_s: float  # of compute_s (no bubble), GEMMs and attention; the rest: non-GEMM ops
    copy_s: float  # copy-in / copy-out of the all-gather and reduce-scatter buffers
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


def ring_time(sent: float, ranks: int, bw_lat: tuple[float, float], call_s: float = 0.0) -> float:
    """``call_s``: the fixed cost of one collective call (gloo / NCCL launch)."""
    if ranks <= 1 or sent <= 0:
        return 0.0
    bw, lat = bw_lat
    return call_s + (ranks - 1) * lat + sent / bw


@dataclass(frozen=True)
class BucketCost:
    """Seconds of one bucket per microbatch: compute-stream work (``forward``,
    ``backward``, the copy-out after its all-gather, the copy-in before its
    reduce-scatter) and communication-queue work (the collectives)."""

    forward: float
    backward: float
    all_gather: float
    reduce_scatter: float
    gather_copy: float = 0.0
    reduce_copy: float = 0.0
    gemm: float = 0.0  # of forward + backward, GEMMs' and attention's (the rest: non-GEMM)


def attention_flops(info: BucketInfo, cfg: Config, tokens: int) -> float:
    """Of ``bucket_flops``, causal attention's (timed at ``hw.attention_tflops``)."""
    return sum(
        4.0 * p.shape[0] * cfg.training.seq_len / 2 * tokens
        for p in info.layout.params
        if p.fqn.endswith("attention.wq.weight") and len(p.shape) >= 2
    )


def expert_flops(info: BucketInfo, cfg: Config, tokens: int) -> float:
    """Of ``bucket_flops``, the routed experts' (timed at ``hw.grouped_gemm_efficiency``):
    a ``[experts, R, C]`` stack's top_k of its experts per token, over all EP ranks."""
    return sum(
        2.0 * p.shape[-2] * p.shape[-1] * cfg.model.moe.top_k * tokens
        for p in info.layout.params
        if len(p.shape) == 3
    )


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


def routed_copies(info: BucketInfo, cfg: Config, tokens: int) -> tuple[float, float]:
    """(forward, backward) bytes an expert bucket's MoE layers move routing ``tokens``
    tokens to their experts and back (``ROUTED_ELEMENTS_*``); 0 for other buckets."""
    stacks = sum(1 for p in info.layout.params if len(p.shape) == 3) // 3  # w1, w2, w3
    if not stacks:
        return 0.0, 0.0
    act = 2 if cfg.training.mixed_precision == "bf16" else 4
    per_layer = tokens * cfg.model.moe.top_k * cfg.model.dim * act
    return (
        stacks * ROUTED_ELEMENTS_FORWARD * per_layer,
        stacks * ROUTED_ELEMENTS_BACKWARD * per_layer,
    )


def ring_merge_bytes(
    info: BucketInfo, cfg: Config, dims: ParallelDims, tokens: int
) -> tuple[float, float]:
    """(forward, backward) bytes ring attention's merges and send copies move in a
    bucket's attention layers (``RING_*``), over its cp - 1 steps after the first; 0
    without a ring (the all-gather method runs one attention over the gathered keys)."""
    if dims.cp == 1 or cfg.parallelism.cp_method != "ring":
        return 0.0, 0.0
    layers = sum(1 for p in info.layout.params if p.fqn.endswith("attention.wq.weight"))
    m = cfg.model
    act = 2 if cfg.training.mixed_precision == "bf16" else 4
    query = tokens * m.n_heads * m.head_size() / dims.tp
    kv = 2 * tokens * m.n_kv_heads * m.head_size() / dims.tp
    forward = (RING_MERGE_QUERY_FIXED + RING_MERGE_QUERY_PER_ACT * act) * query + 2 * act * kv
    backward = (RING_GRAD_QUERY_FIXED + RING_GRAD_QUERY_PER_ACT * act) * query + (
        RING_GRAD_KV_FIXED + RING_GRAD_KV_PER_ACT * act
    ) * kv
    steps = layers * (dims.cp - 1)
    return steps * forward, steps * backward


def gathered_share(info: BucketInfo, techniques: Techniques) -> float:
    """The share of a bucket's all-gather bytes sent: under FSDP Float8 all-gather the
    blocks' linear weights go as 1 byte per element."""
    if not (techniques.float8 and techniques.float8_all_gather) or info.is_root:
        return 1.0
    total = sum(math.prod(p.shape) for p in info.layout.params) or 1
    linear = sum(math.prod(p.shape) for p in info.layout.params if len(p.shape) == 2)
    return 1 - linear / total * (1 - 1 / info.gather_itemsize)


def _simulate(
    order: list[BucketInfo],
    cost: dict[int, BucketCost],
    gather: bool,
    reduce: bool,
    root_prefetches: bool,
    overlap: float = 1.0,
    blocking: bool = False,
    forward_prefetch_blocks: bool = True,
    reduce_scatter_blocks: bool = True,
) -> tuple[float, float]:
    """One microbatch's forward (all-gathers when ``gather``) and backward (re-gathers
    what forward resharded); returns (time, time spent waiting on all-gathers).
    ``blocking``: compute waits for each collective where it is issued (CPU: the
    runtime waits at launch), so a prefetch hides nothing; ``forward_prefetch_blocks``
    False: forward's block prefetches are the exception (flexshard's, see
    runtime/collectives.py's Note on collectives without streams), left in flight beside
    compute; ``reduce_scatter_blocks`` False: so are the reduce-scatters."""
    root = [b for b in order if b.is_root]
    blocks = [b for b in order if not b.is_root]
    t = comm = waited = idle = busy = 0.0
    done: dict[int, float] = {}

    def issue(
        b: BucketInfo, at: float, seconds: float, gathering: bool = True, blocks: bool = True
    ) -> float:
        nonlocal comm, busy, t, waited, idle
        comm = max(at, comm) + seconds
        busy += seconds
        if blocking and blocks and comm > t:  # waited for at launch, before compute goes on
            idle += comm - t
            waited += comm - t if gathering else 0.0
            t = comm
        return comm

    def wait(until: float, gathered: BucketInfo | None = None) -> None:
        """Compute waits for the queue; then copies out what it gathered."""
        nonlocal t, waited, idle
        if until > t:
            idle += until - t
            waited += until - t if gathered is not None else 0.0
            t = until
        if gathered is not None:
            t += cost[id(gathered)].gather_copy

    def ag(b: BucketInfo) -> float:
        return cost[id(b)].all_gather

    for b in root:
        if gather:
            wait(issue(b, t, ag(b)), b)
    if blocks and gather:
        done[id(blocks[0])] = issue(blocks[0], t, ag(blocks[0]))
    for i, b in enumerate(blocks):
        if gather:
            wait(done[id(b)], b)
        if i + 1 < len(blocks) and gather:
            nxt = blocks[i + 1]
            done[id(nxt)] = issue(nxt, t, ag(nxt), blocks=forward_prefetch_blocks)
        t += cost[id(b)].forward
    t += sum(cost[id(b)].forward for b in root)
    # backward: the root (LM head) first, then the blocks in reverse
    done = {}
    back = list(reversed(blocks))
    for b in root:
        if b.reshard_after_forward:
            wait(issue(b, t, ag(b)), b)
    # FSDP2's root prefetches the last block before its own backward; flexshard's
    # root comes first in the forward order and has nothing before it to prefetch
    if back and root_prefetches and back[0].reshard_after_forward:
        done[id(back[0])] = issue(back[0], t, ag(back[0]))
    t += sum(cost[id(b)].backward for b in root)
    pending: list[float] = []
    for i, b in enumerate(back):
        if b.reshard_after_forward:
            wait(done.get(id(b)) or issue(b, t, ag(b)), b)
        if i + 1 < len(back) and back[i + 1].reshard_after_forward:
            done[id(back[i + 1])] = issue(back[i + 1], t, ag(back[i + 1]))
        t += cost[id(b)].backward
        if reduce:
            t += cost[id(b)].reduce_copy
            pending.append(issue(b, t, cost[id(b)].reduce_scatter, False, reduce_scatter_blocks))
            if len(pending) > MAX_PENDING_REDUCTIONS:
                wait(pending.pop(0))
    if reduce:
        for b in root:
            t += cost[id(b)].reduce_copy
            pending.append(issue(b, t, cost[id(b)].reduce_scatter, False, reduce_scatter_blocks))
        wait(max([t, *pending]))
    # what compute covered of the collectives still took that share of its time
    hidden = max(0.0, busy - idle)
    return t + (1.0 - overlap) * hidden, waited


def bucket_costs(
    cfg: Config,
    dims: ParallelDims,
    buckets: list[BucketInfo],
    hw: Hardware,
    tokens: int,
    backend: str = "flexshard",
    host: HostCosts = NO_HOST_COSTS,
    techniques: Techniques = TRAINER,
) -> dict[int, BucketCost]:
    """Per bucket, one microbatch of ``tokens`` tokens per rank: GEMMs from FLOPs, the
    blocks' non-GEMM ops split over the non-root buckets by their FLOPs, the root's
    (embedding, norm, LM head, loss) on the root, copies and ``backend``'s own cost
    per parameter, collectives. Compiled blocks (``[compile] enable``) move the share
    ``hw.fused_share`` of their non-GEMM kernels and bytes; Float8 linears
    (``techniques``) run at the FP8 rate plus their scaling's bytes."""
    per_node = min(dims.world_size, hw.devices_per_node)
    # what is timed op by op is slowed by the ranks sharing the cores; the eager and
    # runtime costs are timed end to end with all ranks at once (already in them)
    slowdown = host.compute_slowdown(per_node) * host.contention
    rate = hw.gemm_flops_per_s() / slowdown
    attention_rate = (
        hw.attention_tflops * 1e12 * hw.sustained_clock / slowdown if hw.attention_tflops else rate
    )
    compiled = cfg.compile.enable
    float8_rate = hw.fp8_flops_per_s() / slowdown if techniques.float8 else rate
    grouped_rate = hw.grouped_gemm_flops_per_s() / slowdown  # bf16 under Float8 too
    flops = {id(b): bucket_flops(b, cfg, tokens) for b in buckets}
    attention = {id(b): attention_flops(b, cfg, tokens) for b in buckets}
    routed = {id(b): expert_flops(b, cfg, tokens) for b in buckets}
    ops = model_ops(cfg, tokens // (cfg.training.seq_len // dims.cp))
    share = tp_share(cfg)  # a tp rank moves its share of a block's activations
    layers = cfg.model.n_layers // dims.pp
    block_flops = sum(flops[id(b)] for b in buckets if not b.is_root) or 1.0
    redo_gemm, redo_other = recompute_parts(cfg, techniques.op_ac_recomputed_mm)

    def non_gemm(count: OpCount, part: float, fused: float = 1.0) -> float:
        ops = round(count.ops * part * fused)
        eager = ops * host.eager_op_us * 1e-6
        return hw.non_gemm_s(ops, count.bytes * share * part * fused) * slowdown + eager

    def float8_scaling(info: BucketInfo) -> tuple[float, float]:
        """(forward, backward) seconds scaling the bucket's linears' FP8 operands."""
        linears = [p.shape for p in info.layout.params if len(p.shape) == 2]
        prescaled = techniques.float8_all_gather
        moved = [float8_scale_bytes(tokens, r, c, compiled, prescaled) for r, c in linears]
        ops = len(linears) * 2 * FLOAT8_SCALE_OPS[compiled]
        fwd = hw.non_gemm_s(ops, sum(f for f, _ in moved)) * slowdown
        return fwd, hw.non_gemm_s(ops, sum(b for _, b in moved)) * slowdown

    def copies(info: BucketInfo, moved: int, kind: str) -> float:
        params = len(info.layout.params)
        runtime = host.runtime_param_s(backend, kind)
        if runtime:  # measured on the runtime itself: its per-parameter copies included
            return params * runtime + hw.copy_s(moved) * slowdown
        return (hw.non_gemm_s(params, 0) + hw.copy_s(moved)) * slowdown

    out = {}
    for b in buckets:
        # EP's expert buckets shard over dp_shard_mod_ep: ranks tp * ep apart
        experts = b.world != dims.dp_shard * dims.cp
        dp_link = link(hw, dims.tp * (dims.ep if experts else 1), b.world)
        # a call's fixed cost and its wait for the slower rank
        call = (hw.collective_overhead_us + host.collective_wait_us) * 1e-6
        rs_link = (hw.reduce_scatter_gbps * 1e9 or dp_link[0], dp_link[1])
        gathered = gathered_share(b, techniques)
        ag = ring_time(
            (b.world - 1) * b.shard_numel * b.gather_itemsize * gathered, b.world, dp_link, call
        )
        rs_bytes = (b.world - 1) * b.shard_numel * b.reduce_itemsize
        rs = ring_time(rs_bytes, b.world, rs_link, call)
        if b.replicas > 1:  # HSDP: the all-reduce over replicas follows on the same queue
            rep = link(hw, dims.tp * dims.dp_shard * dims.cp, b.replicas)
            ar = 2 * (b.replicas - 1) * b.shard_numel * b.reduce_itemsize / b.replicas
            rs += ring_time(ar, b.replicas, rep, call)
        if b.layout.replicated:
            ag = 0.0
            ar = 2 * (b.world - 1) * b.numel * b.reduce_itemsize / b.world
            rs = ring_time(ar, b.world, dp_link, call)
        linear = flops[id(b)] - attention[id(b)] - routed[id(b)]
        grouped = routed[id(b)] / grouped_rate  # the routed experts' forward seconds
        attend = attention[id(b)] / attention_rate  # causal attention's forward seconds
        routed_fwd, routed_bwd = (
            hw.non_gemm_s(0, moved) * slowdown for moved in routed_copies(b, cfg, tokens)
        )
        merge_fwd, merge_bwd = (
            hw.non_gemm_s(0, moved) * slowdown for moved in ring_merge_bytes(b, cfg, dims, tokens)
        )
        if b.is_root:  # torchtitan compiles and converts the blocks alone
            fwd, bwd = non_gemm(ops.head_forward, 1.0), non_gemm(ops.head_backward, 1.0)
            matmul = linear / rate
        else:
            part = layers * flops[id(b)] / block_flops
            fused = hw.fused_share if compiled else 1.0
            fwd = non_gemm(ops.block_forward, part, fused) + routed_fwd
            bwd = non_gemm(ops.block_backward, part, fused) + routed_bwd
            matmul = linear / float8_rate + grouped
            if techniques.float8:
                scale_fwd, scale_bwd = float8_scaling(b)
                fwd, bwd = fwd + scale_fwd, bwd + scale_bwd
        gathered_bytes = 2 * b.gathered_bytes * gathered
        gather_copy = 0.0 if b.layout.replicated else copies(b, gathered_bytes, "gather")
        # copy-in of the gradients (W shards) and out of the reduced shard
        moved = 2 * b.unsharded_grad_bytes + b.shard_numel * b.reduce_itemsize
        reduce_copy = copies(b, moved, "reduce")
        # backward: twice the GEMMs' FLOPs, ATTENTION_BACKWARD times attention's.
        # Activation checkpointing runs the blocks' forward again: its GEMMs (an
        # op-level policy: the share it recomputes, attention kept) and non-GEMM ops
        redo_attend = 0.0 if b.is_root or op_level(cfg) else redo_gemm
        redo_matmul = 0.0 if b.is_root else redo_gemm
        # the ring's merges belong to attention: recomputed with it, not by an op policy
        attend_all = attend + merge_fwd
        recompute = 0.0 if b.is_root else redo_matmul * matmul + redo_attend * attend_all
        recompute += 0.0 if b.is_root else redo_other * fwd
        out[id(b)] = BucketCost(
            forward=matmul + attend_all + fwd,
            backward=2 * matmul + ATTENTION_BACKWARD * attend + merge_bwd + bwd + recompute,
            all_gather=ag,
            reduce_scatter=rs,
            gather_copy=gather_copy,
            reduce_copy=reduce_copy,
            gemm=(3 + redo_matmul) * matmul + (1 + ATTENTION_BACKWARD + redo_attend) * attend,
        )
    return out


def step_time(
    cfg: Config,
    dims: ParallelDims,
    buckets: list[BucketInfo],
    hw: Hardware,
    muon: MatrixWork | None,
    backend: str,
    host: HostCosts = NO_HOST_COSTS,
    techniques: Techniques = TRAINER,
) -> StepTime:
    t, par = cfg.training, cfg.parallelism
    micro = par.pp_microbatches or dims.pp if dims.pp > 1 else t.grad_accum
    seqs = t.batch_size // micro if dims.pp > 1 else t.batch_size
    tokens = seqs * t.seq_len // dims.cp  # per rank per microbatch
    cost = bucket_costs(cfg, dims, buckets, hw, tokens, backend, host, techniques)
    root_prefetches = backend == "fsdp2"
    compute_micro = sum(c.forward + c.backward for c in cost.values())
    keep = dims.pp > 1  # stages stay gathered after backward until the last microbatch
    total, waited = 0.0, 0.0
    for i in range(micro):
        gather = not keep or i == 0
        # a pipeline stage reduces after its last backward (reduce_after_pipeline_backward)
        reduce = i == micro - 1 and dims.pp == 1
        span, w = _simulate(
            buckets,
            cost,
            gather,
            reduce,
            root_prefetches,
            hw.overlap,
            hw.blocking_collectives,
            forward_prefetch_blocks=backend != "flexshard",
            reduce_scatter_blocks=backend != "flexshard",
        )
        total += span
        waited += w
    if dims.pp > 1:
        total += reduce_after_pipeline_backward(buckets, cost)
    other_micro = _other_collectives(cfg, dims, hw, tokens, techniques)
    # the bubble: (pp - 1) / virtual stages of a microbatch's time on a stage, which is
    # its compute and the TP / EP / CP / PP exchanges on its critical path (Narayanan
    # et al. 2021, section 2.2: the bubble is counted in the stage's per-microbatch time)
    per_micro = compute_micro + other_micro
    bubble = (dims.pp - 1) / par.pp_virtual_stages * per_micro if dims.pp > 1 else 0.0
    other = other_micro * micro
    compute = compute_micro * micro + bubble
    copies = _copy_time(buckets, cost, micro, keep)
    exposed_dp = total - compute_micro * micro - copies
    optimizer = _optimizer_time(
        cfg,
        buckets,
        hw,
        host,
        muon,
        link(hw, dims.tp, dims.dp_shard),
        # the optimizer steps DTensors on both backends, under TP too (flexshard's
        # parameters are DTensors over the whole SPMD mesh): DTensor's per-op dispatch
        # (dtensor_op_overhead_us, 0 on the GPU profiles: it runs ahead of the kernels)
        dtensors=True,
    )
    step = total + bubble + other + optimizer
    global_tokens = dims.dp_size * t.batch_size * t.grad_accum * t.seq_len
    return StepTime(
        step_s=step,
        compute_s=compute,
        gemm_s=sum(c.gemm for c in cost.values()) * micro,
        copy_s=copies,
        optimizer_s=optimizer,
        exposed_dp_s=max(0.0, exposed_dp),
        exposed_other_s=other,
        exposed_all_gather_s=waited,
        tokens_per_s_per_device=global_tokens / step / dims.world_size,
    )


def reduce_after_pipeline_backward(buckets: list[BucketInfo], cost: dict[int, BucketCost]) -> float:
    """Seconds a pipeline stage spends reducing its gradients once its last microbatch's
    backward is done: torch's pipelining runs every microbatch's backward with gradient
    sync off and calls FSDP's post-backward for every parameter group only then
    (``torch.distributed.pipelining.stage``: ``backward_maybe_with_nosync``, now
    ``perform_reduce_grad``), so no reduce-scatter overlaps backward compute. In
    backward order, each bucket's copy-in on the compute stream, then its reduce-scatter
    on the one communication queue."""
    compute = comm = 0.0
    for b in reversed(buckets):
        compute += cost[id(b)].reduce_copy
        comm = max(comm, compute) + cost[id(b)].reduce_scatter
    return max(compute, comm)


def _copy_time(
    buckets: list[BucketInfo], cost: dict[int, BucketCost], micro: int, keep: bool
) -> float:
    """The copies ``_simulate`` puts on the compute stream, over the step."""
    total = 0.0
    for b in buckets:
        c = cost[id(b)]
        forward_gathers = 1 if keep else micro
        total += c.gather_copy * (forward_gathers + micro * b.reshard_after_forward)
        total += c.reduce_copy
    return total


def muon_gather_all_time(
    cfg: Config, dims: ParallelDims, buckets: list[BucketInfo], hw: Hardware, host: HostCosts
) -> float:
    """The optimizer step (clipping aside) of the gather-everything Muon baseline on
    these buckets: every rank gathers every matrix and runs every Newton–Schulz."""
    work = gather_all_muon(buckets)
    return _optimizer_time(cfg, buckets, hw, host, work, link(hw, dims.tp, dims.dp_shard))


def _optimizer_time(
    cfg: Config,
    buckets: list[BucketInfo],
    hw: Hardware,
    host: HostCosts,
    muon: MatrixWork | None,
    dp_link: tuple[float, float],
    dtensors: bool = True,
) -> float:
    """Clipping and AdamW counted op by op on each bucket's busiest rank's shards (on
    DTensors each op costs DTensor's dispatch too); Muon: its momentum's
    bytes, Newton–Schulz FLOPs and all-to-all."""
    slowdown = host.compute_slowdown(min(max(b.world for b in buckets), hw.devices_per_node))
    slowdown *= host.contention
    if cfg.training.optimizer != "muon" or muon is None:
        shards = []
        for b in buckets:
            numels = b.rank_numels()
            rank = numels.index(max(numels))
            shards += [sum(r.numel for r in p.regions[rank]) for p in b.layout.params]
        count = optimizer_ops(shards, cfg.training)
        dispatch = count.ops * host.dtensor_op_overhead_us * 1e-6 if dtensors else 0.0
        return (hw.non_gemm_s(count.ops, count.bytes) + dispatch) * slowdown
    rate = hw.gemm_flops_per_s() / slowdown
    elements = sum(b.shard_numel for b in buckets)
    world = len(muon.flops)
    a2a = ring_time(muon.all_to_all_bytes, world, dp_link) if muon.all_to_all_bytes else 0.0
    return elements * MUON_BYTES / (hw.hbm_gbps * 1e9) * slowdown + muon.busiest / rate + a2a


def _other_collectives(
    cfg: Config, dims: ParallelDims, hw: Hardware, tokens: int, techniques: Techniques = TRAINER
) -> float:
    """Per microbatch, forward + backward, on the critical path: TP's activation
    collectives (all-gather + reduce-scatter with sequence parallelism, all-reduce
    without: the same bytes; a block-level recompute runs its forward's again; none
    under async TP), EP's token all-to-all (dispatch + combine, again in a block-level
    recompute), CP's key/value all-gather, PP's activation send/receive (per virtual
    stage)."""
    m = cfg.model
    act = 2 if cfg.training.mixed_precision == "bf16" else 4
    hidden = tokens * m.dim * act
    layers = m.n_layers // dims.pp
    total = 0.0
    # op-level AC keeps its collectives' outputs; a recomputed block runs its forward's
    passes = 2 + (0.0 if op_level(cfg) else recomputed_share(cfg))
    if dims.tp > 1:
        tp_link = link(hw, 1, dims.tp)
        per = ring_time(hidden * (dims.tp - 1) / dims.tp, dims.tp, tp_link)
        exposed = 1.0 - hw.async_tp_overlap if techniques.async_tp else 1.0
        total += layers * 2 * 2 * passes * per * exposed  # 2 sublayers x (AG + RS) x passes
    if dims.ep > 1 and m.moe.num_experts:
        # the stage with the most MoE layers sets the pace
        moe_layers = max(
            sum(m.moe.is_moe_layer(i) for i in range(stage * layers, (stage + 1) * layers))
            for stage in range(dims.pp)
        )
        ep_link = link(hw, dims.tp, dims.ep)
        sent = hidden * m.moe.top_k * (dims.ep - 1) / dims.ep
        # dispatch + combine, in forward, backward and the recomputed forward
        total += moe_layers * 2 * passes * ring_time(sent, dims.ep, ep_link)
    if dims.cp > 1:
        kv = tokens * 2 * m.n_kv_heads * m.head_size() * act // dims.tp
        cp_link = link(hw, dims.tp, dims.cp)
        total += layers * 2 * ring_time(kv * (dims.cp - 1), dims.cp, cp_link)
    if dims.pp > 1:
        # a microbatch enters and leaves each of a rank's virtual stages, forward and
        # backward: v times the sends of one stage per rank (Narayanan et al. 2021,
        # section 2.2: the interleaved schedule's communication grows by v)
        pp_link = link(hw, dims.world_size // dims.pp, 2)
        sends = 2 * cfg.parallelism.pp_virtual_stages
        total += sends * ring_time(hidden / dims.tp, 2, pp_link)
    return total
