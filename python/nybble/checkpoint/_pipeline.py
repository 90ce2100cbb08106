"""Running a checkpoint job as a stream of tasks, one tensor (or one quantized weight) each:
a reader thread reads a task's tensors ahead, the calling thread computes (the Rust codec and
BLAS spread their work over the cores themselves), a writer thread writes the results into
the output shards. The bytes held by tasks in flight are bounded by a budget of at least the
largest task, so peak memory follows the largest tensor, not the checkpoint."""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Protocol

import numpy as np

from ..safetensors_io import Entry
from ._output import ShardedWriter

#: Memory tasks in flight may hold at least (a larger task runs alone).
MIN_BUDGET = 256 * 2**20
#: Tasks read ahead of the one being computed, at most.
MAX_AHEAD = 8

Work = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass
class Task:
    """Read `inputs` (as arrays, or as bytes when `raw`), compute `work` on them, write its
    results, which must be exactly `outputs` (as bytes when `raw`: a copy). `cost` is the
    memory the task holds at its peak, `size` what it counts for in progress (bytes read)."""

    inputs: list[str]
    outputs: list[Entry]
    work: Work
    cost: int
    size: int
    raw: bool = False


def copy_task(name: str, entry: Entry) -> Task:
    """A tensor copied byte for byte."""
    return Task([name], [entry], lambda arrays: arrays, entry.nbytes, entry.nbytes, raw=True)


class Progress(Protocol):
    def start(self, total_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def finish(self) -> None: ...


class ProgressBar:
    """A one-line progress bar on a terminal (nothing when the stream is not a TTY)."""

    def __init__(self, label: str, stream: IO[str] | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = 0
        self.done = 0
        self._start = 0.0
        self._shown = 0.0

    def start(self, total_bytes: int) -> None:
        self.total, self.done, self._start = total_bytes, 0, time.monotonic()
        self._show(force=True)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        self._show()

    def finish(self) -> None:
        if self.enabled:
            self._show(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def _show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._shown < 0.1):
            return
        self._shown = now
        frac = self.done / self.total if self.total else 1.0
        width = 30
        filled = int(frac * width)
        elapsed = now - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(
            f"\r{self.label} {frac:4.0%} [{bar}] {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB"
            f" {rate / 1e9:.2f} GB/s ETA {eta:4.0f}s "
        )
        self.stream.flush()


class _Budget:
    def __init__(self, capacity: int) -> None:
        self.free = capacity
        self._cond = threading.Condition()

    def try_take(self, n: int) -> bool:
        with self._cond:
            if n > self.free:
                return False
            self.free -= n
            return True

    def take(self, n: int, failed: Callable[[], bool]) -> None:
        with self._cond:
            while n > self.free and not failed():
                self._cond.wait(0.1)
            self.free -= n

    def give(self, n: int) -> None:
        with self._cond:
            self.free += n
            self._cond.notify_all()


@dataclass
class _Run:
    errors: list[BaseException] = field(default_factory=list)

    def failed(self) -> bool:
        return bool(self.errors)


def run(
    tasks: Sequence[Task],
    read: Callable[[str, bool], np.ndarray],
    writer: ShardedWriter,
    progress: Progress | None = None,
) -> None:
    """Runs every task; the first error stops the run and is raised (nothing of the output
    is finished: the caller aborts the writer and the output directory)."""
    budget = _Budget(max([MIN_BUDGET, *(t.cost for t in tasks)]))
    state = _Run()
    if progress is not None:
        progress.start(sum(t.size for t in tasks))

    def fetch(task: Task) -> dict[str, np.ndarray]:
        return {name: read(name, task.raw) for name in task.inputs}

    def store(task: Task, results: Mapping[str, np.ndarray]) -> None:
        try:
            if state.failed():
                return
            if set(results) != {e.name for e in task.outputs}:
                raise ValueError(f"a task made {sorted(results)}, planned {task.outputs}")
            for e in task.outputs:
                writer.write(e.name, results[e.name], task.raw)
            if progress is not None:
                progress.advance(task.size)
        except BaseException as e:
            state.errors.append(e)
        finally:
            budget.give(task.cost)

    reader = ThreadPoolExecutor(1, thread_name_prefix="nybble-read")
    writes = ThreadPoolExecutor(1, thread_name_prefix="nybble-write")
    ahead: collections.deque[tuple[Task, Future[dict[str, np.ndarray]]]] = collections.deque()
    stored: list[Future[None]] = []
    next_task = 0
    try:
        while next_task < len(tasks) or ahead:
            while (
                next_task < len(tasks)
                and len(ahead) < MAX_AHEAD
                and budget.try_take(tasks[next_task].cost)
            ):
                ahead.append((tasks[next_task], reader.submit(fetch, tasks[next_task])))
                next_task += 1
            if not ahead:  # wait for written tasks to give back what the next one needs
                budget.take(tasks[next_task].cost, state.failed)
                ahead.append((tasks[next_task], reader.submit(fetch, tasks[next_task])))
                next_task += 1
            task, fetched = ahead.popleft()
            arrays = fetched.result()
            if state.failed():
                break
            results = task.work(arrays)
            del arrays
            stored.append(writes.submit(store, task, results))
            del results
            stored = [f for f in stored if not f.done()]
        for f in stored:
            f.result()
    except BaseException as e:
        state.errors.append(e)  # pending writes stop
        raise
    finally:
        for _, pending in ahead:
            pending.cancel()
        reader.shutdown(wait=True, cancel_futures=True)
        writes.shutdown(wait=True, cancel_futures=True)
    if state.errors:
        raise state.errors[0]
    if progress is not None:
        progress.finish()
