"""One rank of a world of W, built on one CPU: torch's ``fake`` process-group backend
(every collective a no-op) and meta tensors (no storage), with the trainer's own
``setup`` path (``parallelize``) deciding the layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flexshard.torch_internals import FakeStore
from flexshard.trainer.config import Config
from flexshard.trainer.parallel.dims import Meshes, ParallelDims
from flexshard.trainer.parallel.parallelize import checked_dims, parallelize

META = torch.device("meta")


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process is ``rank`` of ``world_size`` until the block ends."""
    if dist.is_initialized():
        raise RuntimeError(
            "flexshard.plan needs its own (fake) process group; one is already initialised"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class RankBuild:
    """What one rank holds after the trainer's parallelize, on meta."""

    cfg: Config
    dims: ParallelDims
    meshes: Meshes
    rank: int
    modules: list[nn.Module]  # this rank's (stage) modules, sharded
    expert_fqns: list[str]


def build_rank(cfg: Config, world_size: int, rank: int) -> RankBuild:
    """The trainer's model for ``rank``, sharded as ``setup`` would shard it, on meta.
    Call inside :func:`fake_world`."""
    dims = checked_dims(cfg, world_size)
    mesh = dims.build_mesh("cpu")
    meshes = dims.meshes(mesh)
    # weights do not exist on meta: initialising them would only walk every rank's
    # copy plan (minutes at W = 8192) to write nothing
    parallel = parallelize(cfg, dims, meshes, META, init=False)
    return RankBuild(cfg, dims, meshes, rank, list(parallel.modules), list(parallel.expert_fqns))


def stage_ranks(dims: ParallelDims) -> list[int]:
    """One rank per pipeline stage (tp, cp and dp ranks of a stage hold alike-shaped
    shards, so one of each stage tells the memory of all)."""
    per_stage = dims.world_size // dims.pp
    return [stage * per_stage for stage in range(dims.pp)]
