"""Mixed precision as each torch release's FSDP2 does it, run with torch's
``fully_shard`` and flexshard's (harness: tests/helpers/fsdp2_training.py): bf16
gradient accumulation over ``set_requires_gradient_sync(False)`` microbatches (from
torch 2.15 held in fp32, a gradient autograd computes in fp32 kept uncast), a
``grad_dtype`` set on a parameter, and ``MixedPrecisionPolicy.param_dtype_override_fn``
(torch 2.15; skipped before, naming it). Dims of 17 split unevenly over 2 and 3 ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests.fsdp2.test_fsdp2_training_chunked import ChunkedHead, _chunked_step
from tests.helpers import fsdp2_training as ts
from tests.helpers.fsdp2_training import _grads, _params, _randn, _tokens

DIM = 17
BF16 = torch.bfloat16


def sc_bf16_accum(rank, world, shard, mesh, chunked, reduce_dtype, grouped=True):
    """Three microbatches, gradient sync on the last only, bf16 compute: RMSNorm's
    weight gradient is computed in fp32 (2.15's FSDP2 keeps it so), the others in bf16.
    Chunked: the synced microbatch reduces the head per chunk; with ``norm`` and
    ``head`` in calls of their own, each chunk's backward also reduces the gradients
    the others hold (FSDP2's final callback), a grouped head's partial forward not."""
    torch.manual_seed(0)
    m = ChunkedHead(dim=DIM)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
    kw = {"mesh": mesh, "mp_policy": policy}
    shard(m.embed, **kw)
    shard(m.body, **kw)
    if grouped:
        shard([m.norm, m.head], **kw)
    else:
        shard(m.norm, **kw)
        shard(m.head, **kw)
    shard(m, **kw)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    out: dict = {"loss": [], "grads": []}
    for it in range(2):
        for mb in range(3):
            m.set_requires_gradient_sync(mb == 2)
            tokens = _tokens(100 * it + 10 * mb + rank, seq=16)
            if chunked:
                out["loss"].append(_chunked_step(m, tokens, 2)["loss"])
            else:
                loss = m(tokens).float().sum()
                loss.backward()
                out["loss"].append(loss.detach())
        out["grads"].append(_grads(m))
        opt.step()
        opt.zero_grad(set_to_none=(it == 0))
    out["params"] = _params(m)
    return out


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)).to(self.b.weight.dtype))


def _train_mlps(model: nn.Module, rank: int, opt: torch.optim.Optimizer, nosync: bool) -> dict:
    out: dict = {"loss": [], "grads": [], "grad_dtypes": []}
    for it in range(2):
        for mb in range(3):
            model.set_requires_gradient_sync(mb == 2 or not nosync)
            loss = model(_randn(100 * it + 10 * mb + rank, 6, DIM)).float().sum()
            loss.backward()
            out["loss"].append(loss.detach())
        out["grads"].append(_grads(model))
        out["grad_dtypes"].append([str(p.grad.dtype) for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=(it == 0))
    out["params"] = _params(model)
    return out


def sc_override_fn(rank, world, shard, mesh, nosync, reduce_dtype):
    """``param_dtype_override_fn`` keeps the LayerNorms in fp32, the Linears in bf16."""
    torch.manual_seed(0)
    model = nn.Sequential(NormedMLP(), NormedMLP())
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    policy = MixedPrecisionPolicy(
        param_dtype=BF16,
        reduce_dtype=reduce_dtype,
        param_dtype_override_fn=lambda p: p.dtype if id(p) in norms else None,
    )
    shard(model[0], mesh=mesh, mp_policy=policy)
    shard(model, mesh=mesh, mp_policy=policy)
    return _train_mlps(model, rank, torch.optim.Adam(model.parameters(), lr=1e-2), nosync)


def sc_grad_dtype(rank, world, shard, mesh, grad_dtype):
    """A ``grad_dtype`` set on parameters before sharding (None: any dtype; bf16 on an
    fp32 parameter), bf16 compute: FSDP2 from torch 2.15 reduces and keeps their
    gradients in it; before, it ignores it."""
    torch.manual_seed(0)
    model = nn.Sequential(NormedMLP(), NormedMLP())
    for param in model[0].parameters():
        param.grad_dtype = grad_dtype
    policy = MixedPrecisionPolicy(param_dtype=BF16)
    shard(model[0], mesh=mesh, mp_policy=policy)
    model[1].norm.weight.grad_dtype = grad_dtype  # on the sharded parameter, before lazy init
    shard(model, mesh=mesh, mp_policy=policy)
    return _train_mlps(model, rank, torch.optim.SGD(model.parameters(), lr=1e-2), nosync=True)


def sc_grad_dtype_unused(rank, world, shard, mesh):
    """``grad_dtype = None`` with ``set_reduce_scatter_unused_params(True)`` and no
    ``reduce_dtype``: torch 2.15's FSDP2 refuses it (zeros need one dtype) before any
    collective; before 2.15 it ignores ``grad_dtype`` and trains."""
    torch.manual_seed(0)
    model = nn.Sequential(NormedMLP(), NormedMLP())
    model[0].norm.weight.grad_dtype = None
    policy = MixedPrecisionPolicy(param_dtype=BF16)
    shard(model[0], mesh=mesh, mp_policy=policy)
    shard(model, mesh=mesh, mp_policy=policy)
    model.set_reduce_scatter_unused_params(True)
    return _train_mlps(model, rank, torch.optim.SGD(model.parameters(), lr=1e-2), nosync=False)


SCENARIOS: dict[str, tuple] = {}
for _chunked in (False, True):
    for _reduce in (None, torch.float32):
        SCENARIOS[f"bf16_accum[chunked={_chunked},reduce={_reduce}]"] = (
            sc_bf16_accum,
            {"chunked": _chunked, "reduce_dtype": _reduce},
        )
SCENARIOS["bf16_accum[chunked=True,separate,reduce=None]"] = (
    sc_bf16_accum,
    {"chunked": True, "reduce_dtype": None, "grouped": False},
)
for _nosync in (False, True):
    for _reduce in (None, torch.float32):
        SCENARIOS[f"param_dtype_override_fn[nosync={_nosync},reduce={_reduce}]"] = (
            sc_override_fn,
            {"nosync": _nosync, "reduce_dtype": _reduce},
        )
for _grad_dtype in (None, BF16):
    SCENARIOS[f"grad_dtype[{_grad_dtype}]"] = (sc_grad_dtype, {"grad_dtype": _grad_dtype})
SCENARIOS["grad_dtype[None,reduce_unused]"] = (sc_grad_dtype_unused, {})

FAST = [
    "bf16_accum[chunked=False,reduce=None]",
    "bf16_accum[chunked=True,reduce=None]",
    "bf16_accum[chunked=True,separate,reduce=None]",
    "param_dtype_override_fn[nosync=True,reduce=None]",
    "grad_dtype[None]",
    "grad_dtype[torch.bfloat16]",
    "grad_dtype[None,reduce_unused]",
]


@pytest.mark.parametrize("selection,name", ts.cases(__name__))
def test_fsdp2_training_scenario(selection, name):
    ts.check(selection, __name__, name)
