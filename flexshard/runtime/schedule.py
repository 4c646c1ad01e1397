"""A bucket's scheduling state: the FSDP2 options that say when it gathers, reshards
and reduces, and this step's counts of its hook modules' forward and backward calls
(runtime/hooks.py reads and writes them).

A leaf: the bucket holding these (runtime/bucket.py) and the hooks driving them
(runtime/hooks.py) import this module, so the buckets and the StepState stored here are
typed ``Any`` rather than named by an import back up (tests/project/test_import_cycles.py).
"""

from __future__ import annotations

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


class StepCounts:
    """Where the bucket is in the current step: its hook modules' forward and backward
    calls, whether its gradients are complete, and the StepState of its model (shared
    with the model's other buckets; set when the root's first forward builds it)."""

    def __init__(self) -> None:
        self.state: Any = None  # hooks.StepState, None until the root's first forward
        self.reset()

    def reset(self) -> None:
        self.forwards_started = self.forwards_wrapped = 0
        self.forwards_done = self.backwards_done = 0
        self.ready = False  # this backward's gradients are complete
