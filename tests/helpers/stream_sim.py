"""A stream race detector for the runtime's CUDA protocol, run on CPU (as CUDA's own
``torch.cuda._sanitizer`` does on a GPU, with the same vector-clock rule).

``SimStreams`` stands in for ``DeviceRuntime`` with streams on: it names a compute,
an all-gather and a reduce-scatter stream, keeps which one the code is "on", and turns
``on`` / ``record`` / ``wait`` / ``join`` into vector-clock merges. ``StreamAccesses``
(a dispatch mode) logs every op's reads and writes of tensor storages as one op on the
current stream, and so do the bucket collectives (wrapped: gloo runs them in C++). An
access of a storage that another stream wrote (or, for a write, read) is a race unless
the accessing stream has waited, through events or stream waits, for that access.

The caching allocator is modelled as CUDA's: a block belongs to the stream it was
allocated on and, once freed, may be handed to that stream's next allocation at once,
unless ``record_stream`` (``protect``, ``release``) named the other streams that used it.
So a block freed while another stream's use of it is not yet ordered before its own
stream, and not protected for that stream, is a hazard when its stream allocates next.
Not modelled: NCCL's own stream (a collective counts as an op on the stream that
launched it, which then waits for it), and block sizes (any freed block counts as
reusable by any allocation of its stream: conservative).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from flexshard.runtime.device import DeviceRuntime

STREAMS = ("compute", "ag", "rs")


class SimEvent:
    def __init__(self, stream: str, clock: dict[str, int]) -> None:
        self.stream, self.clock = stream, clock

    def query(self) -> bool:  # the watchdog polls it: always complete
        return True


class SimStreams(DeviceRuntime):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), streams=False)
        self.streams = True  # the stream-ordered paths, without torch.cuda
        self.all_gather_stream, self.reduce_scatter_stream = "ag", "rs"  # type: ignore
        self.current = "compute"
        # clock[s][t]: the last op of stream t that stream s is ordered after
        self.clock = {s: dict.fromkeys(STREAMS, 0) for s in STREAMS}
        self.races: list[str] = []
        self.counts = {"record": 0, "wait": 0, "join": 0, "on": 0}
        self.accesses: StreamAccesses | None = None  # set by the mode: blocks, pools

    def _merge(self, into: str, clock: dict[str, int]) -> None:
        mine = self.clock[into]
        for stream, count in clock.items():
            mine[stream] = max(mine[stream], count)

    def tick(self) -> tuple[str, int]:
        self.clock[self.current][self.current] += 1
        return self.current, self.clock[self.current][self.current]

    def visible(self, access: tuple[str, int]) -> bool:
        stream, count = access
        return stream == self.current or self.clock[self.current][stream] >= count

    # ---------------------------------------------------------------- DeviceRuntime
    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        self.counts["on"] += 1
        self._merge(stream, self.clock[self.current])  # stream.wait_stream(current)
        outer, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = outer

    def record(self) -> SimEvent:
        self.counts["record"] += 1
        return SimEvent(self.current, dict(self.clock[self.current]))

    def wait(self, event: Any) -> None:
        if isinstance(event, SimEvent):
            self.counts["wait"] += 1
            self._merge(self.current, event.clock)

    def join(self, stream: Any) -> None:
        if stream is not None:
            self.counts["join"] += 1
            self._merge(self.current, self.clock[stream])

    def protect(self, tensor: Any, stream: Any) -> None:
        if stream is not None and tensor is not None and self.accesses is not None:
            self.accesses.protect(tensor, stream)  # tensor.record_stream(stream)

    def release(self, tensor: torch.Tensor) -> None:
        self.protect(tensor, self.current)  # as device.py: record_stream(current), free
        storage = tensor.untyped_storage()
        if storage.size():
            storage.resize_(0)

    def enqueue_wait(self, work: Any) -> SimEvent:
        if work is not None:  # gloo's work done here; on NCCL the current stream waits on it
            with _disable_current_modes():  # not gloo's own copies (NCCL has none)
                work.wait()
        return self.record()


class _Block:
    """A storage's current memory: the stream it was allocated on, the last op count of
    every stream that used it, the streams ``record_stream`` named."""

    __slots__ = ("stream", "what", "users", "protected")

    def __init__(self, stream: str, what: str) -> None:
        self.stream, self.what = stream, what
        self.users: dict[str, int] = {}
        self.protected: set[str] = set()


class StreamAccesses(TorchDispatchMode):
    """Every op's storage reads and writes, as one op on ``sim.current``; allocations
    and frees, as the caching allocator sees them."""

    def __init__(self, sim: SimStreams) -> None:
        super().__init__()
        self.sim = sim
        sim.accesses = self
        self.history: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [write, reads]
        self.blocks: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _Block
        self.pools: dict[str, list[tuple[str, dict[str, int]]]] = {s: [] for s in STREAMS}
        self.hazards: list[str] = []
        self.ops = 0
        self._resize = torch.UntypedStorage.resize_

    # ---------------------------------------------------------------- the allocator
    def _allocate(self, storage: torch.UntypedStorage, what: str) -> None:
        stream = self.sim.current
        for freed, users in self.pools[stream]:  # any of them may be handed out now
            for other, count in users.items():
                if not self.sim.visible((other, count)):
                    self.hazards.append(
                        f"{what} on {stream} may reuse a block of {freed} freed while "
                        f"{other} could still use it (no record_stream for {other})"
                    )
        self.pools[stream] = []
        block = _Block(stream, what)
        self.blocks[storage] = block
        weakref.finalize(storage, self._free, block)

    def _free(self, block: _Block) -> None:
        if block.stream == "":  # freed already (resized to 0)
            return
        pending = {
            s: c for s, c in block.users.items() if s != block.stream and s not in block.protected
        }
        if pending:
            self.pools[block.stream].append((block.what, pending))
        block.stream = ""

    def _block(self, storage: torch.UntypedStorage) -> _Block:
        block = self.blocks.get(storage)
        if block is None:  # memory from before the mode (parameters, state): compute's
            block = self.blocks[storage] = _Block("compute", "an earlier allocation")
            weakref.finalize(storage, self._free, block)
        return block

    def protect(self, tensor: torch.Tensor, stream: str) -> None:
        storage = _storage(tensor)
        if storage is not None:
            self._block(storage).protected.add(stream)

    def __enter__(self) -> StreamAccesses:
        history, resize = self.history, self._resize

        def fresh_resize(storage: torch.UntypedStorage, size: int) -> Any:
            history.pop(storage, None)  # new memory: a fresh history
            block = self.blocks.pop(storage, None)
            if block is not None:
                self._free(block)
            out = resize(storage, size)
            if size:
                self._allocate(storage, "a resize_")
            return out

        torch.UntypedStorage.resize_ = fresh_resize  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*args)

    def access(self, what: str, reads: list, writes: list, fresh: list = ()) -> None:
        sim = self.sim
        for tensor in fresh:  # results in new memory: allocated on the current stream
            storage = _storage(tensor)
            if storage is not None and storage not in self.blocks:
                self._allocate(storage, what)
        now = sim.tick()
        self.ops += 1
        for tensor in [*reads, *writes]:
            storage = _storage(tensor)
            if storage is not None:
                self._block(storage).users[now[0]] = now[1]
        for tensor in reads:
            storage = _storage(tensor)
            if storage is None:
                continue
            entry = self.history.setdefault(storage, [None, {}])
            if entry[0] is not None and not sim.visible(entry[0]):
                sim.races.append(f"{what} on {now[0]} reads what {entry[0][0]} wrote")
            entry[1][now[0]] = now[1]
        for tensor in writes:
            storage = _storage(tensor)
            if storage is None:
                continue
            entry = self.history.setdefault(storage, [None, {}])
            earlier = [entry[0]] if entry[0] is not None else []
            earlier += [(s, c) for s, c in entry[1].items() if s != now[0]]
            for access in earlier:
                if not sim.visible(access):
                    sim.races.append(f"{what} on {now[0]} overwrites what {access[0]} used")
            entry[0], entry[1] = now, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor runs its local ops through here
            return func(*args, **(kwargs or {}))  # sharding propagation's fake tensors
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        written = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        aliased = {id(s) for s in map(_storage, inputs) if s is not None}
        outputs = [  # fresh results (a view of an input is no write)
            t
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and id(_storage(t)) not in aliased
        ]
        self.access(str(func), inputs, written + outputs, outputs)
        return out


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu":
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage if storage.size() else None
