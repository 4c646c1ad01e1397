"""One parameter's dtypes under a mixed-precision policy, as this torch release's FSDP2
gives them (pure dtype rules; the bucket applies them).

From torch 2.15 (``FOLLOWS_GRAD_DTYPE``) FSDP2 keeps unsharded gradients in the
parameter's gradient dtype (the policy's ``reduce_dtype``, else the ``grad_dtype`` set
on the parameter, else its original dtype) and casts the reduced shard to the sharded
gradient dtype; where that gradient dtype is wider than the compute dtype, backward
leaves a gradient in autograd's own dtype (``grad_dtype = None`` on the full parameter)
whenever it will be added to an accumulated one or reduced at once, so a gradient
computed in fp32 for a bf16 weight keeps its precision. Before 2.15 gradients follow
the compute dtype and no-sync steps hold them in the bucket's reduce dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..torch_internals import FOLLOWS_GRAD_DTYPE


@dataclass(frozen=True)
class ParamDtypes:
    """``compute``: the full (gathered) parameter's dtype. ``grad``: the full parameter's
    ``grad_dtype`` and the dtype no-sync gradients are held in (None: as autograd gives
    them; ``follows`` False: the bucket's reduce dtype). ``sharded_grad``: the reduced
    shard's dtype on ``.grad`` (None: the reduce dtype). ``widen``: backward defers the
    cast to ``grad`` (FSDP2 2.15's wider gradient dtype)."""

    compute: torch.dtype
    grad: torch.dtype | None
    sharded_grad: torch.dtype | None
    widen: bool
    follows: bool


def param_dtypes(
    orig: torch.dtype,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    grad_override: tuple[bool, torch.dtype | None] = (False, None),
    outside_dp: bool = False,
    follows: bool = FOLLOWS_GRAD_DTYPE,
) -> ParamDtypes:
    """FSDP2's dtypes for a parameter of dtype ``orig`` given its resolved
    ``param_dtype``, the policy's ``reduce_dtype``, the ``grad_dtype`` set on it
    (``grad_dtype_override``) and whether its gradient may be reduced over a non-dp mesh
    dim first (a tensor-parallel replicated weight: that reduction runs in the
    gradient's dtype, so FSDP2 does not widen it)."""
    compute = orig if param_dtype is None or not orig.is_floating_point else param_dtype
    if not follows:
        return ParamDtypes(compute, None, orig, widen=False, follows=False)
    overridden, override = grad_override
    sharded_grad = override if overridden else orig
    grad = reduce_dtype if reduce_dtype is not None else sharded_grad
    widen = (
        grad is not None
        and compute.is_floating_point
        and grad.is_floating_point
        and grad.itemsize > compute.itemsize
        and not outside_dp
    )
    return ParamDtypes(compute, grad, sharded_grad, widen=widen, follows=True)
