"""Activation checkpointing (``[activation_checkpoint]``) in the trainer: with ``full``,
``selective`` by op and ``selective`` every 2nd block, the losses, gradient norms,
every rank's local gradients and the final parameters equal the run without it BIT FOR
BIT on dp (odd W = 3, every placement, both backends), dp x tp, pp, cp (all-gather and
ring) and ep layouts. Each step issues exactly the plain run's data-parallel and
pipeline collectives (counted per group by the backend); only the block's own TP / CP
/ EP exchanges run again in a recompute (TP's not under op-level AC, which keeps their
outputs). flexshard's buckets are gathered and freed in the same sequence (a
recompute neither gathers again nor keeps a bucket longer), and the blocks really
recompute (their attention runs once more per checkpointed block).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from flexshard.runtime.bucket import Bucket
from flexshard.testing import run_distributed
from flexshard.testing.collectives import record_collectives
from flexshard.trainer.models.model import Attention
from flexshard.trainer.train import setup, train_step

from ..helpers.trainer_cases import whole_parameters
from .test_parallel_layouts import MOE, layout_config

STEPS = 2  # the second step runs on the first step's updated weights and AdamW state
N_LAYERS = 4  # layout_config's
MODES: dict[str, dict[str, str]] = {
    "none": {"mode": "none"},
    "full": {"mode": "full"},
    "op": {"mode": "selective", "selective_ac_option": "op"},
    "every2": {"mode": "selective", "selective_ac_option": "2"},
}
# name: (world size, [parallelism], [model.moe] or None)
LAYOUTS: dict[str, tuple[int, dict, dict | None]] = {
    "dp3": (3, {"dp_shard": 3}, None),
    "dp3_flat": (3, {"dp_shard": 3, "placement": "flat"}, None),
    "dp3_owned": (3, {"dp_shard": 3, "placement": "owned"}, None),
    "dp3_block": (3, {"dp_shard": 3, "placement": "block", "block": [8, 8]}, None),
    "dp3_mixed_keep": (
        3,
        {"dp_shard": 3, "placement": "mixed", "reshard_after_forward": False},
        None,
    ),
    "dp3_fsdp2": (3, {"dp_shard": 3, "dp_backend": "fsdp2"}, None),
    "dp2xtp2": (4, {"dp_shard": 2, "tp": 2}, None),
    "dp2xtp2_fsdp2": (4, {"dp_shard": 2, "tp": 2, "dp_backend": "fsdp2"}, None),
    "dp2xpp2": (4, {"dp_shard": 2, "pp": 2}, None),
    "dp2xcp2": (4, {"dp_shard": 2, "cp": 2}, None),
    "dp2xcp2_ring": (4, {"dp_shard": 2, "cp": 2, "cp_method": "ring"}, None),
    "dp4xep2": (4, {"dp_shard": 4, "ep": 2}, MOE),
    "dp4xep2_fsdp2": (4, {"dp_shard": 4, "ep": 2, "dp_backend": "fsdp2"}, MOE),
}

_EVENTS: list[tuple[str, str]] = []  # this process's bucket gathers and frees, in order


def _log_bucket_events() -> None:
    """Record every all-gather a bucket lands and every gathered bucket freed."""
    if getattr(Bucket, "_ac_logged", False):
        return
    finish, reshard = Bucket._finish_gather, Bucket.reshard

    def logged_finish(self: Bucket) -> None:
        _EVENTS.append(("gather", self.name))
        finish(self)

    def logged_reshard(self: Bucket) -> None:
        held = self.full.unsharded or self.gather_in_flight
        reshard(self)
        if held:
            _EVENTS.append(("free", self.name))

    Bucket._finish_gather, Bucket.reshard = logged_finish, logged_reshard  # type: ignore[method-assign]
    Bucket._ac_logged = True  # type: ignore[attr-defined]


def _group_ranks() -> dict[str, tuple[int, ...]]:
    """Process group name -> its ranks: names differ between two setups, ranks not."""
    return {
        name: tuple(dist.get_process_group_ranks(pg))
        for pg, name in c10d._world.pg_names.items()
        if pg is not dist.GroupMember.NON_GROUP_MEMBER
    }


def _recomputed_groups(job: Any, mode: str) -> set[tuple[int, ...]]:
    """The groups whose collectives a recompute runs again: the trainer's own CP / EP
    exchanges, and TP's where whole blocks recompute (op-level AC keeps TP's outputs)."""
    groups = set()
    if job.meshes.tp is not None and mode in ("full", "every2"):
        groups.add(tuple(dist.get_process_group_ranks(job.meshes.tp.get_group())))
    for module in job.parallel.modules:
        for sub in module.modules():
            for attr in ("expert_parallel", "context_parallel"):
                exchange = getattr(getattr(sub, attr, None), "exchange", None)
                if exchange is not None:
                    groups.add(tuple(dist.get_process_group_ranks(exchange.group)))
    return groups


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _train(folder: str, name: str, mode: str) -> dict[str, Any]:
    _, parallelism, moe = LAYOUTS[name]
    cfg = layout_config(
        f"{folder}/{name}_{mode}",
        parallelism,
        moe,
        training={"steps": STEPS},
        activation_checkpoint=MODES[mode],
    )
    job = setup(cfg)
    calls = [0]
    blocks = [b for module in job.parallel.modules for b in module.layers.children()]
    marked = sum(b.checkpoint is not None for b in blocks)
    for module in job.parallel.modules:
        for sub in module.modules():
            if isinstance(sub, Attention):
                sub.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    grads: list[list[torch.Tensor]] = []
    step_fn = job.optimizer.step

    def step_and_keep_grads(*args: Any, **kwargs: Any) -> Any:
        grads.append([_local(p.grad).clone() for p in job.parallel.parameters()])
        return step_fn(*args, **kwargs)

    job.optimizer.step = step_and_keep_grads  # type: ignore[method-assign]
    steps = []
    for step in range(STEPS):
        _EVENTS.clear()
        calls[0] = 0
        with record_collectives() as log:
            loss, norm, _ = train_step(job, step)
        per_group: Counter[tuple[int, ...]] = Counter()
        ranks = _group_ranks()
        for record in log.records:
            for name, count in record.groups.items():
                per_group[ranks[name]] += count
        # DTensor's funcol wrappers run again in a recompute, but the op answers from
        # the saved output: count what the process groups issued, and c10d calls
        named = {k: v for k, v in log.counts().items() if not k.startswith("funcol.")}
        steps.append(
            {
                "loss": loss,
                "norm": norm,
                "collectives": named,
                "per_group": dict(per_group),
                "issued": log.issued(),
                "buckets": list(_EVENTS),
                "attention_calls": calls[0],
            }
        )
    params = whole_parameters(job)
    return {
        "steps": steps,
        "grads": grads,
        "params": params,
        "blocks": (marked, len(blocks)),
        "recomputed_groups": _recomputed_groups(job, mode),
    }


def _cases(rank: int, world_size: int, folder: str, names: list[str]) -> dict:
    _log_bucket_events()
    return {(n, m): _train(folder, n, m) for n in names for m in MODES}


def _check(results: list[dict], names: list[str]) -> None:
    for rank, by_case in enumerate(results):
        for name in names:
            plain = by_case[(name, "none")]
            for mode in MODES:
                ran = by_case[(name, mode)]
                where = (name, mode, rank)
                marked, blocks = ran["blocks"]
                assert marked == {"none": 0, "every2": blocks // 2}.get(mode, blocks), where
                for got, want in zip(ran["steps"], plain["steps"]):
                    # bit for bit: the same ops on the same inputs in the same order
                    assert got["loss"] == want["loss"] and got["norm"] == want["norm"], where
                    # data-parallel buckets and PP: exactly the plain run's collectives;
                    # the block's own TP / CP / EP exchanges run again in its recompute
                    exchanges = ran["recomputed_groups"]
                    for group in set(got["per_group"]) | set(want["per_group"]):
                        count, plain_count = (
                            got["per_group"].get(group, 0),
                            want["per_group"].get(group, 0),
                        )
                        if group in exchanges and marked:
                            assert count > plain_count, (where, group)
                        else:
                            assert count == plain_count, (where, group, count, plain_count)
                    if not exchanges:
                        assert got["collectives"] == want["collectives"], (where, got, want)
                        assert got["issued"] == want["issued"], where
                    assert got["buckets"] == want["buckets"], where
                    # each marked block's attention runs once more (its recompute)
                    calls = want["attention_calls"]
                    assert got["attention_calls"] == calls + calls * marked // blocks, where
                for got_step, want_step in zip(ran["grads"], plain["grads"]):
                    assert len(got_step) == len(want_step), where
                    for g, w in zip(got_step, want_step):
                        assert torch.equal(g, w), where
                for key, value in plain["params"].items():
                    assert torch.equal(ran["params"][key], value), (where, key)


def _run(world_size: int, names: list[str], tmp_path) -> None:
    results = run_distributed(_cases, world_size, str(tmp_path), names, timeout=900)
    _check(results, names)
    for name in names:
        steps = results[0][(name, "none")]["steps"]
        print(f"{name}: collectives per step {steps[-1]['issued']}, {steps[-1]['collectives']}")


def test_odd_world_every_placement_both_backends(tmp_path):
    _run(3, [n for n, (w, _, _) in LAYOUTS.items() if w == 3], tmp_path)


def test_tp_pp_cp_ep_layouts(tmp_path):
    _run(4, [n for n, (w, _, _) in LAYOUTS.items() if w == 4], tmp_path)
