"""A bucket's storage: one flat buffer per rank, its layouts and dtypes, views into it.

``BucketParam``: what a bucket holds per parameter (FQN, module locations, placement,
TP spec), named by the bucket's parts and by the code that builds buckets (fsdp/build.py).

``ParamDtypes``: one parameter's dtypes under a mixed-precision policy, as this torch
release's FSDP2 gives them (pure dtype rules; the bucket applies them).

From torch 2.15 (``FOLLOWS_GRAD_DTYPE``) FSDP2 keeps unsharded gradients in the
parameter's gradient dtype (the policy's ``reduce_dtype``, else the ``grad_dtype`` set
on the parameter, else its original dtype) and casts the reduced shard to the sharded
gradient dtype; where that gradient dtype is wider than the compute dtype, backward
leaves a gradient in autograd's own dtype (``grad_dtype = None`` on the full parameter)
whenever it will be added to an accumulated one or reduced at once, so a gradient
computed in fp32 for a bf16 weight keeps its precision. Before 2.15 gradients follow
the compute dtype and no-sync steps hold them in the bucket's reduce dtype."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..placements import Placement, Shard
from ..placements.bytes import as_bytes, byte_view
from ..placements.layout import BucketLayout
from ..placements.packing import pack_rank
from ..torch_internals import FOLLOWS_GRAD_DTYPE, DTensorSpec, grad_reduce_dtype
from .dtensor.tensor_parallel import spmd_dims


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


def free(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory, keeping the tensor object (and views' metadata)."""
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def storage_bytes(tensor: torch.Tensor) -> int:
    """The bytes of storage ``tensor`` needs (its offset included)."""
    return (tensor.storage_offset() + tensor.numel()) * tensor.element_size()


def alloc(tensor: torch.Tensor) -> None:
    """Give a ``free``d tensor its memory back (contents undefined)."""
    storage = tensor.untyped_storage()
    needed = storage_bytes(tensor)
    if storage.nbytes() < needed:
        storage.resize_(needed)


def own_version_counter(view: torch.Tensor) -> torch.Tensor:
    """A tensor on the same memory as ``view`` but with a version counter of its own:
    the collective writing the shared buffer (on gloo's thread, whenever it lands)
    must not look to autograd like an in-place change of a saved parameter."""
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    return alias


class BucketStorage:
    """This rank's flat buffer of a bucket and the dtypes around it.

    Parameters of several dtypes share one uint8 buffer (``packed``), each region as
    its bytes; ``storage_layout`` then counts bytes while ``layout`` counts elements.
    ``param_dtype``/``reduce_dtype`` are what the mixed-precision policy makes of them;
    gradients are reduced in ``reduce_dtype`` when set, else as this torch release's
    FSDP2 does (``grad_reduce_dtype``) over the widest dtype of the parameters that
    were ``trainable`` when sharded (FSDP2's rule: a frozen parameter's dtype does not
    count).
    """

    def __init__(
        self,
        layout: BucketLayout,
        rank: int,
        dtypes: list[torch.dtype],
        element_sizes: list[int],
        policy: MixedPrecisionPolicy,
        device: torch.device,
        trainable: list[bool] | None = None,
        params: Sequence[BucketParam] | None = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.policy = policy
        self.trainable = list(trainable) if trainable is not None else [True] * len(dtypes)
        self.params = list(params) if params is not None else None
        self.dtypes = list(dtypes)
        self.packed = len(set(dtypes)) > 1
        self.storage_layout = as_bytes(layout, element_sizes) if self.packed else layout
        self._set_dtype(torch.uint8 if self.packed else dtypes[0])
        extent = self.storage_layout.extent(rank)  # ragged: this rank's own share only
        self.buffer = torch.zeros(extent, dtype=self.dtype, device=device)

    def _set_dtype(self, dtype: torch.dtype) -> None:
        policy = self.policy
        self.dtype = dtype  # the buffer's
        self.per_param = [self._param_dtypes(i, d) for i, d in enumerate(self.dtypes)]
        # any parameter whose backward defers autograd's cast (none before torch 2.15)
        self.widens = any(info.widen for info in self.per_param)
        self.full_dtypes = [info.compute for info in self.per_param]
        # the all-gather's dtype: several compute dtypes (param_dtype_override_fn) gather
        # the storage uncast, each parameter cast as it is copied out
        computed = set(self.full_dtypes)
        self.param_dtype = computed.pop() if len(computed) == 1 and not self.packed else dtype
        graded = [d for d, t in zip(self.dtypes, self.trainable) if t] or self.dtypes
        widest = functools.reduce(torch.promote_types, graded)
        self.reduce_dtype = grad_reduce_dtype(policy, widest)
        sharded = {info.sharded_grad for info in self.per_param}
        # one cast of the whole reduced buffer when every shard takes the same dtype
        self.grad_cast = sharded.pop() if len(sharded) == 1 and not self.packed else None

    def _param_dtypes(self, index: int, dtype: torch.dtype) -> ParamDtypes:
        policy = self.policy
        if self.params is None:
            return param_dtypes(dtype, policy.param_dtype, policy.reduce_dtype)
        param = self.params[index]
        resolved = param.param_dtype if param.param_dtype is not None else policy.param_dtype
        return param_dtypes(
            dtype, resolved, policy.reduce_dtype, param.grad_override, param.grad_outside_dp
        )

    def hold_dtypes(self) -> list[torch.dtype | None]:
        """The dtype each parameter's no-sync gradient is held in (None: its own)."""
        return [info.grad if info.follows else self.reduce_dtype for info in self.per_param]

    def reduce_dtype_of(
        self, grads: Sequence[torch.Tensor | None], trainable: Sequence[bool]
    ) -> torch.dtype:
        """The dtype this backward's ``grads`` reduce in: the policy's ``reduce_dtype``,
        else from torch 2.15 the promotion of the trainable parameters' accumulation
        dtypes (a gradient's own where it has none), as FSDP2's ``_get_reduce_dtype``.
        A trainable parameter without a gradient here counts too: it reduces zeros
        where another rank used it, and every rank must pick the same dtype."""
        if self.policy.reduce_dtype is not None or not FOLLOWS_GRAD_DTYPE:
            return self.reduce_dtype
        dtypes = {
            info.grad or grad.dtype
            for info, grad, used in zip(self.per_param, grads, trainable)
            if used and (info.grad is not None or grad is not None)
        }
        return functools.reduce(torch.promote_types, dtypes) if dtypes else self.reduce_dtype

    def refresh_dtypes(self) -> None:
        """Recompute the dtypes after a parameter's ``grad_override`` changed."""
        self._set_dtype(self.dtype)

    def recast(self, buffer: torch.Tensor) -> None:
        """Adopt ``buffer`` (the storage moved or cast by ``module.to(...)``); a cast
        gives every parameter the new dtype (an unpacked bucket has one dtype)."""
        if buffer.dtype != self.dtype:
            self.dtypes = [buffer.dtype] * len(self.dtypes)
            self._set_dtype(buffer.dtype)
        self.buffer = buffer

    def view(self, index: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of parameter ``index`` in ``buffer`` (the storage by default)."""
        buffer = self.buffer if buffer is None else buffer
        param = self.storage_layout.params[index]
        offset = param.offsets[self.rank]
        piece = buffer[offset : offset + param.local_numel(self.rank)]
        if self.packed:
            piece = piece.view(self.dtypes[index])
        return piece.view(self.layout.params[index].local_shape(self.rank))

    def as_units(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Full tensors as ``pack``/``unpack`` on the storage layout read them."""
        if not self.packed:
            return tensors
        return [None if t is None else byte_view(t.contiguous()) for t in tensors]

    def load(self, fulls: list[torch.Tensor | None]) -> None:
        """Copy this rank's regions of full parameters (None: keep) into the buffer."""
        with torch.no_grad():
            pack_rank(self.storage_layout, self.rank, self.as_units(fulls), self.buffer)
