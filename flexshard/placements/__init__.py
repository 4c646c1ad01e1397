"""Placements: pure layout math. No process group, no collective."""

from .base import Placement, Region
from .block import BlockShard, tile_grid
from .flat import FlatShard
from .layout import BucketLayout, CopyBlock, ParamLayout, plan_bucket
from .owned import Owned, lpt_owners
from .packing import copy_views, gathered_alias, pack_all, pack_rank, unpack
from .replicate import Replicate
from .shard import Shard, chunk_bounds

__all__ = [
    "BlockShard",
    "BucketLayout",
    "CopyBlock",
    "FlatShard",
    "Owned",
    "ParamLayout",
    "Placement",
    "Region",
    "Replicate",
    "Shard",
    "chunk_bounds",
    "gathered_alias",
    "lpt_owners",
    "copy_views",
    "pack_all",
    "pack_rank",
    "plan_bucket",
    "tile_grid",
    "unpack",
]
