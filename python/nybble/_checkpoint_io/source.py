"""Reading a Hugging Face checkpoint: a directory with config.json and either one
model.safetensors or shards listed by model.safetensors.index.json (or a lone .safetensors
file), every file checked before any work starts (docs/checkpoints.md)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from .._json import read_file as read_json
from ..errors import FormatError
from ..safetensors_io import SafeTensorsFile, TensorInfo

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Weight files of other formats: never copied beside the safetensors ones.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


class Checkpoint:
    """The tensors of a checkpoint by name, in file order (shard by shard), read one at a
    time. FormatError for a missing or malformed config, index or shard, naming the file
    and the field."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.files: dict[str, SafeTensorsFile] = {}
        self._where: dict[str, tuple[SafeTensorsFile, TensorInfo]] = {}
        try:
            if self.path.is_dir():
                self.directory = self.path
                self.index_path: Path | None = None
                shard_names = self._shard_names()
            elif self.path.is_file():
                self.directory = self.path.parent
                self.index_path = None
                shard_names = None
            else:
                raise FormatError(
                    self.path, "not found" if not self.path.exists() else "not a file"
                )
            # A lone file is just that file: no config is read from beside it.
            self.config = self._read_config() if self.path == self.directory else None
            if shard_names is None:
                self._open(self.path.name, self.path)
            else:
                for name in shard_names:
                    self._open(name, self.directory / name)
            if self.index_path is not None:
                self._check_index()
            else:
                for f in self.files.values():
                    for key in f.keys():
                        self._where[key] = (f, f.info(key))
        except BaseException:
            self.close()
            raise

    # --- opening ---------------------------------------------------------------------------

    def _shard_names(self) -> list[str]:
        d = self.directory
        if (d / SINGLE_FILE).exists():
            return [SINGLE_FILE]
        if (d / INDEX_FILE).exists():
            self.index_path = d / INDEX_FILE
            self._weight_map = self._read_index(self.index_path)
            return sorted(set(self._weight_map.values()))
        found = sorted(p.name for p in d.glob("*.safetensors") if p.is_file())
        if len(found) == 1:
            return found
        if not found:
            raise FormatError(d, f"holds no {SINGLE_FILE} and no {INDEX_FILE}")
        raise FormatError(
            d, f"holds several .safetensors files ({', '.join(found[:4])}) and no {INDEX_FILE}"
        )

    def _read_index(self, path: Path) -> dict[str, str]:
        raw = read_json(path)
        if not isinstance(raw, dict):
            raise FormatError(path, "not a JSON object")
        weight_map = raw.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FormatError(path, "expected an object of tensor names to files", "weight_map")
        meta = raw.get("metadata", {})
        if not isinstance(meta, dict):
            raise FormatError(path, "expected an object", "metadata")
        for name, file in weight_map.items():
            if not isinstance(file, str) or not _plain_file_name(file):
                raise FormatError(
                    path, f"names {file!r}, not a file name in the checkpoint's directory", name
                )
        return weight_map

    def _read_config(self) -> dict[str, Any] | None:
        path = self.directory / CONFIG_FILE
        if not path.exists():
            return None
        config = read_json(path)
        if not isinstance(config, dict):
            raise FormatError(path, "not a JSON object")
        return config

    def _open(self, name: str, path: Path) -> None:
        where = self.index_path or path
        if not path.exists():
            raise FormatError(where, f"names {name}, which is not there")
        try:
            self.files[name] = SafeTensorsFile(path)
        except IsADirectoryError:
            raise FormatError(path, "not a regular file") from None

    def _check_index(self) -> None:
        """Every tensor the index names is in the shard it names, and every tensor of every
        shard is named by the index."""
        assert self.index_path is not None
        listed: dict[str, set[str]] = {}
        for name, file in self._weight_map.items():
            listed.setdefault(file, set()).add(name)
        for file, f in self.files.items():
            names = listed[file]
            for key in f.keys():
                other = self._weight_map.get(key)
                if other is not None and other != file and key in self.files[other]:
                    raise FormatError(
                        f.path,
                        f"this name appears twice, in {file} and in {other} (which "
                        f"{INDEX_FILE} names): a checkpoint holds each name once",
                        key,
                    )
                if other is not None and other != file:
                    raise FormatError(f.path, f"{INDEX_FILE} says it is in {other}", key)
                if key not in names:
                    raise FormatError(f.path, f"not listed in {INDEX_FILE}", key)
                self._where[key] = (f, f.info(key))
            for key in sorted(names - set(f.keys())):
                raise FormatError(
                    f.path, f"missing, though {INDEX_FILE} says it is in this file", key
                )

    # --- reading ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Tensor names, shard by shard in file order."""
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        if name not in self._where:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return self._where[name][1]

    def file_of(self, name: str) -> Path:
        """The file holding a tensor (to name in errors)."""
        if name not in self._where:
            return self.index_path or self.path
        return self._where[name][0].path

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as an array: fresh, or in `out`'s memory (SafeTensorsFile.get)."""
        self.info(name)
        return self._where[name][0].get(name, out)

    def raw(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes (any dtype) as a uint8 array (SafeTensorsFile.raw)."""
        self.info(name)
        return self._where[name][0].raw(name, out)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for _, info in self._where.values())

    def extra_files(self) -> tuple[list[ExtraFile], list[str]]:
        """The directory's other top-level files (tokenizer, generation config, README, ...),
        to copy beside new weights: everything but config.json, the index, weight files and
        hidden entries. None for a lone .safetensors file. Returns the files to copy and a
        note for each entry left out: a subdirectory, a FIFO, socket or device (never opened),
        a broken link, a link to a file outside the directory (so a checkpoint cannot make
        the tools copy, say, /etc/shadow into an output others can read). A link to a regular
        file inside the directory is copied as that file; so is a link of the Hugging Face
        cache's layout, from `<repo>/snapshots/<revision>/` into `<repo>/blobs/`."""
        if self.path != self.directory:
            return [], []
        files: list[ExtraFile] = []
        notes: list[str] = []
        root = Path(os.path.realpath(self.directory))
        for entry in sorted(os.scandir(self.directory), key=lambda e: e.name):
            name = entry.name
            if name.startswith(".") or name in (CONFIG_FILE, INDEX_FILE):
                continue
            if name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json"):
                continue
            path = Path(entry.path)
            why = None
            if path.is_symlink():
                target = Path(os.path.realpath(path))
                if not (target.is_relative_to(root) or _in_hub_blobs(target, root)):
                    why = "a symbolic link to a file outside the checkpoint's directory"
                path = target
            try:
                mode = path.stat(follow_symlinks=False).st_mode
            except OSError:
                mode = None
            if why is None:
                why = _not_a_file(mode)
            if why is None:
                files.append(ExtraFile(name, path))
            else:
                notes.append(f"not copied: {name} ({why})")
        return files, notes

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class ExtraFile:
    """A file copied beside the new weights: its name, and the regular file to read (the
    entry itself, or the file a symbolic link in the directory points to)."""

    name: str
    path: Path


def _not_a_file(mode: int | None) -> str | None:
    """Why an entry of this mode (None: gone) is not copied, or None for a regular file."""
    if mode is None:
        return "a broken symbolic link"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory: only the top-level files are copied"
    if stat.S_ISFIFO(mode):
        return "a FIFO, not a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a regular file"
    return "a device or other special file, not a regular file"


def _in_hub_blobs(target: Path, snapshot: Path) -> bool:
    """Whether `target` (resolved) is a blob of the Hugging Face cache repository whose
    snapshot `snapshot` (resolved) is: `<repo>/snapshots/<revision>` -> `<repo>/blobs/<hash>`.
    Both paths are free of links, so `blobs` itself is no link to elsewhere."""
    repo = snapshot.parent.parent
    return snapshot.parent.name == "snapshots" and target.parent == repo / "blobs"


def _plain_file_name(name: str) -> bool:
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )
