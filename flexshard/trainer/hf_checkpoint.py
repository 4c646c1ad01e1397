"""The trainer's Hugging Face folders: ``checkpoint.initial_load_path`` with
``initial_load_in_hf`` reads one into the sharded model, ``last_save_in_hf`` writes the
final model as one (``config.json``, safetensors shards and their index, the
tokenizer's files). Every rank reads and writes only what it stores
(``flexshard.checkpoint.hf_safetensors``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors, save_hf_safetensors

from .hf_adapter import DTYPES, check_matches, hf_config, hf_keys

if TYPE_CHECKING:
    from .train import Job

HF_FOLDER = "hf"  # under dump_folder
MAX_SHARD_BYTES = 2**30  # safetensors files of at most 1 GiB (one larger tensor excepted)


def model_state(job: Job) -> dict[str, torch.Tensor]:
    """This rank's sharded parameters, by FQN, over every module it runs."""
    state: dict[str, torch.Tensor] = {}
    for module in job.parallel.modules:
        state.update(module.state_dict())
    return state


def load_hf(job: Job, folder: str | Path) -> None:
    """Copy a ``LlamaForCausalLM`` folder's weights into the sharded model, after
    checking that its config.json describes the model the config builds."""
    config = check_matches(job.cfg.model, folder)
    state = model_state(job)
    tied = bool(config.get("tie_word_embeddings", False))
    load_hf_safetensors(folder, state, hf_keys(list(state), job.cfg.model, tied))


def export_hf(job: Job, folder: Path | None = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """The model as a Hugging Face folder (``dump_folder/hf`` by default) that
    ``LlamaForCausalLM.from_pretrained`` loads; with the tokenizer's files when the run
    used a tokenizer.json. Every rank calls it."""
    cfg = job.cfg
    folder = folder or job.folder / HF_FOLDER
    state = model_state(job)
    dtype = cfg.checkpoint.export_dtype
    config = hf_config(cfg.model, dtype, cfg.training.seq_len)
    save_hf_safetensors(
        folder, state, hf_keys(list(state), cfg.model), DTYPES[dtype], max_shard_bytes
    )
    if job.rank == 0:
        tokenizer = getattr(job, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "save"):
            config.update(tokenizer.special_ids())
            tokenizer.save(folder)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    dist.barrier()
    return folder
