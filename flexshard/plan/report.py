"""A plan: the trainer's config built for one rank per pipeline stage under the fake
backend, turned into per-rank memory, bytes per bucket, Muon balance and step time,
for flexshard and for torch FSDP2 on the same groups."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from flexshard.trainer.config import Config
from flexshard.trainer.models.model import count_params
from flexshard.trainer.parallel.dims import ParallelDims
from flexshard.trainer.parallel.parallelize import checked_dims
from flexshard.trainer.parallel.sharding import muon_row_blocks

from .activations import dense_equivalent, tp_share
from .buckets import BucketInfo, flexshard_buckets, fsdp2_equivalent
from .comm import bucket_comm, muon_work
from .hardware import Hardware, Profile
from .host_costs import BACKENDS, NO_HOST_COSTS, HostCosts
from .memory import rank_memory
from .peak import step_moments
from .recompute import kept_collective_bytes, op_level, recomputed_share
from .reserve import simulate
from .steptime import StepTime, muon_gather_all_time, step_time
from .techniques import TRAINER, Techniques
from .timeline import ActivationTimeline, mix, timeline
from .world import build_rank, fake_world, stage_ranks

GiB = 2**30


def planning_config(cfg: Config) -> Config:
    """The config as the plan builds it: no checkpointing (its pp/ep guard is about
    saving, not layout; ``async_mode`` stays, to count its staging); torch FSDP2 is
    planned from flexshard's Shard(0) groups."""
    cfg = copy.deepcopy(cfg)
    if not cfg.checkpoint.enable:  # no saves: no staging copy either
        cfg.checkpoint.async_mode = "disabled"
    cfg.checkpoint.enable = False
    if cfg.parallelism.dp_backend == "fsdp2":
        cfg.parallelism.dp_backend = "flexshard"
        cfg.parallelism.placement = "shard0"
    return cfg


def build_stages(cfg: Config, world: int, rank: int | None) -> tuple[ParallelDims, list[list]]:
    """Buckets of ``rank`` (or of the first rank of every pipeline stage)."""
    dims = checked_dims(cfg, world)
    ranks = [rank] if rank is not None else stage_ranks(dims)
    stages = []
    for r in ranks:
        with fake_world(world, r):
            built = build_rank(cfg, world, r)
            stages.append(flexshard_buckets(built.modules))
    return built.dims, stages


def storage_balance(buckets: list[BucketInfo]) -> list[dict[str, Any]]:
    """Per group size: each rank's real (unpadded) bytes, summed over the buckets:
    min / mean / max over all the group's ranks (the layout math, every rank)."""
    groups: dict[int, list[int]] = {}
    for b in buckets:
        per_rank = groups.setdefault(b.world, [0] * b.world)
        for r, n in enumerate(b.rank_numels()):
            per_rank[r] += n * b.storage_itemsize
    return [
        {
            "group_size": w,
            "min_bytes": min(v),
            "mean_bytes": sum(v) / w,
            "max_bytes": max(v),
            "max_over_mean": max(v) / (sum(v) / w) if sum(v) else 1.0,
        }
        for w, v in groups.items()
    ]


def activation_timeline(
    cfg: Config, sequences: int, techniques: Techniques = TRAINER
) -> ActivationTimeline:
    """One tp rank's activations through a microbatch of ``sequences`` (measured on 2
    blocks under fake tensors, with the config's activation checkpointing, or
    torchtitan's op policy where ``techniques`` says so); under loss parallel the
    head's logits and loss buffers sharded over tp (their vocabulary dimension; the
    final norm's output is sequence-sharded already)."""
    model = dense_equivalent(cfg.model)
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    seq = cfg.training.seq_len // cfg.parallelism.cp
    plain = timeline(model, sequences, seq, dtype, "none")
    share = recomputed_share(cfg)
    if share:
        op = "op_every_second_mm" if techniques.op_ac_recomputed_mm == 0.5 else "op"
        marked = timeline(model, sequences, seq, dtype, op if op_level(cfg) else "full")
        plain = mix(plain, marked, share)
    # op-level checkpointing under TP also keeps its collectives' outputs
    kept = kept_collective_bytes(cfg, sequences, 2 if dtype == torch.bfloat16 else 4)
    head = 1 / cfg.parallelism.tp if techniques.loss_parallel else 1.0
    return plain.scaled(tp_share(cfg), kept, head)


def allocator_reserve(
    live: int,
    buckets: list[BucketInfo],
    timeline_: ActivationTimeline,
    optimizer: str,
    hw: Hardware,
    techniques: Techniques,
    held_microbatches: int,
    accumulating: bool,
    backend: str,
) -> dict[str, Any]:
    """What torch's CUDA caching allocator reserves beyond the live peak (``reserve.py``);
    ``reserved``: the ``live`` peak plus that, torchtitan's ``memory`` figure."""
    if timeline_.tensors is None:
        return {"reserved": live, "allocator_reserve": 0, "allocator_retries": 0}
    sim = simulate(
        buckets,
        timeline_.tensors,
        optimizer,
        expandable=techniques.expandable_segments,
        capacity=round(hw.memory_gib * 2**30) or None,
        held_microbatches=held_microbatches,
        accumulating=accumulating,
        root_prefetches=backend == "fsdp2",
        foreach=not hw.blocking_collectives,
    )
    return {
        "reserved": live + sim.reserve,
        "allocator_reserve": sim.reserve,
        "allocator_retries": sim.retries,
        "allocator_simulated_peak": sim.requested,
    }


def microbatching(cfg: Config, dims: ParallelDims) -> tuple[int, int, int]:
    """(microbatches per step, sequences per microbatch, microbatches a pipeline stage
    holds at once)."""
    par, t = cfg.parallelism, cfg.training
    micro = (par.pp_microbatches or dims.pp) if dims.pp > 1 else t.grad_accum
    seqs = t.batch_size // micro if dims.pp > 1 else t.batch_size
    in_flight = 1 if dims.pp == 1 else (micro if par.pp_schedule == "gpipe" else dims.pp)
    return micro, seqs, in_flight


def _backend_plan(
    cfg: Config,
    dims: ParallelDims,
    stages: list[list[BucketInfo]],
    hw: Hardware,
    backend: str,
    host: HostCosts,
    techniques: Techniques = TRAINER,
) -> dict[str, Any]:
    if backend == "fsdp2":
        stages = [fsdp2_equivalent(s) for s in stages]
    t = cfg.training
    micro, seqs, in_flight = microbatching(cfg, dims)
    timeline_ = activation_timeline(cfg, seqs, techniques)
    worst: dict[str, Any] | None = None
    slowest: StepTime | None = None  # a pipeline moves at its slowest stage's pace
    for index, buckets in enumerate(stages):
        notes: list[str] = []
        muon = None
        # an AdamW plan shows Muon's balance where it is one group's (data parallel alone)
        if t.optimizer == "muon" or (len({b.world for b in buckets}) == 1 and dims.tp == 1):
            muon = muon_work(buckets, muon_row_blocks(cfg.model))
        if t.optimizer == "muon" and muon is not None and muon.moved:
            notes.append(
                f"Muon: {muon.owned:,} matrices stepped where stored, {muon.moved:,} too "
                "large to own (or split by this placement) redistributed each step"
            )
        moments = step_moments(
            buckets,
            timeline_,
            held_microbatches=in_flight - 1,
            accumulating=micro > 1,
            root_prefetches=backend == "fsdp2",
            foreach=not hw.blocking_collectives,  # torch's AdamW: foreach on GPUs only
        )
        staging = cfg.checkpoint.async_mode != "disabled"
        memory = rank_memory(buckets, t.optimizer, 0, moments, staging)
        reserve = allocator_reserve(memory.total, buckets, timeline_, t.optimizer, hw,
                                    techniques, in_flight - 1, micro > 1, backend)  # fmt: skip
        comms = [bucket_comm(b, micro, dims.pp > 1) for b in buckets]
        step = step_time(cfg, dims, buckets, hw, muon, backend, host, techniques)
        stage = {
            "stage": index,
            "memory": {**memory.as_dict(), **reserve},
            "buckets": [c.as_dict() for c in comms],
            "bytes_per_step": sum(c.all_gather + c.reduce_scatter + c.all_reduce for c in comms)
            + (muon.all_to_all_bytes if muon and t.optimizer == "muon" else 0),
            "storage_balance": storage_balance(buckets),
            "muon": None
            if muon is None
            else {
                "busiest_tflop": muon.busiest / 1e12,
                "imbalance": muon.imbalance,
                "all_to_all_bytes": muon.all_to_all_bytes,
            },
            "step": step.as_dict(),
            # what the optimizer step would take if every rank gathered every matrix
            "muon_gather_all_s": muon_gather_all_time(cfg, dims, buckets, hw, host)
            if t.optimizer == "muon"
            else None,
            "notes": notes,
        }
        # the busiest stage by what the allocator reserves, as torchtitan reports
        if worst is None or stage["memory"]["reserved"] > worst["memory"]["reserved"]:
            worst = stage
        if slowest is None or step.step_s > slowest.step_s:
            slowest = step
    assert worst is not None and slowest is not None
    worst["stages"] = len(stages)
    worst["step"] = slowest.as_dict()
    return worst


def backend_plan(
    cfg: Config,
    dims: ParallelDims,
    stages: list[list[BucketInfo]],
    hw: Hardware,
    backend: str,
    techniques: Techniques = TRAINER,
) -> dict[str, Any]:
    """One backend's plan (the busiest stage) from already built stages, GPU host."""
    return _backend_plan(cfg, dims, stages, hw, backend, NO_HOST_COSTS, techniques)


def make_plan(
    cfg: Config,
    world: int,
    hw: Hardware,
    rank: int | None = None,
    backends: tuple[str, ...] = BACKENDS,
    host: HostCosts = NO_HOST_COSTS,
    techniques: Techniques = TRAINER,
) -> dict[str, Any]:
    """Everything ``flexshard-plan`` prints, as a JSON-able dict; ``hw``'s device and
    links, with ``host``'s costs around them (none by default)."""
    begin = time.perf_counter()
    cfg = planning_config(cfg)
    dims, stages = build_stages(cfg, world, rank)
    total, active = count_params(cfg.model)
    plan: dict[str, Any] = {
        "world": world,
        "mesh": {n: dims.degree(n) for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")},
        "placement": cfg.parallelism.placement,
        "optimizer": cfg.training.optimizer,
        "parameters": total,
        "active_parameters": active,
        "hardware": Profile(hw, host).as_dict(),  # a profile file --hardware reads back
        "backends": {
            b: _backend_plan(cfg, dims, stages, hw, b, host, techniques) for b in backends
        },
    }
    plan["planning_seconds"] = time.perf_counter() - begin
    return plan
