"""A bucket's storage: one flat buffer per rank, its layouts and dtypes, views into it."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..placements.bytes import as_bytes, byte_view
from ..placements.layout import BucketLayout
from ..placements.packing import pack_rank
from ..torch_internals import FOLLOWS_GRAD_DTYPE, grad_reduce_dtype
from .bucket_param import BucketParam
from .mp_dtypes import ParamDtypes, param_dtypes


def free(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s memory, keeping the tensor object (and views' metadata)."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc(tensor: torch.Tensor) -> None:
    """Give a ``free``d tensor its memory back (contents undefined)."""
    storage = tensor.untyped_storage()
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if storage.size() < needed:
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
        self.buffer = torch.zeros(self.storage_layout.shard_numel, dtype=self.dtype, device=device)

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
