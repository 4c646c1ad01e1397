"""What every rank runs: each configuration trains a fresh model for a few steps and
records step times, collectives, memory and bucket padding."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches
from flexshard.testing.live_memory import MB, LiveTensors
from flexshard.testing.stats import alternating, centred

from .common import (
    BucketInfo,
    CollectiveCounter,
    CommRecord,
    MemoryTracker,
    flexshard_buckets,
    fsdp2_buckets,
    held_tensors,
    minimum_bytes,
)


@dataclass(frozen=True)
class BenchOptions:
    cfg: TransformerConfig
    batch: int
    warmup: int
    steps: int
    reps: int
    configs: tuple[str, ...]
    block: tuple[int, int] = (64, 64)
    seed: int = 0


# ---------------------------------------------------------------- configurations
def _mixed(head_dim: int, block: tuple[int, int], fqn: str, param: nn.Parameter) -> fs.Placement:
    """One bucket, five placements: what a model with per-tensor needs would use."""
    if param.ndim < 2:
        return fs.FlatShard()
    if "qkv" in fqn:
        return fs.BlockShard((head_dim, param.shape[1]))  # one head's rows per tile (Muon)
    if "up" in fqn or "embed" in fqn:
        return fs.Owned()
    if "down" in fqn:
        return fs.BlockShard(block)  # FP8-style tiles
    return fs.Shard(1) if "proj" in fqn else fs.Shard(0)


def _per_block(shard: Callable[..., Any], model: TinyTransformer, mesh: DeviceMesh) -> nn.Module:
    for layer in model.layers:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _flex(placement: Any, model: TinyTransformer, mesh: DeviceMesh) -> nn.Module:
    buckets = [
        fs.BucketSpec(f"layers.{i}.*", placement=placement, name=f"layers.{i}")
        for i in range(len(model.layers))
    ]
    buckets.append(
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], placement=placement, name="outer")
    )
    return fs.flex_shard(model, mesh=mesh, buckets=buckets)


def _owned_all_layers(model: TinyTransformer, mesh: DeviceMesh) -> nn.Module:
    """Owned over every block's parameters in one bucket: enough whole matrices per
    bucket for LPT to balance (a per-block bucket has too few, see its padding)."""
    buckets = [
        fs.BucketSpec("layers.*", placement=fs.Owned(), name="layers"),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], name="outer"),
    ]
    return fs.flex_shard(model, mesh=mesh, buckets=buckets)


def _fsdp2_all_layers(model: TinyTransformer, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 with one group over every block (``fully_shard`` of the list of blocks):
    owned_all_layers' layout, one all-gather and one reduce-scatter for all blocks."""
    torch_fully_shard(list(model.layers), mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model


def sharders(opts: BenchOptions) -> dict[str, Callable[[TinyTransformer, DeviceMesh], nn.Module]]:
    """Every configuration by name: (model, mesh) -> the sharded model."""
    cfg, block = opts.cfg, opts.block
    placements = {
        "flex/shard0": fs.Shard(0),
        "flex/flat": fs.FlatShard(),
        "flex/owned": fs.Owned(),
        f"flex/block{block[0]}x{block[1]}": fs.BlockShard(block),
        "flex/mixed": functools.partial(_mixed, cfg.dim // cfg.heads, block),
    }
    out: dict[str, Callable[[TinyTransformer, DeviceMesh], nn.Module]] = {
        "fsdp2": functools.partial(_per_block, torch_fully_shard),
        "fs.fully_shard": functools.partial(_per_block, fs.fully_shard),
    }
    out.update({name: functools.partial(_flex, p) for name, p in placements.items()})
    out["flex/owned_all_layers"] = _owned_all_layers
    out["fsdp2/all_layers"] = _fsdp2_all_layers
    return out


def config_names(block: tuple[int, int]) -> tuple[str, ...]:
    dummy = BenchOptions(TransformerConfig(), 1, 0, 0, 0, (), block)
    return tuple(sharders(dummy))


# ---------------------------------------------------------------- one run
def _comm_summary(
    records: list[CommRecord], buckets: list[BucketInfo], world_size: int
) -> dict[str, float]:
    kinds = [r.kind for r in records]
    return {
        "collectives": len(records),
        "all_gather": kinds.count("all_gather"),
        "reduce_scatter": kinds.count("reduce_scatter"),
        "all_reduce": kinds.count("all_reduce"),
        "bytes_sent": sum(r.sent for r in records),
        "min_bytes": minimum_bytes(records, buckets, world_size),
    }


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple
) -> tuple[list[float], float]:
    """Forward, backward and optimizer step; returns the three phase times and the loss."""
    tokens, targets = batch
    t0 = time.perf_counter()
    loss = model.loss(tokens, targets)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2], loss.item()


def live_step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple, base: int) -> dict:
    """One more (untimed) step under ``LiveTensors``: the peak bytes of live tensors above
    ``base`` (before the model existed), the phase it fell in and what was alive then."""
    tokens, targets = batch
    with LiveTensors() as live:
        live.phase = "forward"  # activations (and what the forward gathers)
        loss = model.loss(tokens, targets)
        live.phase = "backward"  # unsharded gradients, reduce buffers, temporaries
        loss.backward()
        live.name(held_tensors(model, opt)["sharded grads"], "sharded grads")
        live.phase = "optimizer"
        opt.step()
        for what, tensors in held_tensors(model, opt).items():
            if what != "sharded grads":
                live.name(tensors, what)
    opt.zero_grad()
    parts = live.breakdown()
    parts["before the step"] = parts.pop("before", 0) - base  # batches etc. not counted
    return {
        "peak_mb": (live.peak_bytes - base) / MB,
        "phase": live.peak_phase,
        "at_peak_mb": {k: v / MB for k, v in sorted(parts.items())},
    }


def run_config(
    name: str,
    shard: Callable[[TinyTransformer, DeviceMesh], nn.Module],
    rank: int,
    world_size: int,
    mesh: DeviceMesh,
    opts: BenchOptions,
    batches: list,
    counter: CollectiveCounter,
) -> dict[str, Any]:
    tracker = MemoryTracker()
    tracker.start()
    torch.manual_seed(opts.seed)
    model = shard(TinyTransformer(opts.cfg), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    is_flex = not name.startswith("fsdp2")
    tracker.model_built()
    phases, losses, comms, flex_sent = [], [], [], []
    buckets: list[BucketInfo] = []
    for step in range(opts.warmup + opts.steps):
        if step == opts.warmup:  # after the first forward: fully_shard names buckets lazily
            buckets = flexshard_buckets(model) if is_flex else fsdp2_buckets(model, world_size)
        tracker.sample()
        dist.barrier()
        counter.take()
        if is_flex:
            model.comm_stats(reset=True)
        times, loss = _train_step(model, opt, batches[step * world_size + rank])
        tracker.sample()
        records = counter.take()
        if step < opts.warmup:
            continue
        phases.append(times)
        losses.append(loss)
        comms.append(_comm_summary(records, buckets, world_size))
        if is_flex:
            flex_sent.append(model.comm_stats(reset=True)["total"]["bytes_sent"])
    memory = tracker.finish()  # RSS before the live step: its bookkeeping is not counted
    dist.barrier()
    live = live_step(
        model, opt, batches[(opts.warmup + opts.steps) * world_size + rank], tracker.base_live
    )
    counter.take()
    del model, opt
    return {
        "phases_s": phases,
        "losses": losses,
        "comm": comms[-1],
        "comm_constant": all(c == comms[-1] for c in comms),
        # flexshard's own CommStats against the wrapped torch.distributed calls
        "comm_stats_agree": all(f == c["bytes_sent"] for f, c in zip(flex_sent, comms))
        if is_flex
        else None,
        "memory": memory,
        "live": live,
        "buckets": [_bucket_dict(b) for b in buckets],
        "local_param_mb": sum(b.rank_numels[rank] for b in buckets) * 4 / 2**20,  # fp32 model
    }


def _bucket_dict(bucket: BucketInfo) -> dict[str, Any]:
    return dataclasses.asdict(bucket) | {
        "padding": bucket.padding,
        "padding_floor": bucket.padding_floor(),
    }


def run_rank(rank: int, world_size: int, opts: BenchOptions) -> dict[str, list[dict[str, Any]]]:
    """All configurations, ``opts.reps`` times, the order reversed on every other
    repetition, so that each configuration runs after FSDP2 in one repetition and
    before it in the next: drift in machine load favours neither side."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated c10d spellings
    mesh = init_device_mesh("cpu", (world_size,))
    batches = make_batches(
        opts.cfg, (opts.warmup + opts.steps + 1) * world_size, opts.batch, opts.seed
    )  # the last step's batches feed the live-tensor step
    table = sharders(opts)
    counter = CollectiveCounter()
    counter.install()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in opts.configs}
    try:
        order = centred(opts.configs, "fsdp2")  # every ratio is against FSDP2
        for rep in range(opts.reps):
            for name in alternating(order, rep):
                results[name].append(
                    run_config(name, table[name], rank, world_size, mesh, opts, batches, counter)
                )
    finally:
        counter.uninstall()
    return results
