"""Every placement, and a mixed bucket, trains like a single-process reference."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

from ..helpers.reference import mixed_placement, reference_training, sharded_training

STEPS = 4
CFG = TransformerConfig()


PLACEMENTS = {
    "shard0": fs.Shard(0),
    "flat": fs.FlatShard(),
    "owned": fs.Owned(),
    "block4x4": fs.BlockShard((4, 4)),
    "block_rows": fs.BlockShard((5, 64)),
    "replicate": fs.Replicate(),
    "mixed": mixed_placement,
}


def _buckets(placement) -> list[fs.BucketSpec]:
    return [
        fs.BucketSpec("layers.0.*", placement=placement, name="layer0"),
        fs.BucketSpec("layers.1.*", placement=placement, name="layer1"),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], placement=placement, name="outer"),
    ]


def _compare_all(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    batches = make_batches(CFG, STEPS * world_size, batch=2, seed=3)
    torch.manual_seed(0)
    reference = TinyTransformer(CFG)
    expected = reference_training(reference, batches, world_size, STEPS)
    expected_state = reference.state_dict()
    report = {}
    for name, placement in PLACEMENTS.items():
        torch.manual_seed(0)
        model = fs.flex_shard(TinyTransformer(CFG), mesh=mesh, buckets=_buckets(placement))
        losses = sharded_training(model, rank, world_size, batches, STEPS)
        stats = model.comm_stats()
        state = fs.full_state_dict(model)
        worst = max((state[k] - v).abs().max().item() for k, v in expected_state.items())
        report[name] = (losses, worst, stats)
    return [row[rank] for row in expected], report


@pytest.mark.parametrize("world_size", [2, 3])
def test_placements_match_single_process(world_size):
    for rank, (expected, report) in enumerate(run_distributed(_compare_all, world_size)):
        for name, (losses, worst, stats) in report.items():
            assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6), (name, rank)
            assert worst < 2e-5, (name, rank, worst)
            total = stats["total"]
            if name == "replicate":
                assert (total["all_gather"], total["reduce_scatter"]) == (0, 0), name
                # and one agreement on unused parameters per backward
                assert total["all_reduce"] == 4 * STEPS, name
            else:
                # forward gathers 3 buckets, backward re-gathers the 2 resharded layers
                assert total["all_gather"] == 5 * STEPS, (name, total)
                assert total["reduce_scatter"] == 3 * STEPS, (name, total)
                assert total["all_reduce"] == STEPS, name  # the unused agreement
