"""torch's FSDP2 chunked-loss and gradient-accumulation scenarios
(test_fully_shard_training.py: torchtitan-style chunked heads with grouped / tied /
mixed-precision groups, chunked gradient accumulation, reshard toggling, iteration-state
reset, partial double forward),
run with torch's ``fully_shard`` and flexshard's (harness:
tests/helpers/fsdp2_training.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
)
from torch.distributed.tensor import DTensor

from tests.helpers import fsdp2_training as ts
from tests.helpers.fsdp2_training import (
    _full,
    _grads,
    _params,
    _randn,
    _tokens,
)


class ChunkedHead(nn.Module):
    def __init__(self, dim: int = 16, vocab: int = 33, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _chunked_step(model: nn.Module, tokens: torch.Tensor, n_chunks: int = 4) -> dict:
    """torchtitan's chunked loss: the trunk with skip_head, the head per chunk on
    detached pieces, then the trunk's backward with the chunks' input gradients."""
    h = model(tokens, skip_head=True)
    total, h_grads, head_grads = 0.0, [], []
    for chunk in torch.chunk(h.detach().float(), n_chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        out = model.head(chunk)
        loss = out.float().sum()
        total += loss.detach()
        loss.backward()
        h_grads.append(chunk.grad.detach())
        head_grads.append(_full(model.head.weight.grad))
    h.backward(torch.cat(h_grads, dim=1).to(h.dtype))
    return {"loss": total, "h_dtype": str(h.dtype), "head_grads": head_grads}


def sc_chunked_head(rank, world, shard, mesh, raf, tie, mp, grouped):
    """A grouped ``fully_shard([norm, head])`` whose forward skips the head, then the
    head called alone per chunk (torch's partial-group forward)."""
    bf16 = {"param_dtype": torch.float32, "output_dtype": torch.bfloat16}
    inner = MixedPrecisionPolicy(**bf16) if mp != "none" else MixedPrecisionPolicy()
    root = {
        "none": MixedPrecisionPolicy(),
        "bf16_everywhere": MixedPrecisionPolicy(**bf16),
        # no output_dtype at the root, but fp32 inputs cast for the body
        "bf16_inner_only": MixedPrecisionPolicy(param_dtype=torch.float32),
    }[mp]
    torch.manual_seed(0)
    m = ChunkedHead(tie=tie)
    kw = {"mesh": mesh, "reshard_after_forward": raf}
    if tie:
        shard(m.body, mp_policy=root, **kw)
        shard([m.embed, m.norm, m.head], mp_policy=inner, **kw)
    else:
        shard(m.embed, mp_policy=root, **kw)
        shard(m.body, mp_policy=root, **kw)
        if grouped:
            shard([m.norm, m.head], mp_policy=inner, **kw)
        else:
            shard(m.norm, mp_policy=inner, **kw)
            shard(m.head, mp_policy=inner, **kw)
    shard(m, mp_policy=root, **kw)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    out: dict = {"steps": []}
    for i in range(3):
        step = _chunked_step(m, _tokens(rank, seq=16))
        step["grads"] = _grads(m)
        out["steps"].append(step)
        opt.step()
        opt.zero_grad(set_to_none=(i % 2 == 0))
    out["params"] = _params(m)
    return out


class AB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16, bias=False)
        self.b = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).float())  # fp32 between a and b: b must cast its input


def sc_grouped_cast_forward_inputs(rank, world, shard, mesh):
    """cast_forward_inputs applies to every module of a grouped fully_shard([a, b])."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    torch.manual_seed(0)
    model = AB()
    shard([model.a, model.b], mesh=mesh, mp_policy=policy)
    shard(model, mesh=mesh, mp_policy=policy)
    y = model(_randn(rank, 2, 16))
    y.float().sum().backward()
    return {"out": y.detach(), "dtype": str(y.dtype), "grads": _grads(model)}


def sc_chunked_grad_accum(rank, world, shard, mesh, raf, grouped):
    """Chunked loss with gradient accumulation (set_requires_gradient_sync /
    set_is_last_backward) over three microbatches."""
    torch.manual_seed(0)
    m = ChunkedHead()
    kw = {"mesh": mesh, "reshard_after_forward": raf}
    shard(m.embed, **kw)
    shard(m.body, **kw)
    if grouped:
        shard([m.norm, m.head], **kw)
    else:
        shard(m.norm, **kw)
        shard(m.head, **kw)
    shard(m, **kw)
    losses = []
    for i in range(3):
        last = i == 2
        m.set_requires_gradient_sync(last)
        m.set_is_last_backward(last)
        losses.append(_chunked_step(m, _tokens(10 * i + rank, seq=16), 2)["loss"])
    return {"loss": losses, "grads": _grads(m)}


def sc_reshard_toggle(rank, world, shard, mesh, tie, initial_reshard):
    """torchtitan's ChunkedCELoss toggle: reshard_after_forward/backward off on the
    head for the chunk loop, restored, then an explicit ``head.reshard()``."""
    torch.manual_seed(0)
    m = ChunkedHead(tie=tie)
    if tie:
        shard(m.body, mesh=mesh)
        shard([m.embed, m.norm, m.head], mesh=mesh, reshard_after_forward=initial_reshard)
    else:
        shard(m.embed, mesh=mesh)
        shard(m.body, mesh=mesh)
        shard([m.norm, m.head], mesh=mesh, reshard_after_forward=initial_reshard)
    shard(m, mesh=mesh)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    out: dict = {"loss": [], "grads": [], "head_sharded": []}
    for i in range(3):
        h = m(_tokens(rank, seq=16), skip_head=True)
        m.head.set_reshard_after_forward(False)
        m.head.set_reshard_after_backward(False)
        h_grads, total = [], 0.0
        for chunk in torch.chunk(h.detach(), 4, dim=1):
            chunk = chunk.contiguous().requires_grad_(True)
            loss = m.head(chunk).sum()
            loss.backward()
            total += loss.detach()
            h_grads.append(chunk.grad.detach())
            out["head_sharded"].append(isinstance(m.head.weight, DTensor))
        m.head.set_reshard_after_forward(True)
        m.head.set_reshard_after_backward(True)
        m.head.reshard()
        out["head_sharded"].append(isinstance(m.head.weight, DTensor))
        h.backward(torch.cat(h_grads, dim=1))
        out["loss"].append(total)
        out["grads"].append(_grads(m))
        opt.step()
        opt.zero_grad(set_to_none=(i % 2 == 0))
    out["params"] = _params(m)
    return out


class Raiser(nn.Module):
    def __init__(self, wrapped: nn.Module) -> None:
        super().__init__()
        self.wrapped = wrapped
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("boom")
        return self.wrapped(x)


def sc_reset_iter_state(rank, world, shard, mesh):
    """An exception mid-forward, ``reset_iter_state()``, then a clean step."""
    torch.manual_seed(0)
    m = ChunkedHead()
    m.body = Raiser(m.body)
    shard([m.norm, m.head], mesh=mesh)
    shard(m, mesh=mesh)
    tokens = _tokens(rank, seq=16)
    m.body.armed = True
    raised = None
    try:
        m(tokens, skip_head=True)
    except RuntimeError as err:
        raised = str(err)
    m.body.armed = False
    m.reset_iter_state()
    loss = m(tokens).sum()
    loss.backward()
    return {"raised": raised, "loss": loss.detach(), "grads": _grads(m)}


def sc_double_partial_forward(rank, world, shard, mesh):
    """Two forwards that skip the grouped head, then one backward: the head's grad
    stays None."""
    torch.manual_seed(0)
    m = ChunkedHead()
    shard([m.norm, m.head], mesh=mesh)
    shard(m, mesh=mesh)
    h1 = m(_tokens(rank, seq=16), skip_head=True)
    h2 = m(_tokens(rank + 9, seq=16), skip_head=True)
    (h1.sum() + h2.sum()).backward()
    return {"grads": _grads(m)}


# ------------------------------------------------------------------ the registry
SCENARIOS: dict[str, tuple] = {}  # id -> (fn, kwargs)


def _add(name: str, fn, **kwargs) -> None:
    SCENARIOS[name] = (fn, kwargs)


for _raf in (True, False, 1):
    for _tie in (False, True):
        for _mp in ("none", "bf16_everywhere", "bf16_inner_only"):
            if _raf is not True and _raf == 1 and (_tie or _mp != "none"):
                continue
            _add(
                f"chunked_head[raf={_raf},tie={_tie},{_mp}]",
                sc_chunked_head,
                raf=_raf,
                tie=_tie,
                mp=_mp,
                grouped=True,
            )
_add("chunked_head[ungrouped]", sc_chunked_head, raf=True, tie=False, mp="none", grouped=False)
_add("grouped_cast_forward_inputs", sc_grouped_cast_forward_inputs)
for _raf in (True, False):
    for _grouped in (True, False):
        _add(
            f"chunked_grad_accum[raf={_raf},grouped={_grouped}]",
            sc_chunked_grad_accum,
            raf=_raf,
            grouped=_grouped,
        )
for _tie in (False, True):
    for _init in (False, True):
        _add(
            f"reshard_toggle[tie={_tie},initial={_init}]",
            sc_reshard_toggle,
            tie=_tie,
            initial_reshard=_init,
        )
_add("reset_iter_state", sc_reset_iter_state)
_add("double_partial_forward", sc_double_partial_forward)

# the fast suite runs these on two ranks; every scenario runs with -m slow on 2 and 3
FAST = [
    "chunked_head[raf=True,tie=False,none]",
    "chunked_head[raf=False,tie=True,bf16_inner_only]",
    "grouped_cast_forward_inputs",
    "chunked_grad_accum[raf=True,grouped=True]",
    "reshard_toggle[tie=False,initial=False]",
    "reshard_toggle[tie=True,initial=True]",
    "reset_iter_state",
    "double_partial_forward",
]


@pytest.mark.parametrize("selection,name", ts.cases(__name__))
def test_fsdp2_training_scenario(selection, name):
    ts.check(selection, __name__, name)
