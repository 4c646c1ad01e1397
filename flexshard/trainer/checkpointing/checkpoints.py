"""Periodic, resumable checkpoints, one path for both ``dp_backend``s: the state from
torch's DCP state-dict API, saved atomically with a manifest and checked before loading
(``flexshard.checkpoint``), synchronously or in the background; a safetensors export of
the final model; Hugging Face folders in and out.

``Job``: what the training loop needs, set up once by ``train.setup``; the checkpoints
save and restore its pieces.

The trainer's Hugging Face folders: ``checkpoint.initial_load_path`` with
``initial_load_in_hf`` reads one into the sharded model, ``last_save_in_hf`` writes the
final model as one (``config.json``, safetensors shards and their index, the
tokenizer's files). Every rank reads and writes only what it stores
(``flexshard.checkpoint.hf_safetensors``), on every layout: pipeline stages hold their
layers under the whole model's names (the files are planned from the whole model's
shapes, so pp = 1 and pp > 1 write the same files), EP ranks their experts at their
offsets in the whole stacks (``expert_frames``)."""

from __future__ import annotations

import datetime
import functools
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim.lr_scheduler import LRScheduler

from flexshard.checkpoint import load
from flexshard.checkpoint import save as save_checkpoint
from flexshard.checkpoint.async_save import AsyncCheckpointer, SaveError, one_line
from flexshard.checkpoint.bounded import bounded_group, in_flight
from flexshard.checkpoint.hf_safetensors import HFKey, export_safetensors, load_hf_safetensors
from flexshard.checkpoint.logical_model import Model

from ..config.hf_config import folder_fields, folder_quantization, text_model_prefix
from ..config.schema import Config
from ..config.tokenizer import Tokenizer
from ..config.validation import layout_without_mtp
from ..data.dataset import DPSampler, ValidationBatches
from ..models.hf_adapter import (
    DTYPES,
    fused_experts,
    hf_keys,
    in_hf,
    published_layout,
    shared_copies,
    unloaded_mtp,
)
from ..models.model import meta_model
from ..parallel.dims import Meshes, ParallelDims
from ..parallel.exchange import configured_timeout
from ..parallel.expert_parallel import expert_frames
from ..parallel.parallelize import Parallelized
from .hf_export import export_config, source_folder, write_side_files
from .retention import purge


@dataclass
class Job:
    """What the loop needs, set up once."""

    cfg: Config
    device: torch.device
    rank: int
    dims: ParallelDims
    dp_rank: int
    model: nn.Module  # the first (often only) stage module
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler  # stepped after every optimizer step; in the checkpoints
    sampler: DPSampler
    folder: Path
    meshes: Meshes
    parallel: Parallelized  # every stage module this rank runs, and the pipeline runner
    tokenizer: Tokenizer | None = None
    validation: ValidationBatches | None = None  # the held-out batches, when enabled
    checkpointer: Any = None  # the background saver (checkpoint.async_mode), once made


HF_FOLDER = "hf"  # under dump_folder
MAX_SHARD_BYTES = 2**30  # safetensors files of at most 1 GiB (one larger tensor excepted)


def model_state(job: Job, hf: bool = True) -> dict[str, torch.Tensor]:
    """This rank's sharded state dict over every module it runs, by FQN (``hf``: the
    tensors a Hugging Face folder holds)."""
    state: dict[str, torch.Tensor] = {}
    for module in job.parallel.modules:
        state.update(module.state_dict())
    return {fqn: value for fqn, value in state.items() if not hf or in_hf(fqn, job.cfg.model)}


def frames_of(job: Job) -> dict:
    """EP's expert slices at their offsets in the whole stacks (empty without EP): a
    Hugging Face folder and a DCP checkpoint hold the whole stacks."""
    return {k: v for m in job.parallel.modules for k, v in expert_frames(m).items()}


def whole_shapes(job: Job, hf: bool = True) -> dict[str, torch.Size]:
    """Every entry of the whole model's state dict (``hf``: those a Hugging Face folder
    holds) and its shape, in state-dict order (from a meta-built model: no memory, no
    collective)."""
    state = meta_model(job.cfg.model).state_dict()
    return {fqn: v.shape for fqn, v in state.items() if not hf or in_hf(fqn, job.cfg.model)}


def world_group(job: Job) -> tuple[dist.ProcessGroup, datetime.timedelta]:
    """The world on a group bounded by ``parallelism.timeout_s`` (made once, by every
    rank, at first use): a stalled peer makes the others raise a CollectiveError
    (``in_flight``) instead of waiting on gloo's 30 minutes."""
    timeout = configured_timeout(job.cfg.parallelism.timeout_s)
    return bounded_group(dist.group.WORLD, timeout), timeout


def hf_load_notes(folder: str | Path, cfg: Config | None = None) -> list[str]:
    """What a Hugging Face load says it leaves out or converts, one line each: a vision
    tower, quantized weights (dequantized), multi-token-prediction depths the run
    (``cfg``; None: one without MTP) does not load, and why."""
    notes = []
    prefix = text_model_prefix(folder)
    if prefix != "model.":
        notes.append(
            f"{folder}: its text model ({prefix}*) loaded; the vision tower is not "
            "trained and not exported"
        )
    quantization = folder_quantization(folder)
    if quantization is not None:
        notes.append(
            f"{folder}: its quantized weights (FP8 in tiles of {quantization.block}, "
            f"experts {quantization.expert_dtype}) load dequantized into the model's "
            "dtype; the export is unquantized"
        )
    mtp_layers, layout = (cfg.model.mtp_layers, layout_without_mtp(cfg)) if cfg else (0, [])
    mtp = unloaded_mtp(folder, mtp_layers, layout)
    return notes + ([mtp] if mtp else [])


def load_hf(job: Job, folder: str | Path) -> None:
    """Copy a Hugging Face folder's weights (``config.hf_config.FAMILIES``) into the sharded
    model (its config.json was checked against the config before any rank started:
    ``preflight``)."""
    state = model_state(job)
    tied = folder_fields(folder)["tie_embeddings"]
    prefix = text_model_prefix(folder)
    published = published_layout(folder, job.cfg.model)
    keys = hf_keys(list(state), job.cfg.model, tied, prefix, fused_experts(folder), published)
    if job.rank == 0:
        for note in hf_load_notes(folder, job.cfg):
            print(note, flush=True)
    group, timeout = world_group(job)
    with in_flight("Hugging Face load", str(folder), group, timeout):
        quantization = folder_quantization(folder)
        load_hf_safetensors(
            folder, state, keys, group, frames=frames_of(job), quantization=quantization
        )


def export(
    job: Job,
    folder: Path | None = None,
    hf: bool = True,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """The final model through ``flexshard.checkpoint.export_safetensors``, in
    ``checkpoint.export_dtype``. ``hf``: a Hugging Face folder (``dump_folder/hf`` by
    default) that ``from_pretrained`` loads: Hugging Face names, its config.json, and
    the source folder's generation config and tokenizer files or the run's tokenizer
    (``hf_export``). Else the trainer's own
    state dict under its own names (MTP and balance biases included), in the dump
    folder by default (``model.safetensors`` up to ``max_shard_bytes``). Every rank
    calls it; returns the folder."""
    cfg = job.cfg
    folder = folder or (job.folder / HF_FOLDER if hf else job.folder)
    dtype = cfg.checkpoint.export_dtype
    tokenizer = getattr(job, "tokenizer", None)
    config = export_config(cfg, tokenizer) if hf else {}  # refusals first
    shapes = whole_shapes(job, hf)
    source = source_folder(cfg)  # its experts' layout, fused or per expert, kept
    fused = source is not None and fused_experts(source)
    keys = hf_keys(list(shapes), cfg.model, fused=fused) if hf else None
    state = model_state(job, hf)
    if keys is not None:  # DeepSeek's MTP depths hold copies of the embedding and head
        for name, fqn in shared_copies(cfg.model).items():
            state[name], shapes[name], keys[name] = state[fqn], shapes[fqn], HFKey(name)
    group, timeout = world_group(job)
    what = "Hugging Face export" if hf else "safetensors export"
    with in_flight(what, str(folder), group, timeout):
        export_safetensors(
            state,
            folder,
            keys,
            DTYPES[dtype],
            max_shard_bytes,
            process_group=group,
            shapes=shapes,
            frames=frames_of(job),
        )
    if hf and job.rank == 0:
        c = cfg.checkpoint
        if c.initial_load_in_hf and source_folder(cfg) is None:
            print(
                f"flexshard: checkpoint.initial_load_path '{c.initial_load_path}' has no "
                "config.json any more: the export's config.json is the run's own",
                flush=True,
            )
        write_side_files(folder, cfg, config, tokenizer)
    _barrier(job, f"barrier after the {what}", folder)
    return folder


STEP_DIR = re.compile(r"^step-(\d+)$")
# The LambdaLR's state_dict, a DCP entry beside the optimizer's (not a per-rank extra):
# covered by the manifest, its keys checked before anything loads, one copy whatever
# the world size, and readable by torch's own dcp.load.
SCHEDULER = "lr_scheduler"


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


def _model(job: Job) -> Model:
    """What a checkpoint holds of this rank: its module, or its pipeline stages (they
    keep the whole model's FQNs, so every layout saves one logical model)."""
    modules = job.parallel.modules
    return modules[0] if len(modules) == 1 else modules


def _stages(job: Job) -> bool:
    """Whether ranks hold different parameters: the param groups saved list them all."""
    return job.dims.pp > 1


def _timeout(job: Job) -> datetime.timedelta:
    """``parallelism.timeout_s``: every checkpoint collective waits at most this, then
    raises a CollectiveError naming the step."""
    return configured_timeout(job.cfg.parallelism.timeout_s)


def _extra(step: int) -> dict[str, Any]:
    return {"step": step}


def _entries(job: Job) -> dict[str, Any]:
    return {SCHEDULER: job.lr_scheduler.state_dict()}


def _barrier(job: Job, what: str, path: Path) -> None:
    group, timeout = world_group(job)
    with in_flight(what, str(path), group, timeout):
        dist.barrier(group=group)


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
        save_checkpoint(
            path,
            _model(job),
            job.optimizer,
            extra=_extra(step),
            frames=frames_of(job),
            timeout=_timeout(job),
            stages=_stages(job),
            entries=_entries(job),
        )
    except (Exception, CheckpointException) as err:
        if job.rank == 0:  # what the failed save wrote is of no use: give the disk back
            shutil.rmtree(f"{path}.partial", ignore_errors=True)
        raise SaveError(
            f"flexshard: checkpoint step {step} failed; '{path}' was not written and the "
            f"previous checkpoints are untouched: {one_line(err)}"
        ) from (err if isinstance(err, Exception) else None)
    keep = job.cfg.checkpoint.keep_latest_k
    if keep and job.rank == 0:  # every rank is past the save's last barrier
        purge(folder(job), keep)
    return path


def checkpointer(job: Job) -> AsyncCheckpointer:
    """The job's background saver, made at its first asynchronous save."""
    if job.checkpointer is None:
        mode = job.cfg.checkpoint.async_mode
        job.checkpointer = AsyncCheckpointer(mode, _timeout(job))  # type: ignore[arg-type]
        if job.rank == 0:
            print(job.checkpointer.note, flush=True)
    return job.checkpointer


def _save_async(job: Job, step: int, path: Path) -> None:
    """The same contents as the synchronous save, written in the background."""
    saver = checkpointer(job)
    saver.wait()  # the previous save first: its failure is raised here, not lost
    state = saver.state(_model(job), job.optimizer, frames_of(job), stages=_stages(job))
    keep, root = job.cfg.checkpoint.keep_latest_k, folder(job)
    after = functools.partial(purge, root, keep) if keep and job.rank == 0 else None
    label = f"checkpoint step {step}"
    saver.save(path, {**state, **_entries(job)}, label=label, extra=_extra(step), after=after)


def wait_for_saves(job: Job) -> None:
    """At the end of training: the last background save complete (or its error)."""
    if job.checkpointer is not None:
        saver, job.checkpointer = job.checkpointer, None
        saver.close()


def maybe_resume(job: Job) -> int:
    """Load the latest checkpoint when resuming is on; return the step to start from."""
    c = job.cfg.checkpoint
    if not (c.enable and c.resume):
        return 0
    step = latest_step(folder(job))
    if step is None:
        return 0
    path = folder(job) / f"step-{step}"
    entries = _entries(job)
    model, frames = _model(job), frames_of(job)
    extra = load(
        path,
        model,
        job.optimizer,
        frames=frames,
        timeout=_timeout(job),
        entries=entries,
        reads=c.reads,
    )
    step = int((extra or {}).get("step", step))
    _restore_schedule(job, entries[SCHEDULER], step, path)
    if job.rank == 0:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


def _restore_schedule(job: Job, state: dict[str, Any], step: int, path: Path) -> None:
    """The scheduler where the saved run left it: its next lr is step ``step``'s."""
    if state["last_epoch"] != step:
        raise ValueError(
            f"checkpoint '{path}': the lr scheduler's state is at step "
            f"{state['last_epoch']}, the checkpoint at step {step}"
        )
    job.lr_scheduler.load_state_dict(state)


def initial_load(job: Job) -> None:
    """A fresh run (nothing resumed) starts from ``checkpoint.initial_load_path``: the
    model weights of a Hugging Face folder or of a DCP checkpoint (no optimizer state;
    one torch's ``dcp.save`` wrote, without a manifest, too)."""
    c = job.cfg.checkpoint
    if c.initial_load_in_hf:
        load_hf(job, c.initial_load_path)
    else:
        model, frames, timeout = _model(job), frames_of(job), _timeout(job)
        load(
            c.initial_load_path,
            model,
            frames=frames,
            timeout=timeout,
            require_manifest=False,
            reads=c.reads,
        )
    if job.rank == 0:
        print(f"initial weights from {c.initial_load_path}", flush=True)
