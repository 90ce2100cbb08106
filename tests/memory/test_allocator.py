"""The CUDA caching-allocator simulation: hand-worked cases of each rule in
c10/cuda/CUDACachingAllocator.cpp (rounding, pools, segment sizes, best fit, splitting,
merging, releasing, statistics), plus a randomized check of its bookkeeping."""

from __future__ import annotations

import random

import pytest

from nybble.memory.allocator import (
    CachingAllocator,
    DriverAddresses,
    OutOfMemoryError,
    allocation_size,
    replay,
    round_size,
)

KiB = 1 << 10
MiB = 1 << 20


def blocks(alloc: CachingAllocator, address: int) -> list[tuple[int, bool]]:
    """(size, allocated) of each block of the segment at `address`."""
    (seg,) = [s for s in alloc.snapshot() if s.address == address]
    return [(b.size, b.allocated) for b in seg.blocks]


def segment_of(alloc: CachingAllocator, handle: int) -> int:
    for seg in alloc.snapshot():
        if seg.address <= handle < seg.address + seg.size:
            return seg.address
    raise AssertionError(f"{handle:#x} is in no segment")


@pytest.mark.parametrize(
    ("size", "rounded"), [(1, 512), (511, 512), (512, 512), (513, 1024), (1025, 1536)]
)
def test_round_size(size: int, rounded: int) -> None:
    assert round_size(size) == rounded
    alloc = CachingAllocator()
    alloc.malloc(size)
    assert (alloc.allocated, alloc.requested, alloc.reserved) == (rounded, size, 2 * MiB)


def test_allocation_size() -> None:
    assert allocation_size(512) == 2 * MiB
    assert allocation_size(1 * MiB) == 2 * MiB
    assert allocation_size(1 * MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(12 * MiB) == 12 * MiB
    assert allocation_size(13 * MiB) == 14 * MiB


def test_one_mib_is_small_one_mib_plus_one_is_large() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(1 * MiB)
    b = alloc.malloc(1 * MiB)  # the other half of the same 2 MiB small segment
    assert alloc.segments() == [(a, 2 * MiB)]
    assert b == a + 1 * MiB
    c = alloc.malloc(1 * MiB + 1)  # rounds to 1 MiB + 512: large pool, a 20 MiB segment
    assert alloc.reserved == 22 * MiB
    (small, large) = alloc.snapshot()
    assert (small.is_large, large.is_large) == (False, True)
    assert large.address == c and large.size == 20 * MiB
    assert blocks(alloc, c) == [(1 * MiB + 512, True), (19 * MiB - 512, False)]
    assert alloc.allocated == 3 * MiB + 512
    assert alloc.requested == 3 * MiB + 1


def test_five_mib_requests_share_a_20_mib_segment() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(5 * MiB)
    assert alloc.segments() == [(a, 20 * MiB)]
    b = alloc.malloc(5 * MiB)
    assert b == a + 5 * MiB  # split off the remainder of the first segment
    assert alloc.num_segments == 1
    assert (alloc.allocated, alloc.reserved) == (10 * MiB, 20 * MiB)


def test_segments_of_10_mib_and_up_are_rounded_to_2_mib() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(12 * MiB)
    b = alloc.malloc(13 * MiB)
    assert alloc.segments() == [(a, 12 * MiB), (b, 14 * MiB)]
    # 14 - 13 = 1 MiB is not > kSmallSize: no split, and the whole block counts as allocated.
    assert blocks(alloc, b) == [(14 * MiB, True)]
    assert alloc.allocated == 26 * MiB
    assert alloc.requested == 25 * MiB
    alloc.free(b)
    assert alloc.allocated == 12 * MiB


def test_best_fit_takes_the_smallest_block_that_fits() -> None:
    alloc = CachingAllocator()
    big = alloc.malloc(40 * MiB)
    small = alloc.malloc(30 * MiB)  # the smaller free block sits at the higher address
    alloc.free(big)
    alloc.free(small)
    h = alloc.malloc(25 * MiB)
    assert h == small
    assert blocks(alloc, small) == [(25 * MiB, True), (5 * MiB, False)]
    assert alloc.num_segments == 2
    # A request only the 40 MiB block fits goes there; nothing new is cudaMalloc'd.
    assert alloc.malloc(32 * MiB) == big
    assert alloc.reserved == 70 * MiB


def test_best_fit_tie_goes_to_the_lower_address() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(12 * MiB)
    b = alloc.malloc(12 * MiB)
    alloc.free(b)
    alloc.free(a)
    assert alloc.malloc(11 * MiB) == a


def test_large_pool_splits_only_remainders_over_1_mib() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(22 * MiB)
    alloc.free(a)
    # Remainder exactly 1 MiB: not split, the request gets the whole 22 MiB block.
    assert alloc.malloc(21 * MiB) == a
    assert blocks(alloc, a) == [(22 * MiB, True)]
    assert alloc.allocated == 22 * MiB
    alloc.free(a)
    # Remainder 1 MiB + 512: split.
    assert alloc.malloc(21 * MiB - 512) == a
    assert blocks(alloc, a) == [(21 * MiB - 512, True), (1 * MiB + 512, False)]
    assert alloc.allocated == 21 * MiB - 512
    # The remainder serves a later large request in place.
    assert alloc.malloc(1 * MiB + 1) == a + 21 * MiB - 512
    assert alloc.num_segments == 1


def test_small_pool_splits_remainders_of_512() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(1 * MiB)
    b = alloc.malloc(1 * MiB - 512)
    assert blocks(alloc, a) == [(1 * MiB, True), (1 * MiB - 512, True), (512, False)]
    assert alloc.malloc(1) == b + 1 * MiB - 512
    assert alloc.num_segments == 1
    alloc.malloc(1)  # the segment is full now
    assert alloc.num_segments == 2


def test_free_merges_with_both_neighbours() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(5 * MiB)
    b = alloc.malloc(5 * MiB)
    c = alloc.malloc(5 * MiB)
    assert blocks(alloc, a) == [(5 * MiB, True)] * 3 + [(5 * MiB, False)]
    alloc.free(a)
    alloc.free(c)  # merges with the free tail
    assert blocks(alloc, a) == [(5 * MiB, False), (5 * MiB, True), (10 * MiB, False)]
    alloc.free(b)  # merges with both sides: the segment is one free block again
    assert blocks(alloc, a) == [(20 * MiB, False)]
    # An 18 MiB request would cudaMalloc 18 MiB, but fits the merged block.
    assert alloc.malloc(18 * MiB) == a
    assert (alloc.reserved, alloc.num_segments) == (20 * MiB, 1)


def test_merged_neighbours_fit_a_larger_request() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(4 * MiB)
    b = alloc.malloc(4 * MiB)
    keep = alloc.malloc(12 * MiB)  # fills the segment: 4 + 4 + 12 = 20
    assert segment_of(alloc, keep) == a
    alloc.free(a)
    alloc.free(b)
    assert alloc.malloc(8 * MiB) == a  # fits only because a and b merged
    assert alloc.num_segments == 1


def test_empty_cache_releases_only_whole_free_segments() -> None:
    alloc = CachingAllocator()
    part = alloc.malloc(5 * MiB)
    tail = alloc.malloc(5 * MiB)
    whole = alloc.malloc(12 * MiB)
    tiny = alloc.malloc(1 * KiB)
    used = alloc.malloc(30 * MiB)
    alloc.free(tail)  # segment `part` is partly free: kept
    alloc.free(whole)
    alloc.free(tiny)
    assert alloc.reserved == 20 * MiB + 12 * MiB + 2 * MiB + 30 * MiB
    alloc.empty_cache()
    assert sorted(alloc.segments()) == sorted([(part, 20 * MiB), (used, 30 * MiB)])
    assert alloc.reserved == 50 * MiB
    assert alloc.peak_reserved == 64 * MiB
    assert alloc.num_device_free == 2
    assert blocks(alloc, part) == [(5 * MiB, True), (15 * MiB, False)]


def test_peaks_and_reset() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(12 * MiB)
    alloc.free(a)
    assert (alloc.allocated, alloc.peak_allocated) == (0, 12 * MiB)
    assert (alloc.reserved, alloc.peak_reserved) == (12 * MiB, 12 * MiB)
    alloc.empty_cache()
    assert (alloc.reserved, alloc.peak_reserved) == (0, 12 * MiB)
    alloc.reset_peak_stats()
    assert (alloc.peak_allocated, alloc.peak_reserved) == (0, 0)
    alloc.malloc(4 * MiB)
    assert (alloc.peak_allocated, alloc.peak_reserved) == (4 * MiB, 20 * MiB)
    alloc.reset_peak_stats()  # peaks drop to the current values, not to zero
    assert (alloc.peak_allocated, alloc.peak_reserved) == (4 * MiB, 20 * MiB)
    stats = alloc.memory_stats()
    assert stats["reserved_bytes.all.peak"] == 20 * MiB
    assert stats["reserved_bytes.large_pool.current"] == 20 * MiB
    assert stats["reserved_bytes.small_pool.current"] == 0
    assert stats["requested_bytes.all.current"] == 4 * MiB
    assert stats["segment.all.current"] == 1
    assert stats["allocation.all.peak"] == 1


def test_streams_do_not_share_free_blocks() -> None:
    alloc = CachingAllocator()
    a = alloc.malloc(5 * MiB, stream=0)
    alloc.free(a)
    b = alloc.malloc(5 * MiB, stream=1)
    assert segment_of(alloc, b) != a
    assert alloc.reserved == 40 * MiB
    assert alloc.malloc(5 * MiB, stream=0) == a


def test_capacity_releases_the_cache_then_retries() -> None:
    alloc = CachingAllocator(capacity=40 * MiB)
    a = alloc.malloc(30 * MiB)
    alloc.free(a)  # cached, on stream 0
    b = alloc.malloc(12 * MiB, stream=1)  # 30 + 12 > 40: free the cache, retry
    assert alloc.segments() == [(b, 12 * MiB)]
    assert alloc.num_alloc_retries == 1
    assert alloc.peak_reserved == 30 * MiB
    with pytest.raises(OutOfMemoryError) as err:
        alloc.malloc(30 * MiB)
    assert err.value.alloc_size == 30 * MiB
    assert alloc.num_ooms == 1
    assert alloc.segments() == [(b, 12 * MiB)]


def test_failed_allocation_still_releases_the_cache() -> None:
    alloc = CachingAllocator(capacity=40 * MiB)
    keep = alloc.malloc(12 * MiB)
    spare = alloc.malloc(20 * MiB)
    alloc.free(spare)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(30 * MiB)
    assert alloc.segments() == [(keep, 12 * MiB)]


def test_max_split_size_oversize_blocks() -> None:
    alloc = CachingAllocator(max_split_size=30 * MiB)
    a = alloc.malloc(40 * MiB)
    alloc.free(a)
    # A request below max_split_size never takes an oversize block.
    b = alloc.malloc(25 * MiB)
    assert b != a and alloc.num_segments == 2
    assert blocks(alloc, b) == [(26 * MiB, True)]  # a 1 MiB remainder is not split
    # One at or above it takes a block less than 20 MiB bigger, unsplit, all counted.
    assert alloc.malloc(35 * MiB) == a
    assert blocks(alloc, a) == [(40 * MiB, True)]
    assert alloc.allocated == 26 * MiB + 40 * MiB

    alloc = CachingAllocator(max_split_size=30 * MiB)
    big = alloc.malloc(60 * MiB)
    alloc.free(big)
    assert alloc.malloc(40 * MiB) != big  # 60 >= 40 + 20: rejected, a new 40 MiB segment
    assert alloc.malloc(41 * MiB) == big  # 60 < 41 + 20
    assert alloc.num_segments == 2


def test_max_split_size_frees_an_oversize_segment_before_giving_up() -> None:
    alloc = CachingAllocator(capacity=60 * MiB, max_split_size=30 * MiB)
    a = alloc.malloc(40 * MiB)
    alloc.free(a)
    b = alloc.malloc(25 * MiB)  # 40 + 26 > 60: release the 40 MiB segment, not a retry
    assert alloc.segments() == [(b, 26 * MiB)]
    assert alloc.num_alloc_retries == 0
    assert alloc.num_device_free == 1


def test_max_split_size_frees_oversize_segments_largest_first() -> None:
    alloc = CachingAllocator(capacity=100 * MiB, max_split_size=30 * MiB)
    handles = [alloc.malloc(n * MiB) for n in (12, 40, 35)]
    for h in handles:
        alloc.free(h)
    # No cached block fits 70 MiB and 87 + 70 > 100: the 40 and 35 MiB oversize segments go
    # (75 >= 70), the 12 MiB one (below max_split_size) stays; no full-cache retry needed.
    big = alloc.malloc(70 * MiB)
    assert sorted(alloc.segments()) == sorted([(handles[0], 12 * MiB), (big, 70 * MiB)])
    assert alloc.num_alloc_retries == 0
    alloc.free(big)
    # 70 + 12 cached; 95 MiB: the 70 MiB segment alone falls short, so it is freed, then the
    # whole cache, and the retry succeeds.
    alloc.malloc(95 * MiB)
    assert alloc.reserved == 96 * MiB
    assert alloc.num_alloc_retries == 1


def test_zero_size_and_bad_handles() -> None:
    alloc = CachingAllocator()
    assert alloc.malloc(0) == 0
    alloc.free(0)
    assert (alloc.allocated, alloc.reserved) == (0, 0)
    h = alloc.malloc(100)
    alloc.free(h)
    with pytest.raises(ValueError, match="invalid handle"):
        alloc.free(h)
    with pytest.raises(ValueError):
        alloc.malloc(-1)


def test_replay() -> None:
    events = [
        ("alloc", 0xA, 5 * MiB),
        ("alloc", 0xB, 12 * MiB),  # best fit: the 15 MiB left of the 20 MiB segment
        ("free", 0xA, 0),
        ("alloc", 0xC, 3 * MiB),  # best fit: the 3 MiB tail, not the freed 5 MiB
        ("free", 0xB, 0),
        ("free", 0xC, 0),
        ("empty_cache", 0, 0),
        ("reset_peak", 0, 0),
        ("alloc", 0xA, 100),  # a key may come back once freed
    ]
    alloc = replay(events)
    assert alloc.peak_reserved == 2 * MiB
    assert alloc.reserved == 2 * MiB
    assert alloc.allocated == 512
    first = replay(events[:4])
    assert (first.peak_reserved, first.num_segments) == (20 * MiB, 1)
    (seg,) = first.snapshot()
    assert [(b.size, b.allocated) for b in seg.blocks] == [
        (5 * MiB, False),
        (12 * MiB, True),
        (3 * MiB, True),
    ]
    with pytest.raises(ValueError, match="not live"):
        replay([("free", 1, 0)])
    with pytest.raises(ValueError, match="still live"):
        replay([("alloc", 1, 8), ("alloc", 1, 8)])
    with pytest.raises(OutOfMemoryError):
        replay([("alloc", 1, 25 * MiB), ("alloc", 2, 10 * MiB)], capacity=30 * MiB)


def check_invariants(alloc: CachingAllocator, live: dict[int, int]) -> None:
    allocated = requested = 0
    for seg in alloc.snapshot():
        address = seg.address
        prev_free = False
        for b in seg.blocks:
            assert b.address == address
            address += b.size
            assert not (prev_free and not b.allocated), "two free neighbours left unmerged"
            prev_free = not b.allocated
            if b.allocated:
                allocated += b.size
                requested += b.requested_size
                assert live[b.address] == b.requested_size
                assert b.size >= round_size(b.requested_size)
        assert address == seg.address + seg.size
    assert alloc.allocated == allocated
    assert alloc.requested == requested == sum(live.values())
    assert alloc.reserved == sum(size for _, size in alloc.segments())
    assert alloc.peak_reserved >= alloc.reserved and alloc.peak_allocated >= alloc.allocated


def test_random_trace_keeps_consistent_books() -> None:
    rng = random.Random(1234)
    alloc = CachingAllocator(capacity=400 * MiB)
    live: dict[int, int] = {}
    for step in range(3000):
        r = rng.random()
        if live and r < 0.45:
            handle = rng.choice(list(live))
            del live[handle]
            alloc.free(handle)
        elif r < 0.995:
            size = rng.choice([rng.randrange(1, 4 * KiB), rng.randrange(1, 2 * MiB)])
            size = size if rng.random() < 0.7 else rng.randrange(1, 64 * MiB)
            try:
                live[alloc.malloc(size, stream=rng.randrange(2))] = size
            except OutOfMemoryError:
                pass
        else:
            alloc.empty_cache()
        if step % 50 == 0:
            check_invariants(alloc, live)
    check_invariants(alloc, live)
    for handle in list(live):
        alloc.free(handle)
    alloc.empty_cache()
    assert (alloc.allocated, alloc.reserved, alloc.num_segments) == (0, 0, 0)


def test_segments_are_placed_as_the_driver_places_them() -> None:
    """DriverAddresses, as the traces show cudaMalloc: 32 MiB-rounded chunks from the top
    down, each segment at the start of the lowest gap that fits."""
    va = DriverAddresses()
    a = va.take(20 * MiB)  # a new 32 MiB chunk; 12 MiB left above the segment
    b = va.take(64 * MiB)  # does not fit the gap: the next chunk down
    assert b == a - 64 * MiB
    c = va.take(2 * MiB)  # small segments fill the gap from its bottom up
    assert c == a + 20 * MiB and va.take(2 * MiB) == a + 22 * MiB
    d = va.take(16 * MiB)  # two 16 MiB segments share a chunk
    assert d == b - 32 * MiB and va.take(16 * MiB) == d + 16 * MiB
    va.give_back(b, 64 * MiB)  # freed: the lowest gap that fits wins
    assert va.take(16 * MiB) == b
    va.give_back(a, 20 * MiB)
    va.give_back(c, 2 * MiB)  # merged with the gap below it: 22 MiB from a
    assert va.take(48 * MiB) == b + 16 * MiB  # the rest of b's gap, lower down
    assert va.take(22 * MiB) == a
    fresh = DriverAddresses()
    a = fresh.take(20 * MiB)
    fresh.give_back(a, 20 * MiB)
    b = fresh.take(40 * MiB)  # a new chunk below; its rest joins the free one above
    assert b == a - 64 * MiB and fresh.take(56 * MiB) == b + 40 * MiB
