"""``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(...))`` with FSDP2's meaning:
``mesh`` is the full SPMD mesh, every parameter a DTensor on it with ``Replicate`` on
the named data-parallel dims. flexshard shards over the dp dims (one shard dim, HSDP's
replicate dim beside it) and keeps every other dim's placement, as its tensor-parallel
support does; the sharded parameters are DTensors on the same mesh, placed as FSDP2
places them. A ``shard_placement_fn``'s ``ShardPlacementResult`` whose mesh info came
from ``dp_mesh_dims`` (torch's ``_get_mesh_info(mesh, dims)``: torchtitan's routed
experts on their own SPMD mesh) is taken the same way, over that mesh's dp dims."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..runtime.dtensor.tensor_parallel import SpmdDims, register_spmd_mesh
from ..torch_internals import DataParallelMeshDims, concatenate_meshes

WHO = "fully_shard(dp_mesh_dims=...)"


def _one_name(names: tuple[str, ...], what: str) -> str | None:
    if len(names) > 1:  # FSDP2 flattens them into a new group; flexshard does not yet
        raise NotImplementedError(
            f"{WHO}: {what}={names} names several mesh dims; flexshard takes one "
            f"{what} dim (flattening several into one group is not built yet)"
        )
    return names[0] if names else None


def dp_mesh(
    mesh: DeviceMesh | None, dims: DataParallelMeshDims, reshard_after_forward: object
) -> tuple[DeviceMesh, SpmdDims]:
    """The data-parallel mesh flexshard shards over, (shard) or (replicate, shard), cut
    from the full SPMD ``mesh``; FSDP2's checks first, with its messages."""
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"{WHO}: expected a DataParallelMeshDims, got {dims!r}")
    if mesh is None or mesh.mesh_dim_names is None:
        raise ValueError(f"{WHO}: mesh must have mesh_dim_names when dp_mesh_dims is provided")
    names = mesh.mesh_dim_names
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"
        )
    shard = _one_name(dims.shard_names, "shard")
    replicate = _one_name(dims.replicate_names, "replicate")
    if shard is None:
        raise NotImplementedError(
            f"{WHO}: replicate-only dp_mesh_dims (DDP) is not supported by flexshard; "
            "name a shard dim, or use flex_shard with a Replicate() bucket"
        )
    spmd = SpmdDims(mesh, names.index(shard), None if replicate is None else names.index(replicate))
    register_spmd_mesh(spmd)
    if replicate is None:
        return mesh[shard], spmd
    return concatenate_meshes([mesh[replicate], mesh[shard]]), spmd


def check_spmd_param(param: nn.Parameter, fqn: str, spmd: SpmdDims) -> None:
    """A parameter sharded over the dp dims of ``spmd``'s mesh is a DTensor on that mesh,
    Replicate on the dp dims (FSDP2's requirement, its messages); raise naming it."""
    if not isinstance(param, DTensor):
        raise ValueError(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the "
            f"full SPMD mesh (e.g. via distribute_module). Got plain tensor for "
            f"parameter '{fqn}'."
        )
    if param.device_mesh != spmd.mesh:
        raise ValueError(
            f"{WHO}: parameter '{fqn}' is a DTensor on {param.device_mesh}, not on its "
            f"full SPMD mesh ({spmd.mesh})"
        )
    names = spmd.mesh.mesh_dim_names or ()
    for i in sorted(spmd.dp):
        if not param.placements[i].is_replicate():
            raise ValueError(
                f"{WHO}: parameter '{fqn}' has {param.placements[i]} on dp dim "
                f"'{names[i]}' (index {i}); expected Replicate()"
            )


def result_spmd_dims(
    spmd_mesh: DeviceMesh | None,
    dims: DataParallelMeshDims | None,
    reshard_after_forward: object,
    fqn: str,
) -> SpmdDims:
    """The dp dims of a ``ShardPlacementResult``'s mesh info built from ``dp_mesh_dims``
    (torch's ``_get_mesh_info(mesh, dims)``, as torchtitan builds its experts' one):
    the same checks and registration as ``fully_shard(dp_mesh_dims=...)``, the refusal
    naming the parameter."""
    try:
        return dp_mesh(spmd_mesh, dims, reshard_after_forward)[1]
    except NotImplementedError as err:
        raise NotImplementedError(
            f"fully_shard: parameter '{fqn}': shard_placement_fn returned a "
            f"ShardPlacementResult whose mesh info came from dp_mesh_dims: {err}"
        ) from None
