"""A bucket's scheduling state: the FSDP2 options that say when it gathers, reshards
and reduces, and this step's counts of its hook modules' forward and backward calls
(runtime/hooks.py reads and writes them).

A leaf: the bucket holding these (runtime/bucket.py) and the hooks driving them
(runtime/hooks.py) import this module, so the buckets and the StepState stored here are
typed ``Any`` rather than named by an import back up (tests/project/test_import_cycles.py).
"""

from __future__ import annotations

import weakref
from typing import Any


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

    __slots__ = ("in_order", "began", "reported", "__weakref__")

    def __init__(self, in_order: bool) -> None:
        # made inside the root's forward: it follows the recorded order, and so does
        # its backward's prefetch
        self.in_order = in_order
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
        self.uncertain = False  # calls were forgotten while owed: no early launch
        self.reset_pass()

    @property
    def calls(self) -> list[ForwardCall]:
        """The forward calls whose backward is owed, their graphs alive."""
        return [c for c in (ref() for ref in self._calls) if c is not None]

    def add(self, call: ForwardCall) -> None:
        self._calls.append(weakref.ref(call))

    def reset_pass(self) -> None:
        """A backward call ended: the forward calls it reached are over."""
        self._calls = [weakref.ref(c) for c in self.calls if not c.began]
        self.forwards_done = 0
        self.reached = False  # a backward hook of this bucket ran in this backward call
        self.ready = False  # this backward's gradients are complete

    def reset(self) -> None:
        """Forget the step: nothing is owed any more (a graph kept across this, still
        to run its backward, then only loses the early launch of its reduction)."""
        self.uncertain = bool(self.calls)
        self._calls = []
        self.reset_pass()

    @property
    def owes_backward(self) -> bool:
        """A forward call with grad ran whose backward has not begun."""
        return bool(self.calls)

    @property
    def complete(self) -> bool:
        """Every forward call's backward reached its inputs: the gradients can be
        reduced before the backward call ends."""
        return not self.uncertain and all(c.reported for c in self.calls)
