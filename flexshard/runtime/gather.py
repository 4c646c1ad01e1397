"""How a bucket moves its parameters and gradients: the ``Collective`` protocol and the
built-in kinds (plain all-gather, bytes of a mixed-dtype bucket, replicated).

A bucket picks its collective once, when it is built (runtime/strategies.py), from
its placements' or quantization format's ``collective`` name; every all-gather and
gradient reduction then goes through that object, so the bucket never asks which
kind it is. A placement or format with its own wire format brings its own class.

A bucket's full parameters: what the modules use while unsharded, and the all-gather
buffer they are filled from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..placements.layout import BucketLayout
from ..placements.packing import copy_views, gathered_alias, pack_all, pack_rank
from .collectives import BucketComm, Pending
from .device import DeviceRuntime
from .dtensor.tensor_parallel import full_parameter, local_of
from .storage import BucketParam, BucketStorage, own_version_counter, storage_bytes


@runtime_checkable
class Collective(Protocol):
    """One bucket's parameter all-gather and gradient reduction. Built with the
    bucket's ``BucketStorage`` (its buffer, layouts and dtypes). An optional class
    attribute ``payload_uses_version = False`` says ``payload`` ignores its ``version``:
    the bucket then passes None and spares a sum over version counters per gather."""

    #: the storage keeps its dtype: ``module.to(dtype)`` on it raises (bytes, fp8 codes)
    fixed_dtype: bool

    def gather_buffer(self) -> torch.Tensor | None:
        """A fresh all-gather output (None: nothing to fetch, the storage is full)."""
        ...

    def full_base(self, index: int, gathered: torch.Tensor | None) -> torch.Tensor | None:
        """Full parameter ``index`` as a view of ``gathered`` or the storage (None: it
        gets a buffer of its own, filled by ``copy_out``)."""
        ...

    def payload(self, version: object, gathered: torch.Tensor | None) -> torch.Tensor:
        """What this rank sends in the all-gather; ``version`` changes whenever the
        storage may have (a collective may cache its encoding on it). ``gathered`` is
        the all-gather's output, allocated: a payload may be written into this rank's
        part of it (an in-place all-gather, as FSDP2 copies in)."""
        ...

    def all_gather(
        self, comm: BucketComm, out: torch.Tensor, local: torch.Tensor, prefetch: bool
    ) -> Pending:
        """Launch the all-gather of ``local`` (the payload) into ``out`` (the gathered
        buffer); ``prefetch``: forward's prefetch, left in flight on CPU too."""
        ...

    def copy_out(self, gathered: torch.Tensor | None, owned: list[torch.Tensor | None]) -> bool:
        """Fill the full parameters with a buffer of their own (``owned``, None for the
        others) from the landed all-gather; True: ``gathered`` may be freed now."""
        ...

    def gather_storage(self, comm: BucketComm) -> torch.Tensor:
        """Every rank's storage as ``[W, shard_numel]`` (a blocking collective; for
        state dicts, so always the full-precision storage)."""
        ...

    def launch_reduce(
        self,
        comm: BucketComm,
        layout: BucketLayout,
        grads: list[torch.Tensor | None],
        dtype: torch.dtype,
        op: dist.ReduceOp,
        runtime: DeviceRuntime,
    ) -> tuple[Pending, torch.Tensor]:
        """Start reducing the unsharded ``grads`` (laid out by ``layout``, in ``dtype``):
        the pending collective and the buffer this rank's reduced shard lands in."""
        ...


class ShardedCollective:
    """What every sharded kind shares: all-gather the storage for state dicts,
    reduce-scatter the gradients (copy-in on compute, as FSDP2; CUDA: the collective
    on the reduce-scatter stream, its input kept from reuse until that stream is past it)."""

    fixed_dtype = False
    payload_uses_version = False

    def __init__(self, store: BucketStorage) -> None:
        self.store = store
        #: the copy-out's foreach lists, kept while it fills the same tensors (they are
        #: freed and re-allocated in place, so views of them stay good)
        self._copy_out: tuple[tuple, tuple, bool, list[torch.Tensor], list[torch.Tensor]] | None = (
            None
        )

    def copy_out(self, gathered: torch.Tensor | None, owned: list[torch.Tensor | None]) -> bool:
        assert gathered is not None
        key = (gathered, *owned)
        ids = tuple(map(id, key))  # the cache holds ``key``: its ids stay its own
        cached = self._copy_out
        if cached is None or cached[1] != ids:
            # every parameter copied out: free the buffer then, as FSDP2 frees its
            # all-gather output, so an unsharded bucket costs one copy, not two
            frees = all(full is not None for full in owned)
            cached = self._copy_out = (key, ids, frees, *self._views(gathered, owned))
        _, _, frees, dsts, srcs = cached
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return frees

    def _views(
        self, gathered: torch.Tensor, owned: list[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The copy-out's destinations and sources (foreach lists)."""
        raise NotImplementedError

    def all_gather(
        self, comm: BucketComm, out: torch.Tensor, local: torch.Tensor, prefetch: bool
    ) -> Pending:
        return comm.all_gather(out, local, prefetch)

    def gather_storage(self, comm: BucketComm) -> torch.Tensor:
        store, layout = self.store, self.store.storage_layout
        gathered = torch.empty(
            layout.world_size, layout.shard_numel, dtype=store.dtype, device=store.buffer.device
        )
        comm.all_gather(gathered.view(-1), store.buffer).wait()
        return gathered

    def launch_reduce(
        self,
        comm: BucketComm,
        layout: BucketLayout,
        grads: list[torch.Tensor | None],
        dtype: torch.dtype,
        op: dist.ReduceOp,
        runtime: DeviceRuntime,
    ) -> tuple[Pending, torch.Tensor]:
        device = self.store.buffer.device
        stream = runtime.reduce_scatter_stream
        full = torch.empty(layout.world_size, layout.shard_numel, dtype=dtype, device=device)
        pack_all(layout, grads, full)
        runtime.protect(full, stream)
        with runtime.on(stream):
            out = torch.empty(layout.shard_numel, dtype=dtype, device=device)
            # the pending collective keeps ``full`` until it completed (gloo: at once)
            return comm.reduce_scatter(out, full.view(-1), op), out


class PlainGather(ShardedCollective):
    """Sharded parameters of one dtype: all-gather the storage (cast to the policy's
    ``param_dtype``). When every full parameter's pieces sit in order in the gathered
    buffer, the parameters are views of it; otherwise all are copied out and the
    buffer freed, as FSDP2 does: a buffer kept for some views would be held whole (its
    padding too) beside the others' copies."""

    def __init__(self, store: BucketStorage) -> None:
        super().__init__(store)
        layout = store.storage_layout
        probe = torch.empty(layout.world_size, layout.shard_numel, device="meta")
        # several compute dtypes (param_dtype_override_fn): each copied out in its own
        self.aliases = len(set(store.full_dtypes)) == 1 and all(
            param.numel == 0 or gathered_alias(layout, i, probe) is not None
            for i, param in enumerate(layout.params)
        )

    def gather_buffer(self) -> torch.Tensor | None:
        store, layout = self.store, self.store.storage_layout
        return torch.empty(
            layout.world_size * layout.shard_numel,
            dtype=store.param_dtype,
            device=store.buffer.device,
        )

    def full_base(self, index: int, gathered: torch.Tensor | None) -> torch.Tensor | None:
        layout = self.store.storage_layout
        assert gathered is not None
        if not self.aliases:
            return None
        return gathered_alias(layout, index, gathered.view(layout.world_size, layout.shard_numel))

    def payload(self, version: object, gathered: torch.Tensor | None) -> torch.Tensor:
        store = self.store
        if store.param_dtype == store.dtype:
            return store.buffer
        assert gathered is not None  # cast into this rank's part: no buffer of its own
        shard = store.storage_layout.shard_numel
        send = gathered[store.rank * shard : (store.rank + 1) * shard]
        send.copy_(store.buffer)
        return send

    def _views(
        self, gathered: torch.Tensor, owned: list[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        layout = self.store.storage_layout
        gathered_2d = gathered.view(layout.world_size, layout.shard_numel)
        units = self.store.as_units(owned)
        ranks = range(layout.world_size)
        dsts, srcs, strided = copy_views(layout, units, gathered_2d, ranks, into_storage=False)
        assert not strided  # full parameters are made contiguous (FullParams)
        return dsts, srcs


class BytesGather(PlainGather):
    """A bucket of mixed dtypes: the storage is bytes (no cast: ``flex_shard`` refuses
    a ``param_dtype`` for it), each parameter decodes its own bytes."""

    fixed_dtype = True

    def full_base(self, index: int, gathered: torch.Tensor | None) -> torch.Tensor | None:
        return None


class RaggedGather(ShardedCollective):
    """A ragged bucket (``BucketSpec(ragged=True)``): each rank stores only its own
    extent and the collectives move per-rank sizes (collectives.py, [Note: collectives
    of per-rank sizes]), so the gathered buffer is the bucket's parameters back to back
    with no padding. When every parameter's pieces sit there in order (whole Owned
    matrices, flat ranges) the parameters are views of it; otherwise all are copied out
    and the buffer freed, as ``PlainGather`` does."""

    def __init__(self, store: BucketStorage) -> None:
        super().__init__(store)
        layout = store.storage_layout
        probe = torch.empty(layout.wire_numel, device="meta")
        self.aliases = len(set(store.full_dtypes)) == 1 and all(
            param.numel == 0 or gathered_alias(layout, i, probe) is not None
            for i, param in enumerate(layout.params)
        )

    def gather_buffer(self) -> torch.Tensor | None:
        store = self.store
        return torch.empty(
            store.storage_layout.wire_numel, dtype=store.param_dtype, device=store.buffer.device
        )

    def full_base(self, index: int, gathered: torch.Tensor | None) -> torch.Tensor | None:
        assert gathered is not None
        if not self.aliases:
            return None
        return gathered_alias(self.store.storage_layout, index, gathered)

    def payload(self, version: object, gathered: torch.Tensor | None) -> torch.Tensor:
        store = self.store
        if store.param_dtype == store.dtype:
            return store.buffer
        assert gathered is not None  # cast into this rank's part: no buffer of its own
        layout = store.storage_layout
        start = layout.rank_starts[store.rank]
        send = gathered[start : start + layout.extent(store.rank)]
        send.copy_(store.buffer)
        return send

    def all_gather(
        self, comm: BucketComm, out: torch.Tensor, local: torch.Tensor, prefetch: bool
    ) -> Pending:
        layout = self.store.storage_layout
        return comm.all_gather_ragged(out, local, layout.extents, prefetch)

    def _views(
        self, gathered: torch.Tensor, owned: list[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        units = self.store.as_units(owned)
        return ragged_views(self.store.storage_layout, units, gathered, False)

    def gather_storage(self, comm: BucketComm) -> torch.Tensor:
        store, layout = self.store, self.store.storage_layout
        device = store.buffer.device
        wire = torch.empty(layout.wire_numel, dtype=store.dtype, device=device)
        comm.all_gather_ragged(wire, store.buffer, layout.extents).wait()
        padded = torch.zeros(
            layout.world_size, layout.shard_numel, dtype=store.dtype, device=device
        )
        for rank, (start, extent) in enumerate(zip(layout.rank_starts, layout.extents)):
            padded[rank, :extent] = wire[start : start + extent]
        return padded

    def launch_reduce(
        self,
        comm: BucketComm,
        layout: BucketLayout,
        grads: list[torch.Tensor | None],
        dtype: torch.dtype,
        op: dist.ReduceOp,
        runtime: DeviceRuntime,
    ) -> tuple[Pending, torch.Tensor]:
        device = self.store.buffer.device
        stream = runtime.reduce_scatter_stream
        full = torch.zeros(layout.wire_numel, dtype=dtype, device=device)
        dsts, srcs = ragged_views(layout, grads, full, True)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        runtime.protect(full, stream)
        with runtime.on(stream):
            out = torch.empty(layout.extent(self.store.rank), dtype=dtype, device=device)
            return comm.reduce_scatter_ragged(out, full, layout.extents, op), out


def _rank_rows(layout: BucketLayout, wire: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's storage in a ragged wire buffer, as a one-row 2-D view."""
    return [
        wire[start : start + layout.extent(rank)].view(1, -1)
        for rank, start in enumerate(layout.rank_starts)
    ]


def ragged_views(
    layout: BucketLayout,
    fulls: Sequence[torch.Tensor | None],
    wire: torch.Tensor,
    into_wire: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destinations, sources) of one foreach copy between the full tensors
    (contiguous; None: skipped) and a ragged wire buffer, in either direction."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for rank, row in enumerate(_rank_rows(layout, wire)):
        d, s, strided = copy_views(layout, fulls, row, range(rank, rank + 1), into_wire)
        assert not strided  # full parameters and gradients are contiguous here
        dsts += d
        srcs += s
    return dsts, srcs


class ReplicatedGather:
    """Replicate (DDP): every rank stores everything, so there is nothing to gather;
    gradients are all-reduced."""

    fixed_dtype = False
    payload_uses_version = False

    def __init__(self, store: BucketStorage) -> None:
        self.store = store

    def gather_buffer(self) -> torch.Tensor | None:
        return None

    def full_base(self, index: int, gathered: torch.Tensor | None) -> torch.Tensor | None:
        store = self.store  # without a cast the storage already is the full bucket
        return store.view(index) if store.full_dtypes[index] == store.dtype else None

    def payload(self, version: object, gathered: torch.Tensor | None) -> torch.Tensor:
        return self.store.buffer

    def all_gather(
        self, comm: BucketComm, out: torch.Tensor, local: torch.Tensor, prefetch: bool
    ) -> Pending:
        raise AssertionError("a replicated bucket gathers nothing (gather_buffer is None)")

    def copy_out(self, gathered: torch.Tensor | None, owned: list[torch.Tensor | None]) -> bool:
        for i, full in enumerate(owned):  # with a cast: each parameter from the storage
            if full is not None:
                full.copy_(self.store.view(i).view(full.shape))
        return False

    def gather_storage(self, comm: BucketComm) -> torch.Tensor:
        layout = self.store.storage_layout
        return self.store.buffer.view(1, -1).expand(layout.world_size, -1)

    def launch_reduce(
        self,
        comm: BucketComm,
        layout: BucketLayout,
        grads: list[torch.Tensor | None],
        dtype: torch.dtype,
        op: dist.ReduceOp,
        runtime: DeviceRuntime,
    ) -> tuple[Pending, torch.Tensor]:
        stream = runtime.reduce_scatter_stream
        out = torch.zeros(layout.shard_numel, dtype=dtype, device=self.store.buffer.device)
        pack_rank(layout, self.store.rank, grads, out)
        runtime.protect(out, stream)
        with runtime.on(stream):
            return comm.all_reduce(out, op=op), out


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
        # the buffers freed at every reshard and re-allocated at every gather: their
        # storages and the bytes they need, looked up once
        owned = [f for f, owns in zip(self.locals, self.owns) if owns]
        self._owned_storages = [(f.untyped_storage(), storage_bytes(f)) for f in owned]
        if self.gathered is not None:
            self._gathered_storage = self.gathered.untyped_storage()
            self._gathered_bytes = storage_bytes(self.gathered)
        self._to_fill = [f if owns else None for f, owns in zip(self.locals, self.owns)]
        self.free()

    def free(self) -> None:
        for storage, _ in self._owned_storages:
            if storage.nbytes() != 0:
                storage.resize_(0)
        if self.gathered is not None and self._gathered_storage.nbytes() != 0:
            self._gathered_storage.resize_(0)

    def alloc_gathered(self) -> None:
        """Give the all-gather output its memory back (contents undefined)."""
        assert self.gathered is not None
        if self._gathered_storage.nbytes() < self._gathered_bytes:
            self._gathered_storage.resize_(self._gathered_bytes)

    def alloc_owned(self) -> list[torch.Tensor | None]:
        """Give the parameters that own memory their memory back; per parameter, the
        tensor to fill (None: it aliases a buffer)."""
        for storage, nbytes in self._owned_storages:
            if storage.nbytes() < nbytes:
                storage.resize_(nbytes)
        return self._to_fill
