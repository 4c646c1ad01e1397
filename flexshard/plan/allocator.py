"""torch's CUDA caching allocator, simulated on a sequence of allocations and frees, for
what it *reserves* (the figure torchtitan logs as ``memory``: ``reserved_bytes.all.peak``)
beside what is allocated.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.x):

- a request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
- requests of at most 1 MiB (``kSmallSize``) come from the small pool, larger ones from
  the large pool; a block serves only the stream it was made on;
- a request takes the smallest free block of its pool and stream that fits (best fit,
  lowest address among equals), split when the rest is large enough (small pool: at
  least 512 bytes; large pool: more than 1 MiB; with expandable segments any 512);
- with none free, a new segment: 2 MiB (``kSmallBuffer``) for a small request, 20 MiB
  (``kLargeBuffer``) below 10 MiB (``kMinLargeAlloc``), else the request rounded up to
  2 MiB (``kRoundLarge``);
- a freed block merges with its free neighbours and stays cached (reserved);
- where a new segment would pass the device's capacity, every cached segment that is
  wholly free is released (``release_cached_blocks``) and the request retried.

``expandable_segments:True`` (``PYTORCH_CUDA_ALLOC_CONF``, as torchtitan's launch script
sets it): one segment per pool and stream that grows by pages (20 MiB in the large pool,
2 MiB in the small) at its end; a request no free block fits maps just the pages its
last free block lacks. Short of capacity, the free pages at a segment's end are
unmapped. (The allocator can also unmap free pages inside a segment; not modelled.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment (and page, expandable)
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a large pool's segment below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def round_size(size: int) -> int:
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """What a new (non-expandable) segment for a rounded request of ``size`` reserves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    segment: _Segment
    offset: int
    size: int
    free: bool = True


@dataclass
class _Segment:
    pool: tuple[str, bool]  # (stream, small)
    size: int  # reserved (mapped) bytes
    blocks: list[_Block] = field(default_factory=list)  # by address


class CachingAllocator:
    """One device's caching allocator. ``capacity``: the device's bytes (None: no
    limit). Keys name the live allocations."""

    def __init__(self, expandable: bool = False, capacity: int | None = None) -> None:
        self.expandable = expandable
        self.capacity = capacity
        self._segments: list[_Segment] = []
        self._live: dict[object, _Block] = {}
        self._requested: dict[object, int] = {}
        self.requested = 0  # bytes the live allocations asked for (torch's requested_bytes)
        self.peak_requested = 0
        self.allocated = 0  # bytes of the live allocations' blocks
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.retries = 0  # requests that released the cache first (num_alloc_retries)
        self.over_capacity = 0  # requests that passed the capacity even then (an OOM)

    def malloc(self, key: object, size: int, stream: str = "default") -> None:
        if key in self._live:
            raise ValueError(f"allocation {key!r} is already live")
        self._requested[key] = size
        self.requested += size
        self.peak_requested = max(self.peak_requested, self.requested)
        size = round_size(size)
        pool = (stream, size <= SMALL_SIZE)
        block = self._best_fit(pool, size) or self._new_block(pool, size)
        self._split(block, size)
        block.free = False
        self._live[key] = block
        self.allocated += block.size  # a block left whole counts whole, as torch's stats do
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def is_live(self, key: object) -> bool:
        return key in self._live

    def free(self, key: object) -> None:
        block = self._live.pop(key)
        self.requested -= self._requested.pop(key)
        self.allocated -= block.size
        block.free = True
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:  # merge with the next
            block.size += blocks.pop(i + 1).size
        if i > 0 and blocks[i - 1].free:  # and the previous
            blocks[i - 1].size += blocks.pop(i).size

    def _best_fit(self, pool: tuple[str, bool], size: int) -> _Block | None:
        best = None
        for segment in self._segments:
            if segment.pool != pool:
                continue
            for block in segment.blocks:
                if block.free and block.size >= size and (best is None or block.size < best.size):
                    best = block
        return best

    def _split(self, block: _Block, size: int) -> None:
        rest = block.size - size
        small = block.segment.pool[1]
        if rest >= MIN_BLOCK if (small or self.expandable) else rest > SMALL_SIZE:
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, _Block(block.segment, block.offset + size, rest))
            block.size = size

    def _make_room(self, extra: int) -> bool:
        """Whether ``extra`` more reserved bytes pass the capacity: then the cache is
        released first (one retry); True when it did."""
        if self.capacity is None or self.reserved + extra <= self.capacity:
            return False
        self.retries += 1
        self._release()
        return True

    def _account(self, extra: int) -> None:
        if self.capacity is not None and self.reserved + extra > self.capacity:
            self.over_capacity += 1
        self.reserved += extra
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _release(self) -> None:
        if not self.expandable:
            kept = [s for s in self._segments if not (len(s.blocks) == 1 and s.blocks[0].free)]
            self.reserved -= sum(s.size for s in self._segments) - sum(s.size for s in kept)
            self._segments = kept
            return
        for segment in self._segments:  # unmap the free pages at each segment's end
            if not segment.blocks:
                continue
            tail = segment.blocks[-1]
            page = SMALL_BUFFER if segment.pool[1] else LARGE_BUFFER
            pages = tail.size // page if tail.free else 0
            if pages:
                tail.size -= pages * page
                segment.size -= pages * page
                self.reserved -= pages * page
                if not tail.size:
                    segment.blocks.pop()

    def _new_block(self, pool: tuple[str, bool], size: int) -> _Block:
        if not self.expandable:
            reserve = segment_size(size)
            self._make_room(reserve)
            self._account(reserve)
            segment = _Segment(pool, reserve)
            segment.blocks.append(_Block(segment, 0, reserve))
            self._segments.append(segment)
            return segment.blocks[0]
        segment = next((s for s in self._segments if s.pool == pool), None)
        if segment is None:
            segment = _Segment(pool, 0)
            self._segments.append(segment)
        if self._make_room(self._growth(segment, size)):
            found = self._best_fit(pool, size)  # a free page released may not have been needed
            if found is not None:
                return found
        grow = self._growth(segment, size)
        self._account(grow)
        if not (segment.blocks and segment.blocks[-1].free):
            segment.blocks.append(_Block(segment, segment.size, 0))
        tail = segment.blocks[-1]
        tail.size += grow
        segment.size += grow
        return tail

    @staticmethod
    def _growth(segment: _Segment, size: int) -> int:
        """The pages an expandable ``segment`` maps for ``size`` at its end."""
        page = SMALL_BUFFER if segment.pool[1] else LARGE_BUFFER
        tail = segment.blocks[-1].size if segment.blocks and segment.blocks[-1].free else 0
        return -(-(size - tail) // page) * page
