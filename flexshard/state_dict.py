"""Full (unsharded) state dicts: gather for export, scatter-free load for import."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .runtime.bucket import Bucket
from .runtime.module import subtree_buckets
from .runtime.tp_params import global_tensor, local_piece


def param_index(module: nn.Module) -> dict[int, tuple[Bucket, int]]:
    """Local and full parameter objects -> (bucket, index), for every bucket below."""
    index = {}
    for bucket in subtree_buckets(module):
        for i, (local, full) in enumerate(zip(bucket.local_params, bucket.full_params)):
            index[id(local)] = index[id(full)] = (bucket, i)
    return index


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as the unsharded model would give it. Every rank of the
    shard groups must call it (one all-gather per bucket); every rank gets it all."""
    index = param_index(module)
    gathered: dict[int, list[torch.Tensor]] = {}
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        entry = index.get(id(value))
        if entry is None:
            out[key] = value.detach()
            continue
        bucket, i = entry
        if id(bucket) not in gathered:
            gathered[id(bucket)] = bucket.gather_full()
        spec = bucket.params[i].tp_spec
        full = gathered[id(bucket)][i]
        # a TP parameter: the gathered tensor is this tp rank's piece; join the pieces
        out[key] = full if spec is None else global_tensor(full, spec)
    return out


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> None:
    """Load an unsharded state dict: each rank copies out the regions it stores. No
    collective; every key and shape is checked before anything is changed."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"load_full_state_dict: state_dict must be a mapping of name -> tensor, got "
            f"{type(state_dict).__name__}"
        )
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state dict entry '{key}' must be a tensor, got {type(value).__name__}"
            )
    index = param_index(module)
    if not index:
        raise ValueError("load_full_state_dict needs a module sharded by flexshard")
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(
            f"state dict does not match the model: missing {missing}, unexpected {unexpected}"
        )
    updates: dict[int, tuple[Bucket, list[torch.Tensor | None]]] = {}
    buffers = {}
    for key, value in own.items():
        if key not in state_dict:
            continue
        source = state_dict[key]
        entry = index.get(id(value))
        spec = entry[0].params[entry[1]].tp_spec if entry else None
        shape = tuple(value.shape)
        if entry is not None:
            shape = tuple(spec.shape if spec else entry[0].layout.params[entry[1]].shape)
        if tuple(source.shape) != shape:
            raise ValueError(
                f"state dict entry '{key}' has shape {tuple(source.shape)}, "
                f"the model expects {shape}"
            )
        if entry is None:
            buffers[key] = source
            continue
        bucket, i = entry
        fulls = updates.setdefault(id(bucket), (bucket, [None] * len(bucket.params)))[1]
        # a TP parameter: this tp rank stores its piece of the whole tensor
        fulls[i] = source if spec is None else local_piece(source, spec)
    for bucket, fulls in updates.values():
        device = bucket.storage.device
        bucket.load_full([None if f is None else f.to(device) for f in fulls])
    with torch.no_grad():
        for key, source in buffers.items():
            own[key].copy_(source)
