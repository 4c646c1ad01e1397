"""What the public entry points take: ``BucketSpec`` and the checks of every argument.

The checks run before any collective, so a bad argument raises on the rank that passed
it instead of hanging the others."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..placements import Placement, Shard
from ..quant import QuantFormat


def check_bucket_spec(spec: Any) -> None:
    """Field types of a BucketSpec."""
    where = f"BucketSpec({spec.patterns!r})"
    patterns = spec.patterns
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{where}: patterns must be a str or a sequence of str")
    if not patterns:
        raise ValueError(f"{where}: patterns is empty; give at least one FQN glob")
    if spec.name is not None and not isinstance(spec.name, str):
        raise TypeError(f"{where}: name must be a str or None, got {spec.name!r}")
    if not (isinstance(spec.placement, Placement) or callable(spec.placement)):
        raise TypeError(
            f"{where}: placement must be a Placement or a callable (fqn, param) -> "
            f"Placement, got {spec.placement!r}"
        )
    check_options(where, spec.mp_policy, spec.reshard_after_forward, allow_none_policy=True)
    if not isinstance(spec.pack_as_bytes, bool):
        raise TypeError(f"{where}: pack_as_bytes must be a bool, got {spec.pack_as_bytes!r}")
    if spec.quant is not None and not isinstance(spec.quant, QuantFormat):
        raise TypeError(
            f"{where}: quant must be a QuantFormat (FP8Blockwise, MXFP8) or None, "
            f"got {spec.quant!r}"
        )
    if not isinstance(spec.ragged, bool):
        raise TypeError(f"{where}: ragged must be a bool, got {spec.ragged!r}")
    if spec.ragged and (spec.quant is not None or spec.pack_as_bytes):
        raise ValueError(
            f"{where}: ragged=True moves one dtype's elements per rank; a quantized or "
            "byte-packed bucket sends its own wire format: give it ragged=False"
        )


def check_options(
    where: str,
    mp_policy: object,
    reshard_after_forward: object,
    allow_none_policy: bool,
) -> None:
    """Argument types shared by BucketSpec, flex_shard and fully_shard."""
    if not (
        isinstance(mp_policy, MixedPrecisionPolicy) or (mp_policy is None and allow_none_policy)
    ):
        raise TypeError(
            f"{where}: mp_policy must be a torch MixedPrecisionPolicy, got {mp_policy!r}"
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"{where}: reshard_after_forward must be a bool or None, got {reshard_after_forward!r}"
        )


def check_module(where: str, module: object) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{where}: module must be a torch.nn.Module, got {type(module).__name__}")


PlacementFn = Callable[[str, nn.Parameter], Placement]


@dataclass(frozen=True)
class BucketSpec:
    """A named group of parameters, chosen by FQN glob patterns, that shares one
    placement policy (a Placement, or ``placement(fqn, param) -> Placement``)."""

    patterns: str | Sequence[str]
    placement: Placement | PlacementFn = Shard(0)
    name: str | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool | None = None
    #: let parameters of several dtypes share the bucket: one uint8 storage and one
    #: all-gather of bytes; gradients reduce in the widest dtype (or mp reduce_dtype)
    pack_as_bytes: bool = False
    #: all-gather block-quantized (FP8Blockwise or MXFP8): BlockShard tiles that are
    #: multiples of the format's block, each rank quantizing its own tiles
    quant: QuantFormat | None = None
    #: the bucket's own mesh, 1-D (shard) or 2-D (replicate, shard); None: flex_shard's.
    #: FSDP2 says the same with a shard_placement_fn's ShardPlacementResult
    mesh: DeviceMesh | None = None
    #: each rank stores, sends and receives only its own share: the all-gather and the
    #: gradient reduction move per-rank sizes instead of W shards padded to the largest
    #: (Owned / BlockShard buckets whose ranks hold unequal shares, such as a block's
    #: whole matrices over more ranks than it has matrices; docs/placements.md)
    ragged: bool = False

    def __post_init__(self) -> None:
        check_bucket_spec(self)
        if self.mesh is not None and not isinstance(self.mesh, DeviceMesh):
            raise TypeError(
                f"BucketSpec({self.patterns!r}): mesh must be a DeviceMesh or None, "
                f"got {self.mesh!r}"
            )

    @property
    def pattern_list(self) -> list[str]:
        return [self.patterns] if isinstance(self.patterns, str) else list(self.patterns)
