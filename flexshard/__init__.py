"""flexshard: data-parallel sharding with a placement per bucket of parameters.

Every public name loads on first use (PEP 562 ``__getattr__``): ``import flexshard``
imports no torch, so the command lines (``flexshard-train --help``, ...) answer at once,
and a program pays for the parts it touches (``fs.checkpoint`` and ``fs.optim`` only
when read). ``flexshard.testing`` is no part of the library: nothing here imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it (relative: one of flexshard's own)
_EXPORTS: dict[str, str] = {
    # the names FSDP2 users import beside fully_shard, so the one-line import swap covers them
    "CPUOffloadPolicy": "torch.distributed.fsdp",
    "FSDPModule": "torch.distributed.fsdp",
    "MixedPrecisionPolicy": "torch.distributed.fsdp",
    "OffloadPolicy": "torch.distributed.fsdp",
    "UnshardHandle": "torch.distributed.fsdp",
    "register_fsdp_forward_method": "torch.distributed.fsdp",
    "BucketSpec": ".fsdp.arguments",
    "flex_shard": ".fsdp.api",
    "fully_shard": ".fsdp.api",
    "share_comm_ctx": ".fsdp.api",
    "clip_grad_norm_": ".fsdp.clip",
    "full_state_dict": ".fsdp.state_dict",
    "init_params": ".fsdp.state_dict",
    "load_full_state_dict": ".fsdp.state_dict",
    "BlockShard": ".placements",
    "FlatShard": ".placements",
    "Owned": ".placements",
    "Placement": ".placements",
    "Replicate": ".placements",
    "Shard": ".placements",
    "CollectiveError": ".runtime.collectives",
    "distribute_tensor": ".runtime.dtensor.distribute",
    "FlexShardModule": ".runtime.module",
    # torch's own where torch has them (DataParallelMeshDims from 2.13, GradientReductionHandle
    # from 2.15), flexshard's of the same fields before
    "DataParallelMeshDims": ".torch_internals",
    "GradientReductionHandle": ".torch_internals",
}

#: subpackages read as attributes: fs.checkpoint.save, fs.optim.DistMuon, ...
_SUBPACKAGES = ("checkpoint", "optim")

if TYPE_CHECKING:  # what __getattr__ returns, for type checkers
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        UnshardHandle,
        register_fsdp_forward_method,
    )

    from . import checkpoint as checkpoint
    from . import optim as optim
    from .fsdp.api import flex_shard, fully_shard, share_comm_ctx
    from .fsdp.arguments import BucketSpec
    from .fsdp.clip import clip_grad_norm_
    from .fsdp.state_dict import full_state_dict, init_params, load_full_state_dict
    from .placements import BlockShard, FlatShard, Owned, Placement, Replicate, Shard
    from .runtime.collectives import CollectiveError
    from .runtime.dtensor.distribute import distribute_tensor
    from .runtime.module import FlexShardModule
    from .torch_internals import DataParallelMeshDims, GradientReductionHandle


def __getattr__(name: str) -> Any:
    """A public name (or subpackage), imported on first read and kept (PEP 562)."""
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)  # the import sets the attribute
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later reads find it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})


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
