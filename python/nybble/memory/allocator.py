"""A pure-Python simulation of PyTorch's CUDA caching allocator, to predict reserved memory.

Feed it the allocations and frees of a training step and read `peak_reserved`: the figure
`torch.cuda.max_memory_reserved()` reports. It follows `DeviceCachingAllocator` in
c10/cuda/CUDACachingAllocator.cpp (torch 2.x up to 2.11) in its default configuration:
no expandable segments, no roundup_power2_divisions, no garbage_collection_threshold, no
memory fraction; `max_split_size` is unlimited unless given.

Rules (names as in the C++):

- round_size: requests below kMinBlockSize (512 B) become 512 B, the rest round up to a
  multiple of 512 B.
- get_pool: rounded sizes <= kSmallSize (1 MiB) come from the small pool, larger ones from the
  large pool. Free blocks are kept per (stream, pool); a block is only reused on its stream.
- get_free_block: best fit, i.e. lower_bound in the pool's set ordered by (stream, size,
  address): the smallest free block of the stream with size >= request, lowest address on a
  tie. With a max_split_size, a request below it never takes a block of at least
  max_split_size, and a request at or above it never takes a block of request +
  max_non_split_rounding_size (20 MiB) or more; both reject rather than look further.
- get_allocation_size, the cudaMalloc size when nothing fits: <= 1 MiB -> kSmallBuffer (2 MiB);
  < kMinLargeAlloc (10 MiB) -> kLargeBuffer (20 MiB); else rounded up to kRoundLarge (2 MiB).
- should_split: the small pool splits when the remainder is >= 512 B, the large pool when it
  is > 1 MiB (and the request is below max_split_size). The allocation takes the low end;
  the remainder goes back to the pool as a free block. Unsplit, the caller gets the whole
  block, remainder included.
- free_block: a freed block merges with free neighbours of its segment, then returns to its
  pool. Memory is never returned to the device except as whole free segments.
- When cudaMalloc would exceed `capacity`: release_available_cached_blocks (only with a
  max_split_size: free one oversize cached segment big enough, or several, largest first),
  retry; then release_cached_blocks (every entirely free segment, both pools, all streams),
  retry; then OutOfMemoryError. The releases stay done even when the allocation then fails.
- empty_cache() is release_cached_blocks: every entirely free segment is returned.

Statistics are kept as torch keeps them (`memory_stats()` uses torch's key names):

- allocated_bytes (`memory_allocated()`): the sizes of the blocks handed out. That is the
  rounded request when the block was split or fitted exactly, but a large-pool block whose
  remainder was too small to split (<= 1 MiB) counts whole, so an allocation can count up to
  1 MiB more than its rounded size (with a max_split_size, an oversize block up to
  max_non_split_rounding_size more).
- requested_bytes: the sizes callers asked for, unrounded (torch >= 2.1).
- reserved_bytes (`memory_reserved()`): the sizes of all cudaMalloc'd segments.
- Peaks are running maxima of `current`; reset_peak_stats() sets each peak to its current.

Left out: expandable segments, roundup_power2_divisions, garbage collection, memory
fraction, CUDA-graph private pools and mempools, and cross-stream use (record_stream and the
events that delay a free until other streams finish: here a free is reusable at once; streams
are kept only as separate free lists). `capacity` stands for what
cudaMalloc can still get: device memory minus the CUDA context and anything outside the
allocator (cuBLAS/NCCL buffers that bypass it, other processes).

Segment addresses matter: best fit breaks ties between equal free blocks by address, and one
block placed elsewhere can cost a whole segment later. `DriverAddresses` places segments as
the CUDA driver was seen to in 16 allocation traces (H100, CUDA 13): address space taken in
32 MiB-rounded chunks from the top down, each segment at the start of the lowest free gap
that fits. With it the replays of the estimator's timelines reach the traced reserved peaks
within 0.2%; numbering segments upward instead missed one by 6%.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from typing import Final, NamedTuple

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "BlockInfo",
    "CachingAllocator",
    "DriverAddresses",
    "OutOfMemoryError",
    "SegmentInfo",
    "allocation_size",
    "replay",
    "round_size",
]

MiB: Final = 1 << 20
K_MIN_BLOCK_SIZE: Final = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE: Final = 1 * MiB  # largest "small" allocation
K_SMALL_BUFFER: Final = 2 * MiB  # small allocations are packed in 2 MiB segments
K_LARGE_BUFFER: Final = 20 * MiB  # 1-10 MiB allocations are packed in 20 MiB segments
K_MIN_LARGE_ALLOC: Final = 10 * MiB  # from here a segment is just the rounded request
K_ROUND_LARGE: Final = 2 * MiB  # large segments are rounded up to 2 MiB

_SIZE_MAX: Final = (1 << 64) - 1  # max_split_size "unlimited" is SIZE_MAX in the C++
_ONE_EXABYTE: Final = 1 << 60  # NativeCachingAllocator::allocate refuses this much outright
_SEGMENT_ALIGN: Final = 2 * MiB  # cudaMalloc's granularity for segment addresses
_VA_CHUNK: Final = 32 * MiB  # the driver reserves address space in multiples of this
_VA_TOP: Final = 1 << 46  # where the synthetic address space starts, going down


class DriverAddresses:
    """Where cudaMalloc puts each segment, as observed: a segment goes to the start of the
    lowest free gap in the address space reserved so far that fits it; if none does, a new
    chunk (its size rounded up to 32 MiB) is reserved below all earlier ones and the segment
    takes its start, leaving the rest as a gap. Freed segments become gaps again; reserved
    chunks stay. (In the traces: a 20 MiB segment leaves a 12 MiB gap that 2 MiB small-pool
    segments later fill from the bottom up; two 16 MiB segments share a 32 MiB chunk.)"""

    def __init__(self) -> None:
        self._bottom = _VA_TOP
        self._gaps: list[tuple[int, int]] = []  # (start, end), by address, none adjacent

    def take(self, size: int) -> int:
        size = -(-size // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
        for i, (start, end) in enumerate(self._gaps):
            if end - start >= size:
                if end - start == size:
                    del self._gaps[i]
                else:
                    self._gaps[i] = (start + size, end)
                return start
        chunk = -(-size // _VA_CHUNK) * _VA_CHUNK
        self._bottom -= chunk
        if chunk > size:
            self.give_back(self._bottom + size, chunk - size)
        return self._bottom

    def give_back(self, address: int, size: int) -> None:
        size = -(-size // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
        i = bisect_left(self._gaps, (address, address))
        start, end = address, address + size
        if i < len(self._gaps) and self._gaps[i][0] == end:  # merge with the gap above
            end = self._gaps.pop(i)[1]
        if i > 0 and self._gaps[i - 1][1] == start:  # and the one below
            start = self._gaps.pop(i - 1)[0]
            i -= 1
        self._gaps.insert(i, (start, end))


def round_size(size: int) -> int:
    """The block size a request of `size` bytes needs (round_size, default config)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """The segment cudaMalloc'd for a rounded `size` no free block fits (get_allocation_size)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class OutOfMemoryError(MemoryError):
    """A request that no cached block fits and no new segment within `capacity` can hold."""

    def __init__(self, size: int, alloc_size: int, allocated: int, reserved: int, capacity: int):
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {alloc_size} bytes (for a "
            f"{size}-byte request); capacity {capacity}, of which {reserved} is reserved and "
            f"{allocated} allocated"
        )
        self.size = size
        self.alloc_size = alloc_size
        self.allocated = allocated
        self.reserved = reserved
        self.capacity = capacity


class BlockInfo(NamedTuple):
    address: int
    size: int
    requested_size: int  # 0 for a free block
    allocated: bool


class SegmentInfo(NamedTuple):
    address: int
    size: int
    stream: int
    is_large: bool
    blocks: tuple[BlockInfo, ...]  # in address order, covering the segment


class _Block:
    """A piece of a segment, free or allocated; prev/next link the pieces of one segment."""

    __slots__ = ("addr", "allocated", "next", "prev", "requested", "size", "small", "stream")

    def __init__(self, addr: int, size: int, stream: int, small: bool) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.requested = 0
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Stat:
    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0


def _stat_array() -> tuple[_Stat, _Stat, _Stat]:
    return (_Stat(), _Stat(), _Stat())  # aggregate, small pool, large pool


def _increase(stats: tuple[_Stat, _Stat, _Stat], small: bool, amount: int) -> None:
    total = stats[0]
    total.current += amount
    if total.current > total.peak:
        total.peak = total.current
    pool = stats[1] if small else stats[2]
    pool.current += amount
    if pool.current > pool.peak:
        pool.peak = pool.current


def _decrease(stats: tuple[_Stat, _Stat, _Stat], small: bool, amount: int) -> None:
    stats[0].current -= amount
    stats[1 if small else 2].current -= amount


_STAT_SUFFIXES: Final = ("all", "small_pool", "large_pool")


class CachingAllocator:
    """One device's caching allocator. `malloc` returns a handle (the block's address; 0 for a
    zero-byte request, which torch never passes to the allocator), `free` takes it back.

    capacity: bytes cudaMalloc may hand out in all (None: unlimited).
    max_split_size: PYTORCH_CUDA_ALLOC_CONF max_split_size_mb, in bytes (None: unlimited, the
    default; torch requires more than 20 MiB).
    max_non_split_rounding_size: max_non_split_rounding_mb, in bytes (only used together with
    max_split_size).
    """

    def __init__(
        self,
        capacity: int | None = None,
        max_split_size: int | None = None,
        *,
        max_non_split_rounding_size: int = K_LARGE_BUFFER,
    ) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if max_split_size is not None and max_split_size <= 0:
            raise ValueError(f"max_split_size must be > 0, got {max_split_size}")
        self.capacity = capacity
        self._max_split = _SIZE_MAX if max_split_size is None else max_split_size
        self._max_non_split_rounding = max_non_split_rounding_size
        # Free blocks per (stream, small pool?): (size, address) sorted, which is the C++ set's
        # (stream, size, ptr) order within one stream; the blocks themselves by address.
        self._pools: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        self._free: dict[int, _Block] = {}
        self._live: dict[int, _Block] = {}
        # Segments by address: the head block (the lowest piece keeps its object across splits
        # and merges) and the cudaMalloc'd size.
        self._segment_heads: dict[int, _Block] = {}
        self._segment_sizes: dict[int, int] = {}
        self._addresses = DriverAddresses()
        self._placed: set[int] = set()  # segments at addresses given by place_next_segment
        self._placed_address: int | None = None
        self._allocation = _stat_array()
        self._segment = _stat_array()
        self._allocated_bytes = _stat_array()
        self._reserved_bytes = _stat_array()
        self._requested_bytes = _stat_array()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

    # -- statistics -----------------------------------------------------------------------

    @property
    def allocated(self) -> int:
        """allocated_bytes.all.current: what torch.cuda.memory_allocated() reports."""
        return self._allocated_bytes[0].current

    @property
    def reserved(self) -> int:
        """reserved_bytes.all.current: what torch.cuda.memory_reserved() reports."""
        return self._reserved_bytes[0].current

    @property
    def requested(self) -> int:
        """requested_bytes.all.current: live requests, unrounded."""
        return self._requested_bytes[0].current

    @property
    def peak_allocated(self) -> int:
        """allocated_bytes.all.peak: torch.cuda.max_memory_allocated()."""
        return self._allocated_bytes[0].peak

    @property
    def peak_reserved(self) -> int:
        """reserved_bytes.all.peak: torch.cuda.max_memory_reserved()."""
        return self._reserved_bytes[0].peak

    @property
    def peak_requested(self) -> int:
        return self._requested_bytes[0].peak

    @property
    def num_segments(self) -> int:
        return len(self._segment_sizes)

    def reset_peak_stats(self) -> None:
        """torch.cuda.reset_peak_memory_stats(): every peak drops to its current value."""
        for array in (
            self._allocation,
            self._segment,
            self._allocated_bytes,
            self._reserved_bytes,
            self._requested_bytes,
        ):
            for stat in array:
                stat.peak = stat.current

    def memory_stats(self) -> dict[str, int]:
        """The subset of torch.cuda.memory_stats() this simulation keeps, under torch's keys."""
        out: dict[str, int] = {}
        for name, array in (
            ("allocation", self._allocation),
            ("segment", self._segment),
            ("allocated_bytes", self._allocated_bytes),
            ("reserved_bytes", self._reserved_bytes),
            ("requested_bytes", self._requested_bytes),
        ):
            for suffix, stat in zip(_STAT_SUFFIXES, array, strict=True):
                out[f"{name}.{suffix}.current"] = stat.current
                out[f"{name}.{suffix}.peak"] = stat.peak
        out["num_alloc_retries"] = self.num_alloc_retries
        out["num_ooms"] = self.num_ooms
        out["num_device_alloc"] = self.num_device_alloc
        out["num_device_free"] = self.num_device_free
        return out

    def segments(self) -> list[tuple[int, int]]:
        """(address, size) of every segment, by address."""
        return sorted(self._segment_sizes.items())

    def snapshot(self) -> list[SegmentInfo]:
        """Every segment with its blocks, by address (like torch.cuda.memory_snapshot())."""
        out = []
        for addr, size in sorted(self._segment_sizes.items()):
            head = self._segment_heads[addr]
            blocks = []
            block: _Block | None = head
            while block is not None:
                blocks.append(BlockInfo(block.addr, block.size, block.requested, block.allocated))
                block = block.next
            out.append(SegmentInfo(addr, size, head.stream, not head.small, tuple(blocks)))
        return out

    # -- the allocator ----------------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> int:
        """DeviceCachingAllocator::malloc: a block of at least `size` bytes on `stream`."""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if size == 0:
            return 0  # NativeCachingAllocator::allocate hands out nullptr without a malloc
        rounded = round_size(size)
        small = rounded <= K_SMALL_SIZE
        alloc_size = allocation_size(rounded)
        if size >= _ONE_EXABYTE:
            raise OutOfMemoryError(size, alloc_size, self.allocated, self.reserved, -1)

        block = self._get_free_block(rounded, stream, small)
        if block is None:
            block = self._alloc_block(alloc_size, stream, small, retry=False)
        if block is None and self._release_available_cached_blocks(rounded, stream, small):
            block = self._alloc_block(alloc_size, stream, small, retry=False)
        if block is None:
            self._release_cached_blocks()
            block = self._alloc_block(alloc_size, stream, small, retry=True)
        if block is None:
            self.num_ooms += 1
            capacity = -1 if self.capacity is None else self.capacity
            raise OutOfMemoryError(size, alloc_size, self.allocated, self.reserved, capacity)

        if self._should_split(block, rounded):
            rest = _Block(block.addr + rounded, block.size - rounded, stream, small)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rounded
            self._insert_free(rest)
        block.allocated = True
        block.requested = size
        self._live[block.addr] = block
        _increase(self._allocation, small, 1)
        _increase(self._allocated_bytes, small, block.size)
        _increase(self._requested_bytes, small, size)
        return block.addr

    def free(self, handle: int) -> None:
        """DeviceCachingAllocator::free + free_block: back to the pool, merged with free
        neighbours. Cross-stream uses are not modelled, so the block is reusable at once."""
        if handle == 0:
            return
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"invalid handle {handle:#x}: not a live allocation")
        small = block.small
        _decrease(self._allocation, small, 1)
        _decrease(self._allocated_bytes, small, block.size)
        _decrease(self._requested_bytes, small, block.requested)
        block.allocated = False
        block.requested = 0
        prev = block.prev
        if prev is not None and not prev.allocated:  # [prev block] -> [prev]
            self._remove_free(prev)
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            block = prev
        nxt = block.next
        if nxt is not None and not nxt.allocated:  # [block next] -> [block]
            self._remove_free(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        self._insert_free(block)

    def block_size(self, handle: int) -> int:
        """Bytes of the live block `handle` (what `allocated` counts for it)."""
        if handle == 0:
            return 0
        block = self._live.get(handle)
        if block is None:
            raise ValueError(f"invalid handle {handle:#x}: not a live allocation")
        return block.size

    def place_next_segment(self, address: int) -> None:
        """Give the next segment cudaMalloc'd this address: a replay of a real trace uses the
        real addresses, which decide which of two equal free blocks a request takes."""
        if address <= 0 or address in self._segment_sizes:
            raise ValueError(f"address {address:#x} is null or a live segment's")
        self._placed_address = address

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): release_cached_blocks."""
        self._release_cached_blocks()

    # -- internals (C++ names) ------------------------------------------------------------

    def _insert_free(self, block: _Block) -> None:
        key = (block.stream, block.small)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = []
        insort(pool, (block.size, block.addr))
        self._free[block.addr] = block

    def _remove_free(self, block: _Block) -> None:
        pool = self._pools[(block.stream, block.small)]
        del pool[bisect_left(pool, (block.size, block.addr))]
        del self._free[block.addr]

    def _get_free_block(self, size: int, stream: int, small: bool) -> _Block | None:
        pool = self._pools.get((stream, small))
        if not pool:
            return None
        i = bisect_left(pool, (size, -1))  # lower_bound of (stream, size, nullptr)
        if i == len(pool):
            return None
        found_size, addr = pool[i]
        max_split = self._max_split
        # Do not return an oversized block for a request below max_split_size ...
        if size < max_split and found_size >= max_split:
            return None
        # ... and round an oversize request up only within max_non_split_rounding_size.
        if size >= max_split and found_size >= size + self._max_non_split_rounding:
            return None
        del pool[i]
        return self._free.pop(addr)

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _alloc_block(self, alloc_size: int, stream: int, small: bool, retry: bool) -> _Block | None:
        """cudaMalloc a new segment, returned whole (not yet in any pool); None if it would not
        fit in `capacity`."""
        if retry:
            self.num_alloc_retries += 1
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        if self._placed_address is not None:
            addr, self._placed_address = self._placed_address, None
            self._placed.add(addr)
        else:
            addr = self._addresses.take(alloc_size)
        block = _Block(addr, alloc_size, stream, small)
        self._segment_heads[addr] = block
        self._segment_sizes[addr] = alloc_size
        _increase(self._segment, small, 1)
        _increase(self._reserved_bytes, small, alloc_size)
        self.num_device_alloc += 1
        return block

    def _release_block(self, block: _Block) -> None:
        """cudaFree a free block that is a whole segment."""
        assert block.prev is None and block.next is None and not block.allocated
        self._remove_free(block)
        if block.addr not in self._placed:
            self._addresses.give_back(block.addr, block.size)
        self._placed.discard(block.addr)
        del self._segment_heads[block.addr]
        del self._segment_sizes[block.addr]
        _decrease(self._segment, block.small, 1)
        _decrease(self._reserved_bytes, block.small, block.size)
        self.num_device_free += 1

    def _release_available_cached_blocks(self, size: int, stream: int, small: bool) -> bool:
        """Free one cached oversize segment that covers the request, or else the largest ones
        until their total does; a no-op without max_split_size."""
        max_split = self._max_split
        if max_split == _SIZE_MAX:
            return False
        pool = self._pools.get((stream, small))
        if not pool:
            return False
        key_size = max(size, max_split)
        i = bisect_left(pool, (key_size, -1))
        if i < len(pool):
            self._release_block(self._free[pool[i][1]])
            return True
        # No single block is large enough: free oversize blocks, largest first. As in the C++,
        # what was freed stays freed even when it falls short.
        released = 0
        i -= 1
        while i >= 0 and released < key_size and pool[i][0] >= max_split:
            block_size, addr = pool[i]
            self._release_block(self._free[addr])
            released += block_size
            i -= 1
        return released >= key_size

    def _release_cached_blocks(self) -> None:
        """Free every entirely free segment: large pools first, then small, all streams."""
        for want_small in (False, True):
            for (_, small), pool in list(self._pools.items()):
                if small != want_small:
                    continue
                for _, addr in list(pool):
                    block = self._free[addr]
                    if block.prev is None and block.next is None:
                        self._release_block(block)


def replay(
    events: Iterable[tuple[str, int, int]],
    capacity: int | None = None,
    *,
    max_split_size: int | None = None,
) -> CachingAllocator:
    """Run a trace through a fresh allocator and return it (read `peak_reserved` off it).

    Events: ("alloc", key, size), ("free", key, _), ("empty_cache", _, _),
    ("reset_peak", _, _) and ("place_segment", address, _) (`place_next_segment`). `key` is the
    caller's name for a tensor (a real trace's address, say); a key may be reused once its
    tensor is freed. All on stream 0. A timeline's markers are understood too: ("step", n, _)
    resets the peaks as reset_peak does, ("phase", i, _) changes nothing here.
    """
    alloc = CachingAllocator(capacity, max_split_size)
    handles: dict[int, int] = {}
    for op, key, size in events:
        if op == "alloc":
            if key in handles:
                raise ValueError(f"alloc of key {key:#x}, which is still live")
            handles[key] = alloc.malloc(size)
        elif op == "free":
            handle = handles.pop(key, None)
            if handle is None:
                raise ValueError(f"free of key {key:#x}, which is not live")
            alloc.free(handle)
        elif op == "empty_cache":
            alloc.empty_cache()
        elif op in ("reset_peak", "step"):
            alloc.reset_peak_stats()
        elif op == "phase":
            pass
        elif op == "place_segment":
            alloc.place_next_segment(key)
        else:
            raise ValueError(f"unknown event {op!r}")
    return alloc
