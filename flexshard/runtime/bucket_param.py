"""What a bucket holds per parameter: a leaf module, so the parts of a bucket
(runtime/full_params.py) and the code that builds buckets (bucket_plans.py) name the
type without importing runtime/bucket.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..placements import Placement, Shard
from ..torch_internals import DTensorSpec


@dataclass
class BucketParam:
    """One parameter of a bucket and every module attribute that holds it (ties)."""

    fqn: str
    requires_grad: bool
    locations: list[tuple[nn.Module, str]] = field(default_factory=list)
    #: a tensor-parallel DTensor parameter's spec (mesh, placements, global shape): the
    #: bucket shards its local tensor and hands the modules DTensors with this spec
    tp_spec: DTensorSpec | None = None
    placement: Placement = Shard(0)
