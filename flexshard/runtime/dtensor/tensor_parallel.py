"""Tensor-parallel (DTensor) parameters inside a bucket: flexshard shards a DTensor's
local tensor (its TP piece) over the data-parallel group like any plain tensor, and
these helpers convert between that local tensor and the DTensor world."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as TorchShard

from ...torch_internals import (
    DTensorSpec,
    TensorMeta,
    compute_local_shape_and_global_offset,
    dtensor_spec,
    local_tensor,
)


@dataclass(frozen=True)
class SpmdDims:
    """A full SPMD mesh ``fully_shard`` was given with ``dp_mesh_dims``: which of its
    dims are data parallel. Its parameters are DTensors on it, Replicate on those
    dims; flexshard shards over them and keeps every other dim's placement."""

    mesh: DeviceMesh
    shard: int | None  # the dp dim parameters are sharded over
    replicate: int | None  # HSDP's replicate dim

    @property
    def dp(self) -> frozenset[int]:
        return frozenset(i for i in (self.shard, self.replicate) if i is not None)


#: by mesh value (DeviceMesh hashes its ranks and dim names): DTensor may hand back an
#: equal mesh object of an earlier model for a parameter's spec
_SPMD: dict[DeviceMesh, SpmdDims] = {}


def register_spmd_mesh(dims: SpmdDims) -> None:
    known = _SPMD.get(dims.mesh)
    if known is not None and (known.shard, known.replicate) != (dims.shard, dims.replicate):
        raise ValueError(
            f"fully_shard: the mesh {dims.mesh} was given with dp dims {known} before and "
            f"{dims} now; one SPMD mesh has one set of data-parallel dims"
        )
    _SPMD[dims.mesh] = dims


def spmd_dims(spec: DTensorSpec | None) -> SpmdDims | None:
    """The dp dims of a parameter's spec on a full SPMD mesh (None: a TP spec)."""
    return None if spec is None else _SPMD.get(spec.mesh)


def spec_of(param: torch.Tensor) -> DTensorSpec | None:
    """A DTensor parameter's spec (mesh, placements, global shape); None: plain."""
    return dtensor_spec(param) if isinstance(param, DTensor) else None


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """What flexshard shards and gathers: a DTensor's local tensor, else the tensor."""
    return local_tensor(tensor) if isinstance(tensor, DTensor) else tensor


def check_tp_param(param: torch.Tensor, fqn: str, bucket: str) -> None:
    """flexshard takes DTensors whose placements are TP's own: Shard or Replicate."""
    spec = spec_of(param)
    if spec is None:
        return
    if any(not (p.is_shard() or p.is_replicate()) for p in spec.placements):
        raise ValueError(
            f"bucket '{bucket}': parameter '{fqn}' is a DTensor with placements "
            f"{spec.placements}; flexshard takes Shard/Replicate (tensor parallel) DTensors"
        )


def full_parameter(local: torch.Tensor, spec: DTensorSpec | None, requires_grad: bool):
    """The parameter the modules see while unsharded: the gathered tensor, or for a
    tensor-parallel parameter a DTensor on its TP mesh wrapping the gathered local
    tensor (FSDP2 does the same), so that TP's module hooks keep working."""
    if spec is None:
        return nn.Parameter(local, requires_grad=requires_grad)
    meta = spec.tensor_meta
    if meta is not None and meta.dtype != local.dtype:  # mp_policy casts the gathered copy
        meta = TensorMeta(meta.shape, meta.stride, local.dtype)
        spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
    return nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=requires_grad)


def only_dp_dims(spec: DTensorSpec | None) -> bool:
    """Whether every dim of the parameter's mesh is a data-parallel dim of a full SPMD
    mesh: its gradient's placements then stay as they came (``local_grad`` would take
    its local tensor as it is)."""
    spmd = spmd_dims(spec)
    return spmd is not None and len(spmd.dp) == spmd.mesh.ndim


def local_grad(grad: torch.Tensor | None, spec: DTensorSpec | None) -> torch.Tensor | None:
    """A TP parameter's gradient as the local tensor of the parameter's own placements
    (a replicated weight's gradient may come back Partial: redistribute sums it over tp)."""
    if grad is None or spec is None:
        return grad
    if not isinstance(grad, DTensor):
        raise TypeError(f"expected a DTensor gradient for a TP parameter, got {type(grad)}")
    target = tuple(spec.placements)
    spmd = spmd_dims(spec)
    if spmd is not None:  # as FSDP2: dp dims stay as they came (a Partial is reduced by us)
        came = grad.placements
        target = tuple(came[i] if i in spmd.dp else p for i, p in enumerate(target))
    if tuple(grad.placements) != target:
        grad = grad.redistribute(spec.mesh, target)
    return local_tensor(grad)


def tp_sharded(spec: DTensorSpec | None) -> bool:
    """Whether the parameter is split over tp (its local pieces sum, not repeat)."""
    return spec is not None and any(isinstance(p, TorchShard) for p in spec.placements)


def global_tensor(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """The whole parameter from every tp rank's local piece (a collective over tp)."""
    dtensor = DTensor.from_local(
        local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
    )
    return dtensor.full_tensor()


def local_piece(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This tp rank's piece of a whole parameter (no collective)."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, spec.mesh, spec.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[index]


def tp_group(spec: DTensorSpec) -> dist.ProcessGroup:
    spmd = spmd_dims(spec)
    dims = [i for i in range(spec.mesh.ndim) if spmd is None or i not in spmd.dp]
    if len(dims) != 1:
        raise ValueError(f"a TP parameter needs one tp mesh dim, got {len(dims)}")
    return spec.mesh.get_group(dims[0])


def tp_frame(spec: DTensorSpec) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(global shape, offset of this tp rank's piece, whether it writes the piece in a
    checkpoint): a piece replicated over tp is written by its first holder only."""
    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    coordinate = list(spec.mesh.get_coordinate() or [])
    spmd = spmd_dims(spec)
    for i in spmd.dp if spmd is not None else ():  # dp dims: flexshard's own layout decides
        coordinate[i] = 0
    writes = all(not p.is_replicate() or c == 0 for p, c in zip(spec.placements, coordinate))
    return tuple(spec.shape), tuple(offset), writes
