"""A bucket's gradient reduction: the reduce-scatter (or all-reduce) in flight, the
FSDP2 options that shape it (divide factor, forced sums, HSDP all-reduce, hook), and
the landing of the reduced shards on the local parameters' ``.grad``.

A bucket's unsharded gradients between backward and reduction: what no-sync steps
hold back, and the opt-in record of which of them hold a NaN or an inf."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..placements.layout import BucketLayout, trainable_layout
from ..torch_internals import DTensorSpec, local_tensor, post_accumulate_grad_hooks
from .collectives import BucketComm, Pending
from .device import DeviceRuntime
from .dtensor.region_dtensor import wrap
from .dtensor.tensor_parallel import local_grad, local_of
from .gather import Collective

#: (offset, elements, shape) of one parameter's shard in a reduced buffer
_Slice = tuple[int, int, tuple[int, ...]]


class GradReduction:
    """Launches and lands one bucket's gradient reductions over the bucket's layout
    without its frozen parameters (as FSDP2 leaves them out). ``uniform``: per
    parameter, whether its placement pads every rank to the largest slice (Shard)."""

    def __init__(
        self, comm: BucketComm, layout: BucketLayout, rank: int, uniform: Sequence[bool]
    ) -> None:
        self.comm = comm
        self.bucket_layout = layout
        self.uniform = list(uniform)
        self.layout = layout  # the last launch's: its carried parameters' regions
        self.carried: tuple[bool, ...] = ()  # the last launch's parameters, by index
        # per set of carried parameters: its layout and where each parameter's shard
        # lies in a reduced buffer (``_slices``), made once
        self._layouts: dict[tuple[bool, ...], tuple[BucketLayout, list[_Slice]]] = {}
        self._slices_now: list[_Slice] = []  # the last launch's
        self.rank = rank
        # FlexShardModule's setters (runtime/module.py) tune these
        self.requires_all_reduce = True  # HSDP: False skips the all-reduce over replicas
        self.divide_factor: float | None = None  # None: average over the dp ranks
        self.force_sum = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.reduce_unused = False  # set_reduce_scatter_unused_params (Bucket.launch_reduce)
        #: set_agree_on_unused_params: the ranks agree (one small all-reduce per backward)
        #: on the parameters no rank used; False (fully_shard's default, FSDP2's
        #: collectives exactly) decides on this rank alone (``_settle_here``)
        self.agree_on_unused = True
        self._skipped_all_reduce = False  # the gradients hold unreduced replica sums
        self._accumulated_due = False  # settle() all-reduces them over the replicas
        self._pending: tuple[Pending, torch.Tensor] | None = None  # and its output
        # which trainable parameters had a gradient here, when the ranks are to agree
        # on those no rank used (runtime/hooks.py); None: every one is landed
        self.used_here: dict[int, bool] | None = None  # by parameter index
        self.unused_here: list[tuple[int, torch.Tensor]] = []  # (index, reduced grad)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    @property
    def op(self) -> dist.ReduceOp:
        """SUM when the division is done afterwards (a divide factor, forced sums)."""
        summed = self.divide_factor is not None or self.force_sum
        return dist.ReduceOp.SUM if summed else dist.ReduceOp.AVG

    def _layout_of(self, trainable: tuple[bool, ...]) -> tuple[BucketLayout, list[_Slice]]:
        """The reduction's layout for the parameters that require grad now (it follows
        ``requires_grad_`` after sharding, as FSDP2 reduces only those) and its slices."""
        known = self._layouts.get(trainable)
        if known is None:
            layout = self.bucket_layout
            if not all(trainable):
                layout = trainable_layout(layout, trainable, self.uniform)
            known = self._layouts[trainable] = (layout, self._slices(layout))
        return known

    def _slices(self, layout: BucketLayout) -> list[_Slice]:
        """Per parameter, (offset, elements, shape) of this rank's shard in a reduced
        buffer of ``layout``."""
        rank = self.rank
        return [(p.offsets[rank], p.local_numel(rank), p.local_shape(rank)) for p in layout.params]

    def launch(
        self,
        collective: Collective,
        grads: list[torch.Tensor | None],
        dtype: torch.dtype,
        runtime: DeviceRuntime,
        carried: tuple[bool, ...],
        agree: bool = True,
    ) -> None:
        """``carried``: the parameters reduced (trainable, and not left to another
        backward call); ``agree``: a parameter without a gradient on any rank gets none
        (the ranks agree on it, runtime/hooks.py); False: it gets the reduced zeros."""
        self.layout, self._slices_now = self._layout_of(carried)
        self.carried = carried
        self.used_here, self.unused_here = None, []  # a step aborted may have left some
        if self.layout.shard_numel == 0:  # nothing carried (frozen or left): no collective
            return
        if agree:
            used = zip(grads, carried)
            self.used_here = {i: g is not None for i, (g, t) in enumerate(used) if t}
        self._pending = collective.launch_reduce(
            self.comm, self.layout, grads, dtype, self.op, runtime
        )

    def _divide(self, out: torch.Tensor) -> None:
        if self.divide_factor is not None or self.force_sum:  # ``op`` is SUM
            replicas = self.comm.replicate_group
            size = self.layout.world_size * (dist.get_world_size(replicas) if replicas else 1)
            out.div_(self.divide_factor or size)

    def finish(
        self,
        local_params: Sequence[nn.Parameter],
        specs: Sequence[DTensorSpec],
        cast_to: torch.dtype | None,
        grad_dtypes: Sequence[torch.dtype | None],
    ) -> None:
        """Wait for the reduction, finish it (HSDP all-reduce, division, hook) and
        add this rank's shards to ``local_params``' gradients, each in ``grad_dtypes``
        (None: the reduced dtype; ``cast_to``: one cast of the whole buffer first, so
        the gradients stay views of one buffer)."""
        assert self._pending is not None
        pending, out = self._pending
        self._pending = None
        pending.wait()
        replicas = self.comm.replicate_group is not None
        if replicas and self.requires_all_reduce and not self._skipped_all_reduce:
            self.comm.all_reduce(out, replicas=True, op=self.op).wait()
        self._divide(out)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(out)
        if cast_to is not None and out.dtype != cast_to:
            out = out.to(cast_to)
        slices = self._slices_now
        for i, local in enumerate(local_params):
            if not (self.carried[i] and local.requires_grad):
                continue
            offset, numel, shape = slices[i]  # this rank's part of parameter i
            grad, dtype = out[offset : offset + numel].view(shape), grad_dtypes[i]
            if dtype is not None and grad.dtype != dtype:
                grad = grad.to(dtype)
            if self.used_here is not None and not self.used_here.get(i, True):
                self.unused_here.append((i, grad))  # used elsewhere? the ranks agree
                continue
            _land(local, grad, specs[i])
        # after the ranks agreed (settle): the same parameters hold a gradient everywhere
        self._accumulated_due = replicas and self.requires_all_reduce and self._skipped_all_reduce
        self._skipped_all_reduce = replicas and not self.requires_all_reduce
        if self.used_here is None:  # no agreement to wait for: every gradient landed
            self.settle({}, local_params, specs)
        elif not self.agree_on_unused:  # this rank decides alone (fully_shard's default)
            self._settle_here(local_params, specs)

    def _settle_here(
        self, local_params: Sequence[nn.Parameter], specs: Sequence[DTensorSpec]
    ) -> None:
        """Without the ranks' agreement, as FSDP2 (which takes every rank to use the
        same parameters): a parameter this rank did not use keeps no gradient unless
        its reduced shard is nonzero, which proves some rank used it. Only a parameter
        some rank used with a gradient of exact zeros on this rank's shard is told
        apart wrongly (FSDP2's reduce-scatter would be out of step there instead)."""
        if self.unused_here:
            grads = [grad for _, grad in self.unused_here]
            nonzero = torch.stack([g.ne(0).any() for g in grads]).tolist()  # one sync
            used = {i: bool(n) for (i, _), n in zip(self.unused_here, nonzero)}
        else:
            used = {}
        self.settle(used, local_params, specs)

    def settle(
        self,
        used_anywhere: dict[int, bool],
        local_params: Sequence[nn.Parameter],
        specs: Sequence[DTensorSpec],
    ) -> None:
        """Land the gradients of the parameters this rank did not use that some rank
        did (``used_anywhere``, keyed as ``used_here``); those no rank used keep
        ``.grad`` as it was (None after ``zero_grad``), as FSDP2 leaves them. HSDP after
        steps without the replica all-reduce: then all-reduce the accumulated gradients."""
        for i, grad in self.unused_here:
            if used_anywhere[i]:
                _land(local_params[i], grad, specs[i])
        self.unused_here = []
        self.used_here = None
        if self._accumulated_due:
            self._accumulated_due = False
            self._all_reduce_accumulated(local_params)

    def _all_reduce_accumulated(self, local_params: Sequence[nn.Parameter]) -> None:
        """HSDP after steps without the replica all-reduce: average the whole
        accumulated gradient over the replicas (one all-reduce per parameter)."""
        op = dist.ReduceOp.SUM if self.op == dist.ReduceOp.SUM else dist.ReduceOp.AVG
        for local in local_params:
            grad = None if local.grad is None else local_of(local.grad)
            if grad is not None and grad.numel():
                self.comm.all_reduce(grad, replicas=True, op=op).wait()


def _land(local: nn.Parameter, grad: torch.Tensor, spec: DTensorSpec) -> None:
    """Add this rank's reduced shard to ``local.grad`` and run its post-accumulate-grad
    hooks: the sharded gradient is complete (an optimizer stepped in backward), as
    FSDP2 runs them."""
    if local.grad is None:
        local.grad = wrap(grad, spec)
    else:
        local_of(local.grad).add_(grad)
    hooks = post_accumulate_grad_hooks(local)
    for hook in (hooks or {}).values():
        hook(local)


# bit flags per parameter and rank; runtime/hooks.py exchanges and decodes them
NAN, INF = 1, 2


def nonfinite_codes(grads: Sequence[torch.Tensor | None]) -> list[int]:
    """Per gradient: NAN | INF bits, 0 when finite or absent."""
    codes = []
    for grad in grads:
        code = 0
        if grad is not None and not bool(torch.isfinite(grad).all()):
            code = NAN * bool(torch.isnan(grad).any()) | INF * bool(torch.isinf(grad).any())
        codes.append(code)
    return codes


class GradAccumulator:
    """Per parameter of a bucket: the gradient held back by ``set_requires_gradient_sync
    (False)`` steps (``BucketStorage.hold_dtypes``), and the non-finite codes of the last backward
    when ``check_finite`` is on."""

    def __init__(self, count: int) -> None:
        self.held: list[torch.Tensor | None] = [None] * count
        # a no-sync backward carried the parameter (its gradient, or zeros on ranks
        # without one): its reduction is owed on every rank alike
        self.owed = [False] * count
        self.check_finite = False  # opt-in: each backward records NaN/inf per gradient
        self.nonfinite = [0] * count

    def take(
        self,
        fulls: Sequence[torch.Tensor],
        tp_specs: Sequence[DTensorSpec | None],
        as_came: Sequence[bool],
    ) -> list[torch.Tensor | None]:
        """Unsharded gradients of this backward (taken off the full parameters) plus
        those held back by no-sync steps. ``as_came``: per parameter, ``only_dp_dims``
        of its spec."""
        grads = []
        self.owed = [False] * len(self.held)
        for i, (full, spec, came) in enumerate(zip(fulls, tp_specs, as_came)):
            grad, full.grad = full.grad, None
            if grad is not None and spec is not None:  # a DTensor parameter's gradient
                if came and isinstance(grad, DTensor):  # nothing to redistribute
                    grad = local_tensor(grad)
                else:
                    grad = local_grad(grad, spec)
            held = self.held[i]
            self.held[i] = None
            if held is not None and grad is not None:
                held += grad
            grads.append(held if held is not None else grad)
        if self.check_finite:
            self.nonfinite = nonfinite_codes(grads)
        return grads

    def hold(
        self,
        grads: list[torch.Tensor | None],
        dtypes: Sequence[torch.dtype | None],
        owed: Sequence[bool],
    ) -> None:
        """Gradient sync is off: keep ``grads`` for the next backward, each in its
        ``dtypes`` entry (None: as it is); ``owed``: the parameters a synced backward
        would have carried."""
        self.owed = list(owed)
        for i, (grad, dtype) in enumerate(zip(grads, dtypes)):
            if grad is not None and dtype is not None and grad.dtype != dtype:
                grad = grad.to(dtype)
            self.held[i] = grad

    def clear_nonfinite(self) -> None:
        self.nonfinite = [0] * len(self.held)
