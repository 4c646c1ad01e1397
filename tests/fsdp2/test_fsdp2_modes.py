"""Bitwise parity with torch FSDP2 beyond plain fp32: mixed precision, gradient
accumulation without sync, HSDP (2 x 2), meta-device initialisation."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

from ..helpers.reference import reference_training, sharded_training

STEPS = 4
CFG = TransformerConfig()


def _wrap(model, shard, mesh, **kwargs):
    for layer in model.layers:
        shard(layer, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


def _run_pair(rank, world_size, mesh, micro=1, cfg=CFG, **kwargs):
    """Train FSDP2 and flexshard side by side; return both loss lists and whether the
    final parameters are bitwise equal."""
    data_rank = mesh.get_rank() if mesh.ndim == 1 else rank
    batches = make_batches(cfg, STEPS * world_size * micro, batch=2, seed=5)
    results = []
    for shard in (torch_fully_shard, fs.fully_shard):
        torch.manual_seed(0)
        model = _wrap(TinyTransformer(cfg), shard, mesh, **kwargs)
        if shard is torch_fully_shard:
            model.set_requires_gradient_sync(True)
        losses = sharded_training(model, data_rank, world_size, batches, STEPS, micro=micro)
        if shard is torch_fully_shard:
            state = {k: v.full_tensor() for k, v in model.state_dict().items()}
        else:
            state = fs.full_state_dict(model)
        results.append((losses, state))
    (ref_losses, ref_state), (our_losses, our_state) = results
    differ = [k for k in ref_state if not torch.equal(ref_state[k], our_state[k])]
    return ref_losses, our_losses, differ


def _modes(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    out = {
        "bf16": _run_pair(
            rank,
            world_size,
            mesh,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        ),
        "bf16_reduce": _run_pair(
            rank, world_size, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        ),
        "no_sync_x3": _run_pair(rank, world_size, mesh, micro=3),
        "keep_unsharded": _run_pair(rank, world_size, mesh, reshard_after_forward=False),
        "checkpointed": _run_pair(rank, world_size, mesh, cfg=TransformerConfig(checkpoint=True)),
    }
    if world_size == 4:
        out["hsdp_2x2"] = _run_pair(
            rank, world_size, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        )
    return out


@pytest.mark.parametrize("world_size", [3, 4])
def test_modes_bitwise_equal_to_fsdp2(world_size):
    for rank, modes in enumerate(run_distributed(_modes, world_size)):
        assert len(modes) == (6 if world_size == 4 else 5)
        for mode, (ref_losses, our_losses, differ) in modes.items():
            assert our_losses == ref_losses, (mode, rank)
            assert differ == [], (mode, rank, differ)


def _meta_and_accumulation(rank, world_size):
    """Meta-device init then load, against an eagerly built model; and no-sync
    accumulation against the single-process reference."""
    mesh = init_device_mesh("cpu", (world_size,))
    batches = make_batches(CFG, STEPS * world_size * 2, batch=2, seed=6)
    torch.manual_seed(0)
    eager = TinyTransformer(CFG)
    full = {k: v.clone() for k, v in eager.state_dict().items()}
    with torch.device("meta"):
        lazy = TinyTransformer(CFG)
    buckets = [
        fs.BucketSpec("layers.*", placement=fs.Owned()),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"]),
    ]
    lazy = fs.flex_shard(lazy, mesh=mesh, buckets=buckets)
    on_meta = all(p.device.type == "meta" for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    fs.load_full_state_dict(lazy, full)

    # meta build, then init_params under the seed: the values a single process draws
    with torch.device("meta"):
        seeded = TinyTransformer(CFG)
    seeded = fs.flex_shard(seeded, mesh=mesh, buckets=buckets)
    seeded.to_empty(device="cpu")
    torch.manual_seed(0)
    fs.init_params(seeded)
    seeded_state = fs.full_state_dict(seeded)
    seeded_same = all(torch.equal(seeded_state[k], v) for k, v in full.items())
    eager = fs.flex_shard(eager, mesh=mesh, buckets=buckets)
    lazy_losses = sharded_training(lazy, rank, world_size, batches, STEPS, micro=2)
    eager_losses = sharded_training(eager, rank, world_size, batches, STEPS, micro=2)
    lazy_state, eager_state = fs.full_state_dict(lazy), fs.full_state_dict(eager)
    same = all(torch.equal(lazy_state[k], eager_state[k]) for k in eager_state)

    reference = TinyTransformer(CFG)
    reference.load_state_dict(full)
    expected = reference_training(reference, batches, world_size, STEPS, micro=2)
    worst = max((eager_state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return on_meta, seeded_same, lazy_losses, eager_losses, same, expected[0], worst


def test_meta_init_and_accumulation_match():
    for rank, result in enumerate(run_distributed(_meta_and_accumulation, 3)):
        on_meta, seeded_same, lazy_losses, eager_losses, same, expected, worst = result
        assert on_meta
        assert seeded_same, rank
        assert lazy_losses == eager_losses and same, rank
        assert len(eager_losses) == STEPS * 2
        assert worst < 2e-5, worst
