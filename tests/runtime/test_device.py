"""The device abstraction on CPU (every stream/event method a no-op) and the
stream-ordered wait path with its watchdog timeout, driven on gloo by a fake event."""

from __future__ import annotations

import contextlib
import datetime
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import flexshard as fs
from flexshard.runtime import collectives
from flexshard.runtime.collectives import CollectiveError, Pending, Watchdog
from flexshard.runtime.device import HOST, DeviceRuntime, device_runtime


def test_cpu_runtime_is_a_no_op(one_rank_group):
    runtime = device_runtime(torch.device("cpu"), one_rank_group)
    assert runtime is HOST and not runtime.streams
    assert runtime.all_gather_stream is None and runtime.reduce_scatter_stream is None
    assert device_runtime(torch.device("meta"), one_rank_group) is HOST
    with runtime.on(runtime.all_gather_stream):
        x = torch.ones(3) * 2
    assert runtime.record() is None
    runtime.wait(None)
    runtime.join(None)
    runtime.protect(x, None)
    work = dist.all_reduce(x, async_op=True)
    assert runtime.enqueue_wait(work) is None  # gloo: the caller waits (blocking) as before
    work.wait()
    assert x.tolist() == [2.0, 2.0, 2.0]


class _Event:
    """Stands in for a CUDA event: completes when ``done`` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class _StreamRuntime(DeviceRuntime):
    """The CUDA runtime's wait protocol on CPU: waits are recorded, never blocking."""

    def __init__(self, event: _Event) -> None:
        super().__init__(torch.device("cpu"), streams=False)
        self.streams = True  # stream-ordered waits, without torch.cuda's streams
        self.event = event
        self.waited: list[_Event] = []

    def enqueue_wait(self, work):
        work.wait()  # the fake's completion is the event; the real work is done here
        return self.event

    def wait(self, event):
        self.waited.append(event)


def _launch(group, runtime, timeout_s: float) -> Pending:
    x = torch.ones(4)
    return Pending.launch(
        lambda: dist.all_reduce(x, async_op=True),
        "all-reduce",
        "layers.3",
        datetime.timedelta(seconds=timeout_s),
        group,
        runtime=runtime,
    )


def test_stream_ordered_wait_does_not_block(one_rank_group, monkeypatch):
    dog = Watchdog(interval=0.02)
    monkeypatch.setattr(collectives, "WATCHDOG", dog)
    event = _Event()
    runtime = _StreamRuntime(event)
    pending = _launch(one_rank_group, runtime, timeout_s=30)
    started = time.monotonic()
    pending.wait()  # not complete: the stream waits, the CPU returns at once
    pending.wait()  # waited once only
    assert time.monotonic() - started < 1 and runtime.waited == [event]
    event.done = True
    dog.poll()
    assert dog._watched == [] and dog.failure is None


def test_watchdog_times_out_naming_bucket_collective_rank(one_rank_group, monkeypatch):
    dog = Watchdog(interval=0.02)
    monkeypatch.setattr(collectives, "WATCHDOG", dog)
    aborted = []
    monkeypatch.setattr(collectives, "abort", lambda g: aborted.append(g))
    pending = _launch(one_rank_group, _StreamRuntime(_Event()), timeout_s=0.1)
    pending.wait()
    deadline = time.monotonic() + 10
    while dog.failure is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert aborted == [one_rank_group]
    with pytest.raises(CollectiveError, match="all-reduce of bucket 'layers.3' did not") as err:
        pending.wait()
    assert (err.value.bucket, err.value.collective, err.value.rank) == ("layers.3", "all-reduce", 0)
    # sticky: the next launch on any bucket refuses, naming the first failure
    with pytest.raises(CollectiveError, match="layers.3"):
        _launch(one_rank_group, HOST, timeout_s=30)


def test_post_optim_event_is_consumed_by_the_next_gather(one_rank_group):
    mesh = DeviceMesh("cpu", [0])
    model = fs.fully_shard(torch.nn.Linear(4, 3), mesh=mesh)
    (bucket,) = model._flexshard_buckets
    model.set_post_optim_event(object())  # on CPU any event: the gather waits on nothing
    assert bucket.schedule.post_optim_event is not None
    model(torch.ones(2, 4)).sum().backward()
    assert bucket.schedule.post_optim_event is None


class _LoggingRuntime(DeviceRuntime):
    """Stands in for the CUDA runtime in a gloo run: names its streams, logs which
    stream each collective and each buffer protection runs on, and the joins."""

    def __init__(self, log: list) -> None:
        super().__init__(torch.device("cpu"), streams=False)
        self.all_gather_stream, self.reduce_scatter_stream = "ag", "rs"  # type: ignore
        self.log, self.current = log, "compute"

    @contextlib.contextmanager
    def on(self, stream):
        outer, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = outer

    def join(self, stream):
        self.log.append(("join", stream, self.current))

    def protect(self, tensor, stream):
        self.log.append(("protect", stream, self.current))


def _stream_wiring(rank, world_size):
    from flexshard.runtime import bucket as bucket_module
    from flexshard.testing import TinyTransformer, TransformerConfig, make_batches

    log: list = []
    runtime = _LoggingRuntime(log)
    bucket_module.device_runtime = lambda device, group: runtime
    for kind in ("all_gather", "reduce_scatter"):
        original = getattr(collectives.BucketComm, kind)

        def logged(self, *args, _original=original, _kind=kind):
            log.append((_kind, self.bucket, runtime.current))
            return _original(self, *args)

        setattr(collectives.BucketComm, kind, logged)
    mesh = DeviceMesh("cpu", list(range(world_size)))
    model = TinyTransformer(TransformerConfig())
    for layer in model.layers:
        fs.fully_shard(layer, mesh=mesh)
    fs.fully_shard(model, mesh=mesh)
    tokens, targets = make_batches(model.cfg, 1, batch=2)[0]
    model.loss(tokens, targets).backward()
    return log


def test_collectives_run_on_their_streams_and_backward_joins():
    from flexshard.testing import run_distributed

    log = run_distributed(_stream_wiring, 2)[0]
    gathers = [entry for entry in log if entry[0] == "all_gather"]
    reduces = [entry for entry in log if entry[0] == "reduce_scatter"]
    assert len(gathers) == 3 + 2 and len(reduces) == 3  # root + 2 layers, 2 re-gathers
    assert {stream for *_, stream in gathers} == {"ag"}
    assert {stream for *_, stream in reduces} == {"rs"}
    # every reduce-scatter input is protected for the reduce-scatter stream, from compute
    assert log.count(("protect", "rs", "compute")) == 3
    # compute joins the reduce-scatter stream (one runtime for all buckets) once, after
    # the last reduction
    joins = [i for i, entry in enumerate(log) if entry == ("join", "rs", "compute")]
    assert len(joins) == 1 and joins[0] > log.index(reduces[-1])
