"""flexshard: data-parallel sharding with a placement per bucket of parameters."""

from torch.distributed.fsdp import MixedPrecisionPolicy

from . import checkpoint, optim  # noqa: F401  (fs.checkpoint.save, fs.optim.DistMuon, ...)
from .api import BucketSpec, flex_shard, fully_shard
from .clip import clip_grad_norm_
from .init import init_params
from .placements import BlockShard, FlatShard, Owned, Placement, Replicate, Shard
from .runtime.collectives import CollectiveError
from .runtime.module import FlexShardModule
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "BlockShard",
    "BucketSpec",
    "CollectiveError",
    "FlatShard",
    "FlexShardModule",
    "MixedPrecisionPolicy",
    "Owned",
    "Placement",
    "Replicate",
    "Shard",
    "clip_grad_norm_",
    "flex_shard",
    "full_state_dict",
    "fully_shard",
    "init_params",
    "load_full_state_dict",
]
