"""GPU memory peaks of CuPy work, measured the way torch reports its own: the allocated peak
(bytes handed out by the memory pool and not yet given back, at its highest) and the reserved
one (bytes the pool holds from the driver). Runs on the GPU machine only."""

from __future__ import annotations

from typing import Any

import cupy
from cupy.cuda import MemoryHook


class PoolPeak(MemoryHook):  # type: ignore[misc]
    """Used as `with PoolPeak() as peak: ...`; then `peak.allocated`, `peak.reserved`.

    Counts the pool's rounded sizes, as torch counts its 512-byte rounded blocks. A hook runs
    Python on every allocation: measure memory in a pass of its own, not while timing."""

    name = "PoolPeak"

    def __init__(self) -> None:
        self.pool = cupy.get_default_memory_pool()
        self.live: dict[int, int] = {}
        self.used = 0
        self.allocated = 0
        self.reserved = 0

    def __enter__(self) -> PoolPeak:
        cupy.cuda.Device().synchronize()
        self.used = self.allocated = int(self.pool.used_bytes())
        self.reserved = int(self.pool.total_bytes())
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        cupy.cuda.Device().synchronize()
        super().__exit__(*exc)
        self.reserved = max(self.reserved, int(self.pool.total_bytes()))

    def malloc_postprocess(self, **kw: Any) -> None:
        self.live[kw["mem_ptr"]] = kw["mem_size"]
        self.used += kw["mem_size"]
        self.allocated = max(self.allocated, self.used)

    def alloc_postprocess(self, **kw: Any) -> None:
        self.reserved = max(self.reserved, int(self.pool.total_bytes()))

    def free_postprocess(self, **kw: Any) -> None:
        self.used -= self.live.pop(kw["mem_ptr"], 0)


def reset_pool() -> None:
    """Gives every cached block back to the driver, so that the next peak starts clean."""
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
