"""Export the full model as one Hugging Face safetensors file."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn


def export_safetensors(model: nn.Module, path: str | os.PathLike, rank: int | None = None) -> None:
    """Write the unsharded ``model.state_dict()`` to ``path`` (safetensors), readable
    by ``safetensors.torch.load_file``. Every rank of a sharded model calls it (one
    all-gather per bucket); only global rank 0 writes, atomically (temp file, rename)."""
    from ..state_dict import full_state_dict

    state = full_state_dict(model)
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        write_safetensors(state, path)


def write_safetensors(state: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write a full state dict (``fs.full_state_dict``, or torch's full
    ``get_model_state_dict``) to ``path`` atomically (temp file, rename), on the CPU.
    Called by the one rank that writes."""
    from safetensors.torch import save_file

    # safetensors refuses tensors that share memory (tied weights): give each its own
    seen: set[int] = set()
    tensors = {}
    for key, value in state.items():
        value = value.detach().cpu().contiguous()
        if value.untyped_storage().data_ptr() in seen:
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        tensors[key] = value
    final = os.fspath(path)
    partial = final + ".partial"
    save_file(tensors, partial, metadata={"format": "pt"})
    os.replace(partial, final)
