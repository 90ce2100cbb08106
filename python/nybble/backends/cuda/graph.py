"""CUDA graphs of nybble's GPU work: `capture` records a function's launches once and `Graph`
replays them (the public names are `nybble.cuda.capture` and `nybble.cuda.Graph`;
`CudaBackend.capture` is the seam's way in, for the trainer's decode step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import backend, launch


class Graph:
    """A captured CUDA graph of nybble (and any CuPy) GPU work: `replay()` runs it again on
    the current stream, with the same buffers. Made by `capture`."""

    def __init__(self, graph: Any, buffers: tuple[Any, ...], allocations: list[Any]) -> None:
        self._graph = graph
        self._buffers = buffers  # the memory the graph reads and writes, held alive
        # What the captured work allocated (outputs, temporaries such as a dequantized weight):
        # the graph writes there on every replay, so none of it may go back to the pool.
        self._allocations = allocations

    def replay(self) -> None:
        self._graph.launch(backend().xp.cuda.get_current_stream())


def capture(work: Callable[[], object], *buffers: Any, warmup: int = 1) -> Graph:
    """Captures `work()` (a function of no arguments that launches GPU work over fixed
    buffers, e.g. a decode step's GEMVs with `out=`) into a CUDA graph, after running it
    `warmup` times eagerly (the first call of each weight compiles and prepares its launches,
    which a capture must not do). Name the arrays `work` reads and writes in `buffers` to keep
    them alive as long as the graph; the memory `work` allocates during the capture (results it
    returns, temporaries it drops) is kept for the graph's life too, since each replay writes
    there again. Inside the capture nothing may wait for the device: nybble's operations do
    not; quantize's finite check then waits for `check()`, and double quantization (which
    reads scales back to the host) is refused."""
    cp = backend().xp
    for _ in range(warmup):
        work()
    allocate = cp.cuda.get_allocator()
    allocations: list[Any] = []

    def kept(size: int) -> Any:
        memory = allocate(size)
        allocations.append(memory)
        return memory

    stream = cp.cuda.Stream(non_blocking=True)
    launch.forget_outputs_ahead()  # made for streams before this one, which its handle may match
    with stream, cp.cuda.using_allocator(kept):
        stream.begin_capture()
        try:
            work()
        except BaseException:
            try:  # end the capture, which the error may have invalidated; raise the error
                stream.end_capture()
            except Exception:
                pass
            raise
        graph = stream.end_capture()
    stream.synchronize()
    return Graph(graph, buffers, allocations)
