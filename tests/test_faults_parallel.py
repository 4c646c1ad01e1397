"""A rank that stalls in the trainer's own exchanges (EP's all-to-alls, CP's K/V
all-gathers and their backward reduce-scatters, ring attention's sends, in forward
and in backward) or in checkpoint I/O (``fs.checkpoint.save`` / ``load``): the others
raise flexshard's CollectiveError naming the layer and the exchange (the checkpoint
step and path) within the configured timeout, not the backend's 30 minutes.

One spawn of W = 3 ranks, each scenario on a fresh process group (the one it broke
stays broken): rank 2 sleeps past the timeout before the forward or before the
backward, then abandons the scenario (as tests/test_faults.py does for the buckets).
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from flexshard.runtime.collectives import CollectiveError
from flexshard.testing import TinyTransformer, TransformerConfig
from flexshard.trainer.config import ModelConfig, config_from_dict
from flexshard.trainer.context_parallel import apply_cp, split_sequence
from flexshard.trainer.expert_parallel import apply_ep
from flexshard.trainer.model import Transformer, init_weights
from flexshard.trainer.train import loss_fn
from tests.test_faults import BUCKETS, run_tolerant

W = 3
VICTIM = 2
TIMEOUT = datetime.timedelta(seconds=2)
STALL = 3.5  # past the survivors' timeouts
SEQ = 12  # divisible by 2 * cp = 6

# scenario: (layout, where the victim stalls)
SCENARIOS = {
    "ep_forward": ("ep", "forward"),
    "ep_backward": ("ep", "backward"),
    "cp_allgather_forward": ("allgather", "forward"),
    "cp_allgather_backward": ("allgather", "backward"),
    "cp_ring_forward": ("ring", "forward"),
    "cp_ring_backward": ("ring", "backward"),
    # checkpoints: each on its own timeout, hence on its own bounded group (a group a
    # rank stalled on stays broken)
    "checkpoint_save_first": ("save_first", "save"),
    "checkpoint_save": ("save", "save"),
    "checkpoint_load": ("load", "load"),
}
CHECKPOINT_TIMEOUTS = {"save_first": 2.0, "save": 2.25, "load": 2.5}


def _model_config(num_experts: int) -> ModelConfig:
    moe = {"num_experts": num_experts, "top_k": 2, "expert_hidden": 24, "first_dense_layers": 1}
    table = {"model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "moe": moe}}
    return config_from_dict(table).model


class _Stalled(Exception):
    pass


def _stall() -> None:
    time.sleep(STALL)
    raise _Stalled


def _checkpoint(case: str, group: dist.ProcessGroup, victim: bool, folder: str) -> None:
    """The victim stalls before the first save on a new bounded group, or before a
    save / load after a good save (the model's timeout is the default: ``save``)."""
    timeout = datetime.timedelta(seconds=CHECKPOINT_TIMEOUTS[case])
    model = TinyTransformer(TransformerConfig())
    model = fs.flex_shard(model, group, buckets=BUCKETS, timeout=timeout)
    good, path = f"{folder}/{case}-good", f"{folder}/{case}"
    if case != "save_first":
        fs.checkpoint.save(good, model, timeout=None if case == "save" else timeout)
    if victim:
        _stall()
    try:
        if case == "load":
            fs.checkpoint.load(good, model, timeout=timeout)
        else:
            fs.checkpoint.save(path, model, timeout=None if case == "save" else timeout)
    finally:
        _complete[case] = os.path.exists(path)


_complete: dict[str, bool] = {}  # whether the failed save left a complete checkpoint


def _scenario(layout: str, where: str, group: dist.ProcessGroup, victim: bool, folder: str) -> None:
    if where in ("save", "load"):
        _checkpoint(layout, group, victim, folder)
        return
    model = Transformer(_model_config(3 if layout == "ep" else 0))
    init_weights(model, 0)
    batch = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if layout == "ep":
        apply_ep(model, group, TIMEOUT)
        inputs = inputs[:, dist.get_rank(group) :: W]  # each EP rank its own tokens
        targets = targets[:, dist.get_rank(group) :: W]
    else:
        apply_cp(model, group, layout, TIMEOUT)  # type: ignore[arg-type]
        inputs, targets = split_sequence(inputs, group), split_sequence(targets, group)
    if victim and where == "forward":
        _stall()
    loss = loss_fn(model(inputs), targets)
    if victim:
        _stall()
    loss.backward()


def _stall_cases(rank: int, world_size: int, folder: str) -> dict:
    out = {}
    for name, (layout, where) in SCENARIOS.items():
        group = dist.new_group()  # gloo's own timeout (30 min) is not the one that fires
        started, err = time.monotonic(), None
        try:
            _scenario(layout, where, group, rank == VICTIM, folder)
        except _Stalled:
            continue
        except Exception as caught:
            err = caught
        out[name] = {
            "type": type(err).__name__,
            "message": str(err),
            "layer": getattr(err, "bucket", None),
            "collective": getattr(err, "collective", None),
            "is_collective_error": isinstance(err, CollectiveError),
            "seconds": time.monotonic() - started,
            "complete": _complete.get(layout),
        }
    return out


@pytest.fixture(scope="module")
def stalls(tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("stalled_checkpoints"))
    return run_tolerant(_stall_cases, W, folder, timeout=200)


# scenario: (layer named, exchange in flight) on the survivors; the backward runs the
# last layer first, and its first exchange is the last one of the forward
EXPECTED = {
    "ep_forward": ("layers.1.feed_forward.experts", {"EP token-count all-to-all"}),
    "ep_backward": ("layers.1.feed_forward.experts", {"EP combine all-to-all (backward)"}),
    "cp_allgather_forward": ("layers.0.attention", {"CP key all-gather"}),
    "cp_allgather_backward": (
        "layers.1.attention",
        {f"CP {kv} gradient reduce-scatter (backward)" for kv in ("key", "value")},
    ),
    "cp_ring_forward": ("layers.0.attention", {"CP ring K/V block send/recv (forward)"}),
    "cp_ring_backward": ("layers.1.attention", {"CP ring K/V block send/recv (backward)"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(EXPECTED))
def test_a_stalled_rank_makes_the_others_raise_naming_layer_and_exchange(stalls, scenario):
    layer, collectives = EXPECTED[scenario]
    assert stalls[VICTIM] is not None and scenario not in stalls[VICTIM]  # it stalled
    for rank in range(W):
        if rank == VICTIM:
            continue
        got = stalls[rank][scenario]
        assert got["is_collective_error"], got
        assert got["layer"] == layer and got["collective"] in collectives, got
        message = got["message"]
        assert f"{got['collective']} of layer '{layer}'" in message, message
        # the configured timeout fired, not gloo's 30 minutes
        assert "did not complete within the timeout (2 s)" in message, message
        assert f"on rank {rank}" in message and "stalled" in message, message


CHECKPOINT_STEPS = {  # scenario: (step in flight, timeout)
    "checkpoint_save_first": ("set-up of the bounded checkpoint group", "2"),
    "checkpoint_save": ("barrier before writing", "2.25"),
    "checkpoint_load": ("check all-gather", "2.5"),
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(CHECKPOINT_STEPS))
def test_a_rank_stalled_in_checkpoint_io_makes_the_others_raise_naming_the_step(stalls, scenario):
    step, seconds = CHECKPOINT_STEPS[scenario]
    assert stalls[VICTIM] is not None and scenario not in stalls[VICTIM]
    for rank in range(W):
        if rank == VICTIM:
            continue
        got = stalls[rank][scenario]
        assert got["is_collective_error"] and got["collective"] == step, got
        assert got["layer"].startswith("checkpoint '") and scenario.split("_")[1] in got["layer"]
        message = got["message"]
        assert f"{step} of checkpoint '" in message and f"timeout {seconds} s" in message, message
        assert f"on rank {rank}" in message and "stalled" in message, message
        if scenario != "checkpoint_load":
            assert got["complete"] is False  # nothing renamed into place
