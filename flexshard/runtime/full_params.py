"""A bucket's full parameters: what the modules use while unsharded, and the all-gather
buffer they are filled from."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..placements.layout import BucketLayout
from .bucket_param import BucketParam
from .collectives import Pending
from .gather import Collective
from .storage import alloc, free, own_version_counter
from .tp_params import full_parameter, local_of


class FullParams:
    """Full-size parameters of one bucket and whether they are filled. Their memory is
    freed when resharded but the objects live on, so autograd's saved references to
    them stay valid across the backward re-gather. A parameter either aliases a buffer
    (the gathered one, or the storage of a replicated bucket) or owns memory the
    collective copies into. ``pending`` (the all-gather filling them, while in flight)
    and ``unsharded`` (they are on the modules) are set by the bucket's ``unshard`` and
    ``reshard``."""

    def __init__(
        self,
        collective: Collective,
        layout: BucketLayout,
        params: Sequence[BucketParam],
        dtypes: Sequence[torch.dtype],
        device: torch.device,
    ) -> None:
        self.gathered = collective.gather_buffer()  # None: nothing to fetch
        bases, self.owns = [], []
        for i, (p, dtype) in enumerate(zip(layout.params, dtypes)):
            base = collective.full_base(i, self.gathered)
            self.owns.append(base is None)
            bases.append(
                base if base is not None else torch.empty(p.shape, dtype=dtype, device=device)
            )
        self.params = [
            full_parameter(own_version_counter(base), p.tp_spec, p.requires_grad)
            for base, p in zip(bases, params)
        ]
        # the plain tensors the collectives fill: a TP parameter's local tensor
        self.locals = [local_of(full) for full in self.params]
        # refilling any of them must not look like an in-place change to autograd
        self.guarded = tuple(self.params) + tuple(
            local for local, full in zip(self.locals, self.params) if local is not full
        )
        self.pending: Pending | None = None
        self.unsharded = False
        self.free()

    def _owned(self) -> list[torch.Tensor]:
        """Full parameters (local tensors) with a storage of their own."""
        return [f for f, owns in zip(self.locals, self.owns) if owns]

    def free(self) -> None:
        for full in self._owned():
            free(full)
        if self.gathered is not None:
            free(self.gathered)

    def alloc_owned(self) -> list[torch.Tensor | None]:
        """Give the parameters that own memory their memory back; per parameter, the
        tensor to fill (None: it aliases a buffer)."""
        for full in self._owned():
            alloc(full)
        return [f if owns else None for f, owns in zip(self.locals, self.owns)]
