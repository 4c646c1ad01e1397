"""A bucket: one flat storage buffer per rank, parameters as views into it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.profiler import record_function

from ..placements import BucketLayout, Placement, Shard, gathered_alias, pack_all, pack_rank, unpack
from ..placements.bytes import as_bytes, byte_view
from ..placements.layout import trainable_layout
from ..quant import QuantFormat
from .collectives import BucketComm, Pending
from .device import DeviceRuntime, device_runtime
from .grad_check import nonfinite_codes
from .quantized import QuantizedGather, optimizer_steps
from .region_dtensor import wrap
from .sharded_param import sharded_spec
from .tp_params import full_parameter, local_grad, local_of


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


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if storage.size() < needed:
        storage.resize_(needed)


def _own_version_counter(view: torch.Tensor) -> torch.Tensor:
    """A tensor on the same memory as ``view`` but with a version counter of its own:
    the collective writing the shared buffer (on gloo's thread, whenever it lands)
    must not look to autograd like an in-place change of a saved parameter."""
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    alias.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    return alias


def slot_of(param: torch.Tensor) -> tuple[Bucket, int] | None:
    """The bucket holding local parameter ``param`` and its index there (None: not a
    flexshard local shard). ``bucket.layout.params[index].regions[rank]`` says which
    part of the full parameter each rank stores."""
    return getattr(param, "_flexshard_slot", None)


class Bucket:
    """Holds this rank's shard of a group of parameters and moves it.

    Life cycle per step: ``unshard`` (all-gather, then full parameters are set on the
    modules) -> forward -> ``reshard`` (full storage freed) -> ``unshard`` in backward ->
    gradients land on the full parameters -> ``launch_reduce`` (reduce-scatter, async)
    -> ``finish_reduce`` (gradient shards land on the local parameters' ``.grad``).
    """

    def __init__(
        self,
        name: str,
        layout: BucketLayout,
        params: list[BucketParam],
        initial: list[torch.Tensor],
        comm: BucketComm,
        rank: int,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | None,
        quant: QuantFormat | None = None,
        mesh: DeviceMesh | None = None,
    ) -> None:
        self.name = name
        self.mesh = mesh
        self.layout = layout
        self.params = params
        self.comm = comm
        self.rank = rank
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True  # False: stay gathered for the next microbatch
        self.requires_grad_sync = True
        # FSDPModule's setters (runtime/module.py) tune these
        self.forward_prefetch: list[Bucket] | None = None  # None: the recorded order
        self.backward_prefetch: list[Bucket] | None = None
        self.unshard_in_backward = True
        self.requires_all_reduce = True  # HSDP: False skips the all-reduce over replicas
        self._skipped_all_reduce = False  # the gradients hold unreduced replica sums
        self.divide_factor: float | None = None  # None: average over the dp ranks
        self.force_sum = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.post_optim_event: Any = None  # set_post_optim_event: the next gather waits on it
        # opt-in: each backward records which unsharded gradients hold a NaN or an inf
        self.check_finite = False
        self.nonfinite = [0] * len(params)
        # ``initial`` are the unsharded parameters: copy this rank's regions, keep no reference
        first = initial[0]
        self.dtypes = [t.dtype for t in initial]
        # parameters of several dtypes share one uint8 storage, each region as its bytes
        self.packed = len(set(self.dtypes)) > 1
        self.storage_layout = layout
        if self.packed:
            self.storage_layout = as_bytes(layout, [t.element_size() for t in initial])
        self.dtype = torch.uint8 if self.packed else first.dtype  # the storage's
        # frozen parameters are left out of the reduce-scatter, as FSDP2 leaves them
        self.grad_layout = layout
        if not all(p.requires_grad for p in params):
            self.grad_layout = trainable_layout(
                layout,
                [p.requires_grad for p in params],
                [p.placement.uniform_slots for p in params],
            )
        self.param_dtype = mp_policy.param_dtype or self.dtype
        self.full_dtypes = [mp_policy.param_dtype or d for d in self.dtypes]
        widest = functools.reduce(torch.promote_types, self.dtypes)
        self.reduce_dtype = mp_policy.reduce_dtype or mp_policy.param_dtype or widest
        self.storage = torch.zeros(
            self.storage_layout.shard_numel, dtype=self.dtype, device=first.device
        )
        # a quantized bucket all-gathers each rank's fp8 tiles and scales as bytes
        self.quant = QuantizedGather(layout, quant, rank) if quant is not None else None
        self.unsharded = False
        self._gather: Pending | None = None
        if first.device.type != "meta":
            self.load_full(initial)
        self._reduce: tuple[Pending, torch.Tensor] | None = None  # and its output
        self._accumulated: list[torch.Tensor | None] = [None] * len(params)
        self.step_state: Any = None  # the StepState shared with the model's other buckets
        self.ready = False  # this backward's gradients are complete
        self.reset_step_counts()
        self._build_params()

    def reset_step_counts(self) -> None:
        """Forward and backward calls of the bucket's hook modules in this step."""
        self.forwards_started = self.forwards_wrapped = 0
        self.forwards_done = self.backwards_done = 0

    def rename(self, name: str) -> None:
        self.name = name
        self.comm.bucket = name

    def runtime(self) -> DeviceRuntime:
        """Streams and events for this bucket's storage (no-ops on CPU and gloo)."""
        return device_runtime(self.storage.device, self.comm.shard_group)

    def _span(self, what: str) -> record_function:
        """A profiler span naming the bucket (``flexshard::all_gather[layers.3]``)."""
        return record_function(f"flexshard::{what}[{self.name}]")

    # ---------------------------------------------------------------- layout
    def _storage_view(self, storage: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's part of parameter ``index`` in a storage-shaped buffer."""
        param = self.storage_layout.params[index]
        offset = param.offsets[self.rank]
        piece = storage[offset : offset + param.local_numel(self.rank)]
        if self.packed:
            piece = piece.view(self.dtypes[index])
        return piece.view(self.layout.params[index].local_shape(self.rank))

    def _grad_view(self, reduced: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's part of parameter ``index`` in a reduced gradient (elements)."""
        param = self.grad_layout.params[index]
        offset = param.offsets[self.rank]
        return reduced[offset : offset + param.local_numel(self.rank)].view(
            param.local_shape(self.rank)
        )

    def _as_storage_units(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Full tensors as ``pack``/``unpack`` on the storage layout read them."""
        if not self.packed:
            return tensors
        return [None if t is None else byte_view(t.contiguous()) for t in tensors]

    def load_full(self, fulls: list[torch.Tensor | None]) -> None:
        """Copy this rank's regions of full parameters (None: keep) into the storage."""
        with torch.no_grad():
            pack_rank(self.storage_layout, self.rank, self._as_storage_units(fulls), self.storage)
        if self.unsharded:
            self.reshard()  # the gathered copy is stale now

    def gather_full(self) -> list[torch.Tensor]:
        """Every parameter of the bucket in full, in its own dtype (a collective)."""
        layout = self.storage_layout
        device = self.storage.device
        fulls = [
            torch.empty(p.shape, dtype=d, device=device)
            for p, d in zip(self.layout.params, self.dtypes)
        ]
        if layout.replicated:
            gathered = self.storage.view(1, -1).expand(layout.world_size, -1)
        else:
            gathered = torch.empty(
                layout.world_size, layout.shard_numel, dtype=self.dtype, device=device
            )
            self.comm.all_gather(gathered.view(-1), self.storage).wait()
        unpack(layout, gathered, self._as_storage_units(fulls))
        return fulls

    def _build_params(self) -> None:
        """Local parameters (views of the storage, what the optimizer sees) and the full
        ones; both are (re)made whenever the storage is."""
        self.specs = [
            sharded_spec(self.mesh, p.placement, layout, dtype, p.tp_spec)
            for p, layout, dtype in zip(self.params, self.layout.params, self.dtypes)
        ]
        self.local_params = [
            nn.Parameter(wrap(self._storage_view(self.storage, i), spec), p.requires_grad)
            for i, (p, spec) in enumerate(zip(self.params, self.specs))
        ]
        for i, local in enumerate(self.local_params):
            local._flexshard_slot = (self, i)  # type: ignore[attr-defined]
        self._build_full_params()
        self._set_on_modules(self.local_params)

    def local_tensor(self, index: int) -> torch.Tensor:
        """This rank's part of parameter ``index``: a view of the storage."""
        return self._storage_view(self.storage, index)

    def local_grad(self, index: int) -> torch.Tensor | None:
        """The local tensor of the sharded parameter's gradient, if it has one."""
        grad = self.local_params[index].grad
        return None if grad is None else local_of(grad)

    def adopt(self, assigned: dict[int, nn.Parameter]) -> None:
        """Make the parameters ``load_state_dict(assign=True)`` put on the modules (by
        index) the sharded ones: their values go into the storage and their local
        tensors become views of it again, as FSDP2 re-adopts assigned parameters."""
        locals_ = {i: local_of(param) for i, param in assigned.items()}
        if self.storage.is_meta and any(not t.is_meta for t in locals_.values()):
            device = next(t.device for t in locals_.values() if not t.is_meta)
            self.storage = torch.zeros_like(self.storage, device=device)  # meta-built: now real
            self._build_params()
        for i, param in assigned.items():
            view, local = self._storage_view(self.storage, i), locals_[i]
            if tuple(local.shape) != tuple(view.shape):
                raise ValueError(
                    f"bucket '{self.name}': parameter '{self.params[i].fqn}' was assigned a local "
                    f"tensor of shape {tuple(local.shape)}; this rank stores {tuple(view.shape)}"
                )
            if not local.is_meta:
                with torch.no_grad():
                    view.copy_(local)
            param._local_tensor = view  # type: ignore[attr-defined]
            param._flexshard_slot = (self, i)  # type: ignore[attr-defined]
            self.local_params[i] = param
        self._set_on_modules(self.local_params)

    def _build_full_params(self) -> None:
        """Full-size parameters the modules use while unsharded. Their storage is freed
        when resharded but the objects live on, so autograd's saved references to
        them stay valid across the backward re-gather."""
        device = self.storage.device
        layout = self.storage_layout
        self.gathered = None
        if self.quant is not None:
            self.gathered = torch.empty(
                layout.world_size * self.quant.nbytes, dtype=torch.uint8, device=device
            )
        elif not layout.replicated:
            self.gathered = torch.empty(
                layout.world_size * layout.shard_numel, dtype=self.param_dtype, device=device
            )
        bases, self._owns_storage = [], []
        for i, (p, dtype) in enumerate(zip(self.layout.params, self.full_dtypes)):
            if layout.replicated:  # without a cast the storage already is the full bucket
                base = (
                    self._storage_view(self.storage, i) if self.param_dtype == self.dtype else None
                )
            elif self.packed or self.quant is not None:
                base = None  # the gathered buffer is bytes: each parameter decodes its own
            else:
                gathered_2d = self.gathered.view(layout.world_size, layout.shard_numel)
                base = gathered_alias(layout, i, gathered_2d)
            self._owns_storage.append(base is None)
            bases.append(
                base if base is not None else torch.empty(p.shape, dtype=dtype, device=device)
            )
        self.full_params = [
            full_parameter(_own_version_counter(base), p.tp_spec, p.requires_grad)
            for base, p in zip(bases, self.params)
        ]
        # the plain tensors the collectives fill: a TP parameter's local tensor
        self.full_locals = [local_of(full) for full in self.full_params]
        # refilling any of them must not look like an in-place change to autograd
        self._version_guarded = tuple(self.full_params) + tuple(
            local for local, full in zip(self.full_locals, self.full_params) if local is not full
        )
        self._free_full()

    def rebind_storage(self, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Move or cast the storage (``module.to_empty``, ``.to(device)``,
        ``.to(dtype)``) and re-point the local params, as FSDP2 allows after sharding."""
        storage = convert(self.storage)
        if storage.dtype != self.dtype:
            if self.packed or self.quant is not None:
                raise TypeError(
                    f"bucket '{self.name}' packs several dtypes or gathers quantized; it keeps "
                    f"its parameters in {self.dtype} (cast with mp_policy instead)"
                )
            self.dtypes = [storage.dtype] * len(self.dtypes)
            self.dtype = storage.dtype
            policy = self.mp_policy
            self.param_dtype = policy.param_dtype or self.dtype
            self.full_dtypes = [policy.param_dtype or self.dtype] * len(self.dtypes)
            self.reduce_dtype = policy.reduce_dtype or policy.param_dtype or self.dtype
        self.storage = storage
        self._build_params()

    def _set_on_modules(self, tensors: list[nn.Parameter]) -> None:
        for param, tensor in zip(self.params, tensors):
            for module, attr in param.locations:
                module._parameters[attr] = tensor

    def _owned_full(self) -> list[torch.Tensor]:
        """Full parameters (local tensors) with a storage of their own (not views of
        another buffer)."""
        return [f for f, owns in zip(self.full_locals, self._owns_storage) if owns]

    def _free_full(self) -> None:
        for full in self._owned_full():
            _free(full)
        if self.gathered is not None:
            _free(self.gathered)

    # ---------------------------------------------------------------- unshard
    @property
    def gather_in_flight(self) -> bool:
        """An all-gather was launched and has not landed yet."""
        return self._gather is not None

    def unshard(self, async_op: bool = False) -> None:
        if self.unsharded:
            return
        if self._gather is None:
            self._launch_gather()
        if not async_op:
            self._finish_gather()

    def _launch_gather(self) -> None:
        if self.gathered is None:  # replicated: nothing to fetch
            self._gather = Pending(None, "all-gather", self.name, self.comm.timeout)
            return
        runtime = self.runtime()
        # CUDA: copy-in and collective on the all-gather stream, after it waited on
        # compute (the optimizer's writes; reads of the buffer it may reuse)
        with self._span("all_gather"), runtime.on(runtime.all_gather_stream):
            runtime.wait(self.post_optim_event)
            self.post_optim_event = None
            _alloc(self.gathered)
            if self.quant is not None:
                send = self.quant.encode(self.storage, self._data_version())
            elif self.param_dtype == self.dtype:
                send = self.storage
            else:
                send = self.storage.to(self.param_dtype)
            with torch.autograd._unsafe_preserve_version_counter(self._version_guarded):
                self._gather = self.comm.all_gather(self.gathered, send)  # keeps ``send``

    def _finish_gather(self) -> None:
        assert self._gather is not None
        layout = self.storage_layout
        # the parameters are saved for backward: refilling them must not look like an
        # in-place change to autograd (completing the gather bumps the version too).
        # A failed wait leaves ``_gather`` set: it raises again, and the buffer gloo may
        # still write into is never freed or read
        with (
            self._span("all_gather_copy_out"),
            torch.no_grad(),
            torch.autograd._unsafe_preserve_version_counter(self._version_guarded),
        ):
            self._gather.wait()  # CUDA: compute waits on the gather's event, the CPU not
            self._gather = None
            owned = [f if owns else None for f, owns in zip(self.full_locals, self._owns_storage)]
            for full in self._owned_full():
                _alloc(full)
            if self.quant is not None:
                self.quant.decode(self.gathered.view(layout.world_size, -1), owned)
            elif self.gathered is not None:
                gathered_2d = self.gathered.view(layout.world_size, layout.shard_numel)
                unpack(layout, gathered_2d, self._as_storage_units(owned))
                if all(self._owns_storage):
                    # every parameter was copied out: free the buffer now, as FSDP2 frees
                    # its all-gather output, so an unsharded bucket costs one copy, not two
                    self.runtime().release(self.gathered)
            else:  # replicated with a cast
                for i, full in enumerate(owned):
                    if full is not None:
                        full.copy_(self._storage_view(self.storage, i).view(full.shape))
        self._set_on_modules(self.full_params)
        self.unsharded = True

    def _data_version(self) -> tuple[int, int, int]:
        """Changes whenever the storage may have: a direct write bumps its version
        counter, an op on a DTensor parameter bumps the parameter's (not the storage's),
        and a foreach op neither, so every optimizer step counts too."""
        params = sum(p._version for p in self.local_params)
        return (self.storage._version, params, optimizer_steps())

    def quantized_params(self) -> dict[str, Any]:
        """While unsharded, a quantized bucket's parameters as QuantizedTensors (fp8
        data and scales), for FP8 GEMMs that read them instead of the dequantized copy."""
        if self.quant is None or not self.unsharded:
            raise RuntimeError(f"bucket '{self.name}' is not quantized or not unsharded")
        gathered = self.gathered.view(self.layout.world_size, -1)
        return {p.fqn: self.quant.quantized(gathered, i) for i, p in enumerate(self.params)}

    def reshard(self) -> None:
        if self._gather is not None:  # a prefetch nobody used: let it land first
            self._finish_gather()
        if not self.unsharded:
            return
        self._set_on_modules(self.local_params)
        self._free_full()
        self.unsharded = False

    # ---------------------------------------------------------------- gradients
    def _take_grads(self) -> list[torch.Tensor | None]:
        """Unsharded gradients of this backward plus those held back by no-sync steps."""
        grads = []
        for i, (full, param) in enumerate(zip(self.full_params, self.params)):
            grad, full.grad = local_grad(full.grad, param.tp_spec), None
            held = self._accumulated[i]
            self._accumulated[i] = None
            if held is not None and grad is not None:
                held += grad
            grads.append(held if held is not None else grad)
        return grads

    def hold_grads(self) -> None:
        """Gradient sync is off: keep the unsharded gradients, in ``reduce_dtype``."""
        grads = self._take_grads()
        if self.check_finite:
            self.nonfinite = nonfinite_codes(grads)
        for i, grad in enumerate(grads):
            if grad is not None and grad.dtype != self.reduce_dtype:
                grad = grad.to(self.reduce_dtype)
            self._accumulated[i] = grad

    def launch_reduce(self) -> None:
        with self._span("reduce_scatter"):
            self._launch_reduce()

    def _launch_reduce(self) -> None:
        layout = self.grad_layout
        grads = self._take_grads()
        if self.check_finite:
            self.nonfinite = nonfinite_codes(grads)
        if layout.shard_numel == 0:  # every parameter frozen: nothing to reduce
            return
        device = self.storage.device
        runtime = self.runtime()
        stream = runtime.reduce_scatter_stream
        # copy-in on compute, as FSDP2; CUDA: the collective on the reduce-scatter
        # stream after it waited on compute (the end of this bucket's backward), the
        # compute-made input kept from reuse until that stream is past it
        if layout.replicated:
            out = torch.zeros(layout.shard_numel, dtype=self.reduce_dtype, device=device)
            pack_rank(layout, self.rank, grads, out)
            runtime.protect(out, stream)
            with runtime.on(stream):
                self._reduce = (self.comm.all_reduce(out, op=self._op), out)
            return
        full = torch.empty(
            layout.world_size, layout.shard_numel, dtype=self.reduce_dtype, device=device
        )
        pack_all(layout, grads, full)
        runtime.protect(full, stream)
        with runtime.on(stream):
            out = torch.empty(layout.shard_numel, dtype=self.reduce_dtype, device=device)
            # the pending collective keeps ``full`` until it completed (gloo: at once)
            self._reduce = (self.comm.reduce_scatter(out, full.view(-1), self._op), out)

    @property
    def _op(self) -> dist.ReduceOp:
        """SUM when the division is done afterwards (a divide factor, forced sums)."""
        summed = self.divide_factor is not None or self.force_sum
        return dist.ReduceOp.SUM if summed else dist.ReduceOp.AVG

    def _divide(self, out: torch.Tensor) -> None:
        if self._op == dist.ReduceOp.SUM:
            replicas = self.comm.replicate_group
            size = self.layout.world_size * (dist.get_world_size(replicas) if replicas else 1)
            out.div_(self.divide_factor or size)

    def finish_reduce(self) -> None:
        """Land the reduced gradient shards on ``.grad``. CUDA: on the reduce-scatter
        stream; compute joins that stream at the end of backward (``join_reductions``)."""
        if self._reduce is None:
            return
        runtime = self.runtime()
        with self._span("grad_copy"), runtime.on(runtime.reduce_scatter_stream):
            self._finish_reduce()

    def join_reductions(self) -> None:
        """Compute waits on every gradient copy queued so far (no-op on CPU)."""
        runtime = self.runtime()
        runtime.join(runtime.reduce_scatter_stream)

    def _finish_reduce(self) -> None:
        assert self._reduce is not None
        pending, out = self._reduce
        self._reduce = None
        pending.wait()
        replicas = self.comm.replicate_group is not None
        if replicas and self.requires_all_reduce and not self._skipped_all_reduce:
            self.comm.all_reduce(out, replicas=True, op=self._op).wait()
        self._divide(out)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(out)
        if not self.packed and out.dtype != self.dtype:
            out = out.to(self.dtype)  # one cast; the gradients stay views of one buffer
        for i, local in enumerate(self.local_params):
            if not local.requires_grad:
                continue
            grad = self._grad_view(out, i)
            if grad.dtype != local.dtype:
                grad = grad.to(local.dtype)
            if local.grad is None:
                local.grad = wrap(grad, self.specs[i])
            else:
                local_of(local.grad).add_(grad)
        if replicas and self.requires_all_reduce and self._skipped_all_reduce:
            self._all_reduce_accumulated()
        self._skipped_all_reduce = replicas and not self.requires_all_reduce

    def _all_reduce_accumulated(self) -> None:
        """HSDP after steps without the replica all-reduce: average the whole
        accumulated gradient over the replicas (one all-reduce per parameter)."""
        op = dist.ReduceOp.SUM if self._op == dist.ReduceOp.SUM else dist.ReduceOp.AVG
        for i in range(len(self.params)):
            grad = self.local_grad(i)
            if grad is not None and grad.numel():
                self.comm.all_reduce(grad, replicas=True, op=op).wait()
