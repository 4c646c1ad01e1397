"""Shared pieces of the torch FSDP2 state scenario tests (tests/fsdp2/test_fsdp2_state_*.py):
torch's own FSDP2 unit-test scenarios for initialization, ignored and frozen parameters,
gradient accumulation, module state and state dicts (test_fully_shard_init,
_ignore_params, _frozen, _grad_acc, _pending_grad, _state, _state_dict), re-expressed
for CPU and run with torch's ``fully_shard`` and with flexshard's: every result the user
can see (losses, full gradients, parameters after optimizer steps, state-dict keys,
values and types, which calls raise) must be bitwise equal, or both must raise.

Each test file defines ``SCENARIOS`` (its ``s_*`` functions) and parametrizes one test
with ``cases(__name__)``, which registers it; all scenarios of one world size of all
registered files run in one launch, and each test checks one scenario's comparison.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import flexshard as fs
from flexshard.testing import run_distributed

# ------------------------------------------------------------------ models


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int | None = None, buffer: bool = False, bias=True):
        super().__init__()
        hidden = hidden or 3 * dim
        self.in_proj = nn.Linear(dim, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, dim, bias=bias)
        if buffer:
            self.register_buffer("buffer", torch.randn(dim))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(F.relu(self.in_proj(x)))
        return z + self.buffer if self.buffer is not None else z

    def reset_parameters(self) -> None:
        if self.buffer is not None:
            nn.init.normal_(self.buffer)


class C(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class B(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_b = nn.Linear(dim, dim)
        self.module_c = C(dim)
        self.subtrahend = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.module_c(x)) - self.subtrahend


# ------------------------------------------------------------------ helpers


def _x(seed: int, rank: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * seed + rank))


def _mesh(world: int) -> DeviceMesh:
    return init_device_mesh("cpu", (world,))


def _value(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor the ranks can compare: a DTensor's full value, a plain tensor's copy."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    return t.detach().clone()


def _params(model: nn.Module) -> dict:
    return {k: _value(p) for k, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict:
    return {k: _value(p.grad) for k, p in model.named_parameters()}


def _kinds(tensors: dict) -> dict:
    return {k: isinstance(v, DTensor) for k, v in tensors.items()}


def _raises(fn: Callable[[], Any]) -> str | None:
    """None if ``fn()`` returns; else the exception's type and first line."""
    try:
        fn()
    except Exception as err:  # any clear exception counts as raising
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        return f"{type(err).__name__}: {first}"
    return None


def _shard_all(shard, model: nn.Module, children, **kwargs) -> None:
    for child in children:
        shard(child, **kwargs)
    shard(model, **kwargs)


def _train(model, opt, steps, rank, dim, *, start=0, set_to_none=None, grads=False) -> dict:
    out: dict = {"loss": []}
    for step in range(start, start + steps):
        loss = model(_x(step, rank, 4, dim)).pow(2).mean()
        loss.backward()
        out["loss"].append(loss.detach().clone())
        if grads:
            out[f"grads{step}"] = _grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True if set_to_none is None else set_to_none(step))
    out["params"] = _params(model)
    return out


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.ndim), key=lambda d: (param.shape[d], -d)))


# Where FSDP2 raises and flexshard, by design, accepts the input (uneven Shard(1),
# containers, channels_last parameters, ...), flexshard's result is checked against an
# unsharded single-process run of the same scenario instead: every rank trains on the
# same batch, so the data-parallel mean gradient equals the single-process gradient.
def _same_batch(step: int, *shape: int) -> torch.Tensor:
    """Rank 0's batch of ``step``, on every rank."""
    return _x(step, 0, *shape)


def _exact(world: int) -> bool:
    """Whether a sharded run must match the unsharded one bitwise: with 2 ranks the
    mean of equal gradients is exact ((g + g) / 2 == g) and everything else is the same
    arithmetic (full parameters gathered, elementwise Adam on shards); with 3 it rounds
    ((g + g + g) / 3), so ``allclose(rtol=1e-5, atol=1e-6)``."""
    return world == 2


def _mismatch(path: str, got: Any, want: Any, exact: bool) -> list[str]:
    """``exact``: bitwise (``torch.equal``); else ``allclose(rtol=1e-5, atol=1e-6)``."""
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{path}: keys {list(got)} != reference {list(want)}"]
        return [d for k in want for d in _mismatch(f"{path}.{k}", got[k], want[k], exact)]
    if got is None or want is None:
        return [] if got is None and want is None else [f"{path}: {got!r} vs {want!r}"]
    if isinstance(got, DTensor) or isinstance(want, DTensor):
        return [f"{path}: a DTensor where a full tensor was expected"]
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{path}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"]
    if torch.equal(got, want):
        return []
    if not exact and torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        return []
    gap = (got.double() - want.double()).abs().max().item()
    return [f"{path}: max |diff| {gap:.3g} ({'bitwise' if exact else 'allclose'})"]


def _vs_reference(
    model: nn.Module,
    ref: nn.Module,
    batch: Callable[[int], torch.Tensor],
    *,
    exact: bool,
    steps: int = 2,
    opts: tuple | None = None,
    start: int = 0,
) -> list[str]:
    """Train the sharded ``model`` and its unsharded copy ``ref`` side by side for
    ``steps`` Adam steps on ``batch(step)``: what differs in the losses, the full
    gradients and the full parameters (empty if nothing)."""
    if opts is None:
        opts = tuple(torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    problems = _mismatch("init", _params(model), _params(ref), exact)
    for step in range(start, start + steps):
        got: dict = {}
        for name, m, opt in (("model", model, opts[0]), ("ref", ref, opts[1])):
            loss = m(batch(step)).pow(2).mean()
            loss.backward()
            got[name] = {"loss": loss.detach().clone(), "grads": _grads(m)}
            opt.step()
            opt.zero_grad()
            got[name]["params"] = _params(m)
        problems += _mismatch(f"step{step}", got["model"], got["ref"], exact)
    return problems


# ------------------------------------------------------------------ the harness
def _diff(a, b, path: str = "") -> list[str]:
    """Where two results differ: ``raise_*`` entries only in whether they raised;
    ``fsdp2_raises_*`` entries must raise with FSDP2 only (a flexshard extension); a
    ``vs_reference`` entry (what differs from an unsharded run, None where not run)
    must be empty for flexshard, and empty or None for FSDP2."""
    last = path.rsplit(".", 1)[-1]
    if last.startswith("raise_"):
        return [] if (a is None) == (b is None) else [f"{path}: fsdp2={a!r} flexshard={b!r}"]
    if last.startswith("fsdp2_raises_"):
        ok = a is not None and b is None
        return [] if ok else [f"{path}: expected fsdp2 only to raise: fsdp2={a!r} flexshard={b!r}"]
    if last == "vs_reference":
        if b is None:
            return [f"{path}: flexshard did not run the reference check"]
        bad = [f"{path} fsdp2: {d}" for d in a or []] + [f"{path} flexshard: {d}" for d in b]
        return bad
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{path}: keys fsdp2={list(a)} flexshard={list(b)}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}" if path else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
            return [
                f"{path}: {type(a).__name__}{tuple(a.shape)} {a.dtype} vs "
                f"{type(b).__name__}{tuple(b.shape)} {b.dtype}"
            ]
        if torch.equal(a, b):
            return []
        if a.is_floating_point():
            gap = (a.double() - b.double()).abs().max().item()
            return [f"{path}: max |diff| {gap:.3g}"]
        return [f"{path}: values differ"]
    if type(a) is not type(b) or a != b:
        return [f"{path}: fsdp2={a!r:.200} flexshard={b!r:.200}"]
    return []


def _one(rank, world, shard, module, name, ctx) -> Any:
    try:
        return {"ok": importlib.import_module(module).SCENARIOS[name](rank, world, shard, ctx)}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:600]}


def _pairs(rank: int, world: int, items: list[tuple[str, str]], tmp: str, slow: bool) -> dict:
    """Every scenario (module, name) in ``items`` with FSDP2 and with flexshard; what
    differs."""
    results = {}
    impls = {"fsdp2": torch_fully_shard, "flexshard": fs.fully_shard}
    for module, name in items:
        got = {}
        for impl, shard in impls.items():
            other = next(i for i in impls if i != impl)
            ctx = {
                "tmp": tmp,
                "impl": impl,
                "other": impls[other],
                "other_impl": other,
                "slow": slow,
            }
            got[impl] = _one(rank, world, shard, module, name, ctx)
            dist.barrier()
        theirs, ours = got["fsdp2"], got["flexshard"]
        if "error" in theirs or "error" in ours:
            results[module, name] = [
                f"fsdp2: {theirs.get('error')}",
                f"flexshard: {ours.get('error')}",
            ]
        else:
            results[module, name] = _diff(theirs["ok"], ours["ok"])
    return results


_MODULES: list[str] = []  # the test files that registered their scenarios, in import order


def register(module: str) -> None:
    """Add a test file's scenarios to the shared launches (call at import, i.e. at
    collection, so that one launch per world size covers every collected file)."""
    if module not in _MODULES:
        _MODULES.append(module)


def _items(slow: bool) -> list[tuple[str, str]]:
    """All registered scenarios, or (``slow``) those whose extra sub-cases run with -m
    slow (a file's ``WITH_SLOW_CASES``)."""
    if slow:
        return [
            (m, n) for m in _MODULES for n in sorted(getattr(sys.modules[m], "WITH_SLOW_CASES", ()))
        ]
    return [(m, n) for m in _MODULES for n in sys.modules[m].SCENARIOS]


_LAUNCHES: dict = {}


def check(world: int, module: str, name: str, tmp_path_factory, slow: bool = False) -> None:
    """One launch per (world, slow) over every registered file; then this scenario's
    differences on every rank must be empty."""
    if (world, slow) not in _LAUNCHES:
        tmp = str(tmp_path_factory.mktemp("fsdp2_state"))
        _LAUNCHES[world, slow] = run_distributed(
            _pairs, world, _items(slow), tmp, slow, timeout=600
        )
    for rank, results in enumerate(_LAUNCHES[world, slow]):
        got = results[module, name]
        assert got == [], f"rank {rank}: {name}:\n" + "\n".join(got[:20])


def cases(module: str) -> list:
    """Register a test file's scenarios and give them as (world, slow, name) pytest
    params: W = 2 in the fast suite, W = 3 and the extra sub-cases with -m slow."""
    register(module)
    m = sys.modules[module]
    slow = [pytest.mark.slow]
    out = [pytest.param(2, False, n, id=f"w2-{n}") for n in m.SCENARIOS]
    out += [pytest.param(3, False, n, marks=slow, id=f"w3-{n}") for n in m.SCENARIOS]
    more = sorted(getattr(m, "WITH_SLOW_CASES", ()))
    out += [pytest.param(2, True, n, marks=slow, id=f"w2-more-{n}") for n in more]
    return out
