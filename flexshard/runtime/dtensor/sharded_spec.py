"""The parameters the optimizer sees: DTensors on the bucket's mesh whose local tensors
are views into the bucket storage, placed as FSDP2 places its own.

``Shard(dim)`` and ``Replicate`` become torch's placements (FSDP2's exactly, so torch's
tools treat them alike); FlatShard, Owned and BlockShard become a RegionShard. HSDP
adds ``Replicate`` on the replicate dim; a tensor-parallel parameter keeps its tp
placements on a (dp, tp) mesh, as FSDP2 composes with TP."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from ...placements import Placement, Replicate, Shard
from ...placements.layout import ParamLayout
from ...torch_internals import DTensorSpec, StridedShard, TensorMeta, concatenate_meshes
from .distribute import install
from .region_shard import RegionShard
from .tensor_parallel import SpmdDims, spmd_dims


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def dp_placement(placement: Placement, layout: ParamLayout):
    """The torch placement that says what each rank of the shard group holds."""
    if isinstance(placement, Shard):
        return TorchShard(placement.dim % len(layout.shape))
    if isinstance(placement, Replicate):
        return TorchReplicate()
    install()  # torch's full state-dict load must know RegionShard
    return RegionShard(type(placement).__name__, layout)


def sharded_spec(
    mesh: DeviceMesh,
    placement: Placement,
    layout: ParamLayout,
    dtype: torch.dtype,
    tp_spec: DTensorSpec | None = None,
) -> DTensorSpec:
    """The spec of a sharded parameter: ``mesh`` is the bucket's (shard) or
    (replicate, shard) mesh; ``tp_spec`` the parameter's own when tensor parallel."""
    placements = [dp_placement(placement, layout)]
    if mesh.ndim == 2:
        placements.insert(0, TorchReplicate())
    shape = tuple(layout.shape)
    spmd = spmd_dims(tp_spec)
    if spmd is not None:
        mesh, placements, shape = _on_spmd_mesh(placements, tp_spec, spmd)
    elif tp_spec is not None:
        mesh, placements, shape = _with_tp(mesh, placements, tp_spec)
    meta = TensorMeta(torch.Size(shape), _strides(shape), dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def _with_tp(
    mesh: DeviceMesh, placements: list, tp_spec: DTensorSpec
) -> tuple[DeviceMesh, list, tuple[int, ...]]:
    """dp dims first, then tp's: the tp piece is cut first, then split over dp, so a dp
    ``Shard(d)`` over a tp ``Shard(d)`` is torch's ``_StridedShard`` (as in FSDP2)."""
    try:
        joined = concatenate_meshes([mesh, tp_spec.mesh])
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(
            "a tensor-parallel parameter needs its dp and tp meshes cut from one DeviceMesh "
            f"(e.g. mesh['dp'] and mesh['tp']): {err}"
        ) from err
    out = []
    for p in placements:
        if isinstance(p, TorchShard):
            factor = 1
            for tp, size in zip(tp_spec.placements, tp_spec.mesh.shape):
                if isinstance(tp, TorchShard) and tp.dim == p.dim:
                    factor *= size
            p = StridedShard(p.dim, split_factor=factor) if factor > 1 else p
        out.append(p)
    return joined, out + list(tp_spec.placements), tuple(tp_spec.shape)


def _on_spmd_mesh(
    placements: list, spec: DTensorSpec, spmd: SpmdDims
) -> tuple[DeviceMesh, list, tuple[int, ...]]:
    """``fully_shard(dp_mesh_dims=...)``: the parameter stays on its full SPMD mesh with
    every dim in place, the dp shard dim taking the dp placement (``_StridedShard`` over
    a model-parallel ``Shard`` of the same dim on a later mesh dim, FSDP2's rule) and
    HSDP's replicate dim ``Replicate``, as FSDP2 places it."""
    out = list(spec.placements)
    dp = placements[-1]
    if spmd.shard is not None:
        if isinstance(dp, TorchShard):
            factor = 1
            for j in range(spmd.shard + 1, spec.mesh.ndim):
                p = out[j]
                if isinstance(p, (TorchShard, StridedShard)) and p.dim == dp.dim:
                    factor *= spec.mesh.size(j)
            dp = StridedShard(dp.dim, split_factor=factor) if factor > 1 else dp
        out[spmd.shard] = dp
    if spmd.replicate is not None:
        out[spmd.replicate] = TorchReplicate()
    return spec.mesh, out, tuple(spec.shape)
