"""torch's own FSDP2 training/autograd unit-test scenarios (test_fully_shard_autograd.py,
test_fully_shard_training.py, test_fully_shard_shared_params.py,
test_fully_shard_unsharded_views.py), re-expressed for CPU and run with torch's
``fully_shard`` and with flexshard's: losses, gradients, parameters after optimizer
steps and raised exceptions must agree bit for bit (fp32), or both must raise.

Every scenario of one world size runs in one ``run_distributed`` call (start-up is the
cost); each rank compares the two runs itself and hands back which results differ."""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    register_fsdp_forward_method,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import flexshard as fs
from flexshard.testing import run_distributed


# ------------------------------------------------------------------ models
class MLP(nn.Module):
    def __init__(self, dim: int, mult: int = 2) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * mult)
        self.out_proj = nn.Linear(dim * mult, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(o.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, checkpointed: bool = False) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = MLP(dim)
        self.checkpointed = checkpointed

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:  # torch.utils.checkpoint inside the block ("utils")
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


VOCAB, DIM, SEQ = 33, 16, 8


class Transformer(nn.Module):
    def __init__(self, layers: int = 2, tie: bool = False, checkpointed: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block(DIM, 2, checkpointed) for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1])
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


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


# ------------------------------------------------------------------ helpers
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def _tokens(seed: int, batch: int = 2, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=_gen(seed))


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _params(model: nn.Module) -> dict:
    return {k: _full(p) for k, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict:
    return {k: _full(p.grad) for k, p in model.named_parameters()}


def _train(
    model: nn.Module,
    steps: int,
    batch,
    loss_fn=lambda out: out.sum(),
    opt: torch.optim.Optimizer | None = None,
) -> dict:
    """torch's loop: zero_grad(set_to_none alternating), forward, backward, record the
    loss and full gradients, step; the full parameters at the end."""
    opt = opt or torch.optim.Adam(model.parameters(), lr=1e-2)
    out: dict = {"loss": [], "grads": []}
    for i in range(steps):
        opt.zero_grad(set_to_none=(i % 2 == 0))
        loss = loss_fn(model(*batch(i)))
        loss.backward()
        out["loss"].append(loss.detach().clone())
        out["grads"].append(_grads(model))
        opt.step()
    out["params"] = _params(model)
    return out


def _is_dtensor(model: nn.Module) -> list[bool]:
    return [isinstance(p, DTensor) for p in model.parameters()]


# ------------------------------------------------------------------ autograd scenarios
class TwoOut(nn.Module):
    def __init__(self, dim: int = 9) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.relu(self.lin1(x))
        return y, F.relu(self.lin2(y))


def sc_unused_forward_output(rank, world, shard, mesh, raf):
    """Some forward outputs (the root's lin2 path) are not used in later losses."""
    torch.manual_seed(0)
    model = TwoOut()
    shard(model.lin1, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)

    calls = [0]

    def loss_fn(out):
        calls[0] += 1
        return (out[0] * out[1]).sum() if calls[0] <= 3 else out[0].sum()

    return _train(model, 6, lambda i: (_randn(100 * i + rank, 2, 9),), loss_fn)


class SkipsLin2(TwoOut):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin1(x)


def sc_unused_forward_module(rank, world, shard, mesh, raf):
    """A separately wrapped module that never runs forward: its gradient stays None."""
    torch.manual_seed(0)
    model = SkipsLin2()
    shard(model.lin1, mesh=mesh, reshard_after_forward=raf)
    shard(model.lin2, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    out = _train(model, 4, lambda i: (_randn(100 * i + rank, 2, 9),))
    out["grad_none"] = [k for k, p in model.named_parameters() if p.grad is None]
    return out


NT = collections.namedtuple("NT", "x y")


@dataclasses.dataclass
class Carrier:
    x: torch.Tensor
    note: str = "meta"


class ToContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        return {
            "list": lambda: [x],
            "namedtuple": lambda: NT(x, torch.ones_like(x)),
            "tuple": lambda: (x,),
            "dict": lambda: {"x": x},
            "dataclass": lambda: Carrier(x),
        }[self.kind]()


class ContainerModule(nn.Module):
    def __init__(self, dim: int = 9) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.lin2(F.relu(self.lin1(x))))

    def forward(self, inp: Any) -> Any:
        if isinstance(inp, list):
            return [self._f(inp[0])]
        if isinstance(inp, NT):
            return NT(self._f(inp.x), inp.y)
        if isinstance(inp, tuple):
            return (self._f(inp[0]),)
        if isinstance(inp, dict):
            return {"x": self._f(inp["x"])}
        return Carrier(self._f(inp.x), inp.note)


class FromContainer(nn.Module):
    def forward(self, inp: Any) -> torch.Tensor:
        if isinstance(inp, (list, tuple)):
            return inp[0]
        return inp["x"] if isinstance(inp, dict) else inp.x


def sc_nontensor_activations(rank, world, shard, mesh, kind):
    """Activations wrapped in lists, namedtuples, tuples, dicts and dataclasses between
    separately wrapped modules (torch collects tensors from all five)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        ToContainer(kind), ContainerModule(), ContainerModule(), ContainerModule(), FromContainer()
    )
    for module in model:
        shard(module, mesh=mesh)
    shard(model, mesh=mesh)
    return _train(model, 4, lambda i: (_randn(100 * i + rank, 2, 9),))


def sc_post_acc_grad_hook(rank, world, shard, mesh):
    """Post-accumulate-grad hooks on the sharded parameters run once per backward."""
    torch.manual_seed(0)
    model = MLP(9)
    for module in (model.in_proj, model.out_proj, model):
        shard(module, mesh=mesh)
    counts: dict = collections.defaultdict(int)
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            functools.partial(lambda n, p: counts.__setitem__(n, counts[n] + 1), name)
        )
    model(_randn(rank, 2, 9)).sum().backward()
    return {"counts": dict(counts), "grads": _grads(model)}


def sc_optim_in_backward(rank, world, shard, mesh):
    """torch's optimizer-in-backward: per-parameter AdamW + StepLR stepped from the
    post-accumulate-grad hook."""
    torch.manual_seed(0)
    model = Transformer(layers=2)
    for module in [*model.layers, model]:
        shard(module, mesh=mesh)
    optims = {p: torch.optim.AdamW([p], lr=1e-2, foreach=False) for p in model.parameters()}
    scheds = {p: torch.optim.lr_scheduler.StepLR(o, step_size=2) for p, o in optims.items()}

    def hook(param):
        optims[param].step()
        optims[param].zero_grad()
        scheds[param].step()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(hook)
    losses = []
    for i in range(4):
        loss = model(_tokens(10 * i + rank)).sum()
        loss.backward()
        losses.append(loss.detach())
    return {"loss": losses, "params": _params(model)}


# ------------------------------------------------------------------ training scenarios
class Paramless(nn.Module):
    def forward(self, x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return x + ys[0] + ys[1] + 1


class ParameterOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 5))

    def forward(self) -> torch.Tensor:
        return self.weight @ self.weight


def sc_forward_inputs(rank, world, shard, mesh):
    """A parameterless root with nested inputs; a root whose forward takes no input."""
    a = Paramless()
    shard(a, mesh=mesh)
    out = {"paramless": a(_randn(1, 3), (_randn(2, 3), _randn(3, 3)))}
    torch.manual_seed(0)
    b = ParameterOnly()
    shard(b, mesh=mesh)
    y = b()
    y.sum().backward()
    out.update(no_inputs=y.detach(), grads=_grads(b), params=_params(b))
    return out


def sc_param_registration(rank, world, shard, mesh, raf, nested):
    """Which parameters are DTensors (sharded) or plain tensors (unsharded) after
    forward, after ``reshard()``, and after backward, for each reshard_after_forward."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(3), MLP(3)) if nested else MLP(3)
    if nested:
        shard(model[0].in_proj, mesh=mesh, reshard_after_forward=raf)
        shard(model[0].out_proj, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    x = _randn(rank, 2, 3)
    out: dict = {"init": _is_dtensor(model), "values0": _params(model)}
    y = model(x)
    out["after_forward"] = _is_dtensor(model)
    values = {k: _full(p) for k, p in model.named_parameters()}  # plain or DTensor
    out["values1"] = values
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    out["after_reshard"] = _is_dtensor(model)
    model(x).sum().backward()
    out["after_backward"] = _is_dtensor(model)
    out["grads"] = _grads(model)
    del y
    return out


def sc_float64_after_init(rank, world, shard, mesh):
    """``model.to(float64)`` after fully_shard: parameters, shards and grads in fp64."""
    torch.manual_seed(0)
    model = MLP(4)
    for module in (model.in_proj, model.out_proj, model):
        shard(module, mesh=mesh)
    model.to(torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    out = _train(model, 4, lambda i: (_randn(100 * i + rank, 2, 4).double(),), opt=opt)
    out["dtypes"] = [
        (str(p.dtype), str(p.to_local().dtype), str(p.grad.dtype), str(p.grad.to_local().dtype))
        for p in model.parameters()
    ]
    return out


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


class MultiForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


def sc_multi_forward_module(rank, world, shard, mesh, raf):
    """A wrapped module that runs twice in one forward."""
    torch.manual_seed(0)
    model = MultiForward()
    shard(model.inner, mesh=mesh, reshard_after_forward=raf)
    shard(model, mesh=mesh, reshard_after_forward=raf)
    return _train(model, 4, lambda i: (_randn(rank, 8, 4),))


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


def _apply_ac(model: Transformer, impl: str) -> None:
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    if impl == "wrapper":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    elif impl == "composable":
        for module in model.modules():
            if isinstance(module, Block):
                checkpoint(module)


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


def sc_grad_accum(rank, world, shard, mesh, raf, mode, rab, offload, hsdp=False, rs_only=False):
    """torch's gradient accumulation: no reduction (and optionally no reshard after
    backward) for all / the root only / some MLPs until the last microbatch; the
    optimizer zeroes grads to None or to zeros alternately."""
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 9), MLP(9), MLP(9), MLP(9))
    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    kw = {"mesh": mesh, "reshard_after_forward": raf, "offload_policy": policy}
    for mlp in model[1:]:
        shard(mlp, **kw)
    shard(model, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def sync(module, last, recurse=True):
        if rs_only:
            module.set_requires_all_reduce(last, recurse=recurse)
        else:
            module.set_requires_gradient_sync(last, recurse=recurse)

    out: dict = {"loss": [], "grads": []}
    for it in range(3):
        for mb in range(3):
            last = mb == 2
            if mode == "all":
                sync(model, last)
                if not rab:
                    model.set_reshard_after_backward(last)
            elif mode == "some_mlps":
                for mlp in model[1:3]:
                    sync(mlp, last)
                    if not rab:
                        mlp.set_reshard_after_backward(last)
            else:  # root_only
                sync(model, last, recurse=False)
                if not rab:
                    model.set_reshard_after_backward(last, recurse=False)
            loss = model(_randn(100 * it + 10 * mb + rank, 2, 9)).sum()
            loss.backward()
            out["loss"].append(loss.detach())
        out["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=(it % 2 == 1))
    out["params"] = _params(model)
    return out


def _grad_accum_cases() -> list[dict]:
    """torch's sub-cases, minus the ones its own test skips."""
    cases = []
    for raf in (True, False, 2):
        for mode in ("all", "root_only", "some_mlps"):
            for rab in (False, True):
                for offload in (False, True):
                    if not rab and (raf is not False or mode == "some_mlps"):
                        continue
                    if offload and raf is not True:
                        continue
                    cases.append({"raf": raf, "mode": mode, "rab": rab, "offload": offload})
    return cases


def sc_1f1b(rank, world, shard, mesh, explicit_unshard, rab):
    """1F1B microbatching: reshard_after_forward=False, optional explicit async
    unshard of every module up front, sync and reshard only on the last microbatch."""
    torch.manual_seed(0)
    model = Transformer(layers=2)
    for layer in model.layers:
        shard(layer, mesh=mesh, reshard_after_forward=False)
    shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if explicit_unshard:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard(async_op=True)
    losses = []
    for i in range(3):
        last = i == 2
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        if not rab:
            model.set_reshard_after_backward(last)
        loss = model(_tokens(10 * i + rank)).sum()
        loss.backward()
        losses.append(loss.detach())
    grads = _grads(model)
    opt.step()
    return {"loss": losses, "grads": grads, "params": _params(model)}


def sc_hsdp(rank, world, shard, mesh, raf, ac, dim, sync_last, offload):
    """HSDP (2 replicas x 2 shards) train parity with microbatches."""
    from torch.distributed._composable import checkpoint

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(dim, bias=False), MLP(dim, 3), MLP(dim), MLP(dim, 3))
    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    kw = {"mesh": mesh, "reshard_after_forward": raf, "offload_policy": policy}
    for sub in model:
        if ac:
            checkpoint(sub)
        shard(sub, **kw)
    shard(model, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out: dict = {"loss": [], "grads": []}
    for it in range(2):
        for mb in range(3):
            if sync_last:
                model.set_requires_gradient_sync(mb == 2)
            loss = model(_randn(10 * it + mb + 100 * rank, 8, dim)).sum()
            loss.backward()
            out["loss"].append(loss.detach())
        out["grads"].append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=(it % 2 == 0))
    out["params"] = _params(model)
    return out


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


for _raf in (True, False, 2):
    _add(f"unused_forward_output[raf={_raf}]", sc_unused_forward_output, raf=_raf)
    _add(f"unused_forward_module[raf={_raf}]", sc_unused_forward_module, raf=_raf)
    _add(f"multi_forward_module[raf={_raf}]", sc_multi_forward_module, raf=_raf)
    _add(f"multi_group[raf={_raf}]", sc_multi_group, raf=_raf, offload=False)
for _kind in ("list", "namedtuple", "tuple", "dict", "dataclass"):
    _add(f"nontensor_activations[{_kind}]", sc_nontensor_activations, kind=_kind)
_add("post_acc_grad_hook", sc_post_acc_grad_hook)
_add("optim_in_backward", sc_optim_in_backward)
_add("forward_inputs", sc_forward_inputs)
for _raf in (True, False, 1, 2, None):
    for _nested in (False, True):
        _add(
            f"param_registration[raf={_raf},nested={_nested}]",
            sc_param_registration,
            raf=_raf,
            nested=_nested,
        )
_add("float64_after_init", sc_float64_after_init)
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
for _raf in (True, False):
    for _impl in ("composable", "utils"):
        _add(f"double_forward[raf={_raf},{_impl}]", sc_double_forward, raf=_raf, impl=_impl)
_add("double_partial_forward", sc_double_partial_forward)
_add("shard_largest_dim", sc_shard_largest_dim)
_add("shard1_contiguous", sc_shard1_contiguous)
for _raf in (False, True):
    for _ac in (False, True):
        _add(f"shared_params[raf={_raf},ac={_ac}]", sc_shared_params, raf=_raf, ac=_ac)
    _add(f"shared_params_uneven[raf={_raf}]", sc_shared_params_uneven, raf=_raf)
_add("shared_params_separate_groups", sc_shared_params_separate_groups)
_add("layer_by_layer_gc", sc_layer_by_layer_gc)
for _c in _grad_accum_cases():
    _add(
        "grad_accum[raf={raf},{mode},rab={rab},offload={offload}]".format(**_c),
        sc_grad_accum,
        **_c,
    )
for _explicit in (False, True):
    for _rab in (False, True):
        _add(f"1f1b[unshard={_explicit},rab={_rab}]", sc_1f1b, explicit_unshard=_explicit, rab=_rab)
_add("forward_method", sc_forward_method)
for _raf in (True, False):
    _add(f"eval_then_train[raf={_raf}]", sc_eval_then_train, raf=_raf)
for _meta in (False, True):
    for _raf in (False, True):
        _add(f"unsharded_views[meta={_meta},raf={_raf}]", sc_unsharded_views, meta=_meta, raf=_raf)
_add("load_without_reshard", sc_load_without_reshard)
_add("replaced_storage", sc_replaced_storage)
_add("training_after_frozen_forward", sc_training_after_frozen_forward)

# HSDP: four ranks (2 replicas x 2 shards)
HSDP: dict[str, tuple] = {}
for _raf in (True, False, 2):
    for _mode in ("all", "root_only", "some_mlps"):
        for _rs_only in (False, True):
            HSDP[f"hsdp_grad_accum[raf={_raf},{_mode},rs_only={_rs_only}]"] = (
                sc_grad_accum,
                {"raf": _raf, "mode": _mode, "rab": True, "offload": False, "hsdp": True,
                 "rs_only": _rs_only},
            )  # fmt: skip
for _raf in (False, True):
    for _ac in (False, True):
        for _dim in (3, 17):
            for _sync in (True, False):
                HSDP[f"hsdp_train[raf={_raf},ac={_ac},dim={_dim},sync_last={_sync}]"] = (
                    sc_hsdp,
                    {"raf": _raf, "ac": _ac, "dim": _dim, "sync_last": _sync, "offload": False},
                )
HSDP["hsdp_train[offload]"] = (
    sc_hsdp,
    {"raf": True, "ac": False, "dim": 17, "sync_last": True, "offload": True},
)
SCENARIOS_W4 = {**HSDP}

# the fast suite runs these on two ranks; every scenario runs with -m slow on 2 and 3
FAST = [
    "unused_forward_output[raf=True]",
    "unused_forward_output[raf=False]",
    "unused_forward_module[raf=True]",
    "multi_forward_module[raf=True]",
    "multi_forward_module[raf=False]",
    "multi_group[raf=True]",
    "multi_group[raf=False]",
    "nontensor_activations[namedtuple]",
    "nontensor_activations[dict]",
    "nontensor_activations[dataclass]",
    "post_acc_grad_hook",
    "optim_in_backward",
    "forward_inputs",
    "param_registration[raf=True,nested=True]",
    "param_registration[raf=False,nested=True]",
    "param_registration[raf=None,nested=True]",
    "param_registration[raf=1,nested=True]",
    "float64_after_init",
    "single_group[0]",
    "single_group[2]",
    "single_group[largest_dim]",
    "non_root_forward_backward",
    "explicit_prefetching",
    "activation_checkpointing[raf=True,composable,block]",
    "activation_checkpointing[raf=True,wrapper,mem_eff]",
    "activation_checkpointing[raf=False,utils,tied]",
    "chunked_head[raf=True,tie=False,none]",
    "chunked_head[raf=False,tie=True,bf16_inner_only]",
    "grouped_cast_forward_inputs",
    "chunked_grad_accum[raf=True,grouped=True]",
    "reshard_toggle[tie=False,initial=False]",
    "reshard_toggle[tie=True,initial=True]",
    "reset_iter_state",
    "double_forward[raf=True,composable]",
    "double_partial_forward",
    "shard_largest_dim",
    "shard1_contiguous",
    "shared_params[raf=True,ac=True]",
    "shared_params_uneven[raf=True]",
    "shared_params_separate_groups",
    "layer_by_layer_gc",
    "grad_accum[raf=True,all,rab=True,offload=False]",
    "grad_accum[raf=False,all,rab=False,offload=False]",
    "grad_accum[raf=False,root_only,rab=False,offload=False]",
    "grad_accum[raf=2,some_mlps,rab=True,offload=False]",
    "1f1b[unshard=True,rab=False]",
    "forward_method",
    "eval_then_train[raf=True]",
    "unsharded_views[meta=True,raf=False]",
    "load_without_reshard",
    "replaced_storage",
    "training_after_frozen_forward",
]


# ------------------------------------------------------------------ running and comparing
def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def _run_one(rank: int, world: int, shard, fn, kwargs: dict) -> Any:
    mesh = init_device_mesh("cpu", (world,))
    try:
        return {"ok": fn(rank, world, shard, mesh, **kwargs)}
    except Exception as err:  # noqa: BLE001 - compared between the two implementations
        return {"raised": _describe(err)}


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors: dtype, shape and bits)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} vs {sorted(b)}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        if not torch.equal(a, b):
            gap = (a.double() - b.double()).abs().max().item()
            return [f"{path}: max abs difference {gap:.3g}"]
        return []
    if a != b:
        return [f"{path}: {a!r} vs {b!r}"[:300]]
    return []


def _compare(rank: int, world: int, names: list[str], table: str) -> dict:
    """Run each scenario with torch's fully_shard, then flexshard's; per scenario the
    list of differences (empty: bitwise equal or both raised)."""
    scenarios = SCENARIOS_W4 if table == "w4" else SCENARIOS
    out = {}
    for name in names:
        fn, kwargs = scenarios[name]
        theirs = _run_one(rank, world, torch_fully_shard, fn, kwargs)
        ours = _run_one(rank, world, fs.fully_shard, fn, kwargs)
        if "raised" in theirs and "raised" in ours:
            out[name] = []
        elif "raised" in theirs or "raised" in ours:
            out[name] = [
                f"torch: {theirs.get('raised', 'ok')}; flexshard: {ours.get('raised', 'ok')}"
            ]
        else:
            out[name] = _diff(theirs["ok"], ours["ok"])[:5]
    return out


_CACHE: dict = {}


def _results(world: int, names: tuple[str, ...], table: str = "main") -> dict:
    """Every rank's differences, run once per (world, set of scenarios)."""
    key = (world, names, table)
    if key not in _CACHE:
        per_rank = run_distributed(_compare, world, list(names), table, timeout=600)
        _CACHE[key] = {n: sorted({d for r in per_rank for d in r[n]}) for n in names}
    return _CACHE[key]


# Known differences, kept so the suite stays green while they are tracked (strict
# xfail: fixing flexshard turns them into failures that ask for the mark's removal).
NONE_GRAD = (
    "a parameter that got no gradient in a backward (unused output, module that never "
    "ran, backward through a non-root child only) gets a zero .grad instead of None, so "
    "Adam still moves it (runtime/hooks.py _end_of_backward reduces every bucket; "
    "runtime/reduce.py GradReduction.finish gives every trainable parameter a grad)"
)
XFAIL: dict[str, str] = {
    "unused_forward_output[raf=True]": NONE_GRAD,
    "unused_forward_output[raf=False]": NONE_GRAD,
    "unused_forward_module[raf=True]": NONE_GRAD,
    "unused_forward_module[raf=False]": NONE_GRAD,
    "non_root_forward_backward": NONE_GRAD,
    "double_partial_forward": NONE_GRAD,
    "chunked_grad_accum[raf=True,grouped=True]": (
        "rounding (7.6e-6 on body.weight): flexshard's grouped [norm, head] run equals "
        "its and torch's ungrouped runs; torch's grouped run alone differs (and equals a "
        "plain reference), so accumulation order differs on torch's partial-group path"
    ),
    "chunked_grad_accum[raf=False,grouped=True]": "rounding, as raf=True above",
}
# on two ranks an int reshard_after_forward of 2 is the shard size (torch: True)
XFAIL_W2 = {
    "unused_forward_output[raf=2]": NONE_GRAD,
    "unused_forward_module[raf=2]": NONE_GRAD,
}
# torch refuses uneven Shard(dim > 0) (three ranks over even dims); flexshard's
# fully_shard accepts it by design, so these do not apply on three ranks
NOT_ON_W3 = {"single_group[largest_dim]", "shard_largest_dim", "shard1_contiguous"}


def _reason(name: str, world: int) -> str | None:
    table = {**XFAIL, **XFAIL_W2} if world == 2 else XFAIL
    for prefix, reason in table.items():
        if name == prefix or (name.startswith(prefix) and not prefix.endswith("]")):
            return reason
    return None


def _param(name: str, slow: bool, world: int) -> Any:
    marks = [pytest.mark.slow] if slow else []
    reason = _reason(name, world)
    if reason:
        marks.append(pytest.mark.xfail(strict=True, reason=f"flexshard: {reason}"))
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_param(n, False, 2) for n in FAST])
def test_fsdp2_training_scenario_w2(name):
    assert _results(2, tuple(FAST))[name] == [], name


SLOW_W2 = [n for n in SCENARIOS if n not in FAST]


@pytest.mark.parametrize("name", [_param(n, True, 2) for n in SLOW_W2])
def test_fsdp2_training_scenario_w2_slow(name):
    assert _results(2, tuple(SLOW_W2))[name] == [], name


W3 = [n for n in SCENARIOS if n not in NOT_ON_W3]


@pytest.mark.parametrize("name", [_param(n, True, 3) for n in W3])
def test_fsdp2_training_scenario_w3(name):
    assert _results(3, tuple(W3))[name] == [], name


@pytest.mark.parametrize("name", [_param(n, True, 4) for n in SCENARIOS_W4])
def test_fsdp2_training_scenario_hsdp_w4(name):
    assert _results(4, tuple(SCENARIOS_W4), "w4")[name] == [], name


WORLD1 = [
    "single_group[0]",
    "single_group[2]",
    "multi_group[raf=True]",
    "unsharded_views[meta=False,raf=False]",
    "unsharded_views[meta=True,raf=True]",
    "replaced_storage",
    "load_without_reshard",
]


@pytest.mark.parametrize("name", [_param(n, True, 1) for n in WORLD1])
def test_fsdp2_training_scenario_w1(name):
    assert _results(1, tuple(WORLD1))[name] == [], name
