"""A rank that stalls in the trainer's own exchanges (EP's all-to-alls, CP's K/V
all-gathers and their backward reduce-scatters, ring attention's sends, in forward
and in backward) or in checkpoint I/O (``fs.checkpoint.save`` / ``load``): the others
raise flexshard's CollectiveError naming the layer and the exchange (the checkpoint
step and path) within the configured timeout, not the backend's 30 minutes.

One spawn of W = 3 ranks, each scenario on a fresh process group (the one it broke
stays broken): rank 2 sleeps past the timeout before the forward or before the
backward, then abandons the scenario (as tests/runtime/test_faults.py does for the buckets).

Then the trainer's own waits (TP's DTensor collectives, the pipeline's sends and
receives, the MoE load and loss all-reduces), through ``setup`` and ``train_step`` on
2 ranks with ``parallelism.timeout_s = 2``: see below.
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
from flexshard.trainer.models.model import Transformer, init_weights
from flexshard.trainer.parallel.context_parallel import apply_cp, split_sequence
from flexshard.trainer.parallel.expert_parallel import apply_ep
from flexshard.trainer.train import loss_fn
from tests.runtime.test_faults import BUCKETS, run_tolerant

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
    model = fs.flex_shard(model, mesh=group, buckets=BUCKETS, timeout=timeout)
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


# --- The trainer's own waits on its mesh (groups made with parallelism.timeout_s):
# TP's DTensor collectives (forward, backward), the pipeline's sends and receives, the
# MoE load all-reduce and the step's loss all-reduce. One spawn of 2 ranks running
# train_step; rank 1 stalls before the step, before its backward, before the optimizer
# step (the MoE load all-reduce follows it) or before the lr step (the loss all-reduce
# follows it). The loss all-reduce runs on the world group: its scenario comes last.

STEP_W = 2
STEP_VICTIM = 1
TIMEOUT_S = 2.0
STEP_MOE = {"num_experts": 2, "top_k": 1, "expert_hidden": 16, "first_dense_layers": 1}
# name: (parallelism, model.moe or None, where the victim stalls)
STEP_SCENARIOS: dict[str, tuple[dict, dict | None, str]] = {
    "tp_forward": ({"dp_shard": 1, "tp": 2}, None, "step"),
    "tp_backward": ({"dp_shard": 1, "tp": 2}, None, "backward"),
    "pp_send_recv": ({"dp_shard": 1, "pp": 2, "pp_schedule": "gpipe"}, None, "step"),
    "moe_balance": ({"dp_shard": 2}, STEP_MOE, "optimizer"),
    "loss_all_reduce": ({"dp_shard": 2}, None, "lr_scheduler"),
}
FAST_STEP_SCENARIO = "pp_send_recv"


def _step_config(folder: str, name: str):
    from tests.trainer.test_parallel_layouts import layout_config

    parallelism, moe, _ = STEP_SCENARIOS[name]
    parallelism = {**parallelism, "timeout_s": TIMEOUT_S}
    return layout_config(f"{folder}/{name}", parallelism, moe, training={"steps": 1})


def _step_scenario(name: str, victim: bool, folder: str) -> float:
    """Set the job up on every rank, then one train_step; the seconds it took here."""
    from flexshard.trainer.train import setup, train_step

    # the ranks set up together: a rank slower than timeout_s (a loaded machine) would
    # fail the creation of the mesh's groups, or the first collective, before the stall
    dist.barrier()
    job = setup(_step_config(folder, name))
    dist.barrier()
    where = STEP_SCENARIOS[name][2]
    backward = torch.Tensor.backward
    if victim:
        if where == "step":
            _stall()
        if where == "backward":
            torch.Tensor.backward = lambda *args, **kwargs: _stall()  # type: ignore[method-assign]
        if where == "optimizer":
            job.optimizer.step = _stall  # type: ignore[method-assign]
        if where == "lr_scheduler":
            job.lr_scheduler.step = _stall  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        train_step(job, 0)
    finally:
        torch.Tensor.backward = backward  # type: ignore[method-assign]
    return time.monotonic() - started


def _step_stalls(rank: int, world_size: int, folder: str, names: list[str]) -> dict:
    out = {}
    for name in names:
        err, seconds = None, None
        started = time.monotonic()
        try:
            seconds = _step_scenario(name, rank == STEP_VICTIM, folder)
        except _Stalled:
            continue
        except Exception as caught:
            err, seconds = caught, time.monotonic() - started
        out[name] = {
            "type": type(err).__name__,
            "message": str(err),
            "notes": list(getattr(err, "__notes__", [])),
            "of": getattr(err, "bucket", None),
            "collective": getattr(err, "collective", None),
            "is_collective_error": isinstance(err, CollectiveError),
            "seconds": seconds,
        }
    return out


# torch's collectives (TP, the pipeline): the backend's timeout error, the mesh group's
# timeout named (not gloo's 30 minutes)
TORCH_TIMEOUT = "; timeout 2 s): "
# name: (what was in flight, of what, a fragment of the message)
STEP_EXPECTED = {
    "tp_forward": (
        "forward and backward",
        "training step 1",
        "tp group ranks [0, 1]" + TORCH_TIMEOUT,
    ),
    "tp_backward": (
        "forward and backward",
        "training step 1",
        "tp group ranks [0, 1]" + TORCH_TIMEOUT,
    ),
    "pp_send_recv": (
        "gpipe schedule run 1 (sends/receives, loss broadcast)",
        "pipeline stage(s) [0]",
        "pp group ranks [0, 1]" + TORCH_TIMEOUT,
    ),
    "moe_balance": (
        "MoE load all-reduce",
        "layer 'layers.1.feed_forward'",
        "did not complete within the timeout (2 s)",
    ),
    "loss_all_reduce": (
        "loss all-reduce",
        "training step 1",
        "did not complete within the timeout (2 s)",
    ),
}


def _check_step_stall(results: list[dict], name: str) -> None:
    assert results[STEP_VICTIM] is not None and name not in results[STEP_VICTIM]  # it stalled
    got = results[1 - STEP_VICTIM][name]
    collective, of, fragment = STEP_EXPECTED[name]
    assert got["is_collective_error"], got
    assert (got["collective"], got["of"]) == (collective, of), got
    message = got["message"]
    assert message.startswith(f"flexshard: {collective} of {of} "), message
    assert fragment in message and "on rank 0" in message and "stalled" in message, message
    if name == "pp_send_recv":  # the step that ran the schedule is named too
        assert got["notes"] == ["flexshard: raised in forward and backward of training step 1"]
    # it waited the configured timeout, not the backend's 30 minutes
    assert TIMEOUT_S - 0.1 <= got["seconds"] < 30, got


@pytest.fixture(scope="module")
def step_stalls(tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("stalled_steps"))
    return run_tolerant(_step_stalls, STEP_W, folder, list(STEP_SCENARIOS), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STEP_SCENARIOS))
def test_a_rank_stalled_in_a_train_step_makes_the_other_raise_within_timeout_s(step_stalls, name):
    _check_step_stall(step_stalls, name)


def test_a_rank_stalled_in_the_pipeline_makes_the_other_raise_within_timeout_s(tmp_path):
    """Fast: the pipeline's send/recv alone (a spawn of its own)."""
    names = [FAST_STEP_SCENARIO]
    results = run_tolerant(_step_stalls, STEP_W, str(tmp_path), names, timeout=120)
    _check_step_stall(results, FAST_STEP_SCENARIO)
