"""``module.state_dict()`` / ``load_state_dict`` of a sharded module.

``state_dict()`` gives the sharded parameters as the DTensors they are (FSDP2 does
the same): ``dcp.save`` writes this rank's chunks straight from them, ``dcp.load``
reads into them in place. ``load_state_dict`` accepts those, RegionTensors, or full
tensors, and copies this rank's regions into the storage; parameters assigned by
``load_state_dict(assign=True)`` are re-adopted into the storage afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .runtime.bucket import Bucket
from .runtime.dcp_chunks import RegionTensor, local_boxes, shifted
from .runtime.module import own_buckets
from .runtime.region_dtensor import wrap
from .runtime.tp_params import tp_frame

Slot = tuple[Bucket, int]


def sharded_keys(module: nn.Module, buckets: list[Bucket]) -> list[tuple[list[str], Slot]]:
    """Every state-dict key (relative to ``module``) of each parameter of ``buckets``:
    tied parameters have several, the first is the one ``named_parameters`` gives."""
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    entries = []
    for bucket in buckets:
        for i, param in enumerate(bucket.params):
            keys = []
            for owner, attr in param.locations:
                prefix = names.get(id(owner))
                if prefix is not None:
                    keys.append(f"{prefix}.{attr}" if prefix else attr)
            entries.append((keys, (bucket, i)))
    return entries


def to_local(value: torch.Tensor, bucket: Bucket, index: int, key: str) -> torch.Tensor:
    """This rank's local tensor of parameter ``index`` from a DTensor, a RegionTensor or
    a full tensor."""
    param = bucket.layout.params[index]
    shape = param.local_shape(bucket.rank)
    boxes = local_boxes(param, bucket.rank)
    expected = tuple(param.shape)
    spec = bucket.params[index].tp_spec
    if spec is not None:  # a tensor-parallel piece: boxes in the whole tensor's coordinates
        expected, offset, _ = tp_frame(spec)
        boxes = shifted(boxes, offset)
    # a DTensor's shape is global: checked before its local tensor is taken as the shard
    if tuple(value.shape) != expected:
        raise ValueError(
            f"state dict entry '{key}' has shape {tuple(value.shape)}, bucket "
            f"'{bucket.name}' expects {expected}"
        )
    if isinstance(value, DTensor):
        if value.placements != bucket.specs[index].placements:
            value = value.full_tensor()  # placed otherwise: every rank gathers, then cuts
        else:
            return value.to_local()
    if isinstance(value, RegionTensor):
        if [box for box, _ in value.pieces] != boxes:
            raise ValueError(
                f"state dict entry '{key}' describes other chunks than bucket '{bucket.name}' "
                f"stores on rank {bucket.rank}; build it with this model's state_dict()"
            )
        return value.local().view(shape)
    if not boxes:
        return value.new_empty(shape)
    pieces = [value[tuple(slice(o, o + s) for o, s in zip(*box))].reshape(-1) for box in boxes]
    return torch.cat(pieces).view(shape)


def _own_buckets(module: nn.Module) -> list[Bucket]:
    return own_buckets(module)


def _load_pre_hook(module: nn.Module, state_dict: dict, prefix: str, *_args: Any) -> None:
    buckets = _own_buckets(module)
    for bucket in buckets:
        bucket.reshard()  # the modules hold the local parameters the values copy into
    for keys, (bucket, i) in sharded_keys(module, buckets):
        for key in keys:
            value = state_dict.get(prefix + key)
            if isinstance(value, torch.Tensor):
                local = to_local(value, bucket, i, prefix + key)
                state_dict[prefix + key] = wrap(local, bucket.specs[i])


def _load_post_hook(module: nn.Module, _incompatible: Any) -> None:
    """``load_state_dict(assign=True)`` put new parameter objects on the modules:
    move their values into the bucket storage and make them its views again."""
    for bucket in _own_buckets(module):
        bucket.adopt_replaced()


def _save_pre_hook(module: nn.Module, *_args: Any) -> None:
    """``state_dict()`` gives the sharded parameters, also right after a forward that
    kept them gathered (``reshard_after_forward=False``): reshard first, as FSDP2 does."""
    for bucket in _own_buckets(module):
        bucket.reshard()


def install_state_dict_hooks(module: nn.Module) -> None:
    """Make ``state_dict`` give the sharded parameters, ``load_state_dict`` accept
    DTensors, RegionTensors and full tensors, and re-adopt assigned parameters."""
    module.register_state_dict_pre_hook(_save_pre_hook)
    module.register_load_state_dict_pre_hook(_load_pre_hook)
    module.register_load_state_dict_post_hook(_load_post_hook)
