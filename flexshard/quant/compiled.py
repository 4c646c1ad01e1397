"""When the codec runs compiled, and the cache of its compiled functions.

Mode (``FLEXSHARD_QUANT_COMPILE`` in the environment, or ``set_compile_mode``):

* ``"auto"`` (the default): a caller may compile where it pays; the quantized all-gather
  does on CPU for buckets of at least ``AUTO_MIN_NUMEL`` elements, from the second call of
  each bucket shape on (``runtime/quantized.py``). CUDA stays eager (torch's fp8 casts are
  native there, and the compiled path has not been checked bit for bit on a GPU);
* ``"on"`` (or ``1``): compile on every device, from the first call;
* ``"off"`` (or ``0``): eager only.

Compiling is never allowed to change a result: one compiled function per key (a bucket's
static shape), checked bit for bit against the eager codec on its first call by the caller;
if compiling raises (no C++ compiler, an inductor bug) the compiled path is switched off for
the process with one warning, and the call runs eagerly.

Each key gets a function with a code object of its own: dynamo keeps its compiled graphs per
code object and stops compiling one after ``recompile_limit`` (8) variants, silently running
it eagerly; a model has many bucket shapes, each compiled exactly once here.
"""

from __future__ import annotations

import os
import time
import types
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "AUTO_MIN_NUMEL",
    "CompiledFn",
    "compile_mode",
    "compiled_fn",
    "failed",
    "first_call",
    "intern",
    "set_compile_mode",
    "stats",
    "traced",
]

ENV = "FLEXSHARD_QUANT_COMPILE"
_ALIASES = {"auto": "auto", "on": "on", "1": "on", "off": "off", "0": "off", "eager": "off"}
#: the least elements of a bucket for "auto" to compile its codec on CPU: below it a call
#: saves under ~0.1-0.25 ms (0.4-1 ns per element), not worth seconds of compile per shape
AUTO_MIN_NUMEL = 1 << 18

_mode: list[str | None] = [None]  # set_compile_mode's choice; None: the environment's
_broken: list[str] = []  # why compiling failed in this process (then: eager only)
_eager_runs = [0]  # bodies of compiled functions that ran as Python (dynamo did not compile)
_seen: dict[int, int] = {}
_ids: dict[Hashable, int] = {}  # full keys (a bucket's static shape) -> small ints


def _parse(value: str, source: str) -> str:
    mode = _ALIASES.get(value.strip().lower())
    if mode is None:
        raise ValueError(f"{source} must be one of auto, on, off (or 1, 0), got {value!r}")
    return mode


def compile_mode() -> str:
    """``"auto"``, ``"on"`` or ``"off"``; ``"off"`` too once compiling has failed."""
    if _broken:
        return "off"
    if _mode[0] is not None:
        return _mode[0]
    return _parse(os.environ.get(ENV, "auto"), ENV)


def set_compile_mode(mode: str | None) -> None:
    """Override ``FLEXSHARD_QUANT_COMPILE`` for this process (None: follow it again)."""
    _mode[0] = None if mode is None else _parse(mode, "mode")


@dataclass
class CompiledFn:
    """One key's compiled function and what happened to it."""

    fn: Callable[..., Any]
    calls: int = 0
    compile_s: float = 0.0  # the first call's time (dynamo + inductor + the C++ build)
    checked: bool = False  # the caller compared its first result with the eager codec
    failed: str | None = None  # why it is not used (a mismatch, an error)
    _first: bool = field(default=True, repr=False)

    def __call__(self, *args: Any) -> Any:
        """Run it (no autograd: the codec's graphs are inference graphs). Should dynamo run
        the body as Python instead (exact, but slower than the eager codec), it is retired."""
        start, eager_runs = time.perf_counter(), _eager_runs[0]
        with torch.no_grad():
            out = self.fn(*args)
        if self._first:
            self.compile_s, self._first = time.perf_counter() - start, False
        self.calls += 1
        if _eager_runs[0] != eager_runs:
            failed(self, "torch.compile ran it as Python (not compiled)")
        return out


_cache: dict[int, CompiledFn] = {}


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own (its own dynamo cache, see the module doc)."""
    code = fn.__code__.replace()  # a new object, equal in value
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def traced() -> None:
    """Called first thing in every body handed to ``compiled_fn``: counts the runs that
    are Python, not a compiled graph (dynamo folds ``is_compiling()`` to True)."""
    if not torch.compiler.is_compiling():
        _eager_runs[0] += 1


def intern(key: Hashable) -> int:
    """A small int for ``key``: callers hash their (large) key once, then pass the int."""
    return _ids.setdefault(key, len(_ids))


def first_call(key_id: int) -> bool:
    """True the first time ``key_id`` is seen in this process ("auto" runs it eagerly)."""
    seen = _seen[key_id] = _seen.get(key_id, 0) + 1
    return seen == 1


def compiled_fn(key_id: int, make: Callable[[], Callable[..., Any]]) -> CompiledFn | None:
    """The compiled function of ``key_id`` (``intern``; ``make()`` builds the function to
    compile, once per key), or None when compiling is off or failed (for it, or at all)."""
    if compile_mode() == "off":
        return None
    entry = _cache.get(key_id)
    if entry is None:
        # only tensor guards (shape, stride, dtype, device): the function's Python (its
        # closure, the plan of one bucket shape) never changes, and guarding it costs
        # tens of us a call; the caller's key already pins every input's layout
        options = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
        fn = torch.compile(_own_code(make()), fullgraph=True, dynamic=False, options=options)
        entry = _cache[key_id] = CompiledFn(fn)
    return None if entry.failed else entry


def failed(entry: CompiledFn, reason: str, error: BaseException | None = None) -> None:
    """Stop using ``entry``; an error (compiling raised) stops compiling in this process."""
    entry.failed = reason
    if error is not None and not _broken:
        _broken.append(f"{reason}: {type(error).__name__}: {error}")
        warnings.warn(
            f"flexshard.quant: torch.compile of the codec failed ({_broken[0][:500]}); "
            "the codec runs eagerly (bit for bit the same) from now on",
            RuntimeWarning,
            stacklevel=3,
        )
    elif error is None:
        warnings.warn(
            f"flexshard.quant: the compiled codec was not used: {reason}; that shape runs "
            "eagerly (bit for bit the codec's) from now on",
            RuntimeWarning,
            stacklevel=3,
        )


def stats() -> dict[str, Any]:
    """What was compiled in this process: per key's repr, calls, first-call seconds,
    whether its first result was checked, why it failed; and why compiling stopped."""
    keys = {key_id: key for key, key_id in _ids.items()}
    return {
        "broken": _broken[0] if _broken else None,
        "eager_body_runs": _eager_runs[0],
        "entries": [
            {
                "key": repr(keys.get(key_id))[:200],
                "calls": e.calls,
                "compile_s": e.compile_s,
                "checked": e.checked,
                "failed": e.failed,
            }
            for key_id, e in _cache.items()
        ],
    }


def reset() -> None:
    """Forget every compiled function and a past failure (tests)."""
    _cache.clear()
    _broken.clear()
    _seen.clear()
    _ids.clear()
    _eager_runs[0] = 0
