"""Bitwise parity with torch FSDP2 for Shard(0) in fp32, and collective counts (as
flexshard reports them, as the shared logger sees them, and as FSDP2 issues them)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed
from flexshard.testing.collectives import record_collectives

from ..helpers.reference import sharded_training

STEPS = 10


def _train(model, rank, world_size, steps=STEPS):
    batches = make_batches(model.cfg, steps * world_size, batch=2, seed=1)
    return sharded_training(model, rank, world_size, batches, steps)


def _shard_both_ways(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    reference = TinyTransformer(TransformerConfig())
    torch.manual_seed(0)
    ours = TinyTransformer(TransformerConfig())
    for layer in reference.layers:
        torch_fully_shard(layer, mesh=mesh)
    torch_fully_shard(reference, mesh=mesh)
    for layer in ours.layers:
        fs.fully_shard(layer, mesh=mesh)
    fs.fully_shard(ours, mesh=mesh)

    with record_collectives() as ref_log:
        ref_losses = _train(reference, rank, world_size)
    stats = ours.comm_stats(reset=True)
    with record_collectives() as our_log:
        our_losses = _train(ours, rank, world_size)
    stats = ours.comm_stats()
    stats["logged"] = {"fsdp2": dict(ref_log.counts()), "flexshard": dict(our_log.counts())}

    ref_state = {k: v.full_tensor() for k, v in reference.state_dict().items()}
    our_state = fs.full_state_dict(ours)
    mismatched = [k for k in ref_state if not torch.equal(ref_state[k], our_state[k])]
    return ref_losses, our_losses, mismatched, stats


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shard0_bitwise_equal_to_fsdp2(world_size):
    results = run_distributed(_shard_both_ways, world_size)
    for rank, (ref_losses, our_losses, mismatched, stats) in enumerate(results):
        assert our_losses == ref_losses, f"rank {rank}"
        assert mismatched == [], f"rank {rank}: parameters differ: {mismatched}"
        # root + 2 layers: per step one all-gather in forward for each bucket, one
        # re-gather in backward for the two resharded layers, one reduce-scatter each
        total = stats["total"]
        assert total["all_gather"] == STEPS * (3 + 2)
        assert total["reduce_scatter"] == STEPS * 3
        # and nothing else: no agreement on unused parameters by default, as FSDP2
        assert total["all_reduce"] == stats["grad_agreement"]["all_reduce"] == 0
        # the shared logger (every torch.distributed route) sees just these, and torch
        # FSDP2 issues exactly the same collectives for the same model
        logged = stats["logged"]
        assert logged["flexshard"] == {
            "all_gather_single": STEPS * (3 + 2),
            "reduce_scatter_single": STEPS * 3,
        }, logged
        assert logged["fsdp2"] == logged["flexshard"], logged
