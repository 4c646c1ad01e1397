"""FSDP2's mixed-precision casts of forward inputs and outputs, as FSDP2 makes them
(torch's ``_apply_to_tensors``: containers, dataclasses and namedtuples alike).

A module with a bucket casts in the bucket's hooks (``cast_floating``); a module whose
parameters were all taken by earlier ``fully_shard`` calls (accelerate's and most
wrappers' root) gets hooks of its own (``install_forward_casts``): floating inputs to
``param_dtype`` when ``cast_forward_inputs``, floating outputs to ``output_dtype``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..torch_internals import apply_to_tensors


def _cast(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """``tree`` with its floating tensors cast to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tree
    return apply_to_tensors(functools.partial(_cast, dtype), tree)


def install_forward_casts(module: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """Register the casts ``policy`` asks for on ``module`` (none: nothing registered)."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        dtype = policy.param_dtype

        def cast_inputs(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return cast_floating(args, dtype), cast_floating(kwargs, dtype)

        module.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    if policy.output_dtype is not None:
        output_dtype = policy.output_dtype

        def cast_output(_m: nn.Module, _args: tuple, output: Any) -> Any:
            return cast_floating(output, output_dtype)

        module.register_forward_hook(cast_output)
