"""One DeviceMesh with named dimensions for every kind of parallelism, and the
sub-meshes the pieces take.

World mesh, outermost first: ``pp, dp_replicate, dp_shard, cp, tp`` (degree-1 dims
left out, except ``dp_shard``). flexshard's data-parallel mesh spans dp_replicate x
(dp_shard * cp): the sequence is split across cp, so cp ranks average gradients like
dp ranks. EP borrows its ranks from dp_shard * cp (as torchtitan): that dimension is
viewed as (dp_shard_mod_ep, ep), the experts split across ``ep`` and their weights
sharded by flexshard over ``dp_shard_mod_ep``.

Every group of these meshes (and the world group ``init_distributed`` joins) is made
with ``parallelism.timeout_s``: the collectives torch issues on them itself (TP's
DTensor redistributions, the pipeline schedule's sends and receives, FSDP2's, the
state-dict gathers) fail after it instead of the backend's 30 minutes (gloo honours a
group's timeout for collectives and point-to-point alike; NCCL's watchdog aborts).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flexshard.torch_internals import backend_group_options, clear_sharding_prop_cache

from ..config import Config, ConfigError
from .attempt_store import attempt_store, uses_agent_store

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
    #: how long a collective on the mesh's groups may take (None: the backend's default)
    timeout_s: float | None = None

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> ParallelDims:
        """The degrees of ``cfg.parallelism`` on ``world_size`` ranks (``dp_shard = -1``:
        what the others leave); ``parallelize.checked_dims`` adds every parallelism's
        check."""
        p = cfg.parallelism
        others = p.dp_replicate * p.cp * p.tp * p.pp
        dp_shard = p.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by dp_replicate * cp * tp * pp "
                    f"= {others}; cannot infer parallelism.dp_shard"
                )
            dp_shard = world_size // others
        dims = cls(p.dp_replicate, dp_shard, p.cp, p.tp, p.pp, p.ep, world_size, p.timeout_s)
        product = others * dp_shard
        if product != world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {product} (dp_replicate={p.dp_replicate} x "
                f"dp_shard={dp_shard} x cp={p.cp} x tp={p.tp} x pp={p.pp}) but the world "
                f"size is {world_size}; make them equal"
            )
        return dims

    def degree(self, name: str) -> int:
        return getattr(self, name)

    @property
    def dp_size(self) -> int:
        """Data-parallel degree of the sampler (cp ranks share their samples)."""
        return self.dp_replicate * self.dp_shard

    @property
    def composed(self) -> bool:
        """Anything beyond data and context parallelism."""
        return self.tp * self.pp * self.ep > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh; dimensions of degree 1 are kept out, except ``dp_shard``
        which is always there (the data-parallel mesh needs at least one dimension)."""
        names = [n for n in MESH_ORDER if self.degree(n) > 1 or n == "dp_shard"]
        shape = tuple(self.degree(n) for n in names)
        forget_earlier_meshes()
        override = self._bounded(len(names))
        return init_device_mesh(
            device_type,
            shape,
            mesh_dim_names=tuple(names),
            backend_override=dict(enumerate(override)) if override else None,
        )

    def _bounded(self, ndim: int) -> tuple[Any, ...] | None:
        """Per mesh dimension: (backend, options) that give its groups ``timeout_s``
        (torch's DeviceMesh passes the options' timeout to ``new_group``). One options
        object per dimension: new_group writes the group's ranks and name into it."""
        if self.timeout_s is None or group_options(self.timeout_s) is None:
            return None
        return tuple((None, group_options(self.timeout_s)) for _ in range(ndim))

    def meshes(self, mesh: DeviceMesh) -> Meshes:
        """Every sub-mesh the parallel pieces take. The flattened dims are views of the
        world mesh's rank grid, built as their own DeviceMesh (every rank builds them
        alike, so the groups agree)."""
        grid = mesh.mesh.reshape(self.pp, self.dp_replicate, self.dp_shard * self.cp, self.tp)
        dp_names = ("pp", "dp_replicate", "dp_shard_cp", "tp")
        dp_view = DeviceMesh(
            mesh.device_type,
            grid,
            mesh_dim_names=dp_names,
            backend_override=self._bounded(len(dp_names)),
        )
        dp = dp_view["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else None
        dp = dp if dp is not None else dp_view["dp_shard_cp"]
        found = Meshes(
            world=mesh,
            dp=dp,
            dp_shard_cp=dp_view["dp_shard_cp"],
            tp=mesh["tp"] if self.tp > 1 else None,
            pp=mesh["pp"] if self.pp > 1 else None,
            cp=mesh["cp"] if self.cp > 1 else None,
        )
        if self.ep > 1:
            outer = self.dp_shard * self.cp // self.ep
            ep_grid = grid.reshape(self.pp, self.dp_replicate, outer, self.ep, self.tp)
            names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")
            ep_view = DeviceMesh(
                mesh.device_type,
                ep_grid,
                mesh_dim_names=names,
                backend_override=self._bounded(len(names)),
            )
            found.ep = ep_view["ep"]
            found.experts_dp = (
                ep_view["dp_replicate", "dp_shard_mod_ep"]
                if self.dp_replicate > 1
                else ep_view["dp_shard_mod_ep"]
            )
        return found

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


@dataclass
class Meshes:
    """The world mesh and the sub-meshes of one rank (None: that degree is 1)."""

    world: DeviceMesh
    dp: DeviceMesh  # flexshard / FSDP2: (dp_replicate,) dp_shard_cp
    dp_shard_cp: DeviceMesh  # one copy of every gradient element (norms)
    tp: DeviceMesh | None = None
    pp: DeviceMesh | None = None
    cp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    experts_dp: DeviceMesh | None = None  # (dp_replicate,) dp_shard_mod_ep


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError('training.device = "cuda" but CUDA is not available')
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def forget_earlier_meshes() -> None:
    """Empty DTensor's sharding-propagation cache. DeviceMeshes of the same ranks and
    dim names compare equal whatever their groups, so a cached op answers a new mesh's
    DTensors with specs on an earlier mesh: its ops would then run on the earlier
    job's groups (broken ones, after a failure). Cheap: the caches refill."""
    # torch 2.13: the C++ fast path's cache and Python's; another torch without it keeps
    # its caches (the earlier groups still work)
    clear_sharding_prop_cache()


def group_options(timeout_s: float) -> Any:
    """Options for a new group of the world's backend whose collectives time out after
    ``timeout_s``: gloo's (it reads only their timeout), NCCL's (read, not run: this
    machine has no GPU); None for another backend (the planner's fake one), whose
    groups keep their default."""
    return backend_group_options(dist.get_backend(), datetime.timedelta(seconds=timeout_s))


def init_distributed(device: torch.device, timeout_s: float | None = None) -> None:
    """Join the process group torchrun (or the launcher) described in the environment;
    with ``timeout_s`` its collectives (the world's barriers) and the rendezvous wait at
    most that. A group made already (a test's launcher) is kept as it is."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    if uses_agent_store():  # torchrun's shared store outlives restarts: a fresh one
        store = attempt_store(timeout or datetime.timedelta(minutes=30))
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
