"""What a bucket holds while unsharded and while its gradients reduce: the gathered
buffer is kept only when every full parameter is a view of it, and the full parameters
are freed before the reduce-scatter's buffers exist (as FSDP2 reshards before its
reduce-scatter); flexshard/testing/live_memory.py counts it."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.runtime.bucket import Bucket
from flexshard.runtime.module import own_buckets
from flexshard.testing import run_distributed
from flexshard.testing.live_memory import LiveTensors


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))


def _weights_owned(fqn: str, param: nn.Parameter) -> fs.Placement:
    return fs.Owned() if fqn.endswith("weight") else fs.Shard(0)  # a bias: rows per rank


def _unsharded_buffers(rank: int, world_size: int) -> dict[str, tuple]:
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, placement in (("owned", fs.Owned()), ("mixed", _weights_owned)):
        reference = _model()
        model = fs.flex_shard(
            _model(), mesh=mesh, buckets=[fs.BucketSpec("*", placement=placement)]
        )
        (bucket,) = own_buckets(model)
        bucket.unshard()
        fulls = [p.detach().clone() for p in bucket.full_params]
        same = all(torch.equal(f, r) for f, r in zip(fulls, reference.parameters()))
        kept = bucket.full.gathered.untyped_storage().nbytes()
        out[name] = (bucket.collective.aliases, kept, same)
        bucket.reshard()
    return out


def test_gathered_buffer_is_kept_only_when_every_parameter_aliases_it():
    for result in run_distributed(_unsharded_buffers, 2):
        aliases, kept, same = result["owned"]
        assert aliases and kept > 0 and same  # Owned: every parameter a view of the buffer
        aliases, kept, same = result["mixed"]
        # Owned weights would alias it, Shard(0) biases not: all are copied out and the
        # buffer freed, so it is not held whole beside the copies
        assert not aliases and kept == 0 and same


def _reduce_after_reshard(rank: int, world_size: int) -> list[bool]:
    mesh = init_device_mesh("cpu", (world_size,))
    seen: list[bool] = []
    original = Bucket.launch_reduce

    def launch(self: Bucket) -> None:
        seen.append(self.full.unsharded)
        original(self)

    Bucket.launch_reduce = launch  # type: ignore[method-assign]
    try:
        model = fs.flex_shard(
            _model(), mesh=mesh, buckets=[fs.BucketSpec("*", placement=fs.Owned())]
        )
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        model(x).sum().backward()  # reduced at the end of backward (x needs no gradient)
        model(x.requires_grad_()).sum().backward()  # reduced when the module's backward ends
    finally:
        Bucket.launch_reduce = original  # type: ignore[method-assign]
    return seen


def test_full_parameters_are_freed_before_the_reduce_scatter():
    for seen in run_distributed(_reduce_after_reshard, 2):
        assert seen == [False, False], seen  # resharded by the time it reduces


def test_live_tensors_counts_allocations_resizes_and_deaths():
    kept = torch.zeros(100)  # exists before: counted from the start, named later
    with LiveTensors() as live:
        start = live.bytes_now()
        live.phase = "forward"
        a = torch.empty(250)  # 1000 bytes
        buffer = torch.empty(500)  # 2000 bytes, then freed as the runtimes free theirs
        buffer.untyped_storage().resize_(0)
        assert live.bytes_now() - start == 1000
        del a
        live.phase = "backward"
        buffer.untyped_storage().resize_(4000)  # 4000 bytes, the peak
        peak = live.bytes_now()
        buffer.untyped_storage().resize_(0)
        live.name([kept], "kept")
    assert live.peak_bytes == peak and live.peak_phase == "backward"
    parts = live.breakdown()
    assert parts["kept"] == 400 and parts["forward"] == 4000  # allocated in forward
    assert live.bytes_now() == start  # the buffer freed, the rest as before
