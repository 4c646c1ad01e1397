"""Periodic, resumable checkpoints: flexshard's DCP support (``flexshard.checkpoint``)
for the flexshard backend, torch's DCP state-dict helpers for the FSDP2 backend; a
safetensors export of the final model; Hugging Face folders in and out
(``hf_checkpoint``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .config import ConfigError

if TYPE_CHECKING:
    from .train import Job

STEP_DIR = re.compile(r"^step-(\d+)$")
SCHEDULER = "lr_scheduler"  # the LambdaLR's state_dict, beside the optimizer's


def folder(job: Job) -> Path:
    return job.folder / job.cfg.checkpoint.folder


def latest_step(root: Path) -> int | None:
    """The last complete checkpoint (DCP writes ``.metadata`` last) under ``root``."""
    if not root.is_dir():
        return None
    steps = [
        int(m.group(1))
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / ".metadata").exists()
    ]
    return max(steps, default=None)


def _flexshard_checkpoint() -> Any:
    try:
        import flexshard.checkpoint as ckpt
    except ImportError:
        ckpt = None
    if ckpt is None or not all(hasattr(ckpt, f) for f in ("save", "load", "export_safetensors")):
        raise ConfigError(
            'checkpoint.enable / export_safetensors with dp_backend = "flexshard" need '
            "flexshard.checkpoint.save/load/export_safetensors, not in this installation"
        )
    return ckpt


def _is_fsdp2(job: Job) -> bool:
    return job.cfg.parallelism.dp_backend == "fsdp2"


def check_available(job: Job) -> None:
    """Fail before training, not at the first save."""
    c = job.cfg.checkpoint
    if (c.enable or c.export_safetensors) and not _is_fsdp2(job):
        _flexshard_checkpoint()


def save(job: Job, step: int) -> Path:
    path = folder(job) / f"step-{step}"
    if _is_fsdp2(job):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
        state = {"model": model_sd, "optim": optim_sd, SCHEDULER: job.lr_scheduler.state_dict()}
        dcp.save(state, checkpoint_id=str(path))
    else:
        extra = {"step": step, SCHEDULER: job.lr_scheduler.state_dict()}
        _flexshard_checkpoint().save(str(path), job.model, job.optimizer, extra=extra)
    dist.barrier()
    return path


def maybe_resume(job: Job) -> int:
    """Load the latest checkpoint when resuming is on; return the step to start from."""
    check_available(job)
    c = job.cfg.checkpoint
    if not (c.enable and c.resume):
        return 0
    step = latest_step(folder(job))
    if step is None:
        return 0
    path = folder(job) / f"step-{step}"
    if _is_fsdp2(job):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        saved = dcp.FileSystemReader(str(path)).read_metadata().planner_data or {}
        if any(key[0] == SCHEDULER for key in saved.values()):
            state[SCHEDULER] = job.lr_scheduler.state_dict()
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            job.model,
            job.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        scheduler = state.get(SCHEDULER)
    else:
        extra = _flexshard_checkpoint().load(str(path), job.model, job.optimizer) or {}
        step = int(extra.get("step", step))
        scheduler = extra.get(SCHEDULER)
    _restore_schedule(job, scheduler, step, path)
    if job.rank == 0:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


def _restore_schedule(job: Job, state: dict[str, Any] | None, step: int, path: Path) -> None:
    """The scheduler where the saved run left it: its next lr is step ``step``'s."""
    if state is None:
        raise ValueError(
            f"checkpoint '{path}' has no '{SCHEDULER}' state (written before the trainer "
            "kept it); start afresh with --checkpoint.resume false or another "
            "checkpoint.folder"
        )
    if state["last_epoch"] != step:
        raise ValueError(
            f"checkpoint '{path}': the lr scheduler's state is at step "
            f"{state['last_epoch']}, the checkpoint at step {step}"
        )
    job.lr_scheduler.load_state_dict(state)


def initial_load(job: Job) -> None:
    """A fresh run (nothing resumed) starts from ``checkpoint.initial_load_path``: the
    model weights of a Hugging Face folder or of a DCP checkpoint (no optimizer state)."""
    c = job.cfg.checkpoint
    if c.initial_load_in_hf:
        from .hf_checkpoint import load_hf

        load_hf(job, c.initial_load_path)
    elif _is_fsdp2(job):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {"model": get_model_state_dict(job.model)}
        dcp.load(state, checkpoint_id=c.initial_load_path)
    else:
        _flexshard_checkpoint().load(c.initial_load_path, job.model)
    if job.rank == 0:
        print(f"initial weights from {c.initial_load_path}", flush=True)


def export(job: Job) -> Path:
    """The final model, unsharded, as ``model.safetensors`` in the dump folder."""
    path = job.folder / "model.safetensors"
    if not _is_fsdp2(job):
        _flexshard_checkpoint().export_safetensors(job.model, str(path))
        return path
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(job.model, options=StateDictOptions(full_state_dict=True))
    if job.rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in full.items()}, str(path))
    dist.barrier()
    return path
