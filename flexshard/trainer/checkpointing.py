"""Periodic, resumable checkpoints: flexshard's DCP support (``flexshard.checkpoint``)
for the flexshard backend, torch's DCP state-dict helpers for the FSDP2 backend; a
safetensors export of the final model; Hugging Face folders in and out
(``hf_checkpoint``)."""

from __future__ import annotations

import datetime
import functools
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from flexshard.checkpoint.async_save import AsyncCheckpointer, SaveError, one_line
from flexshard.checkpoint.bounded import bounded_group, in_flight
from flexshard.checkpoint.frames import framed_state, unframed

from .config import ConfigError
from .exchange import configured_timeout
from .retention import purge

if TYPE_CHECKING:
    from .job import Job

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


def _fsdp2_state(job: Job, flat: bool) -> dict[str, Any]:
    """FSDP2's state dicts; ``flat``: the optimizer's keyed per parameter
    ("param_groups.<fqn>.lr"), as pipeline ranks need (they hold different parameters,
    so nested groups listing them would collide); otherwise torch's nested form, which
    flexshard's ``fs.checkpoint.load`` also reads."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    options = _options(flat)
    model_sd, optim_sd = get_state_dict(_logical_model(job), job.optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd}


def _options(flat: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _is_fsdp2(job: Job) -> bool:
    return job.cfg.parallelism.dp_backend == "fsdp2"


def _logical_model(job: Job) -> Any:
    """What a checkpoint holds of this rank: its module, or its pipeline stages (they
    keep the whole model's FQNs, so every layout saves one logical model)."""
    modules = job.parallel.modules
    if len(modules) == 1:
        return modules[0]
    if _is_fsdp2(job):
        raise ConfigError(
            'checkpoints with dp_backend = "fsdp2" and parallelism.pp_virtual_stages > 1 '
            "(several stage modules per rank) are not supported; use dp_backend = "
            '"flexshard"'
        )
    return modules


def _frames(job: Job) -> dict[str, Any]:
    """EP's expert slices at their offsets in the whole stacks (empty without EP)."""
    from .expert_parallel import expert_frames

    return {k: v for m in job.parallel.modules for k, v in expert_frames(m).items()}


def _io_group(job: Job) -> tuple[dist.ProcessGroup, datetime.timedelta]:
    """The world's ranks on a group bounded by ``parallelism.timeout_s``: every
    checkpoint collective (DCP's, the barriers) waits at most that, then raises a
    CollectiveError naming the step (made once, on first use, by every rank)."""
    timeout = configured_timeout(job.cfg.parallelism.timeout_s)
    return bounded_group(dist.group.WORLD, timeout), timeout


def _barrier(job: Job, what: str, path: Path) -> None:
    group, timeout = _io_group(job)
    with in_flight(what, str(path), group, timeout):
        dist.barrier(group=group)


def check_available(job: Job) -> None:
    """Fail before training, not at the first save."""
    c = job.cfg.checkpoint
    if (c.enable or c.export_safetensors) and not _is_fsdp2(job):
        _flexshard_checkpoint()


def save(job: Job, step: int) -> Path:
    """Save step ``step``: synchronously, or (``checkpoint.async_mode``) staged here and
    written in the background; then, with ``keep_latest_k``, older checkpoints deleted
    once this one is complete. A failure raises a one-line SaveError naming the step and
    path; the checkpoints before it are untouched."""
    path = folder(job) / f"step-{step}"
    if job.cfg.checkpoint.async_mode != "disabled":
        _save_async(job, step, path)
        return path
    try:
        _save_sync(job, step, path)
    except (Exception, CheckpointException) as err:
        if job.rank == 0:  # what the failed save wrote is of no use: give the disk back
            shutil.rmtree(f"{path}.partial", ignore_errors=True)
            if not (path / ".metadata").exists():
                shutil.rmtree(path, ignore_errors=True)
        raise SaveError(
            f"flexshard: checkpoint step {step} failed; '{path}' was not written and the "
            f"previous checkpoints are untouched: {one_line(err)}"
        ) from (err if isinstance(err, Exception) else None)
    _barrier(job, "barrier after the save", path)
    keep = job.cfg.checkpoint.keep_latest_k
    if keep and job.rank == 0:
        purge(folder(job), keep)
    return path


def _save_sync(job: Job, step: int, path: Path) -> None:
    if _is_fsdp2(job):
        import torch.distributed.checkpoint as dcp

        state = framed_state(_fsdp2_state(job, job.dims.pp > 1), _frames(job))
        group, timeout = _io_group(job)
        with in_flight("dcp.save", str(path), group, timeout):
            dcp.save(
                {**state, SCHEDULER: job.lr_scheduler.state_dict()},
                checkpoint_id=str(path),
                process_group=group,
            )
    else:
        extra = {"step": step, SCHEDULER: job.lr_scheduler.state_dict()}
        _flexshard_checkpoint().save(
            str(path),
            _logical_model(job),
            job.optimizer,
            extra=extra,
            frames=_frames(job),
            timeout=configured_timeout(job.cfg.parallelism.timeout_s),
        )


def checkpointer(job: Job) -> AsyncCheckpointer:
    """The job's background saver, made at its first asynchronous save."""
    if job.checkpointer is None:
        mode = job.cfg.checkpoint.async_mode
        job.checkpointer = AsyncCheckpointer(
            mode, configured_timeout(job.cfg.parallelism.timeout_s)
        )  # type: ignore[arg-type]
        if job.rank == 0:
            print(job.checkpointer.note, flush=True)
    return job.checkpointer


def _save_async(job: Job, step: int, path: Path) -> None:
    """The same contents as the synchronous save, written in the background."""
    saver = checkpointer(job)
    saver.wait()  # the previous save first: its failure is raised here, not lost
    frames = _frames(job)
    if _is_fsdp2(job):
        state = framed_state(_fsdp2_state(job, job.dims.pp > 1), frames)
        state = {**state, SCHEDULER: job.lr_scheduler.state_dict()}
        extra, manifest = None, False  # as the synchronous FSDP2 save: plain DCP
    else:
        state = saver.state(_logical_model(job), job.optimizer, frames)
        extra, manifest = {"step": step, SCHEDULER: job.lr_scheduler.state_dict()}, True
    keep, root = job.cfg.checkpoint.keep_latest_k, folder(job)
    after = functools.partial(purge, root, keep) if keep and job.rank == 0 else None
    label = f"checkpoint step {step}"
    saver.save(path, state, label=label, extra=extra, manifest=manifest, after=after)


def wait_for_saves(job: Job) -> None:
    """At the end of training: the last background save complete (or its error)."""
    if job.checkpointer is not None:
        saver, job.checkpointer = job.checkpointer, None
        saver.close()


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
        from torch.distributed.checkpoint.state_dict import set_state_dict

        saved = dcp.FileSystemReader(str(path)).read_metadata().planner_data or {}
        flat = any(p[0] == "optim" and len(p) == 2 for p in saved.values())  # as saved
        state = _fsdp2_state(job, flat)
        if any(key[0] == SCHEDULER for key in saved.values()):
            state[SCHEDULER] = job.lr_scheduler.state_dict()
        loaded = framed_state(state, _frames(job))
        group, timeout = _io_group(job)
        with in_flight("dcp.load", str(path), group, timeout):
            dcp.load(loaded, checkpoint_id=str(path), process_group=group)
        state = unframed(loaded, state)
        set_state_dict(
            _logical_model(job),
            job.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=_options(flat),
        )
        scheduler = state.get(SCHEDULER)
    else:
        ckpt = _flexshard_checkpoint()
        timeout = configured_timeout(job.cfg.parallelism.timeout_s)
        extra = ckpt.load(
            str(path), _logical_model(job), job.optimizer, frames=_frames(job), timeout=timeout
        )
        extra = extra or {}
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

        state = {"model": get_model_state_dict(_logical_model(job))}
        group, timeout = _io_group(job)
        with in_flight("dcp.load", c.initial_load_path, group, timeout):
            dcp.load(
                framed_state(state, _frames(job)),
                checkpoint_id=c.initial_load_path,
                process_group=group,
            )
    else:
        frames = _frames(job)
        timeout = configured_timeout(job.cfg.parallelism.timeout_s)
        _flexshard_checkpoint().load(
            c.initial_load_path, _logical_model(job), frames=frames, timeout=timeout
        )
    if job.rank == 0:
        print(f"initial weights from {c.initial_load_path}", flush=True)


def export(job: Job) -> Path:
    """The final model, unsharded, as ``model.safetensors`` in the dump folder."""
    path = job.folder / "model.safetensors"
    if job.dims.pp * job.dims.ep > 1:  # stages and expert slices gathered into one model
        from .parallelize import full_buffers, full_parameters

        full = full_parameters(job.parallel, job.meshes)
        _write_full(job, {**full, **full_buffers(job.parallel, job.meshes)}, path)
    elif not _is_fsdp2(job):
        _flexshard_checkpoint().export_safetensors(job.model, str(path))
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True)
        _write_full(job, get_model_state_dict(job.model, options=options), path)
    return path


def _write_full(job: Job, full: dict[str, Any], path: Path) -> None:
    """Rank 0 writes the gathered tensors; every rank waits for it."""
    from safetensors.torch import save_file

    if job.rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in full.items()}, str(path))
    _barrier(job, "barrier after the export", path)
