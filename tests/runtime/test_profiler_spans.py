"""Profiler spans: every bucket's all-gather, copy-out, reduce-scatter and gradient copy
is marked in a torch.profiler trace, and the trace shows the prefetch (bucket i+1's
all-gather starting before bucket i's forward ends) and backward's reverse order."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

import flexshard as fs
from flexshard.testing import TinyTransformer, TransformerConfig, make_batches, run_distributed

CFG = TransformerConfig(layers=3)
KINDS = ("all_gather", "all_gather_copy_out", "reduce_scatter", "grad_copy")


def _mark_forwards(model: torch.nn.Module) -> None:
    """A ``test::forward[layers.i]`` span from each layer's first hook to its last."""
    for i, layer in enumerate(model.layers):
        spans = []

        def enter(mod, args, i=i, spans=spans):
            span = record_function(f"test::forward[layers.{i}]")
            span.__enter__()
            spans.append(span)

        def leave(mod, args, out, spans=spans):
            spans.pop().__exit__(None, None, None)

        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)


def _trace(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = TinyTransformer(CFG)
    for layer in model.layers:
        fs.fully_shard(layer, mesh=mesh)
    fs.fully_shard(model, mesh=mesh)
    _mark_forwards(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batches = make_batches(CFG, 2, batch=2)
    for tokens, targets in batches:  # the first step learns the forward order
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.loss(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.name.startswith(("flexshard::", "test::"))
    )


def test_bucket_spans_and_their_order():
    spans = run_distributed(_trace, 2)[0]
    layers = [f"layers.{i}" for i in range(CFG.layers)]

    def first(name: str) -> tuple[int, int]:
        times = [(start, end) for start, end, n in spans if n == name]
        assert times, f"no span {name} in the trace: {sorted({n for *_, n in spans})}"
        return times[0]

    for bucket in [*layers, "root"]:
        for kind in KINDS:
            first(f"flexshard::{kind}[{bucket}]")
    for i in range(len(layers) - 1):
        # the prefetch: the next layer's gather starts inside this layer's forward
        gather_next = first(f"flexshard::all_gather[layers.{i + 1}]")
        forward = first(f"test::forward[layers.{i}]")
        assert gather_next[0] < forward[1]
        # and is not the whole model gathered up front: it follows the previous forward
        if i > 0:
            assert gather_next[0] > first(f"test::forward[layers.{i - 1}]")[1]
    # backward reduces the last layer first
    starts = [first(f"flexshard::reduce_scatter[{name}]")[0] for name in reversed(layers)]
    assert starts == sorted(starts)
