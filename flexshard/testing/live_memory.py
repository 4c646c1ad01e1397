"""Peak bytes of live tensors over one training step, and what they were at the peak.

RSS counts glibc's cached free memory and gloo's internal copies, so two libraries'
RSS can differ for reasons no tensor explains. ``LiveTensors`` counts what the
libraries themselves hold: every CPU tensor storage an ATen op produces (a
``TorchDispatchMode``), every storage resized through ``UntypedStorage.resize_`` (how
FSDP2 and flexshard allocate and free their all-gather buffers) and every storage
reachable from Python when it starts; a storage counts until it dies. At the running
peak it keeps which storages were alive, so that after the step each can be named:
sharded parameters, unsharded (gathered) parameters, sharded gradients, optimizer
state, or by the phase that allocated it (forward: activations; backward: unsharded
gradients, reduce-scatter buffers and temporaries). Memory only C++ touches (gloo's
buffers, the allocator's cache) is not seen; ``torch.distributed._tools.MemTracker``
does the same on GPU but names storages by module, not by what a library holds.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from ..torch_internals import TorchDispatchMode, tree_map_only

MB = 1024 * 1024


class _Entry:
    """One storage: its bytes now, what it is (a phase, or a name given later) and the
    watched set it counts in, if any."""

    __slots__ = ("nbytes", "category", "watched")

    def __init__(self, nbytes: int, category: str) -> None:
        self.nbytes = nbytes
        self.category = category
        self.watched: str | None = None


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    if tensor.device.type != "cpu" or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return None  # a wrapper subclass (DTensor) has no memory of its own
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _is_tensor(obj: object) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a weakref.proxy whose object died
        return False


class LiveTensors(TorchDispatchMode):
    """``with LiveTensors() as live:`` a step; ``live.phase = ...`` between its parts;
    ``live.name(tensors, what)`` for storages to be named; then ``live.peak_bytes`` and
    ``live.breakdown()`` (bytes per name at the peak). ``live.watch(tensors, what)``:
    storages whose own running peak is wanted (``watched_peaks[what]``), e.g. buffers
    that are resized in place all step long (all-gather outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> (entry, ref)
        self.phase = "before"
        self.current = 0
        self.peak_bytes = 0
        self.peak_phase = "before"
        self.phase_peaks: dict[str, int] = {}  # the largest bytes alive in each phase
        self._at_peak: list[tuple[_Entry, int]] = []
        self.watched_now: dict[str, int] = {}
        self.watched_peaks: dict[str, int] = {}
        self._resize = torch.UntypedStorage.resize_

    # ------------------------------------------------------------ tracking
    def _dead(self, entry: _Entry, _ref: weakref.ref) -> None:
        self.current -= entry.nbytes
        self._watched_change(entry, -entry.nbytes)
        entry.nbytes = 0

    def _watched_change(self, entry: _Entry, delta: int) -> None:
        if entry.watched is None or not delta:
            return
        now = self.watched_now[entry.watched] = self.watched_now[entry.watched] + delta
        if now > self.watched_peaks[entry.watched]:
            self.watched_peaks[entry.watched] = now

    def _track(self, storage: torch.UntypedStorage) -> None:
        found = self._entries.get(storage)
        size = storage.nbytes()
        if found is None:
            entry = _Entry(size, self.phase)
            self._entries[storage] = (entry, weakref.ref(storage, partial(self._dead, entry)))
            self.current += size
        else:
            entry = found[0]
            self.current += size - entry.nbytes
            self._watched_change(entry, size - entry.nbytes)
            entry.nbytes = size
        if self.current > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.current
        if self.current > self.peak_bytes:
            self.peak_bytes, self.peak_phase = self.current, self.phase
            self._at_peak = [(e, e.nbytes) for e, _ in self._entries.values() if e.nbytes]

    def _track_tensor(self, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if storage is not None:
            self._track(storage)

    def __enter__(self) -> LiveTensors:
        with warnings.catch_warnings():  # isinstance wakes deprecated lazy attributes
            warnings.simplefilter("ignore")
            existing = [o for o in gc.get_objects() if _is_tensor(o)]
        for tensor in existing:  # what exists already: parameters, optimizer state
            self._track_tensor(tensor)
        del existing
        tracker, resize = self, self._resize

        def tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            tracker._track(storage)
            return out

        torch.UntypedStorage.resize_ = tracked_resize  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let the subclass (DTensor) run its local ops
            # fake tensors (torch 2.11's DTensor propagates shapes on them): no memory
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track_tensor, out)
        return out

    # ------------------------------------------------------------ naming
    def name(self, tensors: Iterable[torch.Tensor | None], what: str) -> None:
        """Name the storages of ``tensors`` (alive now); later names win."""
        for tensor in tensors:
            storage = None if tensor is None else _storage(tensor)
            found = None if storage is None else self._entries.get(storage)
            if found is not None:
                found[0].category = what

    def watch(self, tensors: Iterable[torch.Tensor | None], what: str) -> None:
        """Count the storages of ``tensors`` (alive now, of any size, 0 included) in the
        set ``what``: its bytes alive now and its running peak from here on."""
        self.watched_now.setdefault(what, 0)
        for tensor in tensors:
            storage = None if tensor is None else _storage(tensor)
            if storage is None:
                continue
            self._track(storage)  # known from here on, if it was not yet
            entry = self._entries[storage][0]
            if entry.watched is None:
                entry.watched = what
                self.watched_now[what] += entry.nbytes
        peak = max(self.watched_peaks.get(what, 0), self.watched_now[what])
        self.watched_peaks[what] = peak

    def bytes_now(self) -> int:
        return self.current

    def breakdown(self) -> dict[str, int]:
        """Bytes alive at the peak, per name (or allocating phase)."""
        out: dict[str, int] = {}
        for entry, nbytes in self._at_peak:
            out[entry.category] = out.get(entry.category, 0) + nbytes
        return out
