"""The floor of bench_overhead.py: the collectives flexshard's ``fully_shard`` issues
for a stack of ``Linear`` + ReLU blocks, on the same buckets, with no hook machinery.

Per block (one flexshard bucket each) a plain flat shard, the same size and dtype as
the bucket's storage, is what AdamW steps. A step hand-schedules what flexshard's
hooks schedule: forward gathers each block before it runs and launches the next
block's all-gather (left in flight), frees the gathered parameters after the block;
backward, driven block by block with ``torch.autograd.grad``, re-gathers each block
(the next one's gather launched and waited for at once, as flexshard's backward
prefetch on CPU), frees it, packs its gradients into the reduce-scatter input and
launches the reduce-scatter, one in flight at a time. A group of one rank copies
where the others communicate, as flexshard does. The same kernels in the same order
as flexshard's step, so the loss and the parameters are the same bit for bit
(bench_overhead.py checks it, and that the collectives and their bytes are the same).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flexshard.placements import Shard
from flexshard.runtime.bucket import Bucket
from flexshard.runtime.module import own_buckets
from flexshard.torch_internals import all_gather_single, reduce_scatter_single


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


#: one piece of one parameter: (its index, first element in the full parameter, length);
#: a start of None: the whole parameter as ``[W, length]``, rank r's piece in row r
Piece = tuple[int, int | None, int]


def _pieces(bucket: Bucket) -> tuple[list[Piece], list[tuple[int, int]]]:
    """Every rank's piece of every parameter (one per parameter whose rows divide
    evenly) and, for each, (rank or -1 for every row, offset) in ``[W, shard numel]``."""
    layout = bucket.store.storage_layout
    world = layout.world_size
    pieces: list[Piece] = []
    places: list[tuple[int, int]] = []
    for index, (param, held) in enumerate(zip(layout.params, bucket.params)):
        if held.placement != Shard(0):
            raise ValueError(f"the floor takes Shard(0) parameters, not {held.fqn}'s")
        rows = -(-param.shape[0] // world)  # ceil: FSDP2's rows per rank
        per_row = param.numel // max(param.shape[0], 1)
        lengths = [param.local_numel(r) for r in range(world)]
        if sum(lengths) != param.numel:
            raise ValueError(f"{bucket.name}: the shards of {held.fqn} do not add up")
        if len(set(lengths)) == 1 and len(set(param.offsets)) == 1:
            pieces.append((index, None, lengths[0]))
            places.append((-1, param.offsets[0]))
            continue
        for r, (offset, length) in enumerate(zip(param.offsets, lengths)):
            if length:
                pieces.append((index, r * rows * per_row, length))
                places.append((r, offset))
    return pieces, places


def _full_views(pieces: list[Piece], fulls: list[torch.Tensor] | tuple, world: int) -> list:
    return [
        fulls[i].view(world, n) if start is None else fulls[i].view(-1)[start : start + n]
        for i, start, n in pieces
    ]


def _flat_views(pieces: list[Piece], places: list, flat2d: torch.Tensor) -> list:
    return [
        flat2d[:, off : off + n] if r < 0 else flat2d[r, off : off + n]
        for (_, _, n), (r, off) in zip(pieces, places)
    ]


class FloorBucket:
    """One block's shard, gathered parameters and reduce-scatter buffers, allocated once."""

    def __init__(self, bucket: Bucket) -> None:
        store, layout = bucket.store, bucket.store.storage_layout
        self.world = layout.world_size
        self.rank = store.rank
        self.group = bucket.comm.shard_group
        self.op = bucket.reduction.op
        shard = layout.shard_numel
        self.shard = nn.Parameter(store.buffer.detach().clone())
        self._shard_data = self.shard.data  # the same memory, no autograd version bumps
        self.gathered = torch.empty(self.world * shard, dtype=store.param_dtype)
        self.fulls = [
            torch.empty(p.shape, dtype=store.param_dtype, requires_grad=True) for p in layout.params
        ]
        # filled without a version bump: autograd saved them for backward
        self._full_data = [f.data for f in self.fulls]
        self._pieces, places = _pieces(bucket)
        gathered2d = self.gathered.view(self.world, shard)
        self._copy_out = (
            _full_views(self._pieces, self._full_data, self.world),
            _flat_views(self._pieces, places, gathered2d),
        )
        self._cast = store.param_dtype != store.dtype  # into this rank's part of the gather
        self._send = (
            self.gathered[self.rank * shard : (self.rank + 1) * shard]
            if self._cast
            else self._shard_data
        )
        self._rs_in = torch.zeros(self.world * shard, dtype=store.reduce_dtype)
        self._rs_out = torch.empty(shard, dtype=store.reduce_dtype)
        self._rs_dst = _flat_views(self._pieces, places, self._rs_in.view(self.world, shard))
        self._gather: dist.Work | None = None
        self._landed = False
        self._reduce: dist.Work | None = None
        self.free()

    def free(self) -> None:
        _free(self.gathered)
        for full in self._full_data:
            _free(full)

    def launch_gather(self, wait: bool) -> None:
        _alloc(self.gathered)
        if self._cast:
            self._send.copy_(self._shard_data)
        if self.world == 1:
            if not self._cast:
                self.gathered.copy_(self._send)
            self._landed = True
            return
        self._gather = all_gather_single(self.gathered, self._send, group=self.group, async_op=True)
        if wait:
            self._gather.wait()
            self._gather, self._landed = None, True

    def unshard(self) -> None:
        if self._gather is None and not self._landed:
            self.launch_gather(wait=True)
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        self._landed = False
        for full in self._full_data:
            _alloc(full)
        torch._foreach_copy_(*self._copy_out)

    def launch_reduce(self, grads: tuple[torch.Tensor, ...]) -> None:
        torch._foreach_copy_(self._rs_dst, _full_views(self._pieces, grads, self.world))
        if self.world == 1:
            self._rs_out.copy_(self._rs_in)
            return
        self._reduce = reduce_scatter_single(
            self._rs_out, self._rs_in, op=self.op, group=self.group, async_op=True
        )

    def finish_reduce(self) -> None:
        if self._reduce is not None:
            self._reduce.wait()
            self._reduce = None
        self.shard.grad = self._rs_out


class Floor:
    """The hand-scheduled step over the buckets of ``model`` (a flexshard ``fully_shard``
    stack of ``Linear`` + ReLU blocks), with its own AdamW on the shards."""

    def __init__(self, model: nn.Module) -> None:
        self.buckets = [FloorBucket(b) for block in model for b in own_buckets(block)]
        if len(self.buckets) != len(model):
            raise ValueError("the floor takes one bucket per block")
        self.dtype = self.buckets[0].fulls[0].dtype
        self.opt = torch.optim.AdamW([b.shard for b in self.buckets], lr=1e-3, foreach=True)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        buckets = self.buckets
        h = x.to(self.dtype)
        inputs, outputs = [], []
        for i, bucket in enumerate(buckets):
            bucket.unshard()
            if i + 1 < len(buckets):
                buckets[i + 1].launch_gather(wait=False)  # prefetch, in flight beside compute
            inputs.append(h)
            weight, bias = bucket.fulls
            out = torch.relu(F.linear(h, weight, bias))
            outputs.append(out)
            bucket.free()
            h = out.detach().requires_grad_()
        loss = outputs[-1].float().square().mean()
        (grad,) = torch.autograd.grad(loss, outputs[-1])
        in_flight: deque[FloorBucket] = deque()
        for i in reversed(range(len(buckets))):
            bucket = buckets[i]
            bucket.unshard()
            if i > 0:
                buckets[i - 1].launch_gather(wait=True)  # CPU backward prefetch: waited at once
            wrt = (*bucket.fulls, inputs[i]) if i > 0 else tuple(bucket.fulls)
            grads = torch.autograd.grad(outputs[i], wrt, grad)
            bucket.free()
            bucket.launch_reduce(grads[:2])
            in_flight.append(bucket)
            if len(in_flight) > 1:
                in_flight.popleft().finish_reduce()
            if i > 0:
                grad = grads[2]
        while in_flight:
            in_flight.popleft().finish_reduce()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()
