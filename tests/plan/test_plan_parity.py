"""flexshard-plan against the runtime it models: the bytes per bucket per step and the
sharded gradient / optimizer-state bytes it predicts under the fake backend equal what
the trainer really moves and allocates on W = 3 gloo processes (tiny model whose
shapes W = 3 does not divide), for every placement family, mixed precision, no
reshard after forward, gradient accumulation and Muon."""

from __future__ import annotations

import tempfile

import pytest
import torch

from flexshard.plan.buckets import flexshard_buckets
from flexshard.plan.comm import bucket_comm
from flexshard.plan.memory import rank_memory
from flexshard.plan.report import build_stages, planning_config
from flexshard.testing import run_distributed
from flexshard.trainer.train import setup, train_step

from ..helpers.trainer_cases import tiny_config

#: comm_stats entries that are no bucket (the unused-parameter agreement, the sum)
NOT_BUCKETS = ("total", "grad_agreement")

W = 3
CASES = {
    "shard0": {},
    "flat": {"parallelism": {"placement": "flat"}},
    "owned": {"parallelism": {"placement": "owned"}},
    "block": {"parallelism": {"placement": "block", "block": [8, 16]}},
    "mixed_bf16": {"parallelism": {"placement": "mixed"}, "training": {"mixed_precision": "bf16"}},
    "no_reshard_accum": {
        "parallelism": {"reshard_after_forward": False},
        "training": {"grad_accum": 2},
    },
    "muon": {"parallelism": {"placement": "muon"}, "training": {"optimizer": "muon"}},
}


def _config(name: str, folder: str):
    sections = {k: dict(v) for k, v in CASES[name].items()}
    sections.setdefault("training", {})["steps"] = 2
    return tiny_config(folder, **sections)


FAST = ("shard0", "owned", "mixed_bf16", "muon")
SLOW = tuple(name for name in CASES if name not in FAST)


def _measure(rank: int, world: int, folder: str, names: tuple[str, ...]) -> dict:
    """Per case: bytes each bucket sent in step 2, and the busiest gradient / state."""
    torch.manual_seed(0)
    out = {}
    for name in names:
        job = setup(_config(name, folder))
        for step in range(2):
            job.model.comm_stats(reset=True)
            train_step(job, step)
            stats = job.model.comm_stats(reset=True)
        # sharded gradients are shaped like the local shards (zero_grad set them to None)
        grads = sum(
            p.to_local().numel() * p.element_size()
            for p in job.model.parameters()
            if p.requires_grad
        )
        state = sum(
            t.to_local().numel() * t.element_size()
            if hasattr(t, "to_local")
            else t.numel() * t.element_size()
            for s in job.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        out[name] = {
            "bytes": {b: e["bytes_sent"] for b, e in stats.items() if b not in NOT_BUCKETS},
            "grads": grads,
            "state": state,
        }
    return out


def check_cases(names: tuple[str, ...]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        measured = run_distributed(_measure, W, folder, names, timeout=600)
        for name in names:
            cfg = planning_config(_config(name, folder))
            _, (buckets,) = build_stages(cfg, W, 0)
            accum = cfg.training.grad_accum
            predicted, ragged = {}, set()
            for info in buckets:
                c = bucket_comm(info, accum, keep_between_micro=False)
                predicted[info.name] = c.all_gather + c.reduce_scatter + c.all_reduce
                if info.layout.ragged:
                    ragged.add(info.name)
            for rank in range(W):  # every rank sends its padded shards
                got = measured[rank][name]["bytes"]
                assert {b: n for b, n in got.items() if b not in ragged} == {
                    b: n for b, n in predicted.items() if b not in ragged
                }, (name, rank)
            for bucket in ragged:  # each rank its own extent: the plan counts their mean
                mean = sum(m[name]["bytes"][bucket] for m in measured) / W
                assert abs(mean - predicted[bucket]) <= 8, (name, bucket, mean, predicted)
            memory = rank_memory(buckets, cfg.training.optimizer, 0)
            assert memory.grads == max(m[name]["grads"] for m in measured), name
            # Muon keeps one momentum buffer per matrix, AdamW two moments per element
            assert memory.optimizer == max(m[name]["state"] for m in measured), name


def test_plan_matches_runtime_bytes_and_state() -> None:
    check_cases(FAST)


@pytest.mark.slow
def test_plan_matches_runtime_more_placements() -> None:
    check_cases(SLOW)


def test_buckets_in_forward_order_with_root_first() -> None:
    with tempfile.TemporaryDirectory() as folder:
        cfg = planning_config(_config("owned", folder))
        _, (buckets,) = build_stages(cfg, W, 1)
    assert [b.name for b in buckets] == ["layers.0", "layers.1", "outer"]
    assert [b.is_root for b in buckets] == [False, False, True]
    assert flexshard_buckets([]) == []
