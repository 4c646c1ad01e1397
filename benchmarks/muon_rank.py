"""One rank of the Muon benchmark: every variant on the same matrices and gradients."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import flexshard as fs
from flexshard.optim import DistMuon, muon_buckets

from .muon_gather import GatherMuon

#: Newton–Schulz-dominated: 8 square and 8 rectangular matrices; at W = 2 and 4 LPT
#: gives every rank the same work (the 8 squares first, two or four each, then the rest)
SHAPES = [(512, 512)] * 8 + [(512, 256)] * 4 + [(256, 512)] * 4
BUCKETS = 4  # consecutive matrices per bucket: the redistribution pipelines over them
LR = 0.02
VARIANTS = ("a gather-everything", "b DistMuon Shard(0)", "c DistMuon Owned", "d AdamW")


class MatrixBank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for i, shape in enumerate(SHAPES):
            self.register_parameter(f"w{i}", nn.Parameter(torch.randn(shape, generator=gen)))


def _buckets(placement: fs.Placement) -> list[fs.BucketSpec]:
    per = len(SHAPES) // BUCKETS
    return [
        fs.BucketSpec([f"w{i}" for i in range(b * per, (b + 1) * per)], placement, name=f"b{b}")
        for b in range(BUCKETS)
    ]


def _build(variant: str, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    if variant.startswith("c"):
        # the planner's buckets: whole matrices, owners by LPT on Newton–Schulz FLOPs
        buckets = muon_buckets(MatrixBank(), mesh.size())
        model = fs.flex_shard(MatrixBank(), mesh, buckets=buckets)
    else:
        model = fs.flex_shard(MatrixBank(), mesh, buckets=_buckets(fs.Shard(0)))
    params = list(model.parameters())
    if variant.startswith("a"):
        return model, GatherMuon(params, lr=LR)
    if variant.startswith("d"):
        return model, torch.optim.AdamW(params, lr=1e-3)
    return model, DistMuon(params, lr=LR)


def _grads(model: nn.Module, step: int) -> None:
    """Full gradients drawn alike on every rank; each keeps its local part."""
    gen = torch.Generator().manual_seed(100 + step)
    for name, param in model.named_parameters():
        full = torch.randn(SHAPES[int(name[1:])], generator=gen)
        bucket, index = param._flexshard_slot
        regions = bucket.layout.params[index].regions[bucket.rank]
        pieces = [r.view_of(full).reshape(-1) for r in regions]
        param.grad = (torch.cat(pieces) if pieces else full.new_empty(0)).view(param.shape)


def _count_collectives() -> tuple[dict[str, int], Callable[[], None]]:
    counts: dict[str, int] = {}
    saved = {}
    names = ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_reduce")
    for name in names:
        original = getattr(dist, name)
        saved[name] = original

        def counted(*args: Any, _name: str = name, _fn: Callable = original, **kw: Any) -> Any:
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kw)

        setattr(dist, name, counted)

    def restore() -> None:
        for name, fn in saved.items():
            setattr(dist, name, fn)

    return counts, restore


def run_variant(variant: str, rank: int, world_size: int, mesh: DeviceMesh, steps: int) -> dict:
    model, opt = _build(variant, mesh)
    times, cpu, bytes_sent, collectives = [], [], [], []
    for step in range(steps + 2):  # two warm-up steps
        _grads(model, step)
        counts, restore = _count_collectives()
        stats_before = opt.comm_stats()["bytes_sent"] if hasattr(opt, "comm_stats") else 0
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        opt.step()
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        restore()
        if step >= 2:
            times.append(elapsed)
            cpu.append(elapsed_cpu)
            after = opt.comm_stats()["bytes_sent"] if hasattr(opt, "comm_stats") else 0
            bytes_sent.append(after - stats_before)
            collectives.append(sum(counts.values()))
    full = fs.full_state_dict(model)
    digest = hashlib.sha256(b"".join(full[k].numpy().tobytes() for k in sorted(full)))
    return {
        "ms": [t * 1e3 for t in times],
        "cpu_ms": [t * 1e3 for t in cpu],  # this process's CPU time (gloo threads too)
        "bytes_sent": bytes_sent[-1],
        "collectives": collectives[-1],
        "digest": digest.hexdigest()[:16],
    }


def rank_main(rank: int, world_size: int, steps: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, list] = {v: [] for v in VARIANTS}
    for repeat in range(2):  # interleave, the second time in reverse, to spread the noise
        for variant in VARIANTS if repeat == 0 else reversed(VARIANTS):
            out[variant].append(run_variant(variant, rank, world_size, mesh, steps))
    return out
