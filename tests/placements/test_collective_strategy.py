"""A placement brings its own collective: the runtime picks it once per bucket and moves
the bucket with it (all-gathers and gradient reductions), with no change to the runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import flexshard as fs
from flexshard.placements import Replicate, Shard
from flexshard.placements.layout import plan_bucket
from flexshard.runtime.gather import Collective, PlainGather, ReplicatedGather
from flexshard.runtime.storage import BucketStorage
from flexshard.runtime.strategies import choose_collective, register_collective
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

CFG = TransformerConfig()


class CountingGather(PlainGather):
    """The plain all-gather, counting what the runtime asked of it; its reduction
    sends SUM and divides after, so it is its own code path, not the default's."""

    calls: ClassVar[dict[str, int]] = {"payload": 0, "reduce": 0}

    def payload(self, version, gathered):
        CountingGather.calls["payload"] += 1
        return super().payload(version, gathered)

    def launch_reduce(self, comm, layout, grads, dtype, op, runtime):
        CountingGather.calls["reduce"] += 1
        return super().launch_reduce(comm, layout, grads, dtype, op, runtime)


@dataclass(frozen=True)
class ToyShard(Shard):
    """Shard(dim), moved by the collective registered as "test-counting"."""

    collective: ClassVar[str] = "test-counting"


def _train(rank, world_size, placement):
    register_collective("test-counting", lambda store, fmt: CountingGather(store))
    CountingGather.calls.update(payload=0, reduce=0)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    buckets = [
        fs.BucketSpec("layers.*", placement=placement, name="layers"),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], placement=placement, name="outer"),
    ]
    model = fs.flex_shard(TinyTransformer(CFG), mesh=mesh, buckets=buckets)
    kinds = sorted({type(b.collective).__name__ for b in model._flexshard_buckets})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens, targets in make_batches(CFG, 2, batch=2):
        loss = model.loss(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # a float: exact, and picklable across processes
    gathers = model.comm_stats()["total"]["all_gather"]
    return kinds, losses, dict(CountingGather.calls), gathers


def test_a_placements_own_collective_moves_its_buckets():
    toy = run_distributed(_train, 3, ToyShard(0))
    plain = run_distributed(_train, 3, Shard(0))
    for (kinds, losses, calls, gathers), (plain_kinds, plain_losses, plain_calls, _) in zip(
        toy, plain
    ):
        assert kinds == ["CountingGather"] and plain_kinds == ["PlainGather"]
        assert calls["payload"] == gathers > 0  # every all-gather sent the toy's payload
        assert calls["reduce"] > 0
        assert plain_calls == {"payload": 0, "reduce": 0}
        assert losses == plain_losses  # bit for bit the default collective's training


def _store(placements, world_size=3):
    shapes = [(5, 4)] * len(placements)
    entries = [(f"p{i}", s, p) for i, (s, p) in enumerate(zip(shapes, placements))]
    layout = plan_bucket(entries, world_size, "b")
    dtypes = [torch.float32] * len(placements)
    store = BucketStorage(layout, 0, dtypes, [4] * len(placements), MixedPrecisionPolicy(), "cpu")
    return store, [e[0] for e in entries]


def test_the_collective_is_chosen_from_the_placements():
    store, fqns = _store([Shard(0), Shard(1)])
    assert type(choose_collective("b", fqns, [Shard(0), Shard(1)], None, store)) is PlainGather
    store, fqns = _store([Replicate()])
    chosen = choose_collective("b", fqns, [Replicate()], None, store)
    assert type(chosen) is ReplicatedGather and isinstance(chosen, Collective)


def test_unknown_or_mixed_collectives_raise_naming_the_bucket():
    @dataclass(frozen=True)
    class Unknown(Shard):
        collective: ClassVar[str] = "no-such-collective"

    store, fqns = _store([Unknown(0)])
    with pytest.raises(ValueError, match="bucket 'b'.*'p0'.*no-such-collective"):
        choose_collective("b", fqns, [Unknown(0)], None, store)
    register_collective("test-counting", lambda store, fmt: CountingGather(store))
    store, fqns = _store([Shard(0), ToyShard(0)])
    with pytest.raises(ValueError, match="bucket 'b'.*'p1' names 'test-counting'"):
        choose_collective("b", fqns, [Shard(0), ToyShard(0)], None, store)
