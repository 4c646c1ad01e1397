"""Process groups for a bucket, resolved from a DeviceMesh (1-D: shard; 2-D: replicate x shard)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class MeshGroups:
    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup | None  # HSDP: gradients are all-reduced across it
    rank: int  # this rank's index in ``shard``
    device: torch.device
    #: the sharded parameters' DTensor mesh: (shard) or (replicate, shard)
    mesh: DeviceMesh

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard)


def resolve_mesh(mesh: DeviceMesh | dist.ProcessGroup | None) -> MeshGroups:
    if not dist.is_initialized():
        raise RuntimeError("flexshard needs torch.distributed to be initialised first")
    replicate = None
    if mesh is None:
        shard = dist.group.WORLD
        device_type = "cpu" if dist.get_backend() == "gloo" else "cuda"
    elif isinstance(mesh, DeviceMesh):
        if mesh.get_coordinate() is None:
            raise ValueError(
                f"the mesh {mesh.mesh.tolist()} does not contain this rank "
                f"({dist.get_rank()}); build the model's mesh from ranks that include it"
            )
        if mesh.ndim == 1:
            shard = mesh.get_group(0)
        elif mesh.ndim == 2:
            replicate, shard = mesh.get_group(0), mesh.get_group(1)
        else:
            raise ValueError(
                f"flexshard takes a 1-D or 2-D (replicate, shard) mesh, got {mesh.ndim}-D"
            )
        device_type = mesh.device_type
    elif mesh is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"the process group does not contain this rank ({dist.get_rank()})")
    elif isinstance(mesh, dist.ProcessGroup):
        if dist.get_rank(mesh) < 0:
            raise ValueError(f"the process group does not contain this rank ({dist.get_rank()})")
        shard = mesh
        device_type = "cpu" if dist.get_backend(mesh) == "gloo" else "cuda"
    else:
        raise TypeError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh)}")
    device = torch.device(device_type)
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if not isinstance(mesh, DeviceMesh):  # a group, or the world: its 1-D mesh
        mesh = DeviceMesh.from_group(shard, device_type)
    return MeshGroups(shard, replicate, dist.get_rank(shard), device, mesh)
