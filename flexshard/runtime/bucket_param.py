"""What a bucket holds per parameter: a leaf module, so the parts of a bucket
(runtime/full_params.py) and the code that builds buckets (bucket_plans.py) name the
type without importing runtime/bucket.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..placements import Placement, Shard
from ..torch_internals import DTensorSpec
from .tp_params import spmd_dims


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
    #: its own ``param_dtype`` (``MixedPrecisionPolicy.param_dtype_override_fn``,
    #: resolved); None: the policy's
    param_dtype: torch.dtype | None = None
    #: the ``grad_dtype`` set on it (``torch_internals.grad_dtype_override``)
    grad_override: tuple[bool, torch.dtype | None] = (False, None)

    @property
    def grad_outside_dp(self) -> bool:
        """Its gradient may be reduced over a tensor-parallel dim before the data-parallel
        reduction (a replicated TP weight's gradient can come back Partial)."""
        spec = self.tp_spec
        if spec is None:
            return False
        spmd = spmd_dims(spec)
        dp = spmd.dp if spmd is not None else ()
        return any(p.is_replicate() for i, p in enumerate(spec.placements) if i not in dp)
