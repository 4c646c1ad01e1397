"""flexshard: data-parallel sharding with a placement per bucket of parameters."""

# the names FSDP2 users import beside fully_shard, so the one-line import swap covers them
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    register_fsdp_forward_method,
)

from . import checkpoint, optim  # noqa: F401  (fs.checkpoint.save, fs.optim.DistMuon, ...)
from .fsdp.api import flex_shard, fully_shard, share_comm_ctx
from .fsdp.arguments import BucketSpec
from .fsdp.clip import clip_grad_norm_
from .fsdp.state_dict import full_state_dict, init_params, load_full_state_dict
from .placements import BlockShard, FlatShard, Owned, Placement, Replicate, Shard
from .runtime.collectives import CollectiveError
from .runtime.dtensor.distribute import distribute_tensor
from .runtime.module import FlexShardModule

# torch's own where torch has them (DataParallelMeshDims from 2.13, GradientReductionHandle
# from 2.15), flexshard's of the same fields before
from .torch_internals import DataParallelMeshDims, GradientReductionHandle

__all__ = [
    "BlockShard",
    "BucketSpec",
    "CPUOffloadPolicy",
    "CollectiveError",
    "DataParallelMeshDims",
    "FSDPModule",
    "FlatShard",
    "FlexShardModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Owned",
    "Placement",
    "Replicate",
    "Shard",
    "UnshardHandle",
    "clip_grad_norm_",
    "distribute_tensor",
    "flex_shard",
    "full_state_dict",
    "fully_shard",
    "init_params",
    "load_full_state_dict",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
