"""A whole tensor cut onto a RegionShard placement, and torch's full state-dict load
taught to do it.

torch's ``distribute_tensor`` and the copy that ``set_model_state_dict`` /
``set_optimizer_state_dict(full_state_dict=True)`` make (``_state_dict_utils.
_distribute_tensors``) know only box-shaped cuts and offer no placement hook: for a
FlatShard/Owned/BlockShard entry they raise on some ranks while the others go on to
the next key's broadcast and wait there until the timeout. ``install`` wraps those two
names inside ``torch.distributed._state_dict_utils`` only (nothing else of torch's
changes): entries placed on a RegionShard are cut into this rank's regions, every
other entry goes to torch's own code unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Placement as TorchPlacement
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from ...torch_internals import (
    DTensorSpec,
    TensorMeta,
    dtensor_spec,
    local_tensor,
    patch_full_state_dict_distribute,
)
from .region_dtensor import wrap
from .region_shard import RegionShard
from .tensor_parallel import local_piece


def _region_dim(placements: Sequence[TorchPlacement]) -> int | None:
    return next((d for d, p in enumerate(placements) if isinstance(p, RegionShard)), None)


def _regions_of_piece(
    piece: torch.Tensor, mesh: DeviceMesh, placements: Sequence[TorchPlacement], dim: int
) -> torch.Tensor:
    """This rank's regions of ``piece`` (the whole tensor, or its tensor-parallel piece)."""
    region = placements[dim]
    if tuple(piece.shape) != tuple(region.layout.shape):
        raise ValueError(
            f"a tensor of shape {tuple(piece.shape)} cannot be placed on {region}: "
            f"its shape (or tensor-parallel piece) is {tuple(region.layout.shape)}"
        )
    return region.take(piece, mesh.get_coordinate()[dim])


def _as_replicate(placements: Sequence[TorchPlacement], dim: int) -> list[TorchPlacement]:
    return [TorchReplicate() if d == dim else p for d, p in enumerate(placements)]


def local_regions(
    full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[TorchPlacement]
) -> torch.Tensor:
    """This rank's local tensor of ``full`` placed on ``placements`` (a RegionShard on one
    mesh dim): a copy, no collective."""
    dim = _region_dim(placements)
    piece = local_piece(full, DTensorSpec(mesh, tuple(_as_replicate(placements, dim))))
    return _regions_of_piece(piece, mesh, placements, dim)


def _spec(
    mesh: DeviceMesh, placements: Sequence[TorchPlacement], full: torch.Tensor
) -> DTensorSpec:
    meta = TensorMeta(full.shape, full.stride(), full.dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[TorchPlacement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """torch's ``distribute_tensor``, for flexshard's placements too: on a RegionShard
    mesh dim each rank keeps its regions of what torch's Replicate there would give it
    (so ``src_data_rank`` means what it means to torch)."""
    dim = None if placements is None else _region_dim(placements)
    if dim is None:
        return torch_distribute_tensor(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    others = _as_replicate(placements, dim)
    pieces = torch_distribute_tensor(tensor, device_mesh, others, src_data_rank=src_data_rank)
    mesh = pieces.device_mesh  # torch's default mesh where none was given
    local = _regions_of_piece(local_tensor(pieces), mesh, placements, dim)
    return wrap(local, _spec(mesh, placements, tensor), requires_grad=tensor.requires_grad)


def _distribute_region_entries(local_state_dict: dict[str, Any], keys: list[str]) -> None:
    """The entries of ``keys`` that pair a RegionShard DTensor with the broadcast whole
    tensor become that DTensor holding this rank's regions (torch's copy, for regions)."""
    for key in keys:
        entry = local_state_dict.get(key)
        if not (isinstance(entry, tuple) and isinstance(entry[0], DTensor)):
            continue
        current, full = entry
        if _region_dim(current.placements) is None:
            continue
        local = local_regions(full, current.device_mesh, current.placements)
        if current.is_meta:  # a meta-built model: the new tensor is assigned
            local_state_dict[key] = wrap(local.clone(), dtensor_spec(current))
            continue
        with torch.no_grad():
            local_tensor(current).copy_(local)
        local_state_dict[key] = current


def install() -> None:
    """Teach torch's full state-dict load (model and optimizer, with and without
    ``broadcast_from_rank0``) flexshard's placements; idempotent."""
    patch_full_state_dict_distribute(_distribute_region_entries, distribute_tensor)
