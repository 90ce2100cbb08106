"""Reading and writing safetensors files with numpy, on top of the `safetensors` library
(docs/checkpoints.md, "Reading and writing safetensors").

The format: 8 bytes little-endian header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}),
then the tensor bytes (offsets relative to the end of the header), row-major, little-endian.

Reading: the library parses and validates every header (offsets that cover the data exactly,
no overlaps or gaps, sizes that match dtype and shape, the file length), so nybble accepts
exactly the files the library accepts. Tensor bytes are then read with `pread` into a fresh
numpy buffer, one tensor at a time: no memory map, so a file truncated or rewritten while it
is open gives a short read and a `FormatError`, never a SIGBUS. Every dtype the format knows
opens; `get` returns a numpy array for those numpy (with ml_dtypes) can hold (BF16 as
`ml_dtypes.bfloat16`, the F8 types as ml_dtypes' float8 types), `raw` the bytes of any.

Writing: `save` / `save_temporary` hand the arrays to the library's serializer, writing a
temporary beside the target that is renamed into place (the library's own temporary goes
into a private directory named as nybble's temporaries, so a kill leaves nothing that the
next write does not sweep). `StreamWriter` writes a file tensor
by tensor (for checkpoints larger than memory); every file it finishes is opened by the
library before it is handed back.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

from ._files import finish_temporary, replace_file, temporary_directory, temporary_path
from .errors import FormatError
from .formats import BFLOAT16


@dataclass(frozen=True)
class Dtype:
    """One safetensors dtype: its code in headers (`F32`), the name the library's TensorSpec
    takes (`float32`), its numpy dtype (None when numpy has none) and its bits per element."""

    code: str
    spec_name: str
    numpy: np.dtype[Any] | None
    bits: int


def _dtypes() -> dict[str, Dtype]:
    table = [
        ("F64", "float64", np.dtype("<f8"), 64),
        ("F32", "float32", np.dtype("<f4"), 32),
        ("F16", "float16", np.dtype("<f2"), 16),
        ("BF16", "bfloat16", BFLOAT16, 16),
        ("I64", "int64", np.dtype("<i8"), 64),
        ("I32", "int32", np.dtype("<i4"), 32),
        ("I16", "int16", np.dtype("<i2"), 16),
        ("I8", "int8", np.dtype("i1"), 8),
        ("U64", "uint64", np.dtype("<u8"), 64),
        ("U32", "uint32", np.dtype("<u4"), 32),
        ("U16", "uint16", np.dtype("<u2"), 16),
        ("U8", "uint8", np.dtype("u1"), 8),
        ("BOOL", "bool", np.dtype("?"), 8),
        ("F8_E4M3", "float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), 8),
        ("F8_E5M2", "float8_e5m2", np.dtype(ml_dtypes.float8_e5m2), 8),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz", np.dtype(ml_dtypes.float8_e4m3fnuz), 8),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz", np.dtype(ml_dtypes.float8_e5m2fnuz), 8),
        ("F8_E8M0", "float8_e8m0fnu", np.dtype(ml_dtypes.float8_e8m0fnu), 8),
        ("C64", "complex64", np.dtype("<c8"), 64),
        # Two 4-bit floats per byte: numpy has no packed dtype, so `raw` only.
        ("F4", "float4_e2m1fn_x2", None, 4),
    ]
    return {code: Dtype(code, spec, dt, bits) for code, spec, dt, bits in table}


#: The safetensors dtypes nybble knows, by header code.
DTYPES: dict[str, Dtype] = _dtypes()
#: Header code of each numpy dtype that safetensors can store.
CODES: dict[np.dtype[Any], str] = {d.numpy: c for c, d in DTYPES.items() if d.numpy is not None}
#: pread returns at most this much per call on Linux (0x7ffff000); larger reads loop.
_READ_CHUNK = 1 << 30


def dtype_code(dtype: Any) -> str:
    """The header code of a numpy dtype (any byte order), or ValueError."""
    dt = np.dtype(dtype)
    code = CODES.get(dt.newbyteorder("<") if dt.byteorder == ">" else dt)
    if code is None:
        raise ValueError(f"dtype {dt} cannot be stored in safetensors")
    return code


def tensor_bytes(code: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of a dtype (by code) and shape."""
    return math.prod(shape) * DTYPES[code].bits // 8


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry; `offset` is absolute in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SafeTensorsFile:
    """A safetensors file opened for reading: the header parsed and validated by the
    `safetensors` library, tensors read on request into fresh arrays."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        # O_NONBLOCK: opening a FIFO must not wait for a writer; refused just below.
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        self._fd: int | None = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        try:
            if not _is_regular(fd):
                raise FormatError(self.path, "not a regular file")
            self._entries, self.metadata = self._read_header(fd)
        except BaseException:
            self.close()
            raise

    def _read_header(self, fd: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        # The library opens the very file we hold (not whatever the path names by now).
        proc = f"/proc/self/fd/{fd}"
        source = proc if sys.platform.startswith("linux") and os.path.exists(proc) else self.path
        try:
            with safetensors.safe_open(source, framework="numpy") as f:
                names = list(f.offset_keys())
                meta = f.metadata() or {}
                declared = {}
                for name in names:
                    s = f.get_slice(name)
                    declared[name] = (str(s.get_dtype()), tuple(int(d) for d in s.get_shape()))
        except safetensors.SafetensorError as e:
            raise FormatError(self.path, f"not a valid safetensors file ({e})") from None
        # The library checked the header; its offsets (which it does not expose) are read
        # from the same bytes and must agree with what it reported.
        (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, self.path, "header length"))
        try:
            header = json.loads(_pread_exact(fd, n, 8, self.path, "header"))
        except (ValueError, RecursionError) as e:
            raise FormatError(self.path, f"unreadable header ({e})") from None
        entries: dict[str, TensorInfo] = {}
        for name in names:
            dtype, shape = declared[name]
            info = header.get(name) if isinstance(header, dict) else None
            agree = False
            if isinstance(info, dict):
                try:
                    begin, end = (int(v) for v in info["data_offsets"])
                    agree = info["dtype"] == dtype and tuple(info["shape"]) == shape
                except (KeyError, TypeError, ValueError):
                    pass
            if not agree:
                raise FormatError(self.path, "the header reads differently than expected", name)
            if dtype not in DTYPES:
                raise FormatError(
                    self.path,
                    f"dtype {dtype}, which nybble does not read (it reads {', '.join(DTYPES)})",
                    name,
                )
            if not _numpy_holds(shape):
                raise FormatError(
                    self.path,
                    f"shape {list(shape)} is beyond what numpy arrays can hold (at most "
                    f"{_MAX_DIMS} dimensions, and fewer than 2**60 elements counting empty "
                    "dimensions as 1)",
                    name,
                )
            entries[name] = TensorInfo(name, dtype, shape, 8 + n + begin, end - begin)
        return entries, {str(k): str(v) for k, v in meta.items()}

    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def info(self, name: str) -> TensorInfo:
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype_name(self, name: str) -> str:
        """The header's dtype code (F32, BF16, U8, F8_E4M3, ...)."""
        return self.info(name).dtype

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    def raw(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes as a uint8 array (any dtype): a fresh one, or the start of
        `out` (a C-contiguous uint8 array at least that large, e.g. a buffer reused from
        tensor to tensor, which saves the page faults of fresh memory)."""
        info = self.info(name)
        if out is None:
            buf = np.empty(info.nbytes, np.uint8)
        elif out.dtype != np.uint8 or out.ndim != 1 or out.size < info.nbytes:
            raise ValueError(f"out must be a flat uint8 array of at least {info.nbytes} bytes")
        else:
            buf = out[: info.nbytes]
        self._read_into(info, buf)
        return buf

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as a writable numpy array of its dtype and shape (in `out`'s memory
        when given, as for `raw`). FormatError for a dtype numpy cannot hold (F4), or when
        the file no longer holds the bytes."""
        info = self.info(name)
        dtype = DTYPES.get(info.dtype)
        if dtype is None or dtype.numpy is None:
            raise FormatError(self.path, f"dtype {info.dtype} has no numpy equivalent", name)
        return self.raw(name, out).view(dtype.numpy).reshape(info.shape)

    def _read_into(self, info: TensorInfo, buf: np.ndarray) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: the file is closed")
        view = buf.data.cast("B")
        done = 0
        while done < info.nbytes:
            count = min(info.nbytes - done, _READ_CHUNK)
            got = os.preadv(self._fd, [view[done : done + count]], info.offset + done)
            if got <= 0:
                raise FormatError(
                    self.path,
                    f"ends at byte {info.offset + done}, before the tensor's end at "
                    f"{info.offset + info.nbytes} (truncated while open?)",
                    info.name,
                )
            done += got

    def close(self) -> None:
        if self._fd is not None:
            self._fd = None
            self._finalizer()

    def __enter__(self) -> SafeTensorsFile:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


#: numpy's limit on dimensions (NPY_MAXDIMS: 64 since numpy 2, 32 before).
_MAX_DIMS = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32


def _numpy_holds(shape: Sequence[int]) -> bool:
    """Whether numpy can make an array of `shape` of any dtype nybble reads (8 bytes an
    element at most: fewer than 2**63 bytes). An empty tensor of a huge shape is valid
    safetensors, but numpy checks its size as if empty dimensions were 1."""
    elements = 1
    for d in shape:
        elements *= max(d, 1)
    return len(shape) <= _MAX_DIMS and elements < 2**60


def _is_regular(fd: int) -> bool:
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)


def _pread_exact(fd: int, n: int, offset: int, path: Path, what: str) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise FormatError(path, f"the {what} ends early (truncated while open?)")
    return data


def load(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of a file, as fresh arrays."""
    with SafeTensorsFile(path) as f:
        return {k: f.get(k) for k in f.keys()}


def iter_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) one at a time, in file order."""
    with SafeTensorsFile(path) as f:
        for k in f.keys():
            yield k, f.get(k)


# --- writing -----------------------------------------------------------------------------------


def _storable(name: str, value: Any) -> tuple[str, np.ndarray]:
    """(code, C-contiguous little-endian array) of a tensor to write."""
    a = np.asarray(value)
    try:
        code = dtype_code(a.dtype)
    except ValueError:
        raise ValueError(
            f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors"
        ) from None
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    # np.ascontiguousarray would turn a 0-d tensor into shape (1,); np.require keeps it.
    return code, np.require(a, requirements="C")


def _metadata(metadata: Mapping[str, Any] | None) -> dict[str, str] | None:
    return None if not metadata else {str(k): str(v) for k, v in metadata.items()}


def save_temporary(
    tensors: Mapping[str, Any],
    target: str | os.PathLike[str],
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Writes a safetensors file (the library's serializer) to a temporary beside `target`
    and returns its path, to be renamed into place (`_files.replace_file`); nothing is left
    behind on failure."""
    arrays = {k: _storable(k, v) for k, v in tensors.items()}
    # The specs point into `arrays`, which stays alive until the serializer returns.
    specs = {
        k: safetensors.TensorSpec(
            dtype=DTYPES[code].spec_name,
            shape=list(a.shape),
            data_ptr=a.ctypes.data,
            data_len=a.nbytes,
        )
        for k, (code, a) in arrays.items()
    }
    # The library writes a temporary of its own (`.tmpXXXXXX`, beside the path it is given)
    # and renames it: it writes in a directory named as nybble's temporaries, which the next
    # write beside `target` sweeps if this process is killed, never in `target`'s.
    private = temporary_directory(target)
    fd, path = temporary_path(target)
    os.close(fd)
    try:
        inside = private / "tensors.safetensors"
        safetensors.serialize_file(specs, inside, metadata=_metadata(metadata))
        os.replace(inside, path)
        finish_temporary(path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return path


def save(
    tensors: Mapping[str, Any],
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Writes a safetensors file atomically (a temporary renamed into place)."""
    replace_file(save_temporary(tensors, path, metadata), path)


@dataclass(frozen=True)
class Entry:
    """A tensor a StreamWriter will write. `max_bytes` marks a U8 1-D tensor whose length is
    known only when it is written (at most that many bytes), e.g. a JSON blob holding a value
    computed from the data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    max_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        return (
            self.max_bytes if self.max_bytes is not None else tensor_bytes(self.dtype, self.shape)
        )


class StreamWriter:
    """Writes one safetensors file tensor by tensor, in any order, to a temporary beside its
    target, so that only the tensor being written needs to be in memory.

    The layout is fixed up front: tensors of fixed size first, by decreasing alignment (as the
    library's serializer orders them), at known offsets written with pwrite; variable-length
    ones (Entry.max_bytes) after them. The header goes in last, padded with spaces to the room
    reserved for the longest it could be. `finish()` has the library open the file and
    compares what it reads with the plan before returning the temporary's path."""

    def __init__(
        self,
        target: str | os.PathLike[str],
        entries: Sequence[Entry],
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.target = Path(target)
        self.metadata = _metadata(metadata)
        names = [e.name for e in entries]
        if len(set(names)) != len(names) or "__metadata__" in names:
            raise ValueError(f"{self.target}: tensor names must be unique (and not __metadata__)")
        for e in entries:
            if e.dtype not in DTYPES:
                raise ValueError(f"{e.name}: unknown dtype {e.dtype}")
            if e.max_bytes is not None and (e.dtype != "U8" or len(e.shape) != 1):
                raise ValueError(f"{e.name}: variable-length tensors must be U8 and 1-D")
        fixed = [e for e in entries if e.max_bytes is None]
        fixed.sort(key=lambda e: -DTYPES[e.dtype].bits)  # stable: plan order within a size
        self._variable = [e for e in entries if e.max_bytes is not None]
        self._offsets: dict[str, int] = {}
        offset = 0
        for e in fixed:
            self._offsets[e.name] = offset
            offset += e.nbytes
        self._fixed_end = offset
        self._entries = {e.name: e for e in entries}
        widest = self._header({e.name: e.max_bytes or 0 for e in self._variable})
        self._header_room = len(widest) + (-len(widest) % 8)
        self._data_start = 8 + self._header_room
        self._pending = set(names)
        self._blobs: dict[str, bytes] = {}
        fd, self.temporary = temporary_path(self.target)
        self._fd: int | None = fd
        self._handed_over = False

    def _header(self, variable_sizes: Mapping[str, int]) -> bytes:
        header: dict[str, Any] = {}
        if self.metadata:
            header["__metadata__"] = self.metadata
        for name, begin in self._offsets.items():
            e = self._entries[name]
            header[name] = {
                "dtype": e.dtype,
                "shape": list(e.shape),
                "data_offsets": [begin, begin + e.nbytes],
            }
        begin = self._fixed_end
        for e in self._variable:
            size = variable_sizes[e.name]
            header[e.name] = {"dtype": "U8", "shape": [size], "data_offsets": [begin, begin + size]}
            begin += size
        return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    @property
    def pending(self) -> set[str]:
        """Names not written yet."""
        return set(self._pending)

    def write(self, name: str, value: Any, raw: bool = False) -> None:
        """Writes one planned tensor: an array of its dtype and shape, or with `raw` its bytes
        (a uint8 array of its size); a variable-length one as uint8 bytes of at most its
        max_bytes."""
        if self._fd is None:
            raise ValueError(f"{self.target}: the writer is closed")
        if name not in self._pending:
            raise ValueError(f"{self.target}: {name!r} is not planned or already written")
        e = self._entries[name]
        code, a = _storable(name, value)
        if raw and e.max_bytes is None:
            if code != "U8" or a.size != e.nbytes:
                raise ValueError(f"{name}: expected {e.nbytes} bytes, got {code} {list(a.shape)}")
            _pwrite_all(self._fd, a, self._data_start + self._offsets[name])
        elif e.max_bytes is not None:
            if code != "U8" or a.ndim != 1 or a.size > e.max_bytes:
                raise ValueError(f"{name}: expected at most {e.max_bytes} uint8 bytes")
            self._blobs[name] = a.tobytes()
        else:
            if code != e.dtype or tuple(a.shape) != e.shape:
                raise ValueError(
                    f"{name}: expected {e.dtype} {list(e.shape)}, got {code} {list(a.shape)}"
                )
            _pwrite_all(self._fd, a, self._data_start + self._offsets[name])
        self._pending.discard(name)

    def finish(self) -> Path:
        """Completes the file and returns the temporary's path, flushed to disk with a normal
        file's mode, for `_files.replace_file`; the library must read back the plan."""
        if self._fd is None:
            raise ValueError(f"{self.target}: the writer is closed")
        if self._pending:
            raise ValueError(f"{self.target}: tensors not written: {sorted(self._pending)[:5]}")
        fd = self._fd
        try:
            offset = self._data_start + self._fixed_end
            for e in self._variable:
                blob = np.frombuffer(self._blobs[e.name], np.uint8)
                _pwrite_all(fd, blob, offset)
                offset += blob.size
            header = self._header({e.name: len(self._blobs[e.name]) for e in self._variable})
            header += b" " * (self._header_room - len(header))
            _pwrite_all(fd, np.frombuffer(struct.pack("<Q", len(header)) + header, np.uint8), 0)
            os.ftruncate(fd, offset)
            self._fd = None
            os.close(fd)
            finish_temporary(self.temporary)
            self._verify()
        except BaseException:
            self.abort()
            raise
        self._handed_over = True
        return self.temporary

    def _verify(self) -> None:
        with SafeTensorsFile(self.temporary) as f:
            got = {k: (f.dtype_name(k), f.shape(k)) for k in f.keys()}
        want = {
            n: (e.dtype, (len(self._blobs[n]),) if e.max_bytes is not None else e.shape)
            for n, e in self._entries.items()
        }
        if got != want:
            raise FormatError(self.temporary, "the file written does not read back as planned")

    def abort(self) -> None:
        """Removes the temporary, unless finish() handed it over."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self._handed_over:
            self.temporary.unlink(missing_ok=True)

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


def _pwrite_all(fd: int, a: np.ndarray, offset: int) -> None:
    view = a.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + _READ_CHUNK], offset + done)
