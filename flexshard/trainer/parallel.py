"""One DeviceMesh with named dimensions for every kind of parallelism.

Today only data parallelism is live (``dp_replicate`` x ``dp_shard``); ``pp``, ``cp``,
``tp`` and ``ep`` are reserved names with degree 1, so that the 5-D trainer adds
dimensions to this mesh instead of building a second one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ConfigError, ParallelismConfig

# outermost first, as torchtitan orders them: pipeline stages are the slowest links,
# tensor parallel ranks the fastest
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelismConfig, world_size: int) -> ParallelDims:
        others = cfg.dp_replicate * cfg.cp * cfg.tp * cfg.pp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by dp_replicate * cp * tp * pp "
                    f"= {others}; cannot infer parallelism.dp_shard"
                )
            dp_shard = world_size // others
        dims = cls(cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.pp, cfg.ep, world_size)
        product = others * dp_shard
        if product != world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {product} (dp_replicate={cfg.dp_replicate} x "
                f"dp_shard={dp_shard} x cp={cfg.cp} x tp={cfg.tp} x pp={cfg.pp}) but the world "
                f"size is {world_size}; make them equal"
            )
        return dims

    def degree(self, name: str) -> int:
        return getattr(self, name)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh; dimensions of degree 1 are kept out, except ``dp_shard``
        which is always there (the data-parallel mesh needs at least one dimension)."""
        names = [n for n in MESH_ORDER if self.degree(n) > 1 or n == "dp_shard"]
        shape = tuple(self.degree(n) for n in names)
        return init_device_mesh(device_type, shape, mesh_dim_names=tuple(names))

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """1-D (dp_shard) or 2-D (dp_replicate, dp_shard, i.e. HSDP) sub-mesh."""
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]
        return mesh["dp_shard"]

    def dp_rank(self, mesh: DeviceMesh) -> int:
        shard = mesh.get_local_rank("dp_shard")
        if self.dp_replicate > 1:
            return mesh.get_local_rank("dp_replicate") * self.dp_shard + shard
        return shard


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError('training.device = "cuda" but CUDA is not available')
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(device: torch.device) -> None:
    """Join the process group torchrun (or the launcher) described in the environment."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)
