"""Gradient clipping over sharded gradients: the norm of the whole model, not the shard,
for every layout (flexshard or FSDP2 data parallelism, TP, PP stages, EP experts).

One path, as torchtitan's ``dist_utils.clip_grad_norm_``: ``get_total_norm`` of the
local gradients, reduced over the mesh dims each gradient's DTensor is split on (a dim
it is replicated on counts once), then over the groups the caller adds (another
pipeline stage's parameters, EP's expert slices); every rank gets the same norm and
scales its gradients by the same coefficient.

Why not ``get_total_norm(dtensor_grads).full_tensor()`` as torchtitan: DTensor's
all-reduce waits on the backend's timeout (gloo: 30 minutes) and torch refuses
gradients on several meshes. The same partial norms are reduced here through the
runtime's ``Pending``, bounded by the model's timeout (a CollectiveError naming the
buckets and the collective).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from ..runtime.bucket import Bucket, slot_of
from ..runtime.collectives import DEFAULT_TIMEOUT, Pending
from ..runtime.device import device_runtime
from ..runtime.module import subtree_buckets
from ..torch_internals import local_tensor

Group = dist.ProcessGroup | DeviceMesh
#: (label for errors, group) pairs a gradient's partial norm is summed over
Reduction = tuple[tuple[str, dist.ProcessGroup], ...]


def clip_grad_norm_(
    parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_group: Group | None = None,
    extra_groups: Sequence[tuple[Iterable[torch.Tensor], Group]] = (),
) -> torch.Tensor:
    """Scale every gradient so that the gradient of the full model has at most
    ``max_norm``; return the full model's gradient norm (the same on every rank).

    ``parameters``: a module (sharded: its parameters are DTensors) or parameters, as
    torch's ``clip_grad_norm_`` takes. ``pp_group``: the pipeline ranks whose stages
    hold the model's other parameters (each rank passes its own stages' parameters).
    ``extra_groups``: ``(params, group)`` pairs for parameters split over one more group
    than their DTensor mesh says, e.g. EP's expert slices and the EP group. Plain
    tensors count as this rank's own. All-reduces wait at most the buckets' timeout.
    """
    _check_numbers(max_norm, norm_type)
    params = _parameters(parameters)
    extra = {id(p): _group(g) for ps, g in extra_groups for p in ps}
    buckets = _buckets(parameters, params)
    inf = math.isinf(norm_type)
    # gradients grouped by what their partial norms are summed over (from the param's
    # spec, not the gradient's: every rank then issues the same collectives)
    grads: dict[Reduction, list[torch.Tensor]] = {}
    scaled: list[torch.Tensor] = []
    for param in params:
        reduction = _reduction(param) + (
            (("extra group", extra[id(param)]),) if id(param) in extra else ()
        )
        local = grads.setdefault(reduction, [])
        if param.grad is not None:
            grad = local_tensor(param.grad) if isinstance(param.grad, DTensor) else param.grad
            scaled.append(grad)
            if grad.numel():  # a rank holding none of a tensor adds nothing
                local.append(grad)
    device = scaled[0].device if scaled else _local(params[0]).device
    bounded = _Bounded(buckets, device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for reduction, local in grads.items():
        part = torch.nn.utils.get_total_norm(local, norm_type, False, foreach)
        part = part.to(device=device, dtype=torch.float32)
        part = part if inf else part**norm_type
        for label, group in reduction:
            bounded.all_reduce(part, inf, group, label)
        total = torch.maximum(total, part) if inf else total + part
    if pp_group is not None:  # the stages on the other pipeline ranks
        bounded.all_reduce(total, inf, _group(pp_group), "pp")
    total = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            f"{float(total)}; pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # never scaled up
    for grad in scaled:
        grad.mul_(coef.to(grad.dtype))
    return total


def _check_numbers(max_norm: object, norm_type: object) -> None:
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"clip_grad_norm_: {name} must be a number, got {value!r}")
    if not max_norm >= 0:  # also rejects NaN
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or inf), got {norm_type}")


def _parameters(
    parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        params = list(parameters.parameters())
        if not any(isinstance(p, DTensor) for p in params):
            # a module's plain parameters are each rank's whole copy: clipping them here
            # would be the local norm, not the model's
            raise ValueError(
                f"clip_grad_norm_ needs a module sharded by flexshard (or FSDP2); "
                f"{type(parameters).__name__} has no DTensor parameter (pass its parameters "
                "to count them as this rank's own)"
            )
        return params
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not params:
        raise ValueError("clip_grad_norm_: no parameters given")
    return params


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return local_tensor(tensor) if isinstance(tensor, DTensor) else tensor


def _reduction(param: torch.Tensor) -> Reduction:
    """The groups of the mesh dims ``param`` is split on: the ranks holding its other
    elements. A Replicate dim holds copies and counts once; a plain tensor is local."""
    if not isinstance(param, DTensor):
        return ()
    mesh, out = param.device_mesh, []
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Partial):  # a norm of partial sums is not a partial norm
            raise ValueError(
                f"clip_grad_norm_: a parameter of shape {tuple(param.shape)} is placed "
                f"{tuple(param.placements)}; Partial placements have no norm"
            )
        if not placement.is_replicate():
            out.append((names[dim] or "", mesh.get_group(dim)))
    return tuple(out)


def _group(group: Group) -> dist.ProcessGroup:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"clip_grad_norm_: a group mesh must be 1-D, got {group.ndim} dims")
        return group.get_group()
    return group


def _buckets(
    parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor], params: list[torch.Tensor]
) -> list[Bucket]:
    """The flexshard buckets holding ``params`` (their names and timeout go into the
    all-reduces' errors): a module's in its order, else by first parameter."""
    if isinstance(parameters, nn.Module):
        found = list(subtree_buckets(parameters))
        if found:
            return found
    buckets: dict[int, Bucket] = {}
    for param in params:
        slot = slot_of(param)
        if slot is not None:
            buckets.setdefault(id(slot[0]), slot[0])
    return list(buckets.values())


class _Bounded:
    """The all-reduces of one clip, each bounded by the model's timeout."""

    def __init__(self, buckets: list[Bucket], device: torch.device) -> None:
        self.names = ", ".join(b.name for b in buckets) or "(torch-sharded gradients)"
        self.timeout: datetime.timedelta = buckets[0].comm.timeout if buckets else DEFAULT_TIMEOUT
        self.device = device

    def all_reduce(
        self, tensor: torch.Tensor, inf: bool, group: dist.ProcessGroup, label: str
    ) -> None:
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        collective = "clip_grad_norm_ all-reduce" + (f" over {label}" if label else "")
        Pending.launch(
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
            collective,
            self.names,
            self.timeout,
            group,
            runtime=device_runtime(self.device, group),
        ).wait()
