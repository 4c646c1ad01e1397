"""FSDP2's mixed-precision casts on a ``fully_shard`` call that builds no bucket.

A module whose parameters were all taken by earlier calls (accelerate's and most
wrappers' root) still casts as FSDP2's does: floating inputs to ``param_dtype`` when
``cast_forward_inputs``, floating outputs to ``output_dtype``. A module with a bucket
casts in the bucket's hooks instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from .torch_internals import apply_to_tensors


def _cast(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def install_forward_casts(module: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """Register the casts ``policy`` asks for on ``module`` (none: nothing registered)."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        to_param = functools.partial(_cast, policy.param_dtype)

        def cast_inputs(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return apply_to_tensors(to_param, args), apply_to_tensors(to_param, kwargs)

        module.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    if policy.output_dtype is not None:
        to_output = functools.partial(_cast, policy.output_dtype)

        def cast_output(_m: nn.Module, _args: tuple, output: Any) -> Any:
            return apply_to_tensors(to_output, output)

        module.register_forward_hook(cast_output)
