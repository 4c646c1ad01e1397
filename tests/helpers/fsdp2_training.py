"""Shared pieces of the torch FSDP2 training/autograd scenario tests
(tests/fsdp2/test_fsdp2_training_*.py): torch's own unit-test scenarios
(test_fully_shard_autograd.py, test_fully_shard_training.py,
test_fully_shard_shared_params.py, test_fully_shard_unsharded_views.py), re-expressed for
CPU and run with torch's ``fully_shard`` and with flexshard's: losses, gradients,
parameters after optimizer steps and raised exceptions must agree bit for bit (fp32), or
both must raise.

Each test file defines ``SCENARIOS`` (name -> (fn, kwargs)), ``FAST`` and optionally
``SCENARIOS_W4`` and ``WORLD1``, and parametrizes one test with ``cases(__name__)``,
which registers it. Every scenario of one
selection (fast on two ranks, slow on two, three ranks, HSDP on four, one rank) of all
registered files runs in one ``run_distributed`` call (start-up is the cost); each rank
compares the two runs itself and hands back which results differ."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import flexshard as fs
import flexshard.torch_internals as ti
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


def _compare(rank: int, world: int, items: list[tuple[str, str, str]]) -> dict:
    """Run each scenario (module, table, name) with torch's fully_shard, then
    flexshard's; per (module, name) the list of differences (empty: bitwise equal or
    both raised)."""
    out = {}
    for module, table, name in items:
        fn, kwargs = getattr(importlib.import_module(module), table)[name]
        theirs = _run_one(rank, world, torch_fully_shard, fn, kwargs)
        ours = _run_one(rank, world, fs.fully_shard, fn, kwargs)
        if "raised" in theirs and "raised" in ours:
            out[module, name] = []
        elif "raised" in theirs or "raised" in ours:
            out[module, name] = [
                f"torch: {theirs.get('raised', 'ok')}; flexshard: {ours.get('raised', 'ok')}"
            ]
        else:
            out[module, name] = _diff(theirs["ok"], ours["ok"])[:5]
    return out


_MODULES: list[str] = []  # the test files that registered their scenarios, in import order


def register(module: str) -> None:
    """Add a test file's scenarios to the shared launches (call at import, i.e. at
    collection, so that one launch per selection covers every collected file)."""
    if module not in _MODULES:
        _MODULES.append(module)


# selection -> (world size, scenario table)
SELECTIONS = {
    "fast": (2, "SCENARIOS"),
    "slow_w2": (2, "SCENARIOS"),
    "w3": (3, "SCENARIOS"),
    "w4": (4, "SCENARIOS_W4"),
    "w1": (1, "SCENARIOS"),
}


def names(module: str, selection: str) -> list[str]:
    """The scenarios of one test file in a selection that this torch can be the
    reference for."""
    return [n for n in _all_names(module, selection) if _torch_gap(n) is None]


def _all_names(module: str, selection: str) -> list[str]:
    m = sys.modules[module]
    if selection == "fast":
        return list(m.FAST)
    if selection == "slow_w2":
        return [n for n in m.SCENARIOS if n not in m.FAST]
    if selection == "w3":
        return [n for n in m.SCENARIOS if n not in NOT_ON_W3]
    if selection == "w4":
        return list(getattr(m, "SCENARIOS_W4", {}))
    return list(getattr(m, "WORLD1", []))


_CACHE: dict = {}


def _results(selection: str) -> dict:
    """Every rank's differences, run once per selection over all registered files."""
    if selection not in _CACHE:
        world, table = SELECTIONS[selection]
        items = [(m, table, n) for m in _MODULES for n in names(m, selection)]
        per_rank = run_distributed(_compare, world, items, timeout=600)
        _CACHE[selection] = {
            (m, n): sorted({d for r in per_rank for d in r[m, n]}) for m, _, n in items
        }
    return _CACHE[selection]


def check(selection: str, module: str, name: str) -> None:
    assert _results(selection)[module, name] == [], name


# Known differences, kept so the suite stays green while they are tracked (strict
# xfail: fixing flexshard turns them into failures that ask for the mark's removal).
XFAIL: dict[str, str] = {}
# the same, for one selection only: (selection, name) -> reason
XFAIL_AT: dict[tuple[str, str], str] = {}
# Scenarios this torch release's FSDP2 cannot be the reference for: a method it lacks, or
# a bug of that release (it raises or hangs where later releases and flexshard train). On
# such a release the comparison is skipped, naming why; later releases still run it.
_OLD_FSDP2 = torch.__version__ < "2.13"
_TORCH_GAPS: dict[str, tuple[bool, str]] = {
    "reset_iter_state": (
        not hasattr(FSDPModule, "reset_iter_state"),
        "FSDPModule.reset_iter_state (torch 2.13 and newer)",
    ),
    "unused_forward_module[reduce_unused]": (
        not hasattr(FSDPModule, "set_reduce_scatter_unused_params"),
        "FSDPModule.set_reduce_scatter_unused_params (torch 2.13 and newer)",
    ),
    "unused_output[raf=True,reduce_unused]": (
        not hasattr(FSDPModule, "set_reduce_scatter_unused_params"),
        "FSDPModule.set_reduce_scatter_unused_params (torch 2.13 and newer)",
    ),
    "grad_dtype[None,reduce_unused]": (
        not hasattr(FSDPModule, "set_reduce_scatter_unused_params"),
        "FSDPModule.set_reduce_scatter_unused_params (torch 2.13 and newer)",
    ),
    "nontensor_activations[dataclass]": (
        _OLD_FSDP2,
        "its FSDP2 frees a dataclass output's parameters before backward (setStorage error)",
    ),
    "chunked_head[raf=True,tie=False,none]": (
        _OLD_FSDP2,
        "its FSDP2 mixes Tensor and DTensor in the chunked head",
    ),
    "chunked_head[raf=False,tie=True,bf16_inner_only]": (
        _OLD_FSDP2,
        "its FSDP2 mixes Tensor and DTensor in the chunked head",
    ),
    "grouped_cast_forward_inputs": (
        _OLD_FSDP2,
        "its FSDP2 does not cast a module group's forward inputs (a dtype error)",
    ),
    "chunked_grad_accum[raf=True,grouped=True]": (_OLD_FSDP2, "its FSDP2 hangs in this run"),
    "reshard_toggle[tie=False,initial=False]": (_OLD_FSDP2, "its FSDP2 hangs in this run"),
    "reshard_toggle[tie=True,initial=True]": (_OLD_FSDP2, "its FSDP2 hangs in this run"),
    "shared_params_separate_groups": (
        _OLD_FSDP2,
        "its FSDP2 accepts a parameter shared by two groups, which 2.13 and flexshard refuse",
    ),
}


# scenarios of a feature by name prefix (every parametrization)
_TORCH_GAP_PREFIXES: dict[str, tuple[bool, str]] = {
    "bf16_accum[chunked=True,reduce=": (
        _OLD_FSDP2,
        "its FSDP2 does not cast a grouped head's inputs when called alone (a dtype error)",
    ),
    "param_dtype_override_fn[": (
        not ti.HAS_PARAM_DTYPE_OVERRIDE,
        "MixedPrecisionPolicy.param_dtype_override_fn (torch 2.15 and newer)",
    ),
}


def _torch_gap(name: str) -> str | None:
    prefixed = [v for k, v in _TORCH_GAP_PREFIXES.items() if name.startswith(k)]
    gap, why = _TORCH_GAPS.get(name, prefixed[0] if prefixed else (False, ""))
    return f"torch {torch.__version__} cannot be the reference: {why}" if gap else None


# torch refuses uneven Shard(dim > 0) (three ranks over even dims); flexshard's
# fully_shard accepts it by design, so these do not apply on three ranks
NOT_ON_W3 = {"single_group[largest_dim]", "shard_largest_dim", "shard1_contiguous"}


def _reason(name: str) -> str | None:
    for prefix, reason in XFAIL.items():
        if name == prefix or (name.startswith(prefix) and not prefix.endswith("]")):
            return reason
    return None


def cases(module: str) -> list:
    """Register a test file's scenarios and give them as (selection, name) pytest params,
    every selection: one parametrized test per file."""
    register(module)
    out = []
    for selection in SELECTIONS:
        for name in _all_names(module, selection):
            marks = [pytest.mark.slow] if selection != "fast" else []
            reason = _reason(name) or XFAIL_AT.get((selection, name))
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=f"flexshard: {reason}"))
            gap = _torch_gap(name)
            if gap:
                marks.append(pytest.mark.skip(reason=gap))
            out.append(pytest.param(selection, name, marks=marks, id=f"{selection}-{name}"))
    return out
