"""Ragged buckets (``BucketSpec(ragged=True)``): each rank stores, sends and receives
only its own share, so a bucket of whole matrices over more ranks than it has matrices
costs no padding; the training is the padded bucket's (bitwise at W = 2, where a sum
of two has one order) and the single process's."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.placements.layout import plan_bucket
from flexshard.placements.packing import gathered_alias
from flexshard.quant import FP8Blockwise
from flexshard.runtime.module import own_buckets
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

from ..helpers.reference import reference_training, sharded_training

STEPS = 3
CFG = TransformerConfig()


def _owned_2d(fqn: str, param: torch.Tensor) -> fs.Placement:
    return fs.Owned() if param.ndim == 2 else fs.Shard(0)


PLACEMENTS = {
    "owned": fs.Owned(),
    "rows": fs.BlockShard((5, 64)),  # 17-row pieces of 5-row tiles: uneven extents
    "owned_and_shard0": _owned_2d,
}


def _buckets(placement, ragged: bool) -> list[fs.BucketSpec]:
    return [
        fs.BucketSpec(f"layers.{i}.*", placement=placement, name=f"layer{i}", ragged=ragged)
        for i in range(CFG.layers)
    ] + [fs.BucketSpec(["embed.*", "norm.*", "head.*"], placement=fs.Shard(0), name="outer")]


def _facts(model) -> dict:
    """Per block bucket: this rank's storage and gathered sizes, both layouts' views."""
    facts = {}
    for bucket in {id(b): b for m in model.modules() for b in own_buckets(m)}.values():
        if not bucket.name.startswith("layer"):
            continue
        layout, rank = bucket.layout, bucket.store.rank
        bucket.unshard()
        gathered = bucket.full.gathered
        facts[bucket.name] = {
            "storage": bucket.storage.numel(),
            "extent": layout.extent(rank),
            "own": layout.rank_numel(rank),
            "numel": layout.numel,
            "padded": layout.world_size * layout.shard_numel,
            "gathered": 0
            if gathered is None
            else gathered.untyped_storage().size() // gathered.element_size(),
            "aliases": getattr(bucket.collective, "aliases", None),
        }
        bucket.reshard()
    return facts


def _train_both(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    batches = make_batches(CFG, STEPS * world, batch=2, seed=3)
    torch.manual_seed(0)
    reference = TinyTransformer(CFG)
    expected = [row[rank] for row in reference_training(reference, batches, world, STEPS)]
    expected_state = reference.state_dict()
    out = {"expected": expected}
    for name, placement in PLACEMENTS.items():
        for ragged in (False, True):
            torch.manual_seed(0)
            model = fs.flex_shard(
                TinyTransformer(CFG), mesh=mesh, buckets=_buckets(placement, ragged)
            )
            facts = _facts(model)
            model.comm_stats(reset=True)
            losses = sharded_training(model, rank, world, batches, STEPS)
            stats = model.comm_stats()
            state = fs.full_state_dict(model)
            worst = max((state[k] - v).abs().max().item() for k, v in expected_state.items())
            out[name, ragged] = (losses, state, worst, facts, stats)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ragged_buckets_train_as_padded_ones_with_no_padding(world):
    for rank, out in enumerate(run_distributed(_train_both, world)):
        for name in PLACEMENTS:
            padded_losses, padded_state, _, padded_facts, padded_stats = out[name, False]
            losses, state, worst, facts, stats = out[name, True]
            assert losses == pytest.approx(out["expected"], rel=1e-5, abs=1e-6), (name, rank)
            assert worst < 1e-5, (name, rank, worst)
            if world == 2:  # one order for a sum of two: the padded bucket's bits
                assert losses == padded_losses, (name, rank)
                assert all(torch.equal(state[k], padded_state[k]) for k in state), name
            for bucket, fact in facts.items():
                # this rank stores its own share and gathers the bucket with no padding
                assert fact["storage"] == fact["extent"], (name, bucket, fact)
                # views of an unpadded buffer, or every parameter copied out and it freed
                kept = fact["numel"] if fact["aliases"] else 0
                assert fact["gathered"] == kept, (name, bucket, fact)
                padded = padded_facts[bucket]
                assert padded["storage"] == padded["padded"] // world
                if name == "owned":  # whole matrices: the buffer is kept, they view it
                    assert fact["aliases"] is True and fact["gathered"] == fact["numel"]
                    assert fact["extent"] == fact["own"]
                # one collective per direction, as the padded bucket; fewer bytes
                ours, theirs = stats[bucket], padded_stats[bucket]
                assert ours["all_gather"] == theirs["all_gather"] > 0
                assert ours["reduce_scatter"] == theirs["reduce_scatter"] > 0
                gathers = ours["all_gather"]
                assert ours["all_gather_bytes"] == gathers * (world - 1) * fact["extent"] * 4
            total = sum(stats[b]["bytes_sent"] for b in facts)
            assert total <= sum(padded_stats[b]["bytes_sent"] for b in facts)


def test_ragged_layout_arithmetic():
    entries = [
        ("a", (17, 8), fs.Owned(rank=2)),
        ("b", (4, 8), fs.Owned(rank=0)),
        ("c", (17, 3), fs.BlockShard((5, 3))),
        ("n", (17,), fs.Shard(0)),
    ]
    padded = plan_bucket(entries, 3)
    ragged = plan_bucket(entries, 3, ragged=True)
    assert ragged.params == padded.params  # the same regions and offsets
    assert not padded.ragged and ragged.ragged
    assert [padded.extent(r) for r in range(3)] == [padded.shard_numel] * 3
    extents = [ragged.extent(r) for r in range(3)]
    # Shard(0)'s slots stay padded to the largest rank's (6 rows of 17 on every rank)
    assert extents == [ragged.rank_numel(r) + (6 - len_rows(ragged, "n", r)) for r in range(3)]
    assert ragged.wire_numel == sum(extents) < padded.wire_numel == 3 * padded.shard_numel
    assert ragged.rank_starts == (0, extents[0], extents[0] + extents[1])
    wire = torch.arange(ragged.wire_numel, dtype=torch.float32)
    whole = gathered_alias(ragged, 0, wire)  # Owned on rank 2: one contiguous piece
    assert whole is not None and whole.shape == (17, 8)
    assert int(whole[0, 0]) == ragged.rank_starts[2] + ragged.params[0].offsets[2]
    assert gathered_alias(ragged, 3, wire) is None  # rows of ranks 0..2 with others between


def len_rows(layout, fqn: str, rank: int) -> int:
    param = next(p for p in layout.params if p.fqn == fqn)
    return param.local_numel(rank)


def test_ragged_refuses_what_has_a_wire_format_of_its_own():
    with pytest.raises(ValueError, match="ragged=True moves one dtype"):
        fs.BucketSpec("*", placement=fs.BlockShard((128, 128)), quant=FP8Blockwise(), ragged=True)
    with pytest.raises(ValueError, match="ragged=True moves one dtype"):
        fs.BucketSpec("*", pack_as_bytes=True, ragged=True)
    with pytest.raises(TypeError, match="ragged must be a bool"):
        fs.BucketSpec("*", ragged="yes")
