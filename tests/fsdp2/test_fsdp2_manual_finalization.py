"""Manual backward finalization (``set_manual_backward_finalization(True)``, then
``finalize_backward()``, sync or with ``async_op=True`` and the handle's ``wait()``):
several backward calls, then one finalization, as torch's pipeline schedules run it.

Against torch FSDP2 on the same model (W = 2 and 3, 17-row weights): gradients after
every finalization and parameters after the optimizer steps bit for bit, the same
collectives, and the same errors (a non-root module, a mode change during or after the
start of backward, finalizing or running forward before waiting). torch's FSDP2 has
these methods from 2.15 on; on an older torch that comparison skips, and flexshard's
manual finalization is checked against its own automatic finalization of the same
microbatches (the same gradients bit for bit, the same collectives), which runs on
every torch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import flexshard as fs
from flexshard.testing import run_distributed
from flexshard.testing.collectives import record_collectives
from flexshard.torch_internals import GradientReductionHandle

#: whether this torch's own FSDP2 has manual backward finalization (2.15 and newer)
TORCH_HAS_MANUAL = hasattr(FSDPModule, "set_manual_backward_finalization")
NO_MANUAL = (
    f"torch {torch.__version__}'s FSDP2 has no manual backward finalization "
    "(set_manual_backward_finalization / finalize_backward: torch 2.15 and newer)"
)

MICROBATCHES = 3
STEPS = 2
#: how each step's microbatches sync: "single" (one backward, sync on), "accumulate"
#: (sync off and no reshard after backward for every microbatch, then both on for the
#: finalization: what torch's pipeline stages do), "sync_last" (the last one syncs)
MODES = ("single", "accumulate", "sync_last")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 17)
        self.blocks = nn.ModuleList(nn.Linear(17, 17) for _ in range(2))
        self.out = nn.Linear(17, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.out(h)


def _build(shard: Callable, mesh) -> Net:
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _batch(step: int, mb: int, rank: int) -> torch.Tensor:
    seed = 100 * step + 10 * mb + rank
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _train(model: Net, rank: int, mode: str, manual: bool) -> dict:
    """``STEPS`` steps of SGD; each step's backwards finalized manually (the last step
    asynchronously) or automatically. The shards of the gradients after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    count = 1 if mode == "single" else MICROBATCHES
    grads = []
    if manual:
        model.set_manual_backward_finalization(True)
    for step in range(STEPS):
        for mb in range(count):
            last = mb == count - 1
            sync = mode == "single" or (mode == "sync_last" and last)
            if mode == "accumulate":
                sync = not manual and last  # manual: sync comes on for the finalization
                model.set_reshard_after_backward(sync)
            model.set_requires_gradient_sync(sync)
            model(_batch(step, mb, rank)).sum().backward()
        if manual:
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            if step == STEPS - 1:
                handle = model.finalize_backward(async_op=True)
                assert isinstance(handle, GradientReductionHandle)
                handle.wait()
                handle.wait()  # a second wait returns at once
            else:
                assert model.finalize_backward() is None
        grads.append({k: _local(p.grad) for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    if manual:
        model.set_manual_backward_finalization(False)
    return {"grads": grads, "params": {k: _local(p) for k, p in model.named_parameters()}}


def _run(rank: int, world: int, runs: list[tuple[str, bool, str]]) -> dict:
    """Each of ``runs`` (which fully_shard, manual finalization, mode) on a fresh
    model: its gradients, parameters and the collectives it issued."""
    mesh = init_device_mesh("cpu", (world,))
    shards = {"fsdp2": torch_fully_shard, "flexshard": fs.fully_shard}
    out = {}
    for name, manual, mode in runs:
        model = _build(shards[name], mesh)
        with record_collectives() as log:
            result = _train(model, rank, mode, manual)
        result["counts"] = dict(log.counts())
        out[(name, manual, mode)] = result
    return out


def _assert_bitwise(ours: dict, theirs: dict, what: str) -> None:
    assert ours.keys() == theirs.keys(), what
    for key in ours:
        a, b = ours[key], theirs[key]
        assert (a is None) == (b is None), f"{what}: {key}"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {key}"
            assert torch.equal(a, b), f"{what}: {key} differs"


def _assert_same_training(ours: dict, theirs: dict, what: str) -> None:
    for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"], strict=True)):
        _assert_bitwise(a, b, f"{what}, gradients of step {step}")
        assert all(g is not None for g in a.values()), what
    _assert_bitwise(ours["params"], theirs["params"], f"{what}, parameters")
    assert ours["counts"] == theirs["counts"], what
    assert ours["counts"].get("reduce_scatter_single", 0) > 0, what  # the log sees them


@pytest.mark.skipif(not TORCH_HAS_MANUAL, reason=NO_MANUAL)
@pytest.mark.parametrize("world", [2, 3])
def test_manual_finalization_matches_fsdp2(world: int) -> None:
    runs = [(name, True, mode) for mode in MODES for name in ("fsdp2", "flexshard")]
    for rank, out in enumerate(run_distributed(_run, world, runs)):
        for mode in MODES:
            what = f"rank {rank}, {mode}"
            _assert_same_training(out[("flexshard", True, mode)], out[("fsdp2", True, mode)], what)


@pytest.mark.parametrize("world", [2, 3])
def test_manual_finalization_matches_automatic(world: int) -> None:
    """flexshard's own: one manual finalization gives what the automatic end of the
    synced backward gives, on every torch."""
    runs = [("flexshard", manual, mode) for mode in MODES for manual in (True, False)]
    for rank, out in enumerate(run_distributed(_run, world, runs)):
        for mode in MODES:
            what = f"rank {rank}, {mode}"
            _assert_same_training(
                out[("flexshard", True, mode)], out[("flexshard", False, mode)], what
            )


def _error(fn: Callable[[], object]) -> str | None:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


def _misuse_one(model: Net, rank: int) -> dict:
    """The misuses FSDP2 refuses: the error each raised (None: none), and the gradients
    of a manual and then an automatic finalization afterwards."""
    errors: dict[str, str | None] = {}
    errors["finalize_before_forward"] = _error(model.finalize_backward)
    model(_batch(0, 0, rank)).sum().backward()  # a plain step: the root is known
    errors["finalize_automatic"] = _error(model.finalize_backward)
    errors["non_root"] = _error(lambda: model.blocks[1].set_manual_backward_finalization(True))
    errors["non_root_finalize"] = _error(model.blocks[1].finalize_backward)

    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    loss = model(_batch(1, 0, rank)).sum()
    during: list[str | None] = []

    def change_mode(grad: torch.Tensor) -> torch.Tensor:
        during.append(_error(lambda: model.set_manual_backward_finalization(False)))
        return grad

    loss.register_hook(change_mode)  # runs inside backward, before any module's
    loss.backward()
    errors["during_backward"] = during[0]
    errors["after_backward_starts"] = _error(lambda: model.set_manual_backward_finalization(False))
    model.set_manual_backward_finalization(True)  # the same mode: accepted
    model(_batch(1, 1, rank)).sum().backward()
    model.set_requires_gradient_sync(True)
    pending = model.finalize_backward(async_op=True)
    errors["finalize_twice"] = _error(model.finalize_backward)
    errors["forward_before_wait"] = _error(lambda: model(_batch(1, 2, rank)))
    pending.wait()
    grads = [_local(p.grad) for p in model.parameters()]
    model.set_manual_backward_finalization(False)
    model.zero_grad()
    model(_batch(2, 0, rank)).sum().backward()  # automatic again
    automatic = [_local(p.grad) for p in model.parameters()]
    return {"errors": errors, "grads": grads, "grads_automatic": automatic}


def _misuse(rank: int, world: int, names: list[str]) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    shards = {"fsdp2": torch_fully_shard, "flexshard": fs.fully_shard}
    out = {}
    for name in names:
        out[name] = _misuse_one(_build(shards[name], mesh), rank)
        # the mode is the root's: set on a block before the first forward, that forward
        # refuses it (it leaves FSDP2's model unusable: a model of its own)
        model = _build(shards[name], mesh)
        model.blocks[0].set_manual_backward_finalization(True)
        error = _error(lambda model=model: model(_batch(0, 0, rank)))
        out[name]["errors"]["lazy_init_off_root"] = error
    return out


#: the misuses and what the error says (FSDP2's message, which flexshard keeps)
MISUSES = {
    "lazy_init_off_root": "set_manual_backward_finalization must be called on the root",
    "finalize_before_forward": None,  # before the first forward: nothing to do
    "finalize_automatic": "finalize_backward requires manual backward finalization",
    "non_root": "set_manual_backward_finalization must be called on the root",
    "non_root_finalize": "finalize_backward must be called on the root",
    "during_backward": "cannot change mode during backward",
    "after_backward_starts": "cannot change mode after backward starts",
    "finalize_twice": "The previous gradient reduction must be waited on",
    "forward_before_wait": "The previous gradient reduction must be waited on before forward",
}


@pytest.mark.parametrize("world", [2, 3])
def test_manual_finalization_misuse(world: int) -> None:
    names = ["flexshard"] + (["fsdp2"] if TORCH_HAS_MANUAL else [])
    for rank, out in enumerate(run_distributed(_misuse, world, names)):
        ours = out["flexshard"]
        for misuse, message in MISUSES.items():
            error = ours["errors"][misuse]
            if message is None:
                assert error is None, f"rank {rank}, {misuse}: {error}"
            else:
                assert error is not None and message in error, f"rank {rank}, {misuse}: {error}"
        assert all(g is not None for g in ours["grads"] + ours["grads_automatic"])
        if TORCH_HAS_MANUAL:
            theirs = out["fsdp2"]
            assert ours["errors"] == theirs["errors"], f"rank {rank}"
            for a, b in zip(ours["grads"], theirs["grads"], strict=True):
                assert torch.equal(a, b), f"rank {rank}"
            for a, b in zip(ours["grads_automatic"], theirs["grads_automatic"], strict=True):
                assert torch.equal(a, b), f"rank {rank}"


def test_keep_unsharded_storage_refused_naming_why() -> None:
    """flexshard frees a bucket's all-gather buffer on every reshard: it raises rather
    than silently ignoring the request (no process group needed to ask)."""
    from flexshard.runtime.module import FlexShardModule

    with pytest.raises(NotImplementedError, match="set_keep_unsharded_storage.*frees"):
        FlexShardModule.set_keep_unsharded_storage(nn.Linear(2, 2), True)  # type: ignore[arg-type]
