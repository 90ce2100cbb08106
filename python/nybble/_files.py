"""Writing files safely: a new file is written in full to a temporary beside its target and
renamed into place, so an interrupted run leaves either nothing new or a complete file. The
file gets the mode a plain `open(path, "w")` would give it (0666 less the umask), not the
0600 of a temporary. Temporaries are named `.<target>.<pid>.<random>.tmp`, so that one left by
a killed process can be told from one being written and swept away later."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.[^.]+\.tmp$")


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (os.umask would
    change it for every thread for a moment)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode a newly created regular file gets: 0666 less the umask."""
    return 0o666 & ~_umask()


def new_directory_mode() -> int:
    """The mode a newly created directory gets: 0777 less the umask."""
    return 0o777 & ~_umask()


def temporary_path(target: str | os.PathLike[str]) -> tuple[int, Path]:
    """An open descriptor and the path of a new temporary beside `target`, after sweeping
    away the temporaries of `target` that killed processes left."""
    t = Path(target)
    parent = t.parent if str(t.parent) else Path(".")
    remove_stale_temporaries(parent, (t.name,))
    fd, name = tempfile.mkstemp(prefix=f".{t.name}.{os.getpid()}.", suffix=".tmp", dir=parent)
    return fd, Path(name)


def temporary_directory(target: str | os.PathLike[str]) -> Path:
    """A new staging directory beside `target` (mode as a plain mkdir gives), named like the
    temporaries so that one a killed process left is swept the same way (done here first)."""
    t = Path(target)
    parent = t.parent if str(t.parent) else Path(".")
    remove_stale_temporaries(parent, (t.name,))
    path = Path(tempfile.mkdtemp(prefix=f".{t.name}.{os.getpid()}.", suffix=".tmp", dir=parent))
    path.chmod(new_directory_mode())
    return path


def finish_temporary(path: Path, mode: int | None = None) -> None:
    """Gives a fully written temporary the mode of a normal file (or `mode`) and flushes it
    to disk."""
    os.chmod(path, new_file_mode() if mode is None else mode)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: Path) -> None:
    """Flushes a directory's entries (the renames in it) to disk, where the system can."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_temporary(target: str | os.PathLike[str], data: bytes, mode: int | None = None) -> Path:
    """Writes `data` to a new temporary beside `target` (flushed, with a normal file's mode
    or `mode`) and returns its path, for `replace_file`; nothing is left behind on failure."""
    fd, path = temporary_path(target)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        finish_temporary(path, mode)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def replace_file(temporary: Path, target: str | os.PathLike[str]) -> None:
    """Renames a finished temporary over `target` (atomic on one filesystem)."""
    try:
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Writes to a temporary beside `path` and renames it into place on success, so an
    interrupted run leaves either nothing or the complete file."""
    fd, tmp = temporary_path(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        finish_temporary(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_stale_temporaries(directory: Path, targets: Iterable[str]) -> None:
    """Removes the temporaries of `targets` in `directory` (files, or staging directories
    named the same way) whose writing process is gone."""
    wanted = set(targets)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        m = _TEMPORARY.match(entry.name)
        if m is None or m["target"] not in wanted or _alive(int(m["pid"])):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
