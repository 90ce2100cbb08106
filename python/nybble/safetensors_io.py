"""Reading and writing the safetensors format with numpy: memory-mapped reads one tensor at
a time, atomic writes. Covers F64/F32/F16/BF16 and the integer types.

The format: 8 bytes little-endian header length N, N bytes of JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}),
then the tensor bytes (offsets relative to the end of the header), row-major, little-endian.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from ._files import finish_temporary, replace_file, temporary_path
from .errors import FormatError
from .formats import BFLOAT16

DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": BFLOAT16,
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafeTensorsFile:
    """A safetensors file opened for reading; tensors are read-only views of a memory map."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")  # closed in close()
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 8:
                raise FormatError(self.path, f"too short for a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", self._file.read(8))
            if n > min(MAX_HEADER, size - 8):
                raise FormatError(self.path, f"header length {n} does not fit the file")
            try:
                header = json.loads(self._file.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise FormatError(self.path, f"unreadable header ({e})") from None
            if not isinstance(header, dict):
                raise FormatError(self.path, "the header is not a JSON object")
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            self._start = 8 + n
            self._entries: dict[str, tuple[np.dtype[Any], tuple[int, ...], int, int]] = {}
            for name, info in header.items():
                self._entries[name] = self._entry(name, info, size - self._start)
            self._map = (
                mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
            )
        except BaseException:
            self._file.close()
            raise

    def _entry(
        self, name: str, info: Any, data_size: int
    ) -> tuple[np.dtype[Any], tuple[int, ...], int, int]:
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(self.path, f"malformed entry {info!r}", name) from None
        count = int(np.prod(shape, dtype=np.int64))
        if any(d < 0 for d in shape) or not 0 <= begin <= end <= data_size:
            raise FormatError(self.path, "lies outside the file", name)
        if end - begin != count * dtype.itemsize:
            raise FormatError(
                self.path,
                f"{end - begin} bytes, {info['dtype']} {list(shape)} needs "
                f"{count * dtype.itemsize}",
                name,
            )
        return dtype, shape, begin, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype_name(self, name: str) -> str:
        return NAMES[self._entries[name][0]]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only array over the memory map (no copy)."""
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        dtype, shape, begin, end = self._entries[name]
        if end == begin or self._map is None:
            return np.zeros(shape, dtype)
        return np.frombuffer(
            self._map, dtype, count=(end - begin) // dtype.itemsize, offset=self._start + begin
        ).reshape(shape)

    def close(self) -> None:
        # Views handed out keep the map alive; closing the file is always safe.
        self._file.close()

    def __enter__(self) -> SafeTensorsFile:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def load(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of a file, as memory-mapped read-only arrays."""
    with SafeTensorsFile(path) as f:
        return {k: f.get(k) for k in f.keys()}


def _header(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, a in tensors.items():
        if a.dtype not in NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
        header[name] = {
            "dtype": NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def save_temporary(
    tensors: Mapping[str, np.ndarray],
    target: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Writes a safetensors file to a temporary beside `target` and returns its path, to be
    renamed into place (`_files.replace_file`); nothing is left behind on failure."""
    # np.ascontiguousarray would turn a 0-d tensor into shape (1,); np.require keeps it.
    arrays = {k: np.require(_little_endian(v), requirements="C") for k, v in tensors.items()}
    header = _header(arrays, metadata)
    fd, path = temporary_path(target)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for a in arrays.values():
                f.write(a.reshape(-1).view(np.uint8).data)
        finish_temporary(path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def save(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes a safetensors file atomically (a temporary renamed into place)."""
    replace_file(save_temporary(tensors, path, metadata), path)


def _little_endian(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a


def iter_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) one at a time, in file order."""
    with SafeTensorsFile(path) as f:
        for k in f.keys():
            yield k, f.get(k)
