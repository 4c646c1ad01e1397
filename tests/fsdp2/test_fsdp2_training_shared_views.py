"""torch's FSDP2 shared-parameter and unsharded-view scenarios
(test_fully_shard_shared_params.py, test_fully_shard_unsharded_views.py, and the
sharding-layout cases of test_fully_shard_training.py: largest-dim and Shard(1)
placements, tied weights in one or separate groups, layer-by-layer gc, loads without
reshard, replaced storage), run with torch's ``fully_shard`` and flexshard's (harness:
tests/helpers/fsdp2_training.py)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from tests.helpers import fsdp2_training as ts
from tests.helpers.fsdp2_training import (
    MLP,
    Transformer,
    _grads,
    _params,
    _randn,
    _tokens,
    _train,
)


def sc_shard_largest_dim(rank, world, shard, mesh):
    """shard_placement_fn sharding every parameter on its largest dim, blocks + root."""
    torch.manual_seed(0)
    model = Transformer(layers=2)

    def fn(p):
        return Shard(p.shape.index(max(p.shape)))

    for layer in model.layers:
        shard(layer, mesh=mesh, shard_placement_fn=fn)
    shard(model, mesh=mesh, shard_placement_fn=fn)
    out = {"init": _params(model)}
    out.update(_train(model, 3, lambda i: (_tokens(rank),)))
    return out


def sc_shard1_contiguous(rank, world, shard, mesh):
    """Shard(1) for matrices, Shard(0) for vectors: parameters and gradients (and
    their local tensors) are contiguous, in forward too."""
    torch.manual_seed(0)
    model = MLP(4)

    def fn(p):
        return Shard(1) if p.ndim > 1 else Shard(0)

    for module in (model.in_proj, model.out_proj, model):
        shard(module, shard_placement_fn=fn, mesh=mesh)
    seen = []

    def check(module, args):
        seen.append([p.is_contiguous() for p in module.parameters()])

    model.in_proj.register_forward_pre_hook(check)
    model.out_proj.register_forward_pre_hook(check)
    before = [(p.is_contiguous(), p.to_local().is_contiguous()) for p in model.parameters()]
    model(_randn(rank, 2, 4)).sum().backward()
    after = [
        (p.is_contiguous(), p.to_local().is_contiguous(), p.grad.is_contiguous(),
         p.grad.to_local().is_contiguous())
        for p in model.parameters()
    ]  # fmt: skip
    return {"before": before, "seen": seen, "after": after, "grads": _grads(model)}


def sc_shared_params(rank, world, shard, mesh, raf, ac):
    """A weight-tied Transformer, blocks wrapped (optionally checkpointed), the tied
    embedding/output at the root."""
    from torch.distributed._composable import checkpoint

    torch.manual_seed(0)
    model = Transformer(layers=2, tie=True)
    for layer in model.layers:
        if ac:
            checkpoint(layer)
        shard(layer, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    return _train(model, 4, lambda i: (_tokens(10 * i + rank),))


class Tied(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, 16)
        self.output = nn.Linear(16, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(self.tok_embeddings(ids))


def sc_shared_params_uneven(rank, world, shard, mesh, raf):
    """Tied embedding/output in one group over an uneven vocabulary: every row trains."""
    vocab = 4 * world + 1
    torch.manual_seed(0)
    model = Tied(vocab)
    shard([model.tok_embeddings, model.output], mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    model.tok_embeddings.unshard()
    initial = model.tok_embeddings.weight.detach().clone()
    model.tok_embeddings.reshard()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict = {"loss": []}
    for i in range(5):
        ids = _tokens(10 * i + rank, vocab=vocab)
        loss = F.cross_entropy(model(ids).view(-1, vocab), ids.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.detach())
    out["params"] = _params(model)
    model.tok_embeddings.unshard()
    final = model.tok_embeddings.weight.detach().clone()
    model.tok_embeddings.reshard()
    out["initial"], out["final"] = initial, final
    out["rows_unchanged"] = [r for r in range(vocab) if torch.equal(initial[r], final[r])]
    return out


def sc_shared_params_separate_groups(rank, world, shard, mesh):
    """Tied parameters in two separate fully_shard calls: torch raises at the first
    forward ("already managed by another FSDP group")."""
    torch.manual_seed(0)
    model = Tied(17)
    shard(model.tok_embeddings, mesh=mesh)
    shard(model.output, mesh=mesh)
    shard(model, mesh=mesh)
    return _train(model, 2, lambda i: (_tokens(rank, vocab=17),))


def sc_layer_by_layer_gc(rank, world, shard, mesh):
    """Blocks built, sharded and garbage-collected one at a time, then the root."""

    class SimpleBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.linear = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            return self.linear(self.norm(x))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList()

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model = Stack()
    for _ in range(6):
        block = SimpleBlock()
        model.blocks.append(block)
        shard(block, mesh=mesh)
        gc.collect()
    shard(model, mesh=mesh)
    return _train(model, 2, lambda i: (_randn(rank, 2, 4, 16),))


# ------------------------------------------------------------------ unsharded views


def sc_unsharded_views(rank, world, shard, mesh, meta, raf):
    """Frozen Linear: the forward output follows ``load_state_dict`` after a
    ``reshard()`` each time (torch's unsharded-view test, plain tensors)."""
    with torch.device("meta" if meta else "cpu"):
        model = nn.Linear(8, 4)
    model.requires_grad_(False)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    if meta:
        model.to_empty(device="cpu")
    state = model.state_dict()
    for t in state.values():
        t.fill_(0.5)
    model.load_state_dict(state)
    inputs = torch.ones(2, 8)
    outs = []
    with torch.no_grad():
        outs.append(model(inputs))
        for version in range(1, 4):
            model.reshard()
            update = {k: torch.full_like(t, version) for k, t in model.state_dict().items()}
            model.load_state_dict(update)
            outs.append(model(inputs))
    return {"outs": outs, "params": _params(model)}


def sc_load_without_reshard(rank, world, shard, mesh):
    """The same, without the explicit reshard(): load_state_dict right after a
    forward that left the parameters unsharded (reshard_after_forward=False)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).requires_grad_(False)
    shard(model, mesh=mesh, reshard_after_forward=False)
    inputs = torch.ones(2, 8)
    outs = []
    with torch.no_grad():
        outs.append(model(inputs))
        for version in range(1, 3):
            update = {k: torch.full_like(t, version) for k, t in model.state_dict().items()}
            model.load_state_dict(update)
            outs.append(model(inputs))
    return {"outs": outs, "params": _params(model)}


def sc_replaced_storage(rank, world, shard, mesh):
    """``load_state_dict(assign=True)`` after a forward with reshard_after_forward=False:
    the next forward uses the assigned values."""
    model = nn.Linear(8, 4).requires_grad_(False)
    shard(model, mesh=mesh, reshard_after_forward=False)
    state = model.state_dict()
    for t in state.values():
        t.fill_(0.5)
    model.load_state_dict(state)
    inputs = torch.ones(2, 8)
    with torch.no_grad():
        first = model(inputs)
        update = {k: torch.full_like(t, 2) for k, t in model.state_dict().items()}
        model.load_state_dict(update, assign=True)
        second = model(inputs)
    return {"outs": [first, second], "params": _params(model)}


def sc_training_after_frozen_forward(rank, world, shard, mesh):
    """torch's storage-independence case with requires_grad: train, the parameters are
    not views of the shards (an optimizer step shows in the next forward)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    shard(model, mesh=mesh, reshard_after_forward=False)
    return _train(model, 3, lambda i: (torch.ones(2, 8) * (i + rank + 1),))


# ------------------------------------------------------------------ the registry
SCENARIOS: dict[str, tuple] = {}  # id -> (fn, kwargs)


def _add(name: str, fn, **kwargs) -> None:
    SCENARIOS[name] = (fn, kwargs)


_add("shard_largest_dim", sc_shard_largest_dim)
_add("shard1_contiguous", sc_shard1_contiguous)
for _raf in (False, True):
    for _ac in (False, True):
        _add(f"shared_params[raf={_raf},ac={_ac}]", sc_shared_params, raf=_raf, ac=_ac)
    _add(f"shared_params_uneven[raf={_raf}]", sc_shared_params_uneven, raf=_raf)
_add("shared_params_separate_groups", sc_shared_params_separate_groups)
_add("layer_by_layer_gc", sc_layer_by_layer_gc)
for _meta in (False, True):
    for _raf in (False, True):
        _add(f"unsharded_views[meta={_meta},raf={_raf}]", sc_unsharded_views, meta=_meta, raf=_raf)
_add("load_without_reshard", sc_load_without_reshard)
_add("replaced_storage", sc_replaced_storage)
_add("training_after_frozen_forward", sc_training_after_frozen_forward)

# the fast suite runs these on two ranks; every scenario runs with -m slow on 2 and 3
FAST = [
    "shard_largest_dim",
    "shard1_contiguous",
    "shared_params[raf=True,ac=True]",
    "shared_params_uneven[raf=True]",
    "shared_params_separate_groups",
    "layer_by_layer_gc",
    "unsharded_views[meta=True,raf=False]",
    "load_without_reshard",
    "replaced_storage",
    "training_after_frozen_forward",
]

WORLD1 = [
    "unsharded_views[meta=False,raf=False]",
    "unsharded_views[meta=True,raf=True]",
    "replaced_storage",
    "load_without_reshard",
]


@pytest.mark.parametrize("selection,name", ts.cases(__name__))
def test_fsdp2_training_scenario(selection, name):
    ts.check(selection, __name__, name)
