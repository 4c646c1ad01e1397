"""One logger for every ``torch.distributed`` collective, shared by the tests that count
or forbid collectives.

Two layers, so that nothing slips past:

* **Names.** While a log is open, every public collective of ``torch.distributed``
  (the ``_single`` variants, ``all_to_all_single``, point-to-point, object
  collectives, ``barrier``, ``new_group``, ...) and of
  ``torch.distributed._functional_collectives`` (what DTensor calls) is wrapped: on
  ``torch.distributed``, on ``torch.distributed.distributed_c10d`` (whose own
  functions call each other through its module globals) and in *every* loaded module
  that bound one of these functions under its own name (``from torch.distributed
  import all_reduce``). A call made from inside another wrapped call (``all_gather``
  inside ``all_gather_object``) belongs to the outer one and is not logged twice.
* **The backend's own count.** Each process group counts the collectives it has
  issued (``_get_sequence_number_for_group``), whatever route they took: a direct
  ``ProcessGroup.allreduce``, a ``torch.ops.c10d`` op, a collective on another thread.
  Whatever the groups issued that no wrapped call accounts for is logged as
  ``"unnamed"``; ``forbid_collectives`` fails if any group's count moved. (A collective
  another thread issues while a wrapped call runs is counted in that call's groups.)

``record_collectives()`` yields a :class:`CollectiveLog`: a sequence of names
(``"all_gather_single"``, ``"funcol.all_gather_tensor"``, ``"new_group"``,
``"unnamed"``), each with the process groups it advanced in ``log.records``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..torch_internals import functional_collectives_module, process_groups, sequence_number

#: public collectives of torch.distributed (those this torch version has are wrapped)
C10D_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "all_to_all",
    "all_to_all_single", "broadcast", "_broadcast_coalesced", "reduce", "scatter",
    "gather", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list", "send_object_list", "recv_object_list", "new_group",
    "new_subgroups", "new_subgroups_by_enumeration", "split_group",
)  # fmt: skip
#: torch.distributed._functional_collectives, logged as "funcol.<name>"
FUNCTIONAL_COLLECTIVES = (
    "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_tensor_inplace",
    "all_gather_single", "all_gather_single_autograd", "all_gather_single_coalesced",
    "all_gather_into_tensor_coalesced", "all_gather_inplace", "all_reduce",
    "all_reduce_coalesced", "all_reduce_inplace", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_inplace", "reduce_scatter_single",
    "reduce_scatter_single_autograd", "reduce_scatter_single_coalesced", "all_to_all_single",
    "all_to_all_single_autograd", "all_to_all_inplace", "broadcast", "permute_tensor",
)  # fmt: skip
UNNAMED = "unnamed"
#: the older names of one collective, logged under its name from torch 2.13 on (where the
#: older became deprecated aliases), so that a count reads the same on every release
SAME_COLLECTIVE = {
    "all_gather_into_tensor": "all_gather_single",  # torch.distributed's
    "reduce_scatter_tensor": "reduce_scatter_single",  # both modules'
    "all_gather_tensor": "all_gather_single",  # funcol's
    "all_gather_tensor_autograd": "all_gather_single_autograd",
    "reduce_scatter_tensor_autograd": "reduce_scatter_single_autograd",
    "all_gather_into_tensor_coalesced": "all_gather_single_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
}


class CollectiveForbidden(AssertionError):
    """A collective ran inside ``forbid_collectives()``."""


@dataclass(frozen=True)
class Collective:
    name: str
    #: group name -> how many collectives the call issued on that group (the backend's
    #: count; empty for new_group, or for a call that issued nothing)
    groups: dict[str, int] = field(default_factory=dict)


class CollectiveLog(Sequence[str]):
    """The collectives issued while the log was open, in order. Reading an open log
    first settles what the process groups issued outside any wrapped call
    (``"unnamed"``)."""

    def __init__(self, forbid: bool) -> None:
        self.forbid = forbid
        self.open = True  # a closed log keeps what it saw and settles no more
        self._records: list[Collective] = []
        self._seen = _sequence_numbers()

    # reading
    @property
    def records(self) -> list[Collective]:
        if self.open:
            self._settle(_sequence_numbers())
        return list(self._records)

    def names(self) -> list[str]:
        return [r.name for r in self.records]

    def counts(self) -> Counter[str]:
        return Counter(self.names())

    def on(self, group: dist.ProcessGroup | str) -> list[str]:
        """The names of the collectives that ran on ``group``."""
        name = group if isinstance(group, str) else group.group_name
        return [r.name for r in self.records if name in r.groups]

    def issued(self, group: dist.ProcessGroup | str | None = None) -> int:
        """How many collectives the backend issued (on ``group``, or on all groups)."""
        name = None if group is None else group if isinstance(group, str) else group.group_name
        return sum(n for r in self.records for g, n in r.groups.items() if name in (None, g))

    def __getitem__(self, index):  # type: ignore[override]
        return self.names()[index]

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"CollectiveLog({self.names()})"

    # writing (by the wrappers)
    def _settle(self, now: dict[str, int]) -> None:
        """Log as "unnamed" what the groups issued beyond what was accounted for."""
        for group, count in now.items():
            for _ in range(count - self._seen.get(group, 0)):
                self._records.append(Collective(UNNAMED, {group: 1}))
        self._seen.update(now)

    def _add(self, name: str, before: dict[str, int], after: dict[str, int]) -> None:
        self._settle(before)
        moved = {g: n - before.get(g, 0) for g, n in after.items() if n != before.get(g, 0)}
        self._records.append(Collective(name, moved))
        self._seen.update(after)


def _sequence_numbers() -> dict[str, int]:
    """Per process group of this process, how many collectives it has issued."""
    if not dist.is_initialized():
        return {}
    out = {}
    for group in process_groups():
        try:
            out[group.group_name] = sequence_number(group)
        except (RuntimeError, AttributeError):  # a backend that does not count
            continue
    return out


_lock = threading.RLock()
_active: list[CollectiveLog] = []
_restore: list[tuple[types.ModuleType, str, Any]] = []
_inside = threading.local()  # depth of wrapped calls on this thread


def _wrap(name: str, fn: Callable) -> Callable:
    def logged(*args: Any, **kwargs: Any) -> Any:
        logs = list(_active)
        if not logs or getattr(_inside, "depth", 0):  # closed, or inside another collective
            return fn(*args, **kwargs)
        before = _sequence_numbers()
        if any(log.forbid for log in logs):
            for log in logs:  # logged even if the caller swallows the error
                log._add(name, before, before)
            raise CollectiveForbidden(
                f"collective torch.distributed.{name} ran while collectives are forbidden"
            )
        _inside.depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.depth = 0
            after = _sequence_numbers()
            for log in logs:
                log._add(name, before, after)

    logged.__wrapped__ = fn  # type: ignore[attr-defined]
    logged.__name__ = getattr(fn, "__name__", name)
    return logged


def _install() -> None:
    funcol = functional_collectives_module()

    wrappers: dict[int, Callable] = {}
    originals: dict[int, Callable] = {}
    for module, names, prefix in (
        (c10d, C10D_COLLECTIVES, ""),
        (funcol, FUNCTIONAL_COLLECTIVES, "funcol."),
    ):
        for name in names:
            fn = getattr(module, name, None)
            if callable(fn) and id(fn) not in wrappers:
                wrappers[id(fn)] = _wrap(prefix + SAME_COLLECTIVE.get(name, name), fn)
                originals[id(fn)] = fn
    # torch.distributed, distributed_c10d, funcol, and any module that bound one by name
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            if id(value) in originals and originals[id(value)] is value:
                _restore.append((module, attr, value))
                setattr(module, attr, wrappers[id(value)])


def _uninstall() -> None:
    while _restore:
        module, attr, value = _restore.pop()
        setattr(module, attr, value)


@contextlib.contextmanager
def record_collectives(forbid: bool = False) -> Iterator[CollectiveLog]:
    """Log every collective issued inside (and let it run, unless ``forbid``).
    Logs may nest; each sees everything issued while it is open."""
    log = CollectiveLog(forbid)
    with _lock:
        if not _active:
            _install()
        _active.append(log)
    try:
        yield log
    finally:
        log._settle(_sequence_numbers())
        log.open = False
        with _lock:
            _active.remove(log)
            if not _active:
                _uninstall()


@contextlib.contextmanager
def forbid_collectives() -> Iterator[CollectiveLog]:
    """Every collective raises :class:`CollectiveForbidden` inside; on the way out, no
    collective may have been attempted or issued by any route (else the same error)."""
    with record_collectives(forbid=True) as log:
        yield log
    if len(log):
        raise CollectiveForbidden(f"collectives ran while forbidden: {log.names()}")


#: a collective's name -> the kind it is counted as
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def kind(name: str) -> str:
    """The kind a logged collective counts as: one of ``KINDS`` or ``"other"``."""
    return next((k for k in KINDS if k in name), "other")


@dataclass
class StepRecord:
    """One optimizer step: its loss (or its micro-batches' losses), collectives by name,
    CPU and wall seconds."""

    loss: float | list[float] | None = None
    collectives: Counter = field(default_factory=Counter)
    cpu: float | None = None
    wall: float | None = None

    def by_kind(self) -> dict[str, int]:
        """Collectives per kind (``KINDS``, and ``"other"`` where any)."""
        out = Counter({k: 0 for k in KINDS})
        for name, n in self.collectives.items():
            out[kind(name)] += n
        return dict(out)
