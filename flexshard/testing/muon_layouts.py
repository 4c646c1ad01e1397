"""The trainer's ``placement = "muon"`` against FSDP2's layout with a redistributing
DistMuon (``placement = "shard0"``), measured on W gloo ranks, beside the plan
(``benchmarks/muon_layouts.py`` prints the table; ``tests/optim/
test_muon_layouts_measured.py`` runs one case).

Both sides run in the same processes, one after the other (the order alternates by
case), with the same seed and data. Per rank, at one step after the optimizer state
exists (``plan_memory.measured_step``, under ``LiveTensors``):

- the peak of the buckets' gathered parameters: every bucket's all-gather output and
  the full parameters with memory of their own (``FullParams``), watched as they are
  resized in place, at every allocation;
- the peak of all live tensors (plan_memory's way: the model's state and what the
  step allocates);
- the bytes the buckets sent (``comm_stats()`` of the sharded modules; apart, the
  backward's small all-reduce agreeing on unused parameters, which the plan leaves
  out) and those DistMuon's ``step()`` sent, with its collectives.

The plan (``make_plan``, H100 profile: memory and bytes do not depend on it) gives
``gathered_peak`` (the all-gather outputs *and* the unsharded gradients in flight),
``total`` and ``bytes_per_step`` (the buckets' and DistMuon's all-to-alls). The
gathered parameters alone are the plan's own moments with the unsharded gradients
left out (``step_moments`` on the same buckets, gradients of 0 bytes).
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
from typing import Any

import torch

import flexshard as fs
from flexshard.plan.hardware import H100
from flexshard.plan.peak import step_moments
from flexshard.plan.report import build_stages, make_plan, planning_config
from flexshard.plan.timeline import ActivationTimeline
from flexshard.runtime.hooks import AGREEMENT
from flexshard.runtime.module import own_buckets
from flexshard.trainer.config import Config, config_from_dict
from flexshard.trainer.train import setup, train_step

from .launch import run_distributed
from .live_memory import LiveTensors
from .plan_memory import measured_step

#: fewer heads than ranks (no per-head owner can take a whole head per rank)
LLAMA = {"dim": 128, "n_layers": 4, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 256}
#: as many experts as the largest world: whole experts on their own owners
MOE = {
    "dim": 64,
    "n_layers": 3,
    "n_heads": 2,
    "n_kv_heads": 1,
    "vocab_size": 256,
    "ffn_hidden": 128,
    "moe": {
        "num_experts": 8,
        "top_k": 2,
        "num_shared_experts": 1,
        "expert_hidden": 32,
        "first_dense_layers": 1,
    },
}
MODELS: dict[str, dict[str, Any]] = {"llama": LLAMA, "moe": MOE}
TRAINING = {"seq_len": 64, "batch_size": 2, "lr": 1e-3, "muon_lr": 1e-3, "optimizer": "muon"}
SIDES = ("muon", "shard0")
MEASURED_STEP = 2  # the third: momentum buffers and DistMuon's plan exist


def side_config(folder: str, model: str, world: int, placement: str, steps: int) -> Config:
    return config_from_dict(
        {
            "model": MODELS[model],
            "training": {**TRAINING, "steps": steps},
            "parallelism": {"dp_shard": world, "placement": placement},
            "job": {"dump_folder": folder, "progress": False, "plot": False, "tensorboard": False},
        }
    )


def gathered_tensors(job: Any) -> list[torch.Tensor]:
    """Every bucket's all-gather output and its full parameters with a storage of their
    own (the others are views of the output): allocated while gathered, else empty."""
    out: list[torch.Tensor] = []
    for top in job.parallel.modules:
        for module in top.modules():
            for bucket in own_buckets(module):
                full = bucket.full
                if full.gathered is not None:
                    out.append(full.gathered)
                out += [t for t, owns in zip(full.locals, full.owns) if owns]
    return out


def _bucket_comm(job: Any) -> dict[str, int]:
    """The buckets' collectives and bytes since the last call, summed over the sharded
    modules (the trainer reads the same counters); ``agreement_bytes``: of
    ``bytes_sent``, the backward's all-reduce of which parameters got gradients."""
    out: dict[str, int] = {"agreement_bytes": 0}
    for module in job.parallel.modules:
        if isinstance(module, fs.FlexShardModule):
            stats = module.comm_stats(reset=True)
            for key, value in stats["total"].items():
                out[key] = out.get(key, 0) + value
            out["agreement_bytes"] += stats.get(AGREEMENT, {}).get("bytes_sent", 0)
    return out


def _optimizer_comm(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What DistMuon's ``step()`` sent since the last call, and its collectives."""
    stats = optimizer.comm_stats(reset=True)  # type: ignore[attr-defined]
    return {
        "bytes_sent": stats["bytes_sent"],
        "collectives": stats["all_to_all"] + stats.get("tp_all_gather", 0),
    }


def _run_side(folder: str, model: str, world: int, side: str, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    job = setup(side_config(f"{folder}/{side}", model, world, side, steps))
    losses: list[float] = []
    measured: dict[str, Any] = {}
    for step in range(steps):
        if step != MEASURED_STEP:
            losses.append(train_step(job, step)[0])
            continue
        _bucket_comm(job), _optimizer_comm(job.optimizer)  # count this step alone
        live = LiveTensors()
        live.watch(gathered_tensors(job), "gathered")
        measured = measured_step(job, step, live)
        losses.append(measured.pop("loss"))
        measured["gathered_peak_bytes"] = live.watched_peaks["gathered"]
        measured["buckets"] = _bucket_comm(job)
        measured["optimizer"] = _optimizer_comm(job.optimizer)
    del job
    gc.collect()  # the first side's buffers gone before the second side's step
    return {**measured, "losses": losses}


def measure_rank(
    rank: int, world: int, folder: str, model: str, steps: int, first: str
) -> dict[str, dict[str, Any]]:
    """Both sides on this rank, ``first`` first."""
    order = SIDES if first == SIDES[0] else tuple(reversed(SIDES))
    return {side: _run_side(folder, model, world, side, steps) for side in order}


def planned(model: str, world: int, side: str) -> dict[str, Any]:
    """The plan's memory and bytes for the same config and W (the busiest rank), and
    its gathered parameters alone (its moments without the unsharded gradients)."""
    with tempfile.TemporaryDirectory() as folder:
        cfg = side_config(folder, model, world, side, 4)
        plan = make_plan(cfg, world, H100, None, ("flexshard",))["backends"]["flexshard"]
        _, stages = build_stages(planning_config(cfg), world, None)
    no_grads = [dataclasses.replace(b, reduce_itemsize=0) for b in stages[0]]
    moments = step_moments(no_grads, ActivationTimeline(0, 0, 0, 0))
    muon = plan["muon"] or {}
    return {
        "gathered_peak": plan["memory"]["gathered_peak"],
        "gathered_params_peak": max(m.gathered for m in moments),
        "total": plan["memory"]["total"],
        "bytes_per_step": plan["bytes_per_step"],
        "optimizer_bytes": muon.get("all_to_all_bytes", 0),
    }


def _gap(measured: float, planned: float) -> float:
    return planned / measured - 1 if measured else 0.0


def compare(model: str, world: int, steps: int = 4, first: str = "muon") -> list[dict[str, Any]]:
    """One launch: both sides on ``world`` ranks; one row per side."""
    if steps <= MEASURED_STEP:
        raise ValueError(f"steps = {steps}: the measured step is step {MEASURED_STEP + 1}")
    with tempfile.TemporaryDirectory() as folder:
        per_rank = run_distributed(measure_rank, world, folder, model, steps, first, timeout=900)
    rows = []
    for side in SIDES:
        ranks = [r[side] for r in per_rank]
        plan = planned(model, world, side)
        gathered = max(r["gathered_peak_bytes"] for r in ranks)
        total = max(r["peak_bytes"] for r in ranks)
        buckets = [r["buckets"]["bytes_sent"] for r in ranks]
        opt = [r["optimizer"] for r in ranks]
        agreement = sum(r["buckets"]["agreement_bytes"] for r in ranks) / world
        # the plan counts bytes per rank averaged over the group (ragged extents differ),
        # without the agreement all-reduce
        sent = (sum(buckets) + sum(o["bytes_sent"] for o in opt)) / world - agreement
        rows.append(
            {
                "model": model,
                "world": world,
                "side": side,
                "first": first,
                "gathered_params_peak": gathered,
                "gathered_params_peak_per_rank": [r["gathered_peak_bytes"] for r in ranks],
                "total_peak": total,
                "total_peak_phase": max(ranks, key=lambda r: r["peak_bytes"])["peak_phase"],
                "total_peak_per_rank": [r["peak_bytes"] for r in ranks],
                "bucket_bytes_per_rank": buckets,
                "bucket_bytes_mean": sum(buckets) / world,
                "bucket_collectives_rank0": ranks[0]["buckets"],
                "agreement_bytes_mean": agreement,
                "optimizer_bytes_per_rank": [o["bytes_sent"] for o in opt],
                "optimizer_collectives": max(o["collectives"] for o in opt),
                "bytes_per_step_mean": sent,
                "losses": ranks[0]["losses"],
                "planned": plan,
                "gap_gathered_params": _gap(gathered, plan["gathered_params_peak"]),
                "gap_total": _gap(total, plan["total"]),
                "gap_bytes": _gap(sent, plan["bytes_per_step"]),
            }
        )
    muon, shard0 = rows
    gaps = [abs(a - b) / abs(b) for a, b in zip(muon["losses"], shard0["losses"])]
    for row in rows:
        row["max_loss_gap"] = max(gaps)
    return rows
