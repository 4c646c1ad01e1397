"""The per-step life cycle: unshard before forward, prefetch, reshard, backward
re-gather, gradient reductions launched as buckets complete, one end-of-backward wait.

FSDP2's mixed-precision casts of forward inputs and outputs, as FSDP2 makes them
(torch's ``_apply_to_tensors``: containers, dataclasses and namedtuples alike).

A module with a bucket casts in the bucket's hooks (``cast_floating``); a module whose
parameters were all taken by earlier ``fully_shard`` calls (accelerate's and most
wrappers' root) gets hooks of its own (``install_forward_casts``): floating inputs to
``param_dtype`` when ``cast_forward_inputs``, floating outputs to ``output_dtype``.

The opt-in finite-gradient check: every rank names the same parameters, buckets and
ranks whose gradients hold a NaN or an inf, and raises the same error.

Each rank inspects its own unsharded gradients before they are reduced (after the
reduction a NaN is everywhere and its source is lost), then the ranks exchange one
small integer row each. Off, it costs nothing: no pass over gradients, no collective.

A parameter no rank used in a backward keeps ``.grad`` None, as FSDP2 leaves it.

flexshard reduces the gradient of every trainable parameter, zeros for one a rank did
not use, so that a parameter unused on some ranks only cannot desynchronise the
collectives (FSDP2 takes every rank to use the same parameters, and hangs or mis-sizes
its reduce-scatter otherwise). Telling "unused on every rank" apart needs the ranks to
agree, and no bit of the reduce-scatter can carry it (a longer buffer changes gloo's
summation order, so FSDP2's results would no longer be matched bit for bit). So after
the last reduction of a backward the ranks all-reduce (MAX) one small bitmap per
process group: which trainable parameters each used. A parameter no rank used gets no
gradient (its reduced zeros are dropped and its post-accumulate-grad hooks do not run),
so Adam's moments and weight decay leave it alone, as in FSDP2.

Only a rank that lacked a gradient itself waits for the bitmap and reads it. A rank
that had every gradient knows the answer already (the MAX of its all-ones is all ones),
so it leaves its all-reduces running in the background and waits for them at the next
agreement, where an error of theirs surfaces: with every parameter used, no rank stops
at the end of backward for the ranks to meet (measured: ~10 ms of a ~215 ms backward at
W = 4 on gloo). Counted in ``comm_stats()["grad_agreement"]``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..torch_internals import (
    apply_to_tensors,
    dynamo_disable,
    queue_backward_callback,
    tree_flatten,
)
from .bucket import Bucket, ForwardCall
from .collectives import Pending, TrafficStats, attach_traffic, by_process_group
from .device import DeviceRuntime
from .reduce import INF, NAN

if TYPE_CHECKING:
    from .bucket import Bucket


def _cast(dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """``tree`` with its floating tensors cast to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tree
    return apply_to_tensors(functools.partial(_cast, dtype), tree)


def install_forward_casts(module: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """Register the casts ``policy`` asks for on ``module`` (none: nothing registered)."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        dtype = policy.param_dtype

        def cast_inputs(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return cast_floating(args, dtype), cast_floating(kwargs, dtype)

        module.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    if policy.output_dtype is not None:
        output_dtype = policy.output_dtype

        def cast_output(_m: nn.Module, _args: tuple, output: Any) -> Any:
            return cast_floating(output, output_dtype)

        module.register_forward_hook(cast_output)


#: parameters named in the message (the count of the rest follows)
NAMED = 8


def _exchange(buckets: list[Bucket], row: torch.Tensor) -> torch.Tensor:
    """Rows of every rank of the buckets' shard group (and replicas, for HSDP)."""
    comm = buckets[0].comm
    rows = row.view(1, -1)
    for replicas in comm.spanning():
        group = comm.group(replicas)
        out = torch.empty(
            dist.get_world_size(group) * rows.numel(), dtype=rows.dtype, device=rows.device
        )
        comm.gather_flags(out, rows.reshape(-1), replicas).wait()
        rows = out.view(-1, row.numel())
    return rows


def _describe(code: int) -> str:
    return " and ".join(name for bit, name in ((NAN, "NaN"), (INF, "inf")) if code & bit)


def check_finite_grads(buckets: Sequence[Bucket]) -> None:
    """Raise FloatingPointError on every rank if any checked bucket's gradient of this
    backward is not finite on any rank. One all-gather per process group (two for
    HSDP); every rank builds the message from the same rows, so all raise alike."""
    checked = [b for b in buckets if b.grads.check_finite]
    found: list[str] = []
    for group_buckets in by_process_group(checked):
        codes = [c for b in group_buckets for c in b.grads.nonfinite]
        device = group_buckets[0].storage.device
        row = torch.tensor([dist.get_rank(), *codes], dtype=torch.int64, device=device)
        rows = _exchange(group_buckets, row).cpu()
        for bucket in group_buckets:
            bucket.grads.clear_nonfinite()
        if not rows[:, 1:].any():
            continue
        slots = [(b, p.fqn) for b in group_buckets for p in b.params]
        for column, (bucket, fqn) in enumerate(slots, start=1):
            bad = [(int(r[0]), int(r[column])) for r in rows if r[column]]
            if bad:
                where = ", ".join(f"{_describe(code)} on rank {rank}" for rank, code in sorted(bad))
                found.append(f"parameter '{fqn}' of bucket '{bucket.name}' ({where})")
    if found:
        named = "; ".join(found[:NAMED])
        more = f"; and {len(found) - NAMED} more" if len(found) > NAMED else ""
        raise FloatingPointError(
            f"flexshard: non-finite gradients in {len(found)} parameter(s), before reduction: "
            f"{named}{more}. The reduced gradients are unusable: skip this optimizer step "
            "(set_check_finite_grads(True) is on)"
        )


#: the ``comm_stats`` entry of the agreement's all-reduces
AGREEMENT = "grad_agreement"


class UnusedGradAgreement:
    """One root's agreements: their traffic (``stats``) and the all-reduces a rank that
    had every gradient left running (waited for at the next agreement)."""

    def __init__(self) -> None:
        self.stats = TrafficStats()
        self._background: list[Pending] = []

    def __call__(self, buckets: Sequence[Bucket]) -> None:
        """Land the gradients of the parameters some rank used on every rank; leave
        those no rank used without one. Every rank calls it with the same buckets, in
        the same order, after their reductions landed."""
        if self._background:
            self.finish()
        settling = [b for b in buckets if b.reduction.used_here is not None]
        if settling:  # none when each rank decided alone (fully_shard's default)
            for group_buckets in by_process_group(settling):
                self._agree(group_buckets)

    def finish(self) -> None:
        """Wait for the all-reduces left running (a failure of theirs raises here)."""
        background, self._background = self._background, []
        for pending in background:
            pending.wait()

    def _agree(self, buckets: list[Bucket]) -> None:
        used = [b.reduction.used_here or {} for b in buckets]
        flat = [u for per_bucket in used for u in per_bucket.values()]
        comm = buckets[0].comm
        spanning = comm.spanning()
        if spanning and flat:
            flags = torch.tensor(flat, dtype=torch.int32)
            device = buckets[0].storage.device
            if device.type != "cpu":  # a pageable copy would make the host wait for compute
                flags = flags.pin_memory().to(device, non_blocking=True)
            if all(flat):  # the result is all ones: nothing to wait for or read
                for replicas in spanning:  # a tensor each: they may run at once
                    self._background.append(comm.agree(flags.clone(), replicas, self.stats.record))
            else:
                for replicas in spanning:  # HSDP: the replicas combine their groups' flags
                    comm.agree(flags, replicas, self.stats.record).wait()
                flat = [bool(f) for f in flags.tolist()]
        cursor = 0
        for bucket, per_bucket in zip(buckets, used):
            keys = list(per_bucket)
            anywhere = dict(zip(keys, flat[cursor : cursor + len(keys)]))
            cursor += len(keys)
            bucket.settle_unused(anywhere)


#: gradient reductions in flight before the oldest is waited for (bounds the memory
#: held by unsharded gradient buffers): FSDP2's default reduce_scatter_max_input_buffers
MAX_PENDING_REDUCTIONS = 1
#: all-gathers launched and not yet landed (prefetches), as FSDP2 bounds its own: a
#: third waits for the oldest, so the CPU running ahead cannot hold more buffers
MAX_GATHERS_IN_FLIGHT = 2

_F = TypeVar("_F", bound=Callable[..., Any])


def eager(fn: _F) -> _F:
    """``fn`` run eagerly even when a compiled region calls it, as FSDP2 keeps its hooks
    out of dynamo: collectives, waits and bookkeeping stay Python, and a compiled
    module's graph holds its own computation alone. Applied when hooks are installed
    (fully_shard has imported torch._dynamo by then), so the hook itself is dynamo's
    disabled wrapper and no flexshard frame is ever traced."""
    return dynamo_disable(fn, reason="flexshard hook")


class StepState:
    """What all buckets of one model share: the forward order (learned on the first
    step, used to prefetch), the order gradient reductions launch in, and the
    end-of-backward callback.

    With manual backward finalization (``set_manual_backward_finalization(True)`` on the
    root, as FSDP2's) a backward's end launches no more reductions and waits for none:
    the buckets that still owe one are remembered, and ``finalize_backward`` reduces
    them, waits and finishes the gradients, once for any number of backward calls."""

    def __init__(self, root: nn.Module, buckets: list[Bucket]) -> None:
        self.root = root
        self.buckets = buckets
        self.forward_order: list[Bucket] = []
        self.order_known = False
        # the root's forward is running: a bucket's call then follows the recorded
        # order (a chunked loss calls the head again after it, out of that order)
        self.in_root_forward = False
        self._launch_queue: list[Bucket] = []
        self._launched = 0
        # the reduction order and the forward order's length it was made for: made
        # again only when a forward records a new bucket (each backward call asks)
        self._order: tuple[int, list[Bucket]] = (-1, [])
        # CUDA: the runtimes whose reduce-scatter stream got gradient work since the
        # last end of backward (compute joins each once); none on CPU
        self._joining: list[DeviceRuntime] = []
        self._in_flight: deque[Bucket] = deque()
        self._gathers: deque[Bucket] = deque()  # prefetches launched, oldest first
        self.in_backward = False
        # this backward call began at the output of a forward call FSDP2 hooks (not a
        # grouped state's partial forward): it ends with FSDP2's final callback
        self.whole_call_in_pass = False
        self._end_of_backward_eager = eager(self._end_of_backward)
        # the finalization mode of the backward iteration under way, fixed when its
        # first backward begins (None: none began since the last finalization)
        self.manual_active: bool | None = None
        # manual mode: buckets whose gradients still owe a reduction (held while
        # gradient sync was off, or never reported by a backward)
        self._unreduced: list[Bucket] = []
        # an asynchronous finalization whose handle was not waited on yet (its token)
        self.pending_finalization: object | None = None
        self.agree_on_unused = UnusedGradAgreement()
        attach_traffic(root, AGREEMENT, self.agree_on_unused.stats)
        for bucket in buckets:
            bucket.step.state = self

    # ---------------------------------------------------------------- forward
    def begin_root_forward(self) -> None:
        """A new step: backward calls the last one still owed (an output no loss used)
        are forgotten; a graph kept across this only loses early launches."""
        if not self.in_root_forward:
            for bucket in self.buckets:
                bucket.step.reset()
        self.in_root_forward = True

    def before_forward(self, bucket: Bucket) -> None:
        if self.pending_finalization is not None:
            raise RuntimeError("The previous gradient reduction must be waited on before forward")
        if not self.order_known and bucket not in self.forward_order:
            self.forward_order.append(bucket)
        bucket.unshard()
        if self.in_root_forward:
            self._prefetch(bucket, +1)

    def _prefetch(self, bucket: Bucket, step: int) -> None:
        """Start gathering the bucket that runs next, so it lands while this one computes
        (or those ``set_modules_to_forward/backward_prefetch`` named)."""
        schedule = bucket.schedule
        explicit = schedule.forward_prefetch if step > 0 else schedule.backward_prefetch
        if explicit is not None:
            for other in explicit:
                if step > 0 or other.schedule.unshard_in_backward:
                    self._unshard_async(other)
            return
        if not self.order_known or bucket not in self.forward_order:
            return
        index = self.forward_order.index(bucket) + step
        if 0 <= index < len(self.forward_order):
            following = self.forward_order[index]
            if step > 0 or following.schedule.unshard_in_backward:
                self._unshard_async(following)

    def _unshard_async(self, bucket: Bucket) -> None:
        """Launch ``bucket``'s all-gather, landing the oldest prefetch first when
        MAX_GATHERS_IN_FLIGHT are already in flight (landing issues no collective)."""
        if bucket.full.unsharded or bucket.full.pending is not None:  # gathered or in flight
            return
        gathers = deque([b for b in self._gathers if b.full.pending is not None])
        while len(gathers) >= MAX_GATHERS_IN_FLIGHT:
            gathers.popleft().unshard()
        bucket.unshard(async_op=True, overlap=not self.in_backward)
        gathers.append(bucket)
        self._gathers = gathers

    # ---------------------------------------------------------------- backward
    def _backward_begins(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        if self.manual_active is None:
            self.manual_active = manual_finalization(self.root)
        self._launch_queue = self._reduction_order()
        self._launched = 0
        queue_backward_callback(self._end_of_backward_eager)

    def _reduction_order(self) -> list[Bucket]:
        """Backward's order (the forward's reversed), then buckets no forward ran: the
        same on every rank, so their reductions pair up. Not to be changed in place."""
        made_for, order = self._order
        if made_for != len(self.forward_order):  # the order only grows, by appends
            rest = [b for b in self.buckets if b not in self.forward_order]
            order = list(reversed(self.forward_order)) + rest
            self._order = (len(self.forward_order), order)
        return order

    def before_backward(self, bucket: Bucket, call: ForwardCall) -> None:
        """The backward of one forward call of the bucket's modules begins."""
        self._backward_begins()
        bucket.step.begin(call)
        self.whole_call_in_pass |= call.whole
        try:  # _abort_step_on_error, without a context manager's calls (once per bucket)
            if bucket.schedule.unshard_in_backward:
                bucket.unshard()
            bucket.defer_grad_casts()
            # the recorded order says which bucket's backward comes next only for a
            # call made inside the root's forward (not a chunked loss's head call)
            if call.in_order or bucket.schedule.backward_prefetch is not None:
                self._prefetch(bucket, -1)
        except BaseException:
            self._reset_step()
            raise

    @contextlib.contextmanager
    def _abort_step_on_error(self) -> Iterator[None]:
        """A collective that fails inside backward ends the backward without the
        end-of-backward callback: forget the step, so the next forward is not taken
        for an activation-checkpointing recompute."""
        try:
            yield
        except BaseException:
            self._reset_step()
            raise

    def after_backward(self, bucket: Bucket) -> None:
        """The bucket's module finished its backward: its gradients are complete.

        This point is set by the graph's structure, not by which parameters got a
        gradient, so every rank reaches it at the same place in its sequence of
        collectives, even when some parameters go unused on some ranks."""
        self._backward_begins()
        bucket.step.ready = True
        try:  # _abort_step_on_error, without a context manager's calls (once per bucket)
            # the gradients are off to the side: free the gathered parameters before the
            # reduction's buffers are made (FSDP2 reshards before its reduce-scatter too)
            if bucket.schedule.reshard_after_backward:
                bucket.reshard()
            # launch strictly in queue order, so every rank issues the same sequence
            queue = self._launch_queue
            while self._launched < len(queue) and queue[self._launched].step.ready:
                self._launch(queue[self._launched])
                self._launched += 1
        except BaseException:
            self._reset_step()
            raise

    def _launch(self, bucket: Bucket) -> None:
        if bucket.schedule.reshard_after_backward:
            bucket.reshard()  # a bucket whose modules never reported: free it first too
        if not bucket.schedule.requires_grad_sync:
            bucket.hold_grads()
            if self.manual_active and bucket not in self._unreduced:
                self._unreduced.append(bucket)
            return
        # manual mode with gradient sync on over several backwards: a bucket's previous
        # reduction lands (oldest first, as always) before its next one launches
        while bucket in self._in_flight:
            self._in_flight.popleft().finish_reduce()
        if bucket in self._unreduced:
            self._unreduced.remove(bucket)
        bucket.launch_reduce()
        runtime = bucket.runtime()
        if runtime.reduce_scatter_stream is not None and runtime not in self._joining:
            self._joining.append(runtime)
        self._in_flight.append(bucket)
        limit = bucket.schedule.reductions_in_flight or MAX_PENDING_REDUCTIONS
        while len(self._in_flight) > limit:
            self._in_flight.popleft().finish_reduce()

    def _end_of_backward(self) -> None:
        if self.manual_active:
            self._end_of_manual_backward()
        else:
            self._finish_backward()

    def _end_of_manual_backward(self) -> None:
        """A backward ended under manual finalization: buckets that never reported hold
        their gradients (sync off) or owe their reduction (sync on: FSDP2 defers it to
        ``finalize_backward`` too); launched reductions stay in flight."""
        try:
            for bucket in self._launch_queue[self._launched :]:
                if bucket.schedule.requires_grad_sync:
                    if bucket not in self._unreduced:
                        self._unreduced.append(bucket)
                else:
                    self._launch(bucket)
        except BaseException:
            self._reset_step()
            raise
        self._end_pass()

    def finalize(self, wait: bool) -> None:
        """``finalize_backward``: launch the reductions the backwards left owing (in the
        same order on every rank), reshard, and with ``wait`` land them and finish the
        gradients (else ``finish_finalization`` does, from the handle's ``wait``)."""
        order = self._reduction_order()
        with self._abort_step_on_error():
            for bucket in order:
                if bucket in self._unreduced:
                    self._launch(bucket)
                elif bucket.schedule.reshard_after_backward:
                    bucket.reshard()
        self._launch_queue, self._launched = order, len(order)
        if wait:
            self._finish_backward()
        else:
            self.pending_finalization = object()

    def finish_finalization(self, token: object) -> None:
        """What an asynchronous finalization's handle ``wait()`` does: land its
        reductions and finish the gradients."""
        if self.pending_finalization is not token:
            raise RuntimeError("This gradient reduction handle was invalidated")
        self._finish_backward()

    def _finish_backward(self) -> None:
        owed: list[Bucket] = []  # left for a later backward call of this step
        try:
            # A bucket whose backward ran in this call reduces now. One it did not reach
            # (its inputs need no gradient, like the root's token ids) reduces now, in
            # queue order, if it holds gradients (fresh, or held by no-sync calls) or
            # reduces even without any (set_reduce_scatter_unused_params), and either no
            # later backward call of this step owes it or this call passed a whole
            # forward call's output: as FSDP2, whose end-of-backward callback (queued by
            # a state's pre-backward hook on a forward's output, which a grouped state's
            # partial forward does not register) runs the post-backward of every group,
            # even one a later backward reaches again. Every rank decides alike: a
            # bucket's backward runs on every rank or on none (a resharded bucket's
            # re-gather in backward needs that already).
            whole = self.whole_call_in_pass
            for bucket in self._launch_queue[self._launched :]:
                if bucket.step.reached:  # its backward ran in this call
                    self._launch(bucket)
                    continue
                owes = bucket.step.owes_backward
                if owes and not whole:  # a later backward call of this step reduces it
                    owed.append(bucket)
                elif bucket.holds_grads() or bucket.reduction.reduce_unused:
                    self._launch(bucket)
                elif owes:
                    owed.append(bucket)
            while self._in_flight:
                self._in_flight.popleft().finish_reduce()
            self.agree_on_unused(self.buckets)  # no gradient where none was
            joining, self._joining = self._joining, []
            for runtime in joining:  # CUDA: compute waits on the gradient copies
                runtime.join(runtime.reduce_scatter_stream)
            for bucket in self.buckets:
                if bucket.schedule.reshard_after_backward and bucket not in owed:
                    bucket.reshard()
            checked = [bucket for bucket in self.buckets if bucket.grads.check_finite]
            if checked:
                check_finite_grads(checked)  # every rank raises alike, or none
        finally:
            self._reset_step(owed)

    def reduce_held(self, buckets: list[Bucket]) -> None:
        """Reduce ``buckets``' gradients now, in this order, as the end of a backward
        does (torch's pipeline schedules call this after the last microbatch, whose
        backwards ran with gradient sync off)."""
        self._launch_queue, self._launched = list(buckets), 0
        self._finish_backward()

    def _end_pass(self, owed: list[Bucket] | None = None) -> None:
        """Forget one backward pass: its hook counts and prefetches. ``owed``: buckets
        whose backward is still to come in a later pass keep their forward calls'
        counts; with none owed, the step's counts start afresh."""
        whole = self.whole_call_in_pass
        for bucket in self.buckets:
            step = bucket.step
            if not owed:
                step.reset()
            elif bucket not in owed:
                step.reset_pass()
            if step.in_pass:
                step.in_pass.clear()
            if whole and step.to_run:  # FSDP2's final callback starts grouped forwards anew
                step.to_run.clear()
        self._gathers.clear()
        self._launched = len(self._launch_queue)
        self.in_backward = False
        self.whole_call_in_pass = False

    def _reset_step(self, owed: list[Bucket] | None = None) -> None:
        """Forget the backward iteration: its passes and what they left to reduce."""
        self._end_pass(owed)
        self._in_flight.clear()
        self._unreduced.clear()
        self._joining.clear()
        self.manual_active = None
        self.pending_finalization = None


#: where FlexShardModule.set_manual_backward_finalization keeps the mode, on the root
#: module itself: it may be set before the first forward decides which module is root
MANUAL_FINALIZATION = "_flexshard_manual_finalization"


def manual_finalization(module: nn.Module) -> bool:
    """Whether ``set_manual_backward_finalization(True)`` was called on ``module``."""
    return bool(module.__dict__.get(MANUAL_FINALIZATION, False))


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once the module's backward is
    done: the moment its bucket's gradients are complete."""

    @staticmethod
    def forward(ctx: Any, hook: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return tuple([t.view_as(t) for t in tensors])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook()
        return (None, *grads)


def _tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a module's output: pytree containers and, as FSDP2 walks them,
    dataclass fields."""
    if isinstance(tree, torch.Tensor):  # the common output: no tree to walk
        return [tree]
    found = []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                found += _tensors_in(getattr(leaf, field.name))
    return found


def _wrap_inputs(args: tuple, kwargs: dict, hook: Any) -> tuple[tuple, dict] | None:
    """The inputs routed through _PostBackward, or None when none needs a gradient."""
    if not kwargs and all([isinstance(a, torch.Tensor) for a in args]):
        # positional tensors only (the common call): the same result without pytree
        slots = [i for i, t in enumerate(args) if t.requires_grad]
        if not slots:
            return None
        flat_args = list(args)
        for i, tensor in zip(slots, _PostBackward.apply(hook, *[args[i] for i in slots])):
            flat_args[i] = tensor
        return tuple(flat_args), kwargs
    flat, spec = tree_flatten((args, kwargs))
    slots = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not slots:
        return None
    wrapped = _PostBackward.apply(hook, *[flat[i] for i in slots])
    for i, tensor in zip(slots, wrapped):
        flat[i] = tensor
    return spec.unflatten(flat)


def install_root_hooks(module: nn.Module) -> None:
    """Hooks on a module that may turn out to be the root: the first of them to run
    forward builds the StepState of every bucket below it (FSDP2's lazy init)."""

    @eager
    def pre_forward(mod: nn.Module, args: tuple) -> None:
        if getattr(mod, "_flexshard_state", None) is None:
            for m in mod.modules():  # FSDP2's lazy init refuses the mode off the root too
                if m is not mod and manual_finalization(m):
                    raise RuntimeError(
                        "set_manual_backward_finalization must be called on the root FSDP module"
                    )
            buckets = []
            for fqn, m in mod.named_modules():
                for bucket in getattr(m, "_flexshard_buckets", ()):
                    bucket.rename(fqn or "root")  # fully_shard buckets are named by module
                    if bucket not in buckets:  # a grouped fully_shard: one bucket, several modules
                        bucket.adopt_replaced()  # parameters assigned since sharding
                        bucket.capture_grad_dtypes()
                        buckets.append(bucket)
            state = StepState(mod, buckets)
            for m in mod.modules():
                if hasattr(m, "_flexshard_buckets"):
                    m._flexshard_state = state
        state = mod._flexshard_state
        if state.root is mod and not state.in_backward:
            state.begin_root_forward()

    @eager
    def post_forward(mod: nn.Module, args: tuple, output: Any) -> None:
        state = mod._flexshard_state
        if state.root is mod:  # the first full forward fixes the prefetch order
            state.order_known = bool(state.forward_order)
            state.in_root_forward = False
            for bucket in state.buckets:  # FSDP2 completes grouped forwards at the root's end
                bucket.step.to_run.clear()

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)
    _remember(module, pre_forward, post_forward)


def _remember(module: nn.Module, *hooks: Any, kwargs: bool = False) -> None:
    """Keep the hooks findable for ``register_fsdp_forward_method``, which runs them
    around a method other than ``forward``."""
    for hook in hooks:
        hook._flexshard_kwargs = kwargs
    module.__dict__.setdefault("_flexshard_hooks", []).extend(hooks)


def install_bucket_hooks(bucket: Bucket, modules: list[nn.Module]) -> None:
    """Forward pre/post hooks on the modules that run the bucket's parameters. With
    several (a bucket over sibling layers) the first to run unshards, the last to
    finish its forward reshards, and the bucket's gradients are complete once every
    one of them finished its backward."""
    policy = bucket.store.policy
    open_calls: list[ForwardCall | None] = []  # forward calls between pre and post hooks
    bucket.hook_modules = modules
    index_of = {id(m): i for i, m in enumerate(modules)}

    @eager
    def pre_forward(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        state = bucket.step.state
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
                args = tuple([_cast(policy.param_dtype, a) for a in args])  # without pytree
            else:
                args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
        if state.in_backward:  # activation checkpointing recomputes inside backward
            bucket.unshard()
            return args, kwargs
        state.before_forward(bucket)
        bucket.step.start_module(len(modules))
        call = None
        if torch.is_grad_enabled():
            call = ForwardCall(state.in_root_forward, index_of[id(mod)])
            wrapped = _wrap_inputs(args, kwargs, functools.partial(post_backward, call))
            if wrapped is not None:
                args, kwargs = wrapped
            else:  # inputs needing no gradient never report: the end of backward decides
                call.reported = None
        open_calls.append(call)
        return args, kwargs

    @eager  # compiled autograd traces backward hooks: keep these out too, as FSDP2 does
    def post_backward(call: ForwardCall) -> None:
        # complete once every forward call owed has run its backward
        step = bucket.step
        step.begin(call)
        call.reported = True
        if step.owes(call) and step.complete:
            step.state.after_backward(bucket)

    @eager
    def before_backward(call: ForwardCall, _grads: Any) -> None:
        bucket.step.state.before_backward(bucket, call)

    @eager
    def post_forward(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        state = bucket.step.state
        if state.in_backward:  # a recompute: backward of this module comes right after
            return cast_floating(output, policy.output_dtype)
        bucket.step.forwards_done += 1
        reshard = bucket.schedule.reshard_after_forward
        if reshard is None:  # FSDP2's default: backward needs the root's params at once
            reshard = state.root is not mod
        last = bucket.step.forwards_done % len(modules) == 0
        if reshard and last:  # a no_grad forward too: FSDP2 keeps what the option says
            bucket.reshard()
        completes = bucket.step.finish_module(index_of[id(mod)])
        call = open_calls.pop() if open_calls else None
        if call is None:  # a forward without grad: no backward to come
            return cast_floating(output, policy.output_dtype)
        call.whole = call.whole or completes
        tensors = [t for t in _tensors_in(output) if t.requires_grad]
        if tensors or call.reported is False:
            bucket.step.add(call)
        if len(tensors) == 1:  # "any" of one tensor: its own hook, once per backward
            tensors[0].register_hook(functools.partial(before_backward, call))
        elif tensors:
            hook = functools.partial(before_backward, call)
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
        return cast_floating(output, policy.output_dtype)

    for module in modules:
        module.register_forward_pre_hook(pre_forward, with_kwargs=True)
        module.register_forward_hook(post_forward, with_kwargs=True)
        _remember(module, pre_forward, post_forward, kwargs=True)
