"""A bucket: one flat storage buffer per rank, parameters as views into it.

The parts live in files of their own, as FSDP2 splits parameter, group and comm
context: ``storage.py`` (the buffer, its layouts and dtypes), ``gather.py`` and
``strategies.py`` (the collective, chosen once per bucket, and the full parameters),
``reduce.py`` (held gradients and the gradient reduction), and the scheduling state
below. The bucket ties them together and owns the local and full parameters.

A bucket's scheduling state: the FSDP2 options that say when it gathers, reshards
and reduces, and this step's counts of its hook modules' forward and backward calls
(runtime/hooks.py reads and writes them).

The hooks driving them (runtime/hooks.py) import this module, so the buckets and the
StepState stored here are typed ``Any`` rather than named by an import back up
(tests/project/test_import_cycles.py)."""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.profiler import record_function

from ..placements.layout import BucketLayout
from ..placements.packing import unpack
from ..quant import QuantFormat, QuantizedTensor
from ..torch_internals import (
    dtensor_spec,
    grad_dtype_override,
    profiler_enabled,
    set_grad_mode,
    set_local_tensor,
    set_versions,
    versions_of,
)
from .collectives import BucketComm, Pending
from .device import HOST, DeviceRuntime, device_runtime
from .dtensor.region_dtensor import wrap
from .dtensor.sharded_spec import sharded_spec
from .dtensor.tensor_parallel import local_of, only_dp_dims
from .gather import FullParams
from .quantized import QuantizedGather, optimizer_steps
from .reduce import GradAccumulator, GradReduction
from .storage import BucketParam, BucketStorage
from .strategies import choose_collective


class BucketSchedule:
    """When a bucket moves; set by ``flex_shard`` and FlexShardModule's setters."""

    def __init__(self, reshard_after_forward: bool | None) -> None:
        self.reshard_after_forward = reshard_after_forward  # None: all but the root
        self.reshard_after_backward = True  # False: stay gathered for the next microbatch
        self.requires_grad_sync = True  # False: hold the gradients (accumulation)
        self.unshard_in_backward = True
        # Buckets to unshard next; None: the recorded order
        self.forward_prefetch: list[Any] | None = None
        self.backward_prefetch: list[Any] | None = None
        self.post_optim_event: Any = None  # the next all-gather waits on it, then drops it
        # reductions (and their input buffers) in flight after this bucket's launch;
        # None: hooks.MAX_PENDING_REDUCTIONS (set_reduce_scatter_max_input_buffers)
        self.reductions_in_flight: int | None = None


class ForwardCall:
    """One forward call with grad of a bucket's module, until its backward has run."""

    __slots__ = ("in_order", "module", "whole", "began", "reported", "__weakref__")

    def __init__(self, in_order: bool, module: int) -> None:
        # made inside the root's forward: it follows the recorded order, and so does
        # its backward's prefetch
        self.in_order = in_order
        self.module = module  # which of the bucket's hook modules ran it
        # FSDP2 hooks its output (so its backward ends with FSDP2's final callback): a
        # call inside the root's forward, or one that completes its bucket's modules'
        # forward (set after it; a single module's call always does)
        self.whole = in_order
        self.began = False  # its backward began: it is over when that backward call ends
        self.reported = False  # its backward reached its inputs: it is over now


class StepCounts:
    """Where the bucket is in the current step: its hook modules' forward calls whose
    backward is still to come, whether its gradients are complete, and the StepState
    of its model (shared with the model's other buckets; set when the root's first
    forward builds it).

    A step may run several backward calls (a chunked loss runs the head's backward once
    per chunk, then the trunk's): a forward call that a backward call did not reach
    stays owed to a later one. A call is held weakly, by the autograd graph its hooks
    are in: a graph freed without its backward (an output no loss used) owes nothing,
    alike on every rank."""

    def __init__(self) -> None:
        self.state: Any = None  # hooks.StepState, None until the root's first forward
        self._calls: list[weakref.ref[ForwardCall]] = []  # calls whose backward is owed
        # every call of this step, by hook module, and how many of them began backward
        self._made: list[tuple[int, weakref.ref[ForwardCall]]] = []
        self._began: Counter[int] = Counter()
        self.in_pass: set[int] = set()  # hook modules whose backward began in this backward call
        self.to_run: set[int] = set()  # hook modules still to run this forward (FSDP2's groups)
        self.uncertain = False  # calls were forgotten while owed: no early launch
        self.reset_pass()

    @property
    def calls(self) -> list[ForwardCall]:
        """The forward calls whose backward is owed, their graphs alive."""
        return [c for ref in self._calls if (c := ref()) is not None]

    def owes(self, call: ForwardCall) -> bool:
        """Whether ``call`` is one of the forward calls whose backward is owed."""
        for ref in self._calls:  # a loop, not ``calls``: asked once per backward hook
            if ref() is call:
                return True
        return False

    def add(self, call: ForwardCall) -> None:
        ref = weakref.ref(call)
        self._calls.append(ref)
        self._made.append((call.module, ref))

    def start_module(self, count: int) -> None:
        """A hook module's forward begins: as FSDP2's grouped forward, a new round of all
        ``count`` modules once the last round completed."""
        if not self.to_run:
            self.to_run.update(range(count))

    def finish_module(self, index: int) -> bool:
        """Hook module ``index``'s forward ended: whether it completed the round (FSDP2
        hooks that call's output)."""
        completes = index in self.to_run
        self.to_run.discard(index)
        return completes and not self.to_run

    def begin(self, call: ForwardCall) -> None:
        """The backward of ``call`` began, in the backward call under way."""
        if not call.began:
            call.began = True
            self._began[call.module] += 1
        self.reached = True
        self.in_pass.add(call.module)

    def later_modules(self) -> set[int]:
        """Hook modules (by index) whose gradients the backward call under way cannot
        bring: they ran forward in this step, and each of those calls' backward began in
        another backward call or is still to come (a chunked loss's trunk, its head's
        chunks). A call dropped without its backward (an output no loss used, which may
        differ by rank) keeps its module out of this set, so that every rank carries its
        parameters alike."""
        made: Counter[int] = Counter()
        dead: Counter[int] = Counter()
        alive_began: Counter[int] = Counter()
        for module, ref in self._made:
            made[module] += 1
            call = ref()
            if call is None:
                dead[module] += 1
            elif call.began:
                alive_began[module] += 1
        return {
            m for m in made if m not in self.in_pass and dead[m] == self._began[m] - alive_began[m]
        }

    def reset_pass(self) -> None:
        """A backward call ended: the forward calls it reached are over."""
        self._calls = [ref for ref in self._calls if (c := ref()) is not None and not c.began]
        self.forwards_done = 0
        self.reached = False  # a backward hook of this bucket ran in this backward call
        self.ready = False  # this backward's gradients are complete

    def reset(self) -> None:
        """Forget the step: nothing is owed any more (a graph kept across this, still
        to run its backward, then only loses the early launch of its reduction)."""
        if not (self._calls or self._made or self._began):  # nothing of a step to forget
            self.uncertain = False
            self.forwards_done = 0
            self.reached = self.ready = False
            return
        self.uncertain = self.owes_backward
        self._calls = []
        self._made = []
        self._began.clear()
        self.reset_pass()

    @property
    def owes_backward(self) -> bool:
        """A forward call with grad ran whose backward has not begun."""
        for ref in self._calls:  # a loop: asked of every bucket at each backward's end
            if ref() is not None:
                return True
        return False

    @property
    def complete(self) -> bool:
        """Every forward call's backward reached its inputs: the gradients can be
        reduced before the backward call ends."""
        if self.uncertain:
            return False
        for ref in self._calls:
            call = ref()
            if call is not None and not call.reported:
                return False
        return True


_NO_SPAN = contextlib.nullcontext()


def slot_of(param: torch.Tensor) -> tuple[Bucket, int] | None:
    """The bucket holding local parameter ``param`` and its index there (None: not a
    flexshard local shard). ``bucket.layout.params[index].regions[rank]`` says which
    part of the full parameter each rank stores."""
    return getattr(param, "_flexshard_slot", None)


def _mark(param: nn.Parameter, bucket: Bucket, index: int) -> None:
    param._flexshard_slot = (bucket, index)  # type: ignore[attr-defined]


class Bucket:
    """Holds this rank's shard of a group of parameters and moves it.

    Life cycle per step: ``unshard`` (all-gather, then full parameters are set on the
    modules) -> forward -> ``reshard`` (full storage freed) -> ``unshard`` in backward ->
    gradients land on the full parameters -> ``reshard`` -> ``launch_reduce``
    (reduce-scatter, async) -> ``finish_reduce`` (gradient shards land on the local
    parameters' ``.grad``). The parts it is made of are listed in docs/architecture.md.
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
        self.params = params
        self.comm = comm
        self.schedule = BucketSchedule(reshard_after_forward)
        self.step = StepCounts()
        self.hook_modules: list[nn.Module] = []  # the modules whose forward runs it (hooks.py)
        # ``initial`` are the unsharded parameters: copy this rank's regions, keep no reference
        first = initial[0]
        self.store = BucketStorage(  # also the bucket's layout, rank and mp_policy
            layout,
            rank,
            [t.dtype for t in initial],
            [t.element_size() for t in initial],
            mp_policy,
            first.device,
            [p.requires_grad for p in params],
            params,
        )
        self.collective = choose_collective(
            name, [p.fqn for p in params], [p.placement for p in params], quant, self.store
        )
        self.reduction = GradReduction(
            comm, layout, rank, [p.placement.uniform_slots for p in params]
        )
        self.grads = GradAccumulator(len(params))
        # per parameter, looked up once: its tp spec, and whether its gradient's local
        # tensor is taken as it comes (every mesh dim data parallel)
        self._tp_specs = [p.tp_spec for p in params]
        self._grads_as_came = [only_dp_dims(p.tp_spec) for p in params]
        self._payload_uses_version = getattr(self.collective, "payload_uses_version", True)
        self._runtime_device: torch.device | None = None  # the device of ``_runtime``
        self._runtime = HOST
        self.gathered_once = False  # unshard() ran: FSDP2's reduce_scatter_unused_params
        # parameter index -> the index whose local parameter its modules were given
        # since sharding (a tie made again after sharding): it gathers that one's values
        self.ties: dict[int, int] = {}
        if first.device.type != "meta":
            self.store.load(initial)
        self._build_params()

    # ------------------------------------------------------------- accessors
    @property
    def layout(self) -> BucketLayout:
        """Which part of each parameter every rank stores (elements)."""
        return self.store.layout

    @property
    def storage(self) -> torch.Tensor:
        """This rank's flat buffer (the local parameters are views of it)."""
        return self.store.buffer

    @property
    def quant(self) -> QuantizedGather | None:
        """A quantized bucket's collective (its format and encode count), else None."""
        return self.collective if isinstance(self.collective, QuantizedGather) else None

    def rename(self, name: str) -> None:
        self.name = name
        self.comm.bucket = name

    def runtime(self) -> DeviceRuntime:
        """Streams and events for this bucket's storage (no-ops on CPU and gloo)."""
        device = self.store.buffer.device  # asked several times a step: kept per device
        if self._runtime_device is None or device != self._runtime_device:
            self._runtime = device_runtime(device, self.comm.shard_group)
            self._runtime_device = device
        return self._runtime

    def _span(self, what: str) -> contextlib.AbstractContextManager:
        """A profiler span naming the bucket (``flexshard::all_gather[layers.3]``),
        made only while a profiler records: a span costs more than a small bucket's copy."""
        if not profiler_enabled():
            return _NO_SPAN
        return record_function(f"flexshard::{what}[{self.name}]")

    # ---------------------------------------------------------------- storage
    def load_full(self, fulls: list[torch.Tensor | None]) -> None:
        """Copy this rank's regions of full parameters (None: keep) into the storage."""
        self.store.load(fulls)
        if self.full.unsharded:
            self.reshard()  # the gathered copy is stale now

    def gather_full(self) -> list[torch.Tensor]:
        """Every parameter of the bucket in full, in its own dtype (a collective)."""
        device = self.storage.device
        fulls = [
            torch.empty(p.shape, dtype=d, device=device)
            for p, d in zip(self.layout.params, self.store.dtypes)
        ]
        self._follow_ties()
        gathered = self.collective.gather_storage(self.comm)
        unpack(self.store.storage_layout, gathered, self.store.as_units(fulls))
        return fulls

    def local_tensor(self, index: int) -> torch.Tensor:
        """This rank's part of parameter ``index``: a view of the storage."""
        self._follow_ties()
        return self.store.view(index)

    def _follow_ties(self) -> None:
        """A parameter tied since sharding takes the values of the one it is tied to
        (the optimizer steps that one): before they are gathered or read."""
        if not self.ties:
            return
        with torch.no_grad():
            for index, source in self.ties.items():
                self.store.view(index).copy_(self.store.view(source))

    def local_grad(self, index: int) -> torch.Tensor | None:
        """The local tensor of the sharded parameter's gradient, if it has one."""
        grad = self.local_params[index].grad
        return None if grad is None else local_of(grad)

    def rebind_storage(self, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Move or cast the storage (``module.to_empty``, ``.to(device)``,
        ``.to(dtype)``) and re-point the local params, as FSDP2 allows after sharding."""
        storage = convert(self.storage)
        if storage.dtype != self.store.dtype and self.collective.fixed_dtype:
            raise TypeError(
                f"bucket '{self.name}' packs several dtypes or gathers quantized; it keeps "
                f"its parameters in {self.store.dtype} (cast with mp_policy instead)"
            )
        self.store.recast(storage)
        self._build_params()

    # ---------------------------------------------------------------- parameters
    def _build_params(self) -> None:
        """Local parameters (views of the storage, what the optimizer sees) and the full
        ones; both are (re)made whenever the storage is."""
        specs = [
            sharded_spec(self.mesh, p.placement, layout, dtype, p.tp_spec)
            for p, layout, dtype in zip(self.params, self.layout.params, self.store.dtypes)
        ]
        # remade (``.to(...)``): keep what ``requires_grad_`` said since sharding
        previous = getattr(self, "local_params", None)
        trainable = [p.requires_grad for p in previous or self.params]
        self.local_params = [
            nn.Parameter(wrap(self.store.view(i), spec), flag)
            for i, (spec, flag) in enumerate(zip(specs, trainable))
        ]
        # gradients are wrapped in their parameter's own spec object (nn.Parameter made
        # a new one), as FSDP2's: DTensor's sharding cache then matches the optimizer's
        # and clip_grad_norm_'s ops on them by identity, not spec by spec
        self.specs = [dtensor_spec(p) for p in self.local_params]
        # new parameter objects: their hook modules' membership is walked afresh
        self._members: dict[tuple[int, ...], list[frozenset[int]]] = {}
        for i, (local, info) in enumerate(zip(self.local_params, self.store.per_param)):
            _mark(local, self, i)
            if info.follows and self.params[i].grad_override[0]:
                local.grad_dtype = info.sharded_grad  # FSDP2 keeps it on the sharded parameter
        for index, source in self.ties.items():
            self.local_params[index] = self.local_params[source]
        self._build_full_params()
        self._set_on_modules(self.local_params)

    def capture_grad_dtypes(self) -> None:
        """A ``grad_dtype`` set on a sharded parameter before the first forward holds, as
        FSDP2 reads it at lazy init (torch 2.15)."""
        changed = False
        for param, local in zip(self.params, self.local_params):
            override = grad_dtype_override(local)
            if override[0] and override != param.grad_override:
                param.grad_override, changed = override, True
        if changed:
            self.store.refresh_dtypes()
            self._set_full_grad_dtypes()

    def adopt_replaced(self) -> None:
        """Adopt the parameters assigned on the modules since sharding (``load_state_dict(
        assign=True)``, or ``module.weight = nn.Parameter(...)`` before the first
        forward), as FSDP2 re-shards them at lazy init."""
        if self.full.unsharded:
            return  # the modules hold the full parameters: nothing was replaced
        assigned = {}
        for i, param in enumerate(self.params):
            owner, attr = param.locations[0]
            current = owner._parameters.get(attr)
            if current is not None and current is not self.local_params[i]:
                assigned[i] = current
        if assigned:
            self.adopt(assigned)

    def adopt(self, assigned: dict[int, nn.Parameter]) -> None:
        """Make the parameters ``load_state_dict(assign=True)`` put on the modules (by
        index) the sharded ones: their values go into the storage and their local
        tensors become views of it again, as FSDP2 re-adopts assigned parameters.

        A module given another of this bucket's sharded parameters (weights tied again
        after sharding, as torchtitan ties its embedding to its head after
        ``to_empty``) keeps it: its parameter gathers that one's values and adds its
        gradient to that one's, as FSDP2's parameter whose module holds another's."""
        for i, param in list(assigned.items()):
            slot = slot_of(param)
            if slot is None:
                continue
            if slot[0] is not self:
                raise ValueError(
                    f"bucket '{self.name}': parameter '{self.params[i].fqn}' was tied after "
                    f"sharding to '{slot[0].params[slot[1]].fqn}' of bucket '{slot[0].name}': "
                    "tie them before sharding, or shard both modules in one fully_shard call"
                )
            if slot[1] != i:
                self.ties[i] = slot[1]
                self.local_params[i] = param
                del assigned[i]
        if not assigned:
            self._set_on_modules(self.local_params)
            return
        locals_ = {i: local_of(param) for i, param in assigned.items()}
        if self.storage.is_meta and any(not t.is_meta for t in locals_.values()):
            device = next(t.device for t in locals_.values() if not t.is_meta)
            self.store.buffer = torch.zeros_like(self.storage, device=device)  # now real
            self._build_params()
        for i, param in assigned.items():
            view, local = self.store.view(i), locals_[i]
            if tuple(local.shape) != tuple(view.shape):
                raise ValueError(
                    f"bucket '{self.name}': parameter '{self.params[i].fqn}' was assigned a local "
                    f"tensor of shape {tuple(local.shape)}; this rank stores {tuple(view.shape)}"
                )
            if not local.is_meta:
                with torch.no_grad():
                    view.copy_(local)
            set_local_tensor(param, view)
            _mark(param, self, i)
            self.local_params[i] = param
        self._set_on_modules(self.local_params)

    def _build_full_params(self) -> None:
        device = self.storage.device
        self.full = FullParams(
            self.collective, self.layout, self.params, self.store.full_dtypes, device
        )
        self._set_full_grad_dtypes()

    def _set_full_grad_dtypes(self) -> None:
        for full, info in zip(self.full.params, self.store.per_param):
            if info.follows:  # FSDP2's unsharded parameter's grad_dtype (torch 2.15)
                full.grad_dtype = info.grad

    @property
    def full_params(self) -> list[nn.Parameter]:
        """The full-size parameters the modules use while unsharded."""
        return self.full.params

    def _set_on_modules(self, tensors: list[nn.Parameter]) -> None:
        for param, tensor in zip(self.params, tensors):
            for module, attr in param.locations:
                module._parameters[attr] = tensor

    def _switch(self, shown: list[nn.Parameter], to: list[nn.Parameter]) -> None:
        """Give the modules ``to`` instead of ``shown`` (full and local parameters).
        ``requires_grad_`` after sharding holds, as in FSDP2: it lands on the parameters
        the modules hold; the others follow them when the modules switch."""
        for param, source, target in zip(self.params, shown, to):
            if target.requires_grad != source.requires_grad:
                target.requires_grad_(source.requires_grad)
            for module, attr in param.locations:
                module._parameters[attr] = target

    # ---------------------------------------------------------------- unshard
    @property
    def gather_in_flight(self) -> bool:
        """An all-gather was launched and has not landed yet."""
        return self.full.pending is not None

    def unshard(self, async_op: bool = False, overlap: bool = False) -> None:
        """All-gather the full parameters onto the modules; ``async_op``: launch only
        (``_finish_gather`` lands it). ``overlap``: on CPU too, leave the all-gather in
        flight beside compute (forward's prefetches, see collectives.py)."""
        self.gathered_once = True
        if self.full.unsharded:
            return
        if self.full.pending is None:
            if self.ties:
                self._follow_ties()
            self._launch_gather(async_op and overlap)
        if not async_op:
            self._finish_gather()

    def _launch_gather(self, forward_prefetch: bool = False) -> None:
        full = self.full
        if full.gathered is None:  # the collective fetches nothing (replicated)
            full.pending = Pending(None, "all-gather", self.name, self.comm.timeout)
            return
        runtime = self.runtime()
        # CUDA: copy-in and collective on the all-gather stream, after it waited on
        # compute (the optimizer's writes; reads of the buffer it may reuse)
        with self._span("all_gather"), runtime.on(runtime.all_gather_stream):
            if self.schedule.post_optim_event is not None:  # CUDA only
                runtime.wait(self.schedule.post_optim_event)
                self.schedule.post_optim_event = None
            full.alloc_gathered()
            version = self._data_version() if self._payload_uses_version else None
            send = self.collective.payload(version, full.gathered)
            versions = versions_of(full.guarded)
            try:  # keeps ``send``
                full.pending = self.collective.all_gather(
                    self.comm, full.gathered, send, forward_prefetch
                )
            finally:
                set_versions(full.guarded, versions)

    def _finish_gather(self) -> None:
        full = self.full
        assert full.pending is not None
        # the parameters are saved for backward: refilling them must not look like an
        # in-place change to autograd (completing the gather bumps the version too).
        # A failed wait leaves ``pending`` set: it raises again, and the buffer gloo may
        # still write into is never freed or read
        with self._span("all_gather_copy_out"):
            versions, grad_mode = versions_of(full.guarded), torch.is_grad_enabled()
            set_grad_mode(False)
            try:
                full.pending.wait()  # CUDA: compute waits on the gather's event, the CPU not
                full.pending = None
                owned = full.alloc_owned()
                if self.collective.copy_out(full.gathered, owned):
                    self.runtime().release(full.gathered)
            finally:
                set_grad_mode(grad_mode)
                set_versions(full.guarded, versions)
        self._switch(self.local_params, self.full.params)
        full.unsharded = True

    def _data_version(self) -> tuple[int, int, int]:
        """Changes whenever the storage may have: a direct write bumps its version
        counter, an op on a DTensor parameter bumps the parameter's (not the storage's),
        and a foreach op neither, so every optimizer step counts too."""
        params = sum(p._version for p in self.local_params)
        return (self.storage._version, params, optimizer_steps())

    def keep_quantized_params(self, keep: bool = True) -> None:
        """Keep a quantized bucket's gathered fp8 codes while it is unsharded (from its
        next unshard on) for ``quantized_params``; by default they are freed once decoded."""
        if self.quant is None:
            raise RuntimeError(f"bucket '{self.name}' is not quantized")
        self.quant.keep_codes = keep

    def quantized_params(self) -> dict[str, QuantizedTensor]:
        """While unsharded, a quantized bucket's parameters as QuantizedTensors (fp8
        data and scales), for FP8 GEMMs that read them instead of the dequantized copy."""
        if self.quant is None or not self.full.unsharded:
            raise RuntimeError(f"bucket '{self.name}' is not quantized or not unsharded")
        return self.quant.quantized_params(self.name, self.full.gathered)

    def reshard(self) -> None:
        if self.full.pending is not None:  # a prefetch nobody used: let it land first
            self._finish_gather()
        if not self.full.unsharded:
            return
        self._switch(self.full.params, self.local_params)
        self.full.free()
        self.full.unsharded = False

    # ---------------------------------------------------------------- gradients
    def _take_grads(self) -> list[torch.Tensor | None]:
        grads = self.grads.take(self.full.params, self._tp_specs, self._grads_as_came)
        self.restore_grad_casts()
        return grads

    def holds_grads(self) -> bool:
        """A gradient waits to be reduced: on a full parameter, or held back by no-sync."""
        return any([p.grad is not None for p in self.full.params]) or any(
            [held is not None for held in self.grads.held]
        )

    def hold_grads(self) -> None:
        """Gradient sync is off: keep the unsharded gradients, in ``reduce_dtype`` (from
        torch 2.15 in each parameter's gradient dtype, as FSDP2)."""
        owed = self._carried(self._trainable())
        self.grads.hold(self._take_grads(), self.store.hold_dtypes(), owed)

    def _shown(self) -> list[nn.Parameter]:
        """The parameters the modules hold now (``requires_grad_`` lands on these)."""
        return self.full.params if self.full.unsharded else self.local_params

    def _trainable(self) -> tuple[bool, ...]:
        shown = self.full.params if self.full.unsharded else self.local_params
        return tuple([p.requires_grad for p in shown])

    def _carried(self, trainable: tuple[bool, ...]) -> tuple[bool, ...]:
        """The trainable parameters this backward call's reduction carries. As FSDP2's
        (which carries those holding a gradient), not one without a gradient that only
        another backward call of this step touches: a chunked loss reduces the head's
        chunks and the trunk apart, and the reduce-scatter's sums depend on what it
        carries. Decided by which modules ran, so that every rank carries the same."""
        present = [
            full.grad is not None or held is not None or owed
            for full, held, owed in zip(self.full.params, self.grads.held, self.grads.owed)
        ]
        if all([p or not t for p, t in zip(present, trainable)]):
            return trainable
        later = self.step.later_modules()
        if not later:
            return trainable
        elsewhere, here = set(), set()
        for j, members in enumerate(self._module_members()):
            (elsewhere if j in later else here).update(members)
        return tuple(
            [t and (present[i] or i in here or i not in elsewhere) for i, t in enumerate(trainable)]
        )

    def _module_members(self) -> list[frozenset[int]]:
        """Per hook module, the indices of this bucket's parameters it holds (itself or
        below it). Walked once per set of parameters the modules hold (full or local),
        not at every reduction: a chunked loss asks at each of its backward calls."""
        shown = self._shown()
        key = tuple(map(id, shown))
        members = self._members.get(key)
        if members is None:
            index = {id(p): i for i, p in enumerate(shown)}
            members = self._members[key] = [
                frozenset(index[id(p)] for p in module.parameters() if id(p) in index)
                for module in self.hook_modules
            ]
        return members

    def defer_grad_casts(self) -> None:
        """Before the bucket's backward (torch 2.15's FSDP2): a parameter whose gradient
        dtype is wider than its compute dtype takes autograd's gradient uncast when it
        is added to a held one or reduced in this backward; else autograd casts it."""
        if not self.store.widens:
            return
        sync = self.schedule.requires_grad_sync
        for full, info, held in zip(self.full.params, self.store.per_param, self.grads.held):
            accumulates = held is not None or full.grad is not None
            if info.widen and full.requires_grad and (sync or accumulates):
                full.grad_dtype = None

    def restore_grad_casts(self) -> None:
        """After the bucket's backward: the full parameters' ``grad_dtype`` as FSDP2 sets
        it between backwards (its gradient dtype)."""
        if not self.store.widens:
            return
        for full, info in zip(self.full.params, self.store.per_param):
            if info.widen:
                full.grad_dtype = info.grad

    def launch_reduce(self) -> None:
        # copy-in on compute, as FSDP2; the collective on the reduce-scatter stream
        with self._span("reduce_scatter"):
            trainable = self._trainable()
            self._check_unused_grad_dtypes(trainable)
            # set_reduce_scatter_unused_params(True): zeros for a missing gradient, as
            # FSDP2 gives them in a group unsharded at least once (others keep None)
            agree = not (self.reduction.reduce_unused and self.gathered_once)
            carried = self._carried(trainable) if agree else trainable
            grads = self._take_grads()
            dtype = self.store.reduce_dtype_of(grads, carried)
            self.reduction.launch(self.collective, grads, dtype, self.runtime(), carried, agree)

    def _check_unused_grad_dtypes(self, trainable: tuple[bool, ...]) -> None:
        """As FSDP2 (torch 2.15), before any collective and on every rank alike: zeros for
        unused parameters need one dtype, which a parameter whose ``grad_dtype`` is None
        (any) lacks without the policy's ``reduce_dtype``."""
        if not self.reduction.reduce_unused:
            return
        for param, info, used in zip(self.params, self.store.per_param, trainable):
            if used and info.follows and info.grad is None:
                raise ValueError(
                    "Reducing unused parameters with grad_dtype=None requires an explicit "
                    "MixedPrecisionPolicy.reduce_dtype so every rank can build zero gradients "
                    f"of the same dtype: {param.fqn} (bucket '{self.name}'). Set "
                    "reduce_dtype to the dtype its gradients already have."
                )

    def finish_reduce(self) -> None:
        """Land the reduced gradient shards on ``.grad``. CUDA: on the reduce-scatter
        stream; compute joins that stream at the end of backward (hooks.StepState)."""
        if not self.reduction.in_flight:
            return
        runtime = self.runtime()
        with self._span("grad_copy"), runtime.on(runtime.reduce_scatter_stream):
            # one dtype: one cast of the buffer, the gradients stay views of one buffer
            sharded = [info.sharded_grad for info in self.store.per_param]
            self.reduction.finish(self.local_params, self.specs, self.store.grad_cast, sharded)

    def settle_unused(self, used_anywhere: dict[int, bool]) -> None:
        """The ranks agreed which parameters some rank used: land those this rank did
        not (runtime/hooks.py), on the stream the other gradients landed on."""
        runtime = self.runtime()
        with runtime.on(runtime.reduce_scatter_stream):
            self.reduction.settle(used_anywhere, self.local_params, self.specs)
