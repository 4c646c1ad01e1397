"""A load that reads each stored chunk once, whoever needs it.

DCP's reader has every rank read each chunk its plan names: a chunk that several ranks
need (a replicated tensor, the same shard on every HSDP replica, a chunk saved at W = 2
that two ranks of a W = 4 load cut pieces from) is read from storage once per rank.
``StripedReader`` takes the plans DCP already gathers on the coordinator and gives
each stored chunk one reader among the ranks that need it (longest-first, to the
needer with the fewest bytes so far). Each rank reads and checks only its stripe
(checksum on the bytes read, as ``VerifyingReader``), then the raw bytes move to the
other needers in batches: one ``all_to_all_single`` over the load's group per batch,
each batch staging at most ``batch_bytes`` per rank (a chunk larger than that travels
alone). Every rank then decodes what it needs from those bytes exactly as DCP does
(``weights_only``: no code from the checkpoint), so the values are DCP's, bit for bit.

A chunk that fails its check, or whose bytes cannot be decoded, never stops a rank
between collectives: it is sent marked bad (its receivers skip it), and the error is
raised once every batch has moved; DCP then raises it on every rank. A peer that dies
or stalls during an exchange fails the collective within the group's timeout; the
error names the ranks that had not reached that batch (``load_progress.py``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from ..runtime.collectives import CollectiveError
from .load_progress import LoadProgress, TrackedReader, batch
from .manifest import storage_key
from .verified_read import ChecksumError, check_chunk, decode_chunk, open_unbuffered, read_chunk

#: staging per rank and batch: the bytes a rank sends plus those it receives
DEFAULT_BATCH_BYTES = 64 * 2**20
_OK, _BAD = 1, 0  # the byte before each chunk sent: whether its reader got it right
_NOTHING = torch.empty(0, dtype=torch.uint8)


@dataclass
class RankBatch:
    """One rank's part of one batch: the chunks it reads (with the ranks it sends each
    to) and the chunks it receives (with their reader), in the order they travel."""

    reads: list[tuple[MetadataIndex, tuple[int, ...]]] = field(default_factory=list)
    receives: list[tuple[MetadataIndex, int]] = field(default_factory=list)
    #: whether this batch moves any bytes between ranks (the same on every rank)
    exchange: bool = False


@dataclass(frozen=True)
class _Chunk:
    index: MetadataIndex
    length: int
    needers: tuple[int, ...]


def assign_readers(chunks: list[_Chunk]) -> dict[MetadataIndex, int]:
    """One reader per chunk among its needers, balanced by bytes: the largest chunks
    first, each to the needer that has the fewest bytes to read so far (lowest rank
    on a tie), so every rank reads a near-equal share of what it already needs."""
    load: dict[int, int] = defaultdict(int)
    reader: dict[MetadataIndex, int] = {}
    for chunk in sorted(chunks, key=lambda c: (-c.length, storage_key(c.index))):
        chosen = min(chunk.needers, key=lambda r: (load[r], r))
        load[chosen] += chunk.length
        reader[chunk.index] = chosen
    return reader


def stripe_schedule(
    needs: list[list[MetadataIndex]],
    lengths: dict[MetadataIndex, int],
    order: Callable[[MetadataIndex], Any],
    batch_bytes: int,
) -> list[list[RankBatch]]:
    """Per rank, its part of every batch (all ranks get the same number of batches).
    ``needs``: the storage indices each rank's plan reads; ``lengths``: each stored
    chunk's bytes; ``order``: the sort key of the storage order (file, offset: reads go
    sequentially). A batch closes before any rank's staging would pass ``batch_bytes``."""
    needers: dict[MetadataIndex, set[int]] = defaultdict(set)
    for rank, indices in enumerate(needs):
        for index in indices:
            needers[index].add(rank)
    chunks = [_Chunk(i, lengths[i], tuple(sorted(r))) for i, r in needers.items()]
    reader = assign_readers(chunks)
    world = len(needs)
    batches: list[list[RankBatch]] = []
    staged = [0] * world
    for chunk in sorted(chunks, key=lambda c: order(c.index)):
        src = reader[chunk.index]
        dests = tuple(r for r in chunk.needers if r != src)
        cost = {src: chunk.length * len(dests), **{d: chunk.length for d in dests}}
        full = any(staged[r] and staged[r] + b > batch_bytes for r, b in cost.items() if b)
        if not batches or full:
            batches.append([RankBatch() for _ in range(world)])
            staged = [0] * world
        batch = batches[-1]
        batch[src].reads.append((chunk.index, dests))
        for dest in dests:
            batch[dest].receives.append((chunk.index, src))
        for rank, added in cost.items():
            staged[rank] += added
        if dests:
            for part in batch:
                part.exchange = True
    for batch in batches:  # a receiver takes each sender's chunks in the order it sends them
        for part in batch:
            part.receives.sort(key=lambda item: item[1])
    return [[batch[rank] for batch in batches] for rank in range(world)]


class StripedReader(TrackedReader):
    """A TrackedReader for DCP loads over ``group`` in which each chunk is read from
    storage by one rank and sent to the others that need it. ``digests`` (manifest key
    -> sha256; None: unchecked) are checked on the bytes read; ``batch_bytes`` bounds
    each rank's staging per batch; ``metadata_bytes`` as for ``SafeReader``;
    ``progress``: the load's (default: a new one on ``group``)."""

    def __init__(
        self,
        root: str,
        digests: dict[str, str] | None,
        group: dist.ProcessGroup,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        metadata_bytes: bytes | None = None,
        progress: LoadProgress | None = None,
    ) -> None:
        progress = progress if progress is not None else LoadProgress(group, root)
        super().__init__(root, metadata_bytes, progress)
        self._progress = progress
        if batch_bytes <= 0:
            raise ValueError(f"batch_bytes = {batch_bytes}: must be > 0")
        self._root = root
        self._digests = digests
        self._group = group
        self._batch_bytes = batch_bytes
        #: an exchange that failed (a peer died or stalled): DCP's own collectives fail
        #: after it, with less to say, so the load raises this one
        self.exchange_failure: CollectiveError | None = None

    # ----------------------------------------------------------- planning (coordinator)
    def _storage_order(self, index: MetadataIndex) -> tuple[str, int]:
        info = self.storage_data[index]
        return (info.relative_path, info.offset)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        needs = [[item.storage_index for item in plan.items] for plan in plans]
        lengths = {i: self.storage_data[i].length for indices in needs for i in indices}
        schedule = stripe_schedule(needs, lengths, self._storage_order, self._batch_bytes)
        return super().prepare_global_plan(
            [
                LoadPlan(plan.items, storage_data=parts, planner_data=plan.planner_data)
                for plan, parts in zip(plans, schedule, strict=True)
            ]
        )

    # ----------------------------------------------------------- reading (every rank)
    def read_chunks(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        items: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            items[item.storage_index].append(item)
        errors: list[BaseException] = []
        files: dict[str, IO[bytes]] = {}
        try:
            for number, part in enumerate(plan.storage_data):
                self._batch(number, part, items, planner, files, errors)
        finally:
            for stream in files.values():
                stream.close()
        if errors:
            raise errors[0]

    def _read(self, index: MetadataIndex, files: dict[str, IO[bytes]]) -> bytes:
        info = self.storage_data[index]
        stream = files.get(info.relative_path)
        if stream is None:
            path = os.path.join(self._root, info.relative_path)
            stream = files[info.relative_path] = open_unbuffered(path)  # closed in read_chunks
        data = read_chunk(stream, index, info)
        if self._digests is not None:
            check_chunk(self._digests, index, data, info)
        elif len(data) != info.length:  # its receivers expect info.length bytes
            raise ChecksumError(
                f"'{storage_key(index)}' is missing or truncated in '{info.relative_path}'"
            )
        return data

    def _decode(
        self, data: bytes, wanted: list[ReadItem], planner: LoadPlanner, errors: list
    ) -> None:
        for item in wanted:
            try:
                decode_chunk(item, data, planner)
            except Exception as err:  # raised once every batch has moved
                errors.append(err)

    def _batch(
        self,
        number: int,
        part: RankBatch,
        items: dict[MetadataIndex, list[ReadItem]],
        planner: LoadPlanner,
        files: dict[str, IO[bytes]],
        errors: list[BaseException],
    ) -> None:
        world = dist.get_world_size(self._group)
        outgoing: list[list[bytes]] = [[] for _ in range(world)]
        for index, dests in part.reads:
            try:
                data, status = self._read(index, files), _OK
            except Exception as err:
                errors.append(err)
                data, status = bytes(self.storage_data[index].length), _BAD
            if status == _OK and index in items:
                self._decode(data, items[index], planner, errors)
            for dest in dests:
                outgoing[dest] += [bytes([status]), data]
        if not part.exchange:
            return
        payload = bytearray().join(piece for out in outgoing for piece in out)  # one copy
        send = torch.frombuffer(payload, dtype=torch.uint8) if payload else _NOTHING
        send_splits = [sum(len(b) for b in out) for out in outgoing]
        recv_splits = [0] * world
        for index, src in part.receives:
            recv_splits[src] += 1 + self.storage_data[index].length
        received = torch.empty(sum(recv_splits), dtype=torch.uint8)
        self._exchange(number, received, send, recv_splits, send_splits)
        at = 0
        view = memoryview(received.numpy())
        for index, _ in part.receives:
            length = self.storage_data[index].length
            if view[at] == _OK:
                self._decode(bytes(view[at + 1 : at + 1 + length]), items[index], planner, errors)
            at += 1 + length

    def _exchange(
        self,
        number: int,
        received: torch.Tensor,
        send: torch.Tensor,
        recv_splits: list[int],
        send_splits: list[int],
    ) -> None:
        self._progress.arrive(batch(number))
        try:
            dist.all_to_all_single(received, send, recv_splits, send_splits, group=self._group)
        except Exception as err:
            self.exchange_failure = self._progress.failure(err, self._progress.step())
            raise self.exchange_failure from None
