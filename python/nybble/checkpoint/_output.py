"""Writing a checkpoint directory so that an interruption at any moment leaves the target
either as it was or complete (docs/checkpoints.md, "Safety"):

- the whole directory is built in a staging directory beside the target,
  `.<target>.<pid>.<random>.tmp`, and renamed into place once every file in it is complete
  and flushed; an existing target is swapped with the staging directory in one step
  (renameat2 RENAME_EXCHANGE where Linux allows) and the old one removed after;
- each file inside is itself written to a temporary and renamed when complete, so the
  staging directory only ever holds finished files;
- staging directories left by killed runs are removed by the next run on the same target.

Shards follow transformers' `save_pretrained` (huggingface_hub's sharding rule): tensors in
order, a new shard when the next tensor would take the current one past `max_shard_size`, a
tensor larger than that alone in its own shard; one shard is `model.safetensors`, several are
`model-00001-of-0000N.safetensors` with `model.safetensors.index.json`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._checkpoint_io.source import INDEX_FILE, SINGLE_FILE, ExtraFile
from .._files import (
    fsync_directory,
    new_directory_mode,
    remove_stale_temporaries,
    replace_file,
    write_temporary,
)
from ..errors import FormatError
from ..safetensors_io import Entry, StreamWriter

#: transformers' default max_shard_size ("5GB", decimal as huggingface_hub reads it).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
#: Metadata transformers writes in every shard (and requires when it loads one).
SHARD_METADATA = {"format": "pt"}

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class OutputDirectory:
    """A directory built aside and put in place whole by `commit()`; `abort()` (or leaving
    the `with` block by an exception) removes everything built so far."""

    def __init__(self, target: str | os.PathLike[str], overwrite: bool = False) -> None:
        self.target = Path(target)
        self.overwrite = overwrite
        parent = self.target.parent
        if not self.target.name or self.target.name in (".", ".."):
            raise ValueError(f"{self.target}: name the output directory itself")
        if os.path.lexists(self.target) and not overwrite:
            raise FormatError(self.target, "already exists (pass --force to replace it)")
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale(parent, self.target.name)
        self.staging = Path(
            tempfile.mkdtemp(
                prefix=f".{self.target.name}.{os.getpid()}.", suffix=".tmp", dir=parent
            )
        )
        self.staging.chmod(new_directory_mode())
        self._done = False

    def path(self, name: str) -> Path:
        return self.staging / name

    def write_bytes(self, name: str, data: bytes, mode: int | None = None) -> None:
        replace_file(write_temporary(self.path(name), data, mode), self.path(name))

    def write_json(self, name: str, obj: Any) -> None:
        """JSON as transformers writes its files (2-space indent, sorted keys)."""
        text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
        self.write_bytes(name, text.encode("utf-8"))

    def copy(self, name: str, source: Path) -> None:
        """A copy of the regular file `source` under `name`, with the source's permission
        bits (a file only its owner may read stays so). The file is opened without following
        a link and without blocking, and must still be a regular file once open."""
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(source, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise FormatError(source, f"cannot be copied ({e.strerror or e})") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(source, "is no longer a regular file (changed while copied)")
            data = f.read()
        self.write_bytes(name, data, stat.S_IMODE(st.st_mode) & 0o777)

    def commit(self) -> None:
        """Puts the staging directory in place of the target (atomically)."""
        fsync_directory(self.staging)
        if not os.path.lexists(self.target):
            _rename(self.staging, self.target, _RENAME_NOREPLACE)
        elif not self.overwrite:
            raise FormatError(self.target, "appeared while the output was being written")
        elif _rename(self.staging, self.target, _RENAME_EXCHANGE):
            pass  # the old target now sits at the staging path, removed below
        else:
            # No atomic exchange here: move the old one aside first (a moment without it).
            old = Path(
                tempfile.mkdtemp(
                    prefix=f".{self.target.name}.{os.getpid()}.",
                    suffix=".tmp",
                    dir=self.target.parent,
                )
            )
            os.replace(self.target, old / "old")
            os.rename(self.staging, self.target)
            self.staging = old
        fsync_directory(self.target.parent)
        self._done = True
        _remove(self.staging)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            _remove(self.staging)

    def __enter__(self) -> OutputDirectory:
        return self

    def __exit__(self, t: Any, e: Any, tb: Any) -> None:
        self.abort()


def _rename(source: Path, target: Path, flags: int) -> bool:
    """renameat2 with `flags`; False where the system cannot (then the caller falls back).
    RENAME_NOREPLACE falls back to a plain rename, which refuses a non-empty target."""
    libc = _libc()
    if libc is not None:
        result = libc.renameat2(
            _AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags
        )
        if result == 0:
            return True
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(target))
    if flags == _RENAME_NOREPLACE:
        os.rename(source, target)
        return True
    return False


_LIBC: list[Any] = []


def _libc() -> Any:
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _LIBC.append(libc if hasattr(libc, "renameat2") else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def remove_stale(parent: Path, name: str) -> None:
    """Removes the staging directories (and temporaries) of `name` in `parent` whose writing
    process is gone (killed runs)."""
    remove_stale_temporaries(parent, (name,))


# --- sharding ------------------------------------------------------------------------------------


def shard_plan(entries: Sequence[Entry], max_shard_size: int) -> list[list[Entry]]:
    """huggingface_hub's split of tensors, in order, into shards of at most max_shard_size
    bytes (a larger tensor alone in its own shard, placed before the shard being filled)."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for e in entries:
        n = e.nbytes
        if n > max_shard_size:
            shards.append([e])
            continue
        if size + n > max_shard_size and current:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += n
    if current:
        shards.append(current)
    return shards or [[]]


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class ShardedWriter:
    """Writes planned tensors into shards inside an OutputDirectory, in any order; a shard is
    finished (and renamed into place) as soon as its last tensor is written, and the index
    written by `finish()`."""

    def __init__(self, out: OutputDirectory, entries: Sequence[Entry], max_shard_size: int) -> None:
        if not isinstance(max_shard_size, int) or max_shard_size < 1:
            raise ValueError(
                f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}"
            )
        self.out = out
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"the output would hold tensors named twice: {twice[:3]}")
        plan = shard_plan(entries, max_shard_size)
        self.names = shard_names(len(plan))
        self._shard_of: dict[str, int] = {}
        self._writers: list[StreamWriter | None] = []
        for i, shard in enumerate(plan):
            for e in shard:
                self._shard_of[e.name] = i
        self._plan = plan
        self._sizes: dict[str, int] = {}
        try:
            for i, shard in enumerate(plan):
                self._writers.append(StreamWriter(out.path(self.names[i]), shard, SHARD_METADATA))
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, value: np.ndarray, raw: bool = False) -> None:
        """Writes a planned tensor (see StreamWriter.write); finishes its shard when it was
        the shard's last."""
        i = self._shard_of[name]
        w = self._writers[i]
        if w is None:
            raise ValueError(f"{name}: its shard is already finished")
        w.write(name, value, raw)
        self._sizes[name] = int(np.asarray(value).nbytes)
        if not w.pending:
            self._writers[i] = None
            replace_file(w.finish(), self.out.path(self.names[i]))

    def finish(self) -> None:
        left = [n for n, w in zip(self.names, self._writers, strict=True) if w is not None]
        if left:
            raise ValueError(f"shards not complete: {left}")
        if len(self.names) > 1:
            weight_map = {name: self.names[i] for name, i in self._shard_of.items()}
            index = {
                "metadata": {"total_size": sum(self._sizes.values())},
                "weight_map": dict(sorted(weight_map.items())),
            }
            self.out.write_json(INDEX_FILE, index)

    def abort(self) -> None:
        for w in self._writers:
            if w is not None:
                w.abort()


def without_quantization(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json for dense weights: the quantization config removed."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def copy_files(out: OutputDirectory, files: Iterable[ExtraFile]) -> None:
    for f in files:
        out.copy(f.name, f.path)


def check_apart(target: str | os.PathLike[str], inputs: Mapping[str, Any]) -> None:
    """Refuses an output directory that is, holds or lies inside one of `inputs` (what ->
    path), symlinks resolved: putting it in place would delete the input (or the staging
    directory would be built inside it). Called before anything is read or written."""
    for what, source in inputs.items():
        if _within(Path(source), Path(target)):
            how = "is" if _within(Path(target), Path(source)) else "contains"
        elif _within(Path(target), Path(source)):
            how = "lies inside"
        else:
            continue
        raise ValueError(
            f"target {os.fspath(target)!r} {how} the {what} {os.fspath(source)!r}; the output "
            f"directory must be apart from the {what} (not it, not inside it, not holding it), "
            f"so that writing it cannot change or delete the {what}"
        )


def _within(inner: Path, outer: Path) -> bool:
    """Whether `inner` is `outer` or lies inside it, links resolved; by device and inode too
    where they exist (a bind mount, or another spelling on a case-insensitive system)."""
    a, b = Path(os.path.realpath(inner)), Path(os.path.realpath(outer))
    if a.is_relative_to(b):
        return True
    try:
        st = os.stat(b)
    except OSError:
        return False
    for p in (a, *a.parents):
        with contextlib.suppress(OSError):
            s = os.stat(p)
            if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                return True
    return False
