"""The planner's peak memory per rank against the peak of live tensors of a real step
(``tests/plan/test_plan_peak.py``; ``benchmarks/plan_memory.py`` prints the table).

Each case sets up the trainer's own job on W gloo ranks, runs two steps (so the
optimizer state exists, as in every later step), then one more ``train_step`` under
``LiveTensors`` (``flexshard.testing.live_memory``: every CPU tensor storage alive). What
the planner counts is the rank's model: its sharded parameters and optimizer state
(alive before the step) and everything the step allocates; the other storages alive
before the step (the token stream, the data sampler's, RoPE's tables) are left out of
the measured peak. The plan is made for the same config and W under the fake backend.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flexshard.plan.hardware import H100
from flexshard.plan.report import make_plan
from flexshard.runtime.module import own_buckets
from flexshard.torch_internals import local_tensor
from flexshard.trainer.config import Config, config_from_dict
from flexshard.trainer.train import setup, train_step

from .launch import run_distributed
from .live_memory import LiveTensors

MODEL = {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}
TRAINING = {"seq_len": 128, "batch_size": 4, "steps": 4, "lr": 1e-3}
CASES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"training": {"mixed_precision": "bf16"}},
}


def case_config(folder: str, case: str) -> Config:
    table: dict[str, Any] = {
        "model": dict(MODEL),
        "training": dict(TRAINING),
        "job": {"dump_folder": folder, "progress": False, "plot": False, "tensorboard": False},
    }
    for section, values in CASES[case].items():
        table[section] = {**table.get(section, {}), **values}
    return config_from_dict(table)


def _storage_bytes(tensors: list[torch.Tensor | None]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type == "cpu":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What the plan counts as the rank's model: its sharded parameters (each bucket's
    whole storage, padding included) and its optimizer state, as local tensors."""
    params = [_local(p) for p in model.parameters()]
    params += [bucket.storage for module in model.modules() for bucket in own_buckets(module)]
    state = [
        _local(t)
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    ]
    return params + state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the memory), a plain tensor itself."""
    return local_tensor(tensor) if isinstance(tensor, DTensor) else tensor


def _phases(job: Any, live: LiveTensors) -> list[Any]:
    """Label the step's parts: forward, loss (and its backward), backward, optimizer."""

    def on_logits(module: Any, args: Any, out: torch.Tensor) -> None:
        live.phase = "loss"
        if out.requires_grad:  # the gradient reaching the logits: the blocks' backward
            out.register_hook(lambda grad: setattr(live, "phase", "backward"))

    def block(index: int) -> tuple[Any, Any]:
        def pre(module: Any, args: Any) -> None:
            live.phase = f"forward {index}"

        def post(module: Any, args: Any, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda grad: setattr(live, "phase", f"backward {index}"))

        return pre, post

    handles = [
        job.model.register_forward_pre_hook(lambda *a: setattr(live, "phase", "forward")),
        job.model.register_forward_hook(on_logits),
        job.optimizer.register_step_pre_hook(lambda *a: setattr(live, "phase", "optimizer")),
    ]
    for i, layer in enumerate(job.model.layers):
        pre, post = block(i)
        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return handles


def measure_rank(rank: int, world: int, folder: str, case: str) -> dict[str, Any]:
    torch.manual_seed(0)
    job = setup(case_config(f"{folder}/{case}", case))
    for step in range(2):
        train_step(job, step)
    return measured_step(job, 2, LiveTensors())


def measured_step(job: Any, step: int, live: LiveTensors) -> dict[str, Any]:
    """Run ``train_step(job, step)`` under ``live`` (a fresh ``LiveTensors``, maybe
    watching storages already): the peak counts the model's state and what the step
    allocates, not the other storages alive."""
    model_state = _storage_bytes(model_state_tensors(job.model, job.optimizer))
    with live:
        other = live.bytes_now() - model_state  # alive before the step, not the model's
        handles = _phases(job, live)
        try:
            loss = train_step(job, step)[0]
        finally:
            for h in handles:
                h.remove()
    return {
        "peak_bytes": live.peak_bytes - other,
        "peak_phase": live.peak_phase,
        "phase_peaks": {k: v - other for k, v in live.phase_peaks.items()},
        "model_state_bytes": model_state,
        "loss": loss,
    }


def planned(case: str, world: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        cfg = case_config(folder, case)
    plan = make_plan(cfg, world, H100, None, ("flexshard",))
    return plan["backends"]["flexshard"]["memory"]


def compare(world: int, cases: list[str]) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        with tempfile.TemporaryDirectory() as folder:
            measured = run_distributed(measure_rank, world, folder, case, timeout=600)
        peak = max(m["peak_bytes"] for m in measured)
        memory = planned(case, world)
        rows.append(
            {
                "case": case,
                "world": world,
                "measured": peak,
                "measured_phase": max(measured, key=lambda m: m["peak_bytes"])["peak_phase"],
                "phase_peaks": measured[0]["phase_peaks"],
                "planned": memory["total"],
                "planned_moment": memory["peak_moment"],
                "sum_of_part_peaks": memory["sum_of_part_peaks"],
                "gap": memory["total"] / peak - 1,
            }
        )
    return rows
