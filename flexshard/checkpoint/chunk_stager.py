"""Staging for ``dcp.async_save``: a copy of a state dict that training may not touch.

torch's own stagers (``DefaultStager``, ``BlockingAsyncStager``) allocate every tensor
at its full shape and ``copy_`` into it, which a flexshard ``RegionTensor`` (a rank's
chunks of a parameter, not a tensor with values) refuses. ``ChunkStager`` is an
``AsyncStager`` that copies what DCP will write, in the form DCP reads it:

* a ``RegionTensor`` or region DTensor: its chunks, each copied, as a ``RegionTensor``
  (the same write items, the same bytes);
* a DTensor: its local tensor copied, under the same spec;
* any other tensor: copied; everything else (lr, step, betas): deep-copied.

With ``reuse`` the copies' buffers are allocated at the first save and refilled at the
next ones (torchtitan's ``async_with_pinned_mem`` keeps them too), pinned where CUDA can
pin; without it every save allocates afresh, as torch's default staging does.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ..runtime.dtensor.chunks import RegionTensor, chunks_of
from ..torch_internals import dtensor_spec, local_tensor


def can_pin() -> bool:
    """Page-locked host memory needs a CUDA runtime; a CPU-only torch has none."""
    return torch.cuda.is_available()


class ChunkStager(AsyncStager):
    """Stage synchronously (the caller's thread copies, then training may go on)."""

    _synchronize_after_execute = False  # nothing to wait for once stage() returns

    def __init__(self, reuse: bool, pin: bool = False) -> None:
        if pin and not can_pin():
            raise ValueError("pinned staging needs CUDA (torch.cuda.is_available() is False)")
        self.reuse = reuse
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}
        self.staged_bytes = 0  # of the last stage(): host memory the copy holds

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
        self.staged_bytes = 0
        return self._copy(state_dict, "")

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns when the copy is made."""

    def close(self) -> None:
        self._buffers.clear()

    # ---------------------------------------------------------------- copies
    def _copy(self, value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {k: self._copy(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, f"{key}.{i}") for i, v in enumerate(value)]
            return type(value)(items) if isinstance(value, tuple) else items
        if isinstance(value, RegionTensor) or hasattr(value, "_chunks"):
            chunks = chunks_of(value)
            pieces = [(box, self._tensor(t, f"{key}@{box}")) for box, t in chunks.pieces]
            cpu = torch.device("cpu")
            return RegionTensor(chunks.shape, pieces, chunks.writer, chunks.dtype, cpu, None)
        if isinstance(value, DTensor):
            local = self._tensor(local_tensor(value), key)
            return DTensor(local, dtensor_spec(value), requires_grad=False)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, key)
        return copy.deepcopy(value)

    def _tensor(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """A host copy of ``tensor`` (into the kept buffer for ``key`` when reusing)."""
        tensor = tensor.detach()
        self.staged_bytes += tensor.numel() * tensor.element_size()
        out = self._buffers.get(key) if self.reuse else None
        if out is None or out.shape != tensor.shape or out.dtype != tensor.dtype:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            if self.pin and out.numel():
                out = out.pin_memory()
            if self.reuse:
                self._buffers[key] = out
        out.copy_(tensor, non_blocking=False)
        return out
