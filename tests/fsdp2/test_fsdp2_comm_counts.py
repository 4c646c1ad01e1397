"""fully_shard issues exactly FSDP2's collectives, counted by the shared logger (every
torch.distributed route) around the same training on the same model: the scenarios of
torch's ``test_fully_shard_communication_count``, ``reshard_after_forward`` as an int
and ``test_gradient_accumulation`` (no-sync micro-batches, then a synced one). The
unused-gradient agreement is flexshard's opt-in (``set_agree_on_unused_params``): with
it, one all-reduce per synced backward more, and nothing else."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed
from flexshard.testing.collectives import record_collectives

from ..reference import sharded_training

CFG = TransformerConfig(layers=3)
STEPS = 3


def _build(shard: Callable, mesh, reshard: bool | int | None) -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer(CFG)
    for layer in model.layers:
        shard(layer, mesh=mesh, reshard_after_forward=reshard)
    shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _train(model: TinyTransformer, rank: int, world: int, micro: int) -> list[float]:
    """``STEPS`` steps of ``micro`` micro-batches, all but the last without gradient sync."""
    batches = make_batches(CFG, STEPS * micro * world, batch=2, seed=3)
    return sharded_training(model, rank, world, batches, STEPS, micro)


def _counts(rank: int, world: int, reshard: bool | int | None, micro: int, agree: bool) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("flexshard", fs.fully_shard)):
        model = _build(shard, mesh, reshard)
        if agree and name == "flexshard":
            model.set_agree_on_unused_params(True)
        with record_collectives() as log:
            losses = _train(model, rank, world, micro)
        out[name] = {"counts": dict(log.counts()), "losses": losses}
    return out


SCENARIOS = {  # name: (world, reshard_after_forward, micro-batches per step)
    "communication_count": (3, None, 1),
    "reshard_true": (2, True, 1),
    "reshard_int_world": (2, 2, 1),  # an int of the group's size is True
    "reshard_int_1": (3, 1, 1),  # 1 is False
    "gradient_accumulation": (3, True, 3),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_fully_shard_issues_fsdp2s_collectives(scenario: str) -> None:
    world, reshard, micro = SCENARIOS[scenario]
    for rank, out in enumerate(run_distributed(_counts, world, reshard, micro, False)):
        assert out["flexshard"]["losses"] == out["fsdp2"]["losses"], f"rank {rank}"
        assert out["flexshard"]["counts"] == out["fsdp2"]["counts"], f"rank {rank}"
        assert out["fsdp2"]["counts"]["all_gather_single"] > 0  # the log sees them


def test_agreement_is_one_all_reduce_per_synced_backward_more() -> None:
    world, reshard, micro = SCENARIOS["gradient_accumulation"]
    for out in run_distributed(_counts, world, reshard, micro, True):
        ours, theirs = dict(out["flexshard"]["counts"]), dict(out["fsdp2"]["counts"])
        assert ours.pop("all_reduce") == STEPS  # once per synced backward, not per micro
        assert ours == theirs
        assert out["flexshard"]["losses"] == out["fsdp2"]["losses"]


def _one_rank(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("flexshard", fs.fully_shard)):
        model = _build(shard, mesh, None)
        with record_collectives() as log:
            out[name] = {"losses": _train(model, rank, world, 2), "counts": dict(log.counts())}
        if name == "flexshard":
            out["stats"] = model.comm_stats()["total"]
    return out


def test_a_group_of_one_rank_issues_no_collective() -> None:
    """W = 1: FSDP2 copies instead of calling c10d, and so does flexshard (no all-gather,
    reduce-scatter or wait per bucket), with the same losses."""
    (out,) = run_distributed(_one_rank, 1)
    assert out["flexshard"]["counts"] == out["fsdp2"]["counts"] == {}
    assert out["stats"]["collectives"] == 0 and out["stats"]["bytes_sent"] == 0
    assert out["flexshard"]["losses"] == out["fsdp2"]["losses"]
