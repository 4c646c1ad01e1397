"""MatrixOptimizer's state across a change of world size and placement, through
fs.checkpoint and torch's own state-dict API (``get_optimizer_state_dict`` /
``set_optimizer_state_dict``, sharded with DCP, and ``full_state_dict=True``): saved
at W = 2 on split storage, loaded at W = 3 on other placements, the next step equals
one process's bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import flexshard as fs
from flexshard import checkpoint as ckpt
from flexshard.optim import MatrixOptimizer
from flexshard.testing import run_distributed
from flexshard.testing.collectives import forbid_collectives

from ..helpers.muon_cases import SHAPES, Mats, full_grads, set_grads
from .test_matrix_optim import CASES, NAMES, STEPS, _adapter, reference

FULL = StateDictOptions(full_state_dict=True)
BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
#: one state entry per matrix: "matrix", or one per expert of a stack
MATRICES = {
    n: [f"expert{e}" for e in range(s[0])] if len(s) == 3 else ["matrix"] for n, s in SHAPES.items()
}


@functools.cache
def _expected() -> dict[str, torch.Tensor]:
    return reference("soap", STEPS)


def _trained(world_size: int, case: str) -> tuple[torch.nn.Module, MatrixOptimizer]:
    """SOAP after two of the reference's steps (and lr schedule) on ``case``'s buckets."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = fs.flex_shard(Mats(), mesh=mesh, buckets=CASES[case][0])
    opt = _adapter(model, "soap")
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        set_grads(model, full_grads(NAMES, step))
        opt.step()
        schedule.step()
    return model, opt


def _fresh(world_size: int, case: str) -> tuple[torch.nn.Module, MatrixOptimizer]:
    mesh = init_device_mesh("cpu", (world_size,))
    model = fs.flex_shard(Mats(seed=99), mesh=mesh, buckets=CASES[case][0])
    return model, _adapter(model, "soap")


def _third_step(model: torch.nn.Module, opt: MatrixOptimizer, comm_free: bool) -> list[str]:
    """Step 3 from the loaded state: the parameters that differ from one process's."""
    assert opt.param_groups[0]["step"] == 2  # SOAP's group counter came back
    assert opt.param_groups[1]["lr"] == 0.02 * 0.25  # and the scheduled lr
    set_grads(model, full_grads(NAMES, 2))
    if comm_free:
        with forbid_collectives():
            opt.step()
    else:
        opt.step()
    full = fs.full_state_dict(model)
    expected = _expected()
    return [n for n in NAMES if not torch.equal(full[n], expected[n])]


def _whole(state: dict, name: str, key: str) -> bool:
    """Matrix ``key`` of ``name`` is there, its tensors plain and of the matrix's size."""
    inner = state.get(name, {}).get(key)
    if not isinstance(inner, dict) or "exp_avg" not in inner:
        return False
    return type(inner["exp_avg"]) is torch.Tensor and inner["exp_avg"].shape == SHAPES[name][-2:]


def _save(rank: int, world_size: int, root: str) -> list:
    """After two steps at W = 2 on Shard(0): fs.checkpoint, torch's sharded state dict
    through DCP, and torch's full state dict (checked whole on every rank)."""
    model, opt = _trained(world_size, "shard0")
    ckpt.save(f"{root}/fs", model, opt)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=f"{root}/dcp")
    full = get_optimizer_state_dict(model, opt, options=FULL)
    # every matrix's whole state on every rank, as plain tensors (torch's gather)
    missing = [(n, k) for n in NAMES for k in MATRICES[n] if not _whole(full["state"], n, k)]
    model_state = fs.full_state_dict(model)
    if rank == 0:
        torch.save({"optim": full, "model": model_state}, f"{root}/full.pt")
    return missing


def _load_fs(world_size: int, root: str) -> list[str]:
    model, opt = _fresh(world_size, "owned")
    ckpt.load(f"{root}/fs", model, opt)
    return _third_step(model, opt, comm_free=True)


def _load_dcp(world_size: int, root: str) -> list[str]:
    model, opt = _fresh(world_size, "owned")
    # the target asks for the matrices this rank computes now (torch first gives the
    # fresh optimizer its state with one zero-gradient, lr-0 step)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=f"{root}/dcp")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return _third_step(model, opt, comm_free=True)


def _load_full(rank: int, world_size: int, root: str) -> list[str]:
    saved = torch.load(f"{root}/full.pt", weights_only=True)
    model, opt = _fresh(world_size, "mixed")
    fs.load_full_state_dict(model, saved["model"])
    # torch's full load fills only the entries a fresh state has, which for a
    # per-matrix optimizer differ by rank and step: it raises rather than load part
    for options in (FULL, BROADCAST):
        given = saved["optim"] if rank == 0 or not options.broadcast_from_rank0 else {}
        with pytest.raises(ValueError, match="cannot load the per-matrix state of parameter"):
            set_optimizer_state_dict(model, opt, given, options=options)
    opt.load_state_dict(saved["optim"])  # torch's FQN-keyed full dict, on every rank
    return _third_step(model, opt, comm_free=False)


def _load(rank: int, world_size: int, root: str) -> dict[str, list[str]]:
    return {
        "fs.checkpoint": _load_fs(world_size, root),
        "dcp": _load_dcp(world_size, root),
        "full": _load_full(rank, world_size, root),
    }


def test_state_reshards_through_every_api(tmp_path) -> None:
    """SOAP state saved at W = 2 on split storage (each matrix's state on its owner),
    loaded at W = 3 on Owned storage (fs.checkpoint; torch's sharded state dict with
    DCP) and on a mixed bucket (torch's full state dict, given to load_state_dict):
    the third step equals one process's bit for bit each time. The full state dict is
    every matrix's, on every rank, never just the ones a rank computes."""
    root = str(tmp_path)
    assert run_distributed(_save, 2, root, timeout=180) == [[], []]
    expected = {"fs.checkpoint": [], "dcp": [], "full": []}
    assert run_distributed(_load, 3, root, timeout=180) == [expected] * 3
