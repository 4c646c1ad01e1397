"""A rank that dies in one of DCP's own steps of a load (its local plan, the
coordinator's global plan, the read) makes the other ranks raise within the load's
timeout, naming the dead rank, with their model unchanged: also when the dead rank is
rank 0, whose process serves the job's store. One spawn of 3 ranks per death."""

from __future__ import annotations

import datetime
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from flexshard.checkpoint import load_progress, safe_load, verified_read
from flexshard.testing import TinyTransformer, TransformerConfig
from tests.runtime.test_faults import run_tolerant

TIMEOUT = datetime.timedelta(seconds=60)  # generous: the machine is shared


def _die(*args: object, **kwargs: object) -> None:
    os._exit(3)


#: where the victim dies: (victim, what it replaces, the step the others name)
DEATHS = {
    "local plan": (2, (safe_load.SafeLoadPlanner, "create_local_plan"), "DCP's plan"),
    "global plan": (0, (load_progress.TrackedReader, "prepare_global_plan"), "DCP's plan"),
    "read": (1, (verified_read.VerifyingReader, "read_chunks"), "DCP's read"),
}


def _model(seed: int, sharded: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyTransformer(TransformerConfig())
    if sharded:
        buckets = [fs.BucketSpec("*", placement=fs.Shard(0))]
        fs.flex_shard(model, mesh=dist.group.WORLD, buckets=buckets)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's checkpoint (a W = 3 load reshards it)."""
    root = tmp_path_factory.mktemp("load_faults") / "ckpt"
    fs.checkpoint.save(root, *_model(0))
    return root


def _dies_in(rank: int, world: int, root: str, death: str) -> dict | None:
    victim, (owner, method), _ = DEATHS[death]
    if rank == victim:
        setattr(owner, method, _die)
    model, optimizer = _model(1, sharded=True)
    before = [p.to_local().clone() for p in model.parameters()]
    started = time.monotonic()
    try:
        fs.checkpoint.load(root, model, optimizer, timeout=TIMEOUT)
    except Exception as err:
        after = [p.to_local() for p in model.parameters()]
        return {
            "type": type(err).__name__,
            "error": str(err),
            "seconds": time.monotonic() - started,
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        }
    return {"type": None}


@pytest.mark.parametrize("death", list(DEATHS))
def test_a_rank_dying_in_dcps_steps_is_named(saved, death):
    victim, _, step = DEATHS[death]
    results = run_tolerant(_dies_in, 3, os.fspath(saved), death, timeout=180)
    assert results[victim] is None  # it died without a word
    for rank in {0, 1, 2} - {victim}:
        got = results[rank]
        assert got is not None and got["type"] == "CollectiveError", (rank, got)
        assert got["unchanged"] and got["seconds"] < TIMEOUT.total_seconds(), (rank, got)
        named = re.escape(f"in {step}") + r".*: rank\(s\) " + re.escape(f"[{victim}] never")
        assert re.search(named, got["error"]), (rank, got)
