"""A simulation of CuPy's default memory pool (`cupy.cuda.MemoryPool`), which nybble's GPU
trainer allocates from: what it reserves from the driver for a sequence of allocations and
frees.

The pool's rules (CuPy's `SingleDeviceMemoryPool`, one stream):
- a request is rounded up to a multiple of 512 bytes;
- the free chunks are binned by exact size; a request takes a chunk from the smallest
  non-empty bin at least its size, and the rest of that chunk, if any, goes back to the bins
  as a chunk of its own;
- with no such chunk, the pool asks the driver for exactly the request (one cudaMalloc per
  miss, no larger segments), which is what `total_bytes()` counts;
- a freed chunk merges with its free neighbours of the same cudaMalloc block;
- nothing goes back to the driver unless asked (`free_all_blocks`).
Which chunk of a bin CuPy takes is arbitrary (a Python set's pop); the simulation takes the
lowest address, one of the choices CuPy may make.

`CupyPool` takes the events of a `timeline.Tape` as `replay.TaggedReplay`'s allocator.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

#: CuPy rounds every request to this many bytes.
UNIT = 512


def round_size(nbytes: int) -> int:
    return max(1, -(-int(nbytes) // UNIT)) * UNIT


@dataclass
class _Chunk:
    block: int  # which cudaMalloc
    offset: int
    size: int
    free: bool = False
    prev: _Chunk | None = field(default=None, repr=False)
    next: _Chunk | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[int, int]:
        return (self.block, self.offset)


class CupyPool:
    """Allocations as CuPy's pool makes them; `reserved`, `allocated` and their peaks in
    bytes. `malloc` returns a handle for `free`."""

    def __init__(self) -> None:
        self._bins: dict[int, dict[tuple[int, int], _Chunk]] = {}
        self._sizes: list[int] = []  # sorted sizes of the non-empty bins
        self._handles: dict[int, _Chunk] = {}
        self._next_handle = 0
        self._blocks = 0
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0

    # --- free bins ---------------------------------------------------------------------

    def _add(self, chunk: _Chunk) -> None:
        chunk.free = True
        bucket = self._bins.get(chunk.size)
        if bucket is None:
            bucket = self._bins[chunk.size] = {}
            bisect.insort(self._sizes, chunk.size)
        bucket[chunk.key] = chunk

    def _remove(self, chunk: _Chunk) -> None:
        bucket = self._bins[chunk.size]
        del bucket[chunk.key]
        chunk.free = False
        if not bucket:
            del self._bins[chunk.size]
            self._sizes.pop(bisect.bisect_left(self._sizes, chunk.size))

    def _take(self, size: int) -> _Chunk | None:
        i = bisect.bisect_left(self._sizes, size)
        if i == len(self._sizes):
            return None
        bucket = self._bins[self._sizes[i]]
        chunk = bucket[min(bucket)]
        self._remove(chunk)
        if chunk.size > size:  # the rest stays free, right after the part handed out
            rest = _Chunk(chunk.block, chunk.offset + size, chunk.size - size)
            rest.prev, rest.next = chunk, chunk.next
            if chunk.next is not None:
                chunk.next.prev = rest
            chunk.next = rest
            chunk.size = size
            self._add(rest)
        return chunk

    # --- the allocator's interface (replay.TaggedReplay) -------------------------------

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """A chunk of at least `nbytes` (nybble's trainer runs on one stream: `stream` is
        there for the replay's protocol and must be 0)."""
        if stream:
            raise ValueError("CupyPool models one stream")
        size = round_size(nbytes)
        chunk = self._take(size)
        if chunk is None:
            chunk = _Chunk(self._blocks, 0, size)
            self._blocks += 1
            self.reserved += size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._next_handle += 1
        self._handles[self._next_handle] = chunk
        return self._next_handle

    def block_size(self, handle: int) -> int:
        return self._handles[handle].size

    def free(self, handle: int) -> None:
        chunk = self._handles.pop(handle)
        self.allocated -= chunk.size
        nxt = chunk.next
        if nxt is not None and nxt.free:
            self._remove(nxt)
            chunk.size += nxt.size
            chunk.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = chunk
        prev = chunk.prev
        if prev is not None and prev.free:
            self._remove(prev)
            prev.size += chunk.size
            prev.next = chunk.next
            if chunk.next is not None:
                chunk.next.prev = prev
            chunk = prev
        self._add(chunk)

    def reset_peak_stats(self) -> None:
        self.peak_reserved = self.reserved
        self.peak_allocated = self.allocated

    def empty_cache(self) -> None:
        """`free_all_blocks`: whole free cudaMalloc blocks go back to the driver."""
        for size in list(self._sizes):
            for chunk in list(self._bins.get(size, {}).values()):
                if chunk.prev is None and chunk.next is None:
                    self._remove(chunk)
                    self.reserved -= chunk.size

    @property
    def num_segments(self) -> int:
        return self._blocks


__all__ = ["UNIT", "CupyPool", "round_size"]
