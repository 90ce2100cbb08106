"""Running a checkpoint job as a stream of tasks, one tensor (or one quantized weight) each:
a reader thread reads a task's tensors ahead, the calling thread computes (the Rust codec and
BLAS spread their work over the cores themselves), a writer thread writes the results into
the output shards. The bytes held by tasks in flight are bounded by a budget of at least the
largest task, so peak memory follows the largest tensor, not the checkpoint."""

from __future__ import annotations

import collections
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import numpy as np

from .._checkpoint_io.source import CONFIG_FILE, Checkpoint
from ..errors import FormatError
from ..safetensors_io import Entry
from ._common import Report, written_files
from ._output import OutputDirectory, ShardedWriter, copy_files

#: Memory tasks in flight may hold at least (a larger task runs alone): room for a task being
#: read, one computed and one written, so that the disk and the cores work at once.
MIN_BUDGET = 384 * 2**20
#: Tasks read ahead of the one being computed, at most.
MAX_AHEAD = 4

Work = Callable[[Mapping[str, np.ndarray], "Scratch"], Mapping[str, np.ndarray]]


@dataclass
class Task:
    """Read `inputs` (as arrays, or as bytes when `raw`), compute `work` on them, write its
    results, which must be exactly `outputs` (as bytes when `raw`: a copy). `cost` is the
    memory the task holds at its peak, `size` what it counts for in progress (bytes read).
    `work` may take large result buffers from its Scratch (reused from task to task)."""

    inputs: list[str]
    outputs: list[Entry]
    work: Work
    cost: int
    size: int
    raw: bool = False


def copy_task(name: str, entry: Entry) -> Task:
    """A tensor copied byte for byte."""
    return Task([name], [entry], lambda arrays, _: arrays, entry.nbytes, entry.nbytes, raw=True)


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


#: Buffers at least this large are reused from task to task (smaller ones cost little).
_POOLED = 1 << 20


class _Buffers:
    """Memory for tasks: a budget of bytes in flight, and uint8 buffers reused from task to
    task, since fresh memory costs a page fault per page on first touch (about a third of
    the time of reading a tensor from the page cache, measured). Idle buffers count against
    the budget too, so what the process holds stays within `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.free = capacity
        self._idle: list[np.ndarray] = []
        self._cond = threading.Condition()

    def _trim(self) -> None:
        held = sum(b.nbytes for b in self._idle)
        while self._idle and held > self.free:
            held -= self._idle.pop(0).nbytes  # the oldest first

    def try_take(self, n: int) -> bool:
        with self._cond:
            if n > self.free:
                return False
            self.free -= n
            self._trim()
            return True

    def take(self, n: int, failed: Callable[[], bool]) -> None:
        with self._cond:
            while n > self.free and not failed():
                self._cond.wait(0.1)
            self.free -= n
            self._trim()

    def give(self, n: int, buffers: list[np.ndarray]) -> None:
        with self._cond:
            self.free += n
            self._idle.extend(buffers)
            self._trim()
            self._cond.notify_all()

    def buffer(self, n: int) -> np.ndarray:
        """A uint8 buffer of at least n bytes (an idle one not much larger, or a new one)."""
        if n >= _POOLED:
            with self._cond:
                fits = [i for i, b in enumerate(self._idle) if n <= b.nbytes <= 2 * n]
                if fits:
                    return self._idle.pop(min(fits, key=lambda i: self._idle[i].nbytes))
        return np.empty(n, np.uint8)


class Scratch:
    """The buffers one task takes (given back to the pool once its results are written)."""

    def __init__(self, buffers: _Buffers) -> None:
        self._buffers = buffers
        self.taken: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A flat uint8 array of exactly nbytes (in a reused buffer when large)."""
        buf = self._buffers.buffer(nbytes)
        if nbytes >= _POOLED:
            self.taken.append(buf)
        return buf[:nbytes]

    def array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """An uninitialised array of `shape` and `dtype` in a reused buffer."""
        n = math.prod(shape) * dtype.itemsize
        return self.take(n).view(dtype).reshape(shape)


@dataclass
class _Run:
    errors: list[BaseException] = field(default_factory=list)

    def failed(self) -> bool:
        return bool(self.errors)


def run(
    tasks: Sequence[Task],
    source: Checkpoint,
    writer: ShardedWriter,
    progress: Progress | None = None,
) -> None:
    """Runs every task, reading from `source`; the first error stops the run and is raised
    (nothing of the output is finished: the caller aborts the writer and the output
    directory)."""
    memory = _Buffers(max([MIN_BUDGET, *(t.cost for t in tasks)]))
    state = _Run()
    if progress is not None:
        progress.start(sum(t.size for t in tasks))

    def fetch(task: Task) -> tuple[dict[str, np.ndarray], Scratch]:
        scratch = Scratch(memory)
        arrays = {}
        for name in task.inputs:
            buf = scratch.take(source.info(name).nbytes)
            arrays[name] = source.raw(name, buf) if task.raw else source.read(name, buf)
        return arrays, scratch

    def store(task: Task, results: Mapping[str, np.ndarray], scratch: Scratch) -> None:
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
            memory.give(task.cost, scratch.taken)

    reader = ThreadPoolExecutor(1, thread_name_prefix="nybble-read")
    writes = ThreadPoolExecutor(1, thread_name_prefix="nybble-write")
    ahead: collections.deque[tuple[Task, Future[tuple[dict[str, np.ndarray], Scratch]]]]
    ahead = collections.deque()
    stored: list[Future[None]] = []
    next_task = 0
    try:
        while next_task < len(tasks) or ahead:
            while (
                next_task < len(tasks)
                and len(ahead) < MAX_AHEAD
                and memory.try_take(tasks[next_task].cost)
            ):
                ahead.append((tasks[next_task], reader.submit(fetch, tasks[next_task])))
                next_task += 1
            if not ahead:  # wait for written tasks to give back what the next one needs
                memory.take(tasks[next_task].cost, state.failed)
                ahead.append((tasks[next_task], reader.submit(fetch, tasks[next_task])))
                next_task += 1
            task, fetched = ahead.popleft()
            arrays, scratch = fetched.result()
            if state.failed():
                break
            results = task.work(arrays, scratch)
            del arrays
            stored.append(writes.submit(store, task, results, scratch))
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


def write_checkpoint(
    source: Checkpoint,
    tasks: Sequence[Task],
    config: Mapping[str, Any] | None,
    report: Report,
    target: str | os.PathLike[str],
    overwrite: bool,
    shard_size: int,
    progress: Progress | None,
) -> None:
    """Writes the results of `tasks` as the safetensors shards of a new checkpoint directory
    `target`, with `config` as its config.json (none when None) and the source's other files
    copied (those left out noted in `report.notes`); the directory appears whole or not at all.
    Counts the bytes read and the files and bytes written in `report`."""
    _check_unique_outputs(source, tasks)
    extra, report.notes = source.extra_files()
    with OutputDirectory(target, overwrite) as out:
        writer = ShardedWriter(out, [e for t in tasks for e in t.outputs], shard_size)
        try:
            run(tasks, source, writer, progress)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        if config is not None:
            out.write_json(CONFIG_FILE, config)
        copy_files(out, extra)
        out.commit()
    report.bytes_read = source.nbytes
    report.files, report.bytes_written = written_files(out.target)


def _check_unique_outputs(source: Checkpoint, tasks: Sequence[Task]) -> None:
    """FormatError for two tasks writing a tensor of one name (a copied tensor named as
    one of a quantized weight's own, say), naming both sources, before anything is written."""
    made_by: dict[str, Task] = {}
    for task in tasks:
        for e in task.outputs:
            other = made_by.setdefault(e.name, task)
            if other is not task:
                raise FormatError(
                    source.file_of(task.inputs[0]),
                    f"the output would hold two tensors of this name: one made from "
                    f"{', '.join(other.inputs[:2])}, one from {', '.join(task.inputs[:2])} "
                    "(rename or remove one of them in the input)",
                    e.name,
                )
