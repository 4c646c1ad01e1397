"""torch's FSDP2 training-parity scenarios (test_fully_shard_training.py: one and several
fully_shard groups, CPU offload, non-root forward/backward, explicit prefetching,
activation checkpointing (composable / utils / wrapper), double forward, forward
methods, eval then train), run with torch's ``fully_shard`` and
flexshard's (harness: tests/helpers/fsdp2_training.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    OffloadPolicy,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import Shard

from tests.helpers import fsdp2_training as ts
from tests.helpers.fsdp2_training import (
    MLP,
    Transformer,
    _apply_ac,
    _grads,
    _is_dtensor,
    _params,
    _randn,
    _tokens,
    _train,
)


def sc_single_group(rank, world, shard, mesh, shapes, largest_dim):
    """Root-only wrapping of Linear-ReLU-Linear, dim-0 (uneven) or largest-dim sharding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1]))
    fn = (lambda p: Shard(p.shape.index(max(p.shape)))) if largest_dim else None
    shard(model, mesh=mesh, shard_placement_fn=fn)
    return _train(model, 5, lambda i: (_randn(7 * rank + i, 4, shapes[0][0]),))


def sc_multi_group(rank, world, shard, mesh, raf, offload):
    """Transformer with every block wrapped, then the root."""
    torch.manual_seed(0)
    model = Transformer(layers=2)
    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    for layer in model.layers:
        shard(layer, mesh=mesh, reshard_after_forward=raf, offload_policy=policy)
    shard(model, mesh=mesh, reshard_after_forward=raf, offload_policy=policy)
    return _train(model, 4, lambda i: (_tokens(10 * i + rank),))


def sc_non_root_forward_backward(rank, world, shard, mesh):
    """Forward/backward through the root, step, then through a non-root child alone."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(8), MLP(8), MLP(8))
    for mlp in model:
        shard(mlp, mesh=mesh)
    shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    x = _randn(rank, 4, 8)
    root_loss = model(x).sum()
    root_loss.backward()
    grads0 = _grads(model)
    opt.step()
    opt.zero_grad()
    nonroot_loss = model[0](x).sum()
    nonroot_loss.backward()
    grads1 = _grads(model)
    opt.step()
    final = model(x).sum()
    return {"loss": [root_loss.detach(), nonroot_loss.detach(), final.detach()],
            "grads": [grads0, grads1], "params": _params(model)}  # fmt: skip


def sc_explicit_prefetching(rank, world, shard, mesh):
    """set_modules_to_forward/backward_prefetch two layers ahead."""
    torch.manual_seed(0)
    model = Transformer(layers=4)
    for layer in [*model.layers, model]:
        shard(layer, mesh=mesh)
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if i + 2 < len(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        if i >= 2:
            layer.set_modules_to_backward_prefetch([layers[i - 1], layers[i - 2]])
    return _train(model, 3, lambda i: (_tokens(rank),))


def sc_activation_checkpointing(rank, world, shard, mesh, raf, impl, grouping):
    """Activation checkpointing (composable / utils / wrapper) composed with fully_shard
    per block, memory-efficient lists of modules, or a weight-tied list."""
    torch.manual_seed(0)
    model = Transformer(layers=3, tie=grouping != "mem_eff", checkpointed=impl == "utils")
    _apply_ac(model, impl)
    kw = {"mesh": mesh, "reshard_after_forward": raf}
    if grouping == "mem_eff":
        shard(model.layers[0], **kw)
        shard([model.layers[1], model.layers[2]], **kw)
        shard([model.tok_embeddings, model.pos_embeddings], **kw)
        model.tok_embeddings.set_unshard_in_backward(False)
        shard([model.norm, model.output], **kw)
    elif grouping == "tied":
        shard([model.tok_embeddings, model.output], **kw)
        for layer in model.layers:
            shard(layer, **kw)
    else:
        for layer in model.layers:
            shard(layer, **kw)
    shard(model, **kw)
    return _train(model, 3, lambda i: (_tokens(rank),))


def sc_double_forward(rank, world, shard, mesh, raf, impl):
    """DPO: two forwards of a nested-wrapped, checkpointed model before one backward."""
    torch.manual_seed(0)
    model = Transformer(layers=2, checkpointed=impl == "utils")
    _apply_ac(model, impl)
    for layer in model.layers:
        shard(layer.attention, mesh=mesh, reshard_after_forward=raf)
        shard(layer.feed_forward, mesh=mesh, reshard_after_forward=raf)
        shard(layer, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    out1 = model(_tokens(rank))
    out2 = model(_tokens(rank + 50))
    loss = (out1.sum() - out2.sum()).pow(2)
    loss.backward()
    return {"loss": loss.detach(), "grads": _grads(model)}


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_proj = nn.Conv2d(3, 16, kernel_size=4, stride=4)

    def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.patch_proj(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.forward_features(imgs).sum(dim=1)


class WithViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit, self.projector = ViT(), nn.Linear(16, 8)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vit.forward_features(imgs))  # not vit.forward


def sc_forward_method(rank, world, shard, mesh):
    """register_fsdp_forward_method on a wrapped child whose parent calls a method
    other than forward."""
    torch.manual_seed(0)
    model = WithViT()
    shard(model.vit, mesh=mesh)
    shard(model.projector, mesh=mesh)
    shard(model, mesh=mesh)
    register_fsdp_forward_method(model.vit, "forward_features")
    return _train(model, 3, lambda i: (_randn(10 * i + rank, 2, 3, 16, 16),))


def sc_eval_then_train(rank, world, shard, mesh, raf):
    """A no-grad (eval) forward between training steps."""
    torch.manual_seed(0)
    model = Transformer(layers=2)
    for layer in model.layers:
        shard(layer, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out: dict = {"loss": [], "eval": [], "types": []}
    for i in range(3):
        loss = model(_tokens(10 * i + rank)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            out["eval"].append(model(_tokens(rank + 77)).sum())
        out["types"].append(_is_dtensor(model))
        out["loss"].append(loss.detach())
    out["params"] = _params(model)
    return out


# ------------------------------------------------------------------ the registry
SCENARIOS: dict[str, tuple] = {}  # id -> (fn, kwargs)


def _add(name: str, fn, **kwargs) -> None:
    SCENARIOS[name] = (fn, kwargs)


for _raf in (True, False, 2):
    _add(f"multi_group[raf={_raf}]", sc_multi_group, raf=_raf, offload=False)
for _i, _shapes in enumerate([[(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]]):
    _add(f"single_group[{_i}]", sc_single_group, shapes=_shapes, largest_dim=False)
_add("single_group[largest_dim]", sc_single_group, shapes=[(32, 16), (16, 8)], largest_dim=True)
_add("multi_group[offload]", sc_multi_group, raf=True, offload=True)
_add("non_root_forward_backward", sc_non_root_forward_backward)
_add("explicit_prefetching", sc_explicit_prefetching)
for _raf in (True, False):
    for _impl in ("composable", "utils", "wrapper"):
        for _grouping in ("block", "mem_eff", "tied"):
            _add(
                f"activation_checkpointing[raf={_raf},{_impl},{_grouping}]",
                sc_activation_checkpointing,
                raf=_raf,
                impl=_impl,
                grouping=_grouping,
            )
for _raf in (True, False):
    for _impl in ("composable", "utils"):
        _add(f"double_forward[raf={_raf},{_impl}]", sc_double_forward, raf=_raf, impl=_impl)
_add("forward_method", sc_forward_method)
for _raf in (True, False):
    _add(f"eval_then_train[raf={_raf}]", sc_eval_then_train, raf=_raf)

# the fast suite runs these on two ranks; every scenario runs with -m slow on 2 and 3
FAST = [
    "multi_group[raf=True]",
    "multi_group[raf=False]",
    "single_group[0]",
    "single_group[2]",
    "single_group[largest_dim]",
    "non_root_forward_backward",
    "explicit_prefetching",
    "activation_checkpointing[raf=True,composable,block]",
    "activation_checkpointing[raf=True,wrapper,mem_eff]",
    "activation_checkpointing[raf=False,utils,tied]",
    "double_forward[raf=True,composable]",
    "forward_method",
    "eval_then_train[raf=True]",
]

WORLD1 = [
    "single_group[0]",
    "single_group[2]",
    "multi_group[raf=True]",
]


@pytest.mark.parametrize("selection,name", ts.cases(__name__))
def test_fsdp2_training_scenario(selection, name):
    ts.check(selection, __name__, name)
