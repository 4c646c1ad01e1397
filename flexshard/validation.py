"""Argument checks of the public entry points: run before any collective, so a bad
argument raises on the rank that passed it instead of hanging the others."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from .placements import Placement
from .quant import QuantFormat


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
