"""A timeline's events replayed through the allocator simulation, step by step and by part.

`TaggedReplay` feeds the events of a `timeline.Tape` to a `CachingAllocator` and keeps, for
every training step, what a measurement of that step reports (`max_memory_reserved()` and
`max_memory_allocated()` with the counters reset at its start) and, at the moment of each
phase's allocated peak, the allocated bytes of every part (the tags of the allocations then
alive, counted as the allocator counts them: block sizes). The parts at a moment add up to
the allocator's `allocated` at that moment, exactly. A ("stream", n) event makes the
allocations that follow come from stream n's pools (0, the default stream, unless told): the
side streams of FSDP's collectives (`distributed`) keep their own cached blocks.

`live_peak` is the fast lower bound the searches use: the same events walked without the
allocator, each allocation counted at its rounded size, so it never exceeds the replayed
allocated peak (and so the reserved one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .allocator import CachingAllocator, OutOfMemoryError, round_size


class Allocator(Protocol):
    """What a replay needs of an allocator simulation (`allocator.CachingAllocator`, torch's;
    `cupy_pool.CupyPool`, CuPy's)."""

    @property
    def allocated(self) -> int: ...

    @property
    def peak_allocated(self) -> int: ...

    @property
    def peak_reserved(self) -> int: ...

    def malloc(self, nbytes: int, stream: int = 0) -> int: ...

    def free(self, handle: int) -> None: ...

    def block_size(self, handle: int) -> int: ...

    def reset_peak_stats(self) -> None: ...

    def empty_cache(self) -> None: ...

    @property
    def num_segments(self) -> int: ...


@dataclass
class StepPeaks:
    """What one training step of a replay reached (its number: 0 is the setup before it)."""

    number: int
    reserved_peak: int = 0
    allocated_peak: int = 0
    #: phase name -> (allocated peak within that phase, allocated bytes by part at it)
    phases: dict[str, tuple[int, dict[str, int]]] = field(default_factory=dict)
    #: the largest single request of the step on the default stream (bytes asked for)
    largest_request: int = 0

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name][0]) if self.phases else ""

    @property
    def parts(self) -> dict[str, int]:
        """Allocated bytes by part at the step's allocated peak."""
        return dict(self.phases[self.peak_phase][1]) if self.phases else {}


class TaggedReplay:
    """Feed events (in as many pieces as wanted); read `steps`."""

    def __init__(
        self, tags: dict[int, str], phases: Sequence[str], allocator: Allocator | None = None
    ) -> None:
        self.allocator: Allocator = allocator if allocator is not None else CachingAllocator()
        self.tags = tags
        self.phases = phases
        self.steps: list[StepPeaks] = [StepPeaks(0)]
        self._handles: dict[int, tuple[int, int, str]] = {}
        self._live: dict[str, int] = {}
        self._phase = "setup"
        self._stream = 0

    def feed(self, events: Iterable[tuple[str, int, int]]) -> None:
        alloc = self.allocator
        handles, tags, live = self._handles, self.tags, self._live
        step = self.steps[-1]
        phase = self._phase
        phase_peak = step.phases.get(phase, (0, {}))[0]
        stream = self._stream
        for op, key, size in events:
            if op == "alloc":
                try:
                    handle = alloc.malloc(size, stream) if stream else alloc.malloc(size)
                except OutOfMemoryError:
                    raise ValueError(
                        f"the run would allocate one tensor of {size} bytes; no GPU holds "
                        "that (batch, seq_len or the model's sizes are out of range)"
                    ) from None
                nbytes = alloc.block_size(handle)
                tag = tags[key]
                handles[key] = (handle, nbytes, tag)
                live[tag] = live.get(tag, 0) + nbytes
                if size > step.largest_request and not stream:
                    step.largest_request = size
                if alloc.allocated > phase_peak:
                    phase_peak = alloc.allocated
                    step.phases[phase] = (phase_peak, dict(live))
            elif op == "free":
                handle, nbytes, tag = handles.pop(key)
                alloc.free(handle)
                live[tag] -= nbytes
            elif op == "phase":
                self._close(step)
                phase = self.phases[key]
                phase_peak = step.phases.get(phase, (0, {}))[0]
                if alloc.allocated > phase_peak:
                    phase_peak = alloc.allocated
                    step.phases[phase] = (phase_peak, dict(live))
            elif op == "step":
                self._close(step)
                alloc.reset_peak_stats()
                step = StepPeaks(key)
                self.steps.append(step)
                phase_peak = 0
            elif op == "stream":
                stream = key
            elif op == "empty_cache":
                alloc.empty_cache()
            elif op == "reset_peak":
                alloc.reset_peak_stats()
            else:
                raise ValueError(f"unknown event {op!r}")
        self._phase = phase
        self._stream = stream
        self._close(step)

    def _close(self, step: StepPeaks) -> None:
        step.reserved_peak = max(step.reserved_peak, self.allocator.peak_reserved)
        step.allocated_peak = max(step.allocated_peak, self.allocator.peak_allocated)


def live_peak(events: Iterable[tuple[str, int, int]], from_step: int) -> int:
    """The most bytes alive at once (each request rounded as the allocator rounds it) from the
    start of step `from_step` on: a lower bound of the replayed allocated peak."""
    sizes: dict[int, int] = {}
    live = peak = 0
    counting = False
    for op, key, size in events:
        if op == "alloc":
            rounded = round_size(size)
            sizes[key] = rounded
            live += rounded
            if counting and live > peak:
                peak = live
        elif op == "free":
            live -= sizes.pop(key)
        elif op == "step" and key >= from_step:
            counting = True
            peak = max(peak, live)
    return peak


__all__ = ["Allocator", "StepPeaks", "TaggedReplay", "live_peak"]
