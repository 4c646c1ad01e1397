"""``flexshard.clip_grad_norm_``: the norm of the whole model's gradient on every
rank (sharded and Replicate buckets alike), and clipped training follows the single
process. Its argument checks are in ``test_errors.py``, a stalled peer in
``test_faults.py``, every 5-D layout in ``tests/trainer/test_parallel_layouts.py``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

CFG = TransformerConfig()


def _buckets(outer: fs.Placement) -> list[fs.BucketSpec]:
    return [
        fs.BucketSpec("layers.0.*", name="layer0"),
        fs.BucketSpec("layers.1.*", placement=fs.Owned(), name="layer1"),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], placement=outer, name="outer"),
    ]


def _clipped(rank, world_size):
    """fs.clip_grad_norm_ sees the full model's gradient: the same norm as the
    single-process reference, and clipped training follows it."""
    from ..helpers.reference import reference_training

    mesh = init_device_mesh("cpu", (world_size,))
    batches = make_batches(CFG, 3 * world_size, batch=2, seed=11)
    torch.manual_seed(0)
    reference = TinyTransformer(CFG)
    full = {k: v.clone() for k, v in reference.state_dict().items()}
    norms = []

    def clip_reference(model):
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())

    expected = reference_training(reference, batches, world_size, 3, before_step=clip_reference)
    runs = []
    for buckets in (_buckets(fs.FlatShard()), _buckets(fs.Replicate())):
        model = fs.flex_shard(TinyTransformer(CFG), mesh=mesh, buckets=buckets)
        fs.load_full_state_dict(model, full)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses, ours = [], []
        for step in range(3):
            tokens, targets = batches[step * world_size + rank]
            loss = model.loss(tokens, targets)
            loss.backward()
            ours.append(fs.clip_grad_norm_(model, 0.5).item())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, ours))
    return runs, [row[rank] for row in expected], norms


def test_clip_grad_norm_uses_the_full_gradient():
    for runs, expected, norms in run_distributed(_clipped, 3):
        assert max(norms) > 0.5  # clipping really happened
        for losses, ours in runs:  # sharded outer bucket, then a Replicate one
            assert ours == pytest.approx(norms, rel=1e-5)
            assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
