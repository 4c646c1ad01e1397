"""A bucket of several dtypes packed as bytes: one storage, one all-gather, exact state."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.testing import run_distributed

STEPS = 3


class MixedDtypes(nn.Module):
    """A float64 layer feeding a float32 layer, with a float64 scale in between."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 17, dtype=torch.float64)
        self.scale = nn.Parameter(torch.ones(17, dtype=torch.float64))
        self.b = nn.Linear(17, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b((self.a(x.double()) * self.scale).tanh().float()).square().mean()


def _placement(fqn: str, param: torch.Tensor) -> fs.Placement:
    if param.ndim < 2:
        return fs.FlatShard()
    return fs.BlockShard((4, 4)) if fqn.startswith("a.") else fs.Owned()


def _inputs(world_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 5, generator=gen) for _ in range(STEPS * world_size)]


def _packed(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    reference = MixedDtypes()
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    spec = fs.BucketSpec("*", placement=_placement, name="mixed", pack_as_bytes=True)
    model = fs.flex_shard(MixedDtypes(), mesh=mesh, buckets=[spec])
    fs.load_full_state_dict(model, initial)
    round_trip = fs.full_state_dict(model)
    exact = all(
        torch.equal(round_trip[k], v) and round_trip[k].dtype == v.dtype for k, v in initial.items()
    )
    bucket = model._flexshard_buckets[0]
    dtypes = {n: p.dtype for n, p in model.named_parameters()}

    inputs = _inputs(world_size)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.comm_stats(reset=True)
    losses, expected = [], []
    for step in range(STEPS):
        loss = model(inputs[step * world_size + rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        for r in range(world_size):
            ref_loss = reference(inputs[step * world_size + r])
            (ref_loss / world_size).backward()
            if r == rank:
                expected.append(ref_loss.item())
        ref_opt.step()
        ref_opt.zero_grad()
    stats = model.comm_stats()["mixed"]
    final = fs.full_state_dict(model)
    worst = max((final[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return exact, dtypes, bucket.storage.dtype, losses, expected, worst, stats


def test_mixed_dtypes_packed_as_bytes_train_like_the_reference():
    for result in run_distributed(_packed, 3):
        exact, dtypes, storage_dtype, losses, expected, worst, stats = result
        assert exact
        assert storage_dtype == torch.uint8
        assert dtypes == {
            "a.weight": torch.float64,
            "a.bias": torch.float64,
            "scale": torch.float64,
            "b.weight": torch.float32,
            "b.bias": torch.float32,
        }
        assert losses == pytest.approx(expected, rel=1e-6)
        assert worst < 1e-6
        # the root bucket: one all-gather and one reduce-scatter per step
        assert (stats["all_gather"], stats["reduce_scatter"]) == (STEPS, STEPS)
