"""The trainer's Hugging Face folders: ``checkpoint.initial_load_path`` with
``initial_load_in_hf`` reads one into the sharded model, ``last_save_in_hf`` writes the
final model as one (``config.json``, safetensors shards and their index, the
tokenizer's files). Every rank reads and writes only what it stores
(``flexshard.checkpoint.hf_safetensors``), on every layout: pipeline stages hold their
layers under the whole model's names (the files are planned from the whole model's
shapes, so pp = 1 and pp > 1 write the same files), EP ranks their experts at their
offsets in the whole stacks (``expert_frames``)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flexshard.checkpoint.bounded import bounded_group, in_flight
from flexshard.checkpoint.hf_safetensors import load_hf_safetensors, save_hf_safetensors

from .exchange import configured_timeout
from .expert_parallel import expert_frames
from .hf_adapter import DTYPES, check_matches, hf_config, hf_keys, in_hf
from .model import Transformer

if TYPE_CHECKING:
    from .job import Job

HF_FOLDER = "hf"  # under dump_folder
MAX_SHARD_BYTES = 2**30  # safetensors files of at most 1 GiB (one larger tensor excepted)


def model_state(job: Job) -> dict[str, torch.Tensor]:
    """This rank's sharded tensors a Hugging Face folder holds, by FQN, over every
    module it runs."""
    state: dict[str, torch.Tensor] = {}
    for module in job.parallel.modules:
        state.update(module.state_dict())
    return {fqn: value for fqn, value in state.items() if in_hf(fqn)}


def frames_of(job: Job) -> dict:
    """EP's expert slices at their offsets in the whole stacks (empty without EP): a
    Hugging Face folder and a DCP checkpoint hold the whole stacks."""
    return {k: v for m in job.parallel.modules for k, v in expert_frames(m).items()}


def whole_shapes(job: Job) -> dict[str, torch.Size]:
    """Every parameter of the whole model and its shape, in state-dict order (from a
    meta-built model: no memory, no collective)."""
    with torch.device("meta"):
        model = Transformer(job.cfg.model)
    return {fqn: value.shape for fqn, value in model.state_dict().items() if in_hf(fqn)}


def world_group(job: Job) -> tuple[dist.ProcessGroup, datetime.timedelta]:
    """The world on a group bounded by ``parallelism.timeout_s`` (made once, by every
    rank, at first use): a stalled peer makes the others raise a CollectiveError
    (``in_flight``) instead of waiting on gloo's 30 minutes."""
    timeout = configured_timeout(job.cfg.parallelism.timeout_s)
    return bounded_group(dist.group.WORLD, timeout), timeout


def load_hf(job: Job, folder: str | Path) -> None:
    """Copy a ``LlamaForCausalLM`` / ``MixtralForCausalLM`` folder's weights into the
    sharded model, after checking that its config.json describes the model the config
    builds."""
    config = check_matches(job.cfg.model, folder)
    state = model_state(job)
    tied = bool(config.get("tie_word_embeddings", False))
    keys = hf_keys(list(state), job.cfg.model, tied)
    group, timeout = world_group(job)
    with in_flight("Hugging Face load", str(folder), group, timeout):
        load_hf_safetensors(folder, state, keys, process_group=group, frames=frames_of(job))


def export_hf(job: Job, folder: Path | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """The model as a Hugging Face folder (``dump_folder/hf`` by default) that
    ``from_pretrained`` loads; with the tokenizer's files when the run used a
    tokenizer.json. Every rank calls it."""
    cfg = job.cfg
    folder = folder or job.folder / HF_FOLDER
    dtype = cfg.checkpoint.export_dtype
    config = hf_config(cfg.model, dtype, cfg.training.seq_len)  # refusals first
    shapes = whole_shapes(job)
    group, timeout = world_group(job)
    with in_flight("Hugging Face export", str(folder), group, timeout):
        save_hf_safetensors(
            folder,
            model_state(job),
            hf_keys(list(shapes), cfg.model),
            DTYPES[dtype],
            max_shard_bytes,
            process_group=group,
            shapes=shapes,
            frames=frames_of(job),
        )
    if job.rank == 0:
        tokenizer = getattr(job, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "save"):
            config.update(tokenizer.special_ids())
            tokenizer.save(folder)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with in_flight("barrier after the Hugging Face export", str(folder), group, timeout):
        dist.barrier(group=group)
    return folder
