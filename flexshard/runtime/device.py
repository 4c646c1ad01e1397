"""Every CUDA-only branch of the runtime: side streams, events, buffer protection and
stream-ordered waits, as FSDP2 uses them.

On CPU (gloo) and meta each method is a no-op and ``record`` returns None, so the
bucket code is the same everywhere. On CUDA with NCCL (``DeviceRuntime.streams``):

* a bucket's all-gather (copy-in, collective) runs on ``all_gather_stream`` after that
  stream waited on the compute stream; compute waits on the gather's event before it
  reads the gathered parameters;
* a reduce-scatter runs on ``reduce_scatter_stream`` after it waited on the compute
  stream (the end of the bucket's backward); the gradient copy runs there too, and
  compute waits on that stream at the end of backward;
* every block a side stream allocates is allocated *after* that stream waited on the
  compute stream, so a buffer freed on the CPU while compute still reads it is never
  reused before those reads ran (the caching allocator hands a freed block only to
  its own stream); a compute-allocated buffer a side stream reads is ``protect``-ed
  with ``record_stream``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..torch_internals import abort_cuda_backend

#: ``DeviceRuntime.on`` without a stream: made once, entered at no cost
_HERE = contextlib.nullcontext()


class DeviceRuntime:
    """Streams and events of one device (shared by every bucket on it)."""

    def __init__(self, device: torch.device, streams: bool) -> None:
        self.device = device
        #: side streams and stream-ordered waits: CUDA tensors on an NCCL group only
        self.streams = streams
        self.all_gather_stream: torch.cuda.Stream | None = None
        self.reduce_scatter_stream: torch.cuda.Stream | None = None
        if streams:
            # high priority, as FSDP2's, so a collective is not queued behind compute
            self.all_gather_stream = torch.cuda.Stream(device, priority=-1)
            self.reduce_scatter_stream = torch.cuda.Stream(device, priority=-1)

    def on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        """Run the enclosed ops on ``stream`` after it waited on the compute stream
        (none: where they are, at no cost; a bucket enters this several times a step)."""
        if stream is None:
            return _HERE
        return self._on(stream)

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream) -> Iterator[None]:
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        """An event at the current point of the current stream (None without streams)."""
        if not self.streams:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """The current stream waits on ``event``; the CPU does not."""
        if self.streams and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def join(self, stream: torch.cuda.Stream | None) -> None:
        """The current (compute) stream waits on all ``stream`` has queued so far."""
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def protect(self, tensor: torch.Tensor | None, stream: torch.cuda.Stream | None) -> None:
        """``tensor`` (allocated on another stream) is not reused before ``stream``'s
        work queued so far has run, even if the CPU drops it now."""
        if stream is not None and tensor is not None and tensor.is_cuda:
            tensor.record_stream(stream)

    def release(self, tensor: torch.Tensor) -> None:
        """Free ``tensor``'s storage now; on CUDA its memory is reused only after the
        current stream's queued reads of it have run."""
        if self.streams and tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(self.device))
        storage = tensor.untyped_storage()
        if storage.nbytes() != 0:
            storage.resize_(0)

    def enqueue_wait(self, work: dist.Work | None) -> torch.cuda.Event | None:
        """Make the current stream wait on ``work`` and return an event marking it, or
        None where waits block the CPU (gloo): the caller waits as before. NCCL's
        ``wait()`` without a timeout is a stream wait; with one it blocks the CPU."""
        if not self.streams or work is None:
            return None
        work.wait()
        return self.record()


def abort(group: dist.ProcessGroup) -> None:
    """Best effort: abort ``group``'s NCCL communicators so kernels stuck in a collective
    exit and the CPU, blocked in a synchronisation, gets control back (the watchdog
    calls this when a collective passed its timeout)."""
    with contextlib.suppress(Exception):
        abort_cuda_backend(group)


#: CPU, meta and gloo: every method a no-op
HOST = DeviceRuntime(torch.device("cpu"), streams=False)


@functools.cache
def _runtime(device: torch.device) -> DeviceRuntime:
    return DeviceRuntime(device, streams=True)


def device_runtime(device: torch.device, group: dist.ProcessGroup | None) -> DeviceRuntime:
    """The runtime for buffers on ``device`` moved by ``group``: streams on CUDA/NCCL,
    no-ops elsewhere (CPU, meta, gloo)."""
    # "nccl", or a multi-backend group such as "cpu:gloo,cuda:nccl" (CUDA tensors: NCCL)
    streams = device.type == "cuda" and group is not None and "nccl" in dist.get_backend(group)
    if not streams:
        return HOST
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _runtime(device)
