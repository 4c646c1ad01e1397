"""Placements: pure layout math. No process group, no collective.

The package exports what a user places buckets with (and what a custom placement
returns); the layout and packing math the runtime uses is imported from its module
(``placements.layout``, ``placements.packing``, ...)."""

from .base import Placement, Region, Replicate
from .block import BlockShard
from .flat import FlatShard
from .owned import Owned
from .shard import Shard

__all__ = ["BlockShard", "FlatShard", "Owned", "Placement", "Region", "Replicate", "Shard"]
