"""Runtime behaviour: prefetch and gradient reductions overlap compute, exact byte
accounting, unshard/reshard, and a stalled rank raises naming the bucket."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard.runtime import collectives
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

CFG = TransformerConfig()


def _buckets():
    return [
        fs.BucketSpec("layers.0.*", name="layer0"),
        fs.BucketSpec("layers.1.*", placement=fs.Owned(), name="layer1"),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], placement=fs.FlatShard(), name="outer"),
    ]


def _record_events(model, events):
    """Log collective launches/waits and the compute of each layer's MLP."""
    comm_cls = collectives.BucketComm
    for kind in ("all_gather", "reduce_scatter"):
        original = getattr(comm_cls, kind)

        def launch(self, *args, _original=original, _kind=kind):
            events.append((f"launch_{_kind}", self.bucket))
            return _original(self, *args)

        setattr(comm_cls, kind, launch)
    for i, layer in enumerate(model.layers):
        layer.up.register_forward_hook(lambda *_, i=i: events.append(("forward", f"layer{i}")))

        def watch_backward(module, args, out, i=i):
            out.register_hook(lambda grad: events.append(("backward", f"layer{i}")))

        layer.up.register_forward_hook(watch_backward)


def _overlap(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = fs.flex_shard(TinyTransformer(CFG), mesh=mesh, buckets=_buckets())
    events: list[tuple[str, str]] = []
    _record_events(model, events)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens, targets in make_batches(CFG, 2, batch=2):
        events.clear()  # keep the second step, when the forward order is known
        model.loss(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    return events


def test_prefetch_and_reduce_overlap_compute():
    events = run_distributed(_overlap, 3)[0]
    at = {event: i for i, event in reversed(list(enumerate(events)))}  # first occurrence
    # forward: layer1's all-gather is launched before layer0 computes
    assert at[("launch_all_gather", "layer1")] < at[("forward", "layer0")], events
    # backward: layer0 is re-gathered while layer1 computes its backward
    backward_gathers = [i for i, e in enumerate(events) if e == ("launch_all_gather", "layer0")]
    assert len(backward_gathers) == 2, events
    assert backward_gathers[1] < at[("backward", "layer0")], events
    # layer1's gradient reduce-scatter is in flight while layer0 runs its backward
    assert at[("launch_reduce_scatter", "layer1")] < at[("backward", "layer0")], events


def _accounting(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = fs.flex_shard(TinyTransformer(CFG), mesh=mesh, buckets=_buckets())
    tokens, targets = make_batches(CFG, 1, batch=2)[0]
    model.loss(tokens, targets).backward()
    stats = model.comm_stats(reset=True)
    layouts = {b.name: (b.layout.shard_numel, b.layout.numel) for b in model._flexshard_buckets}

    model.unshard()
    shapes_unsharded = {n: tuple(p.shape) for n, p in model.named_parameters()}
    model.reshard()
    shapes_sharded = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    after = model.comm_stats()["total"]
    return stats, layouts, shapes_unsharded, shapes_sharded, after


def test_comm_stats_bytes_and_unshard_reshard():
    world_size = 3
    results = run_distributed(_accounting, world_size)
    for rank, (stats, layouts, unsharded, sharded, after) in enumerate(results):
        for name, (shard_numel, numel) in layouts.items():
            gathers = 1 if name == "outer" else 2  # the root bucket stays unsharded
            per_collective = (world_size - 1) * shard_numel * 4  # fp32
            assert stats[name]["all_gather"] == gathers
            assert stats[name]["reduce_scatter"] == 1
            assert stats[name]["bytes_sent"] == (gathers + 1) * per_collective
            assert stats[name]["bytes_received"] == stats[name]["bytes_sent"]
            assert world_size * shard_numel >= numel
        assert unsharded["layers.0.up.weight"] == (CFG.hidden, CFG.dim)
        assert unsharded["embed.weight"] == (CFG.vocab, CFG.dim)
        rows = [10, 10, 9][rank]  # torch.chunk of 29 rows over 3 ranks
        assert sharded["layers.0.up.weight"] == (rows, CFG.dim)
        assert after["all_gather"] == 3 and after["reduce_scatter"] == 0


def _stall(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = fs.flex_shard(
        TinyTransformer(CFG), mesh=mesh, buckets=_buckets(), timeout=datetime.timedelta(seconds=2)
    )
    dist.barrier()
    if rank == 1:
        time.sleep(6)  # a stalled rank: never joins the forward's all-gathers
        return "stalled"
    tokens, targets = make_batches(CFG, 1, batch=2)[0]
    started = time.monotonic()
    try:
        model.loss(tokens, targets)
    except RuntimeError as err:
        return str(err), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_stalled_rank_raises_naming_bucket():
    results = run_distributed(_stall, 2, timeout=60)
    message, waited = results[0]
    assert "all-gather of bucket 'outer'" in message, message
    assert waited < 5.5, waited
    assert results[1] == "stalled"


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(5, 17)
        self.a = torch.nn.Linear(17, 3)
        self.b = torch.nn.Linear(17, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.body(x)
        return self.a(h).sum() + (self.b(h).sum() if use_b else 0)


def _unused_on_some_ranks(rank, world_size):
    """Head ``b`` gets no gradient on odd ranks: the reduction still runs on every rank
    (zeros for the missing gradient) and nothing hangs."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    reference = _TwoHeads()
    model = fs.flex_shard(
        _TwoHeads(),
        mesh=mesh,
        buckets=[fs.BucketSpec(["body.*", "b.*"], placement=fs.Owned()), fs.BucketSpec("a.*")],
    )
    fs.load_full_state_dict(model, reference.state_dict())
    inputs = [
        torch.randn(4, 5, generator=torch.Generator().manual_seed(r)) for r in range(world_size)
    ]
    model(inputs[rank], use_b=rank % 2 == 0).backward()
    for r in range(world_size):
        (reference(inputs[r], use_b=r % 2 == 0) / world_size).backward()
    grads = {n: p.grad.to_local() for n, p in model.named_parameters()}
    regions = {
        b.params[i].fqn: (b, i) for b in model._flexshard_buckets for i in range(len(b.params))
    }
    worst = 0.0
    for name, param in reference.named_parameters():
        bucket, i = regions[name]
        expected = torch.zeros(bucket.layout.params[i].local_numel(rank))
        for region in bucket.layout.params[i].regions[rank]:
            expected = region.view_of(param.grad).reshape(-1)
        got = grads[name]
        worst = max(worst, (got.reshape(-1) - expected).abs().max().item() if got.numel() else 0.0)
    return worst, model.comm_stats()["total"]["reduce_scatter"]


def test_parameters_unused_on_some_ranks():
    for worst, reductions in run_distributed(_unused_on_some_ranks, 3):
        assert worst < 1e-6
        assert reductions == 2


def _bucket_over_sibling_layers(rank, world_size):
    """One Owned bucket over every layer (``layers.*``, a ModuleList): gathered once
    before layer 0, freed after the last layer, re-gathered once in backward."""
    from ..helpers.reference import reference_training, sharded_training

    mesh = init_device_mesh("cpu", (world_size,))
    batches = make_batches(CFG, 3 * world_size, batch=2, seed=9)
    torch.manual_seed(0)
    reference = TinyTransformer(CFG)
    expected = reference_training(reference, batches, world_size, 3)
    torch.manual_seed(0)
    buckets = [
        fs.BucketSpec("layers.*", placement=fs.Owned(), name="layers"),
        fs.BucketSpec(["embed.*", "norm.*", "head.*"], name="outer"),
    ]
    model = fs.flex_shard(TinyTransformer(CFG), mesh=mesh, buckets=buckets)
    layers = model._flexshard_buckets[0]
    seen = []
    model.layers[1].register_forward_pre_hook(
        lambda *_: seen.append(("layer1", layers.full.unsharded))
    )
    model.norm.register_forward_pre_hook(lambda *_: seen.append(("norm", layers.full.unsharded)))
    losses = sharded_training(model, rank, world_size, batches, 3)
    stats = model.comm_stats()["layers"]
    return losses, [row[rank] for row in expected], seen, stats


def test_bucket_over_sibling_layers():
    for losses, expected, seen, stats in run_distributed(_bucket_over_sibling_layers, 3):
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert seen == [("layer1", True), ("norm", False)] * 3
        assert (stats["all_gather"], stats["reduce_scatter"]) == (6, 3)


def _reductions_in_flight(rank, world_size):
    """The most gradient reductions still in flight when a bucket launches its own (3
    buckets in one backward), by default (FSDP2's 1) and with
    ``set_reduce_scatter_max_input_buffers(2)``."""
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for limit in (None, 2):
        model = fs.flex_shard(TinyTransformer(CFG), mesh=mesh, buckets=_buckets())
        if limit is not None:
            model.set_reduce_scatter_max_input_buffers(limit)
        in_flight, most = [0], [0]
        for bucket in model._flexshard_buckets:
            launch, finish = bucket.launch_reduce, bucket.finish_reduce

            def launched(launch=launch, in_flight=in_flight, most=most):
                most[0] = max(most[0], in_flight[0])
                launch()
                in_flight[0] += 1

            def finished(finish=finish, in_flight=in_flight):
                in_flight[0] -= 1
                finish()

            bucket.launch_reduce, bucket.finish_reduce = launched, finished
        tokens, targets = make_batches(CFG, 1, batch=2)[0]
        model.loss(tokens, targets).backward()
        out[limit] = most[0]
    errors = []
    for bad in (True, 0, 1.5):
        try:
            model.set_reduce_scatter_max_input_buffers(bad)
        except (TypeError, ValueError) as err:
            errors.append(type(err).__name__)
    return out, errors


def test_reduce_scatter_max_input_buffers_bounds_reductions_in_flight():
    for most, errors in run_distributed(_reductions_in_flight, 2):
        assert most == {None: 1, 2: 2}
        assert errors == ["TypeError", "ValueError", "TypeError"]  # as FSDP2 raises


class _TiedLM(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(29, 17)
        self.norm = torch.nn.RMSNorm(17)
        self.head = torch.nn.Linear(17, 29, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)))


def _tied_after_sharding(rank, world_size):
    """The embedding given the head's sharded parameter after sharding (torchtitan's
    Trainer shards the two apart, then ties them after ``to_empty``) trains as the
    model tied before sharding does: the embedding gathers the head's values every
    step (the optimizer steps that one parameter) and both gradients reach it."""
    mesh = init_device_mesh("cpu", (world_size,))
    runs = {}
    for when in ("before", "after"):
        with torch.device("meta"):
            model = _TiedLM(tie=when == "before")
        fs.fully_shard([model.embed, model.norm, model.head], mesh=mesh)
        fs.fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        if when == "after":
            model.embed.weight = model.head.weight
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(fs.distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(rank)
        losses, seen = [], []
        for _ in range(3):
            tokens = torch.randint(0, 29, (2, 8), generator=gen)
            seen.append([])
            embed = model.embed

            def same_values(head, _args, embed=embed, seen=seen):
                seen[-1].append(torch.equal(head.weight, embed.weight))

            hook = model.head.register_forward_pre_hook(same_values)
            logits = model(tokens)
            hook.remove()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        names = [n for n, _ in model.named_parameters()]
        runs[when] = (losses, seen, names, model.head.weight.full_tensor())
    return runs


def test_weights_tied_after_sharding():
    for runs in run_distributed(_tied_after_sharding, 3):
        losses, seen, names, head = runs["after"]
        assert seen == [[True]] * 3  # the head's and the embedding's values agree
        assert names == runs["before"][2]
        assert losses == pytest.approx(runs["before"][0], rel=1e-6)
        torch.testing.assert_close(head, runs["before"][3], rtol=1e-6, atol=1e-6)
