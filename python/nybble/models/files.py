"""A pretrained model's files, read one tensor at a time by Hugging Face name: a checkpoint
folder (config.json + model.safetensors or shards; dense bf16/f16/f32, or 4-bit weights in
bitsandbytes' or nybble's layout, read as stored) or a GGUF file (dequantized as llama.cpp
does, its config and tokenizer taken from its metadata)."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from .._checkpoint_io.layouts import QuantGroup, find_groups, load_group
from .._checkpoint_io.source import Checkpoint
from ..errors import FormatError
from ..tensor import NF4Tensor
from . import gguf
from .hub import resolve
from .tokenizer import Tokenizer


class ModelFiles:
    """What the trainer and `generate` read: `config` (the HF config.json fields),
    `read(name)` (a dense float array on the host), `stored_quantized(name)` (a weight as a
    4-bit checkpoint stores it, or None), `tokenizer()`."""

    path: Path
    config: dict[str, Any]

    def names(self) -> list[str]:
        raise NotImplementedError

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def stored_quantized(self, name: str) -> NF4Tensor | None:
        return None

    def tokenizer(self) -> Tokenizer:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> ModelFiles:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class CheckpointFiles(ModelFiles):
    """A Hugging Face checkpoint folder. A weight stored in 4 bits (a `*-bnb-4bit` folder,
    `nybble quantize` output) is its NF4Tensor, never re-quantized; read dense it is
    dequantized to float32."""

    def __init__(self, directory: Path) -> None:
        self.path = directory
        self.checkpoint = Checkpoint(directory)
        try:
            if self.checkpoint.config is None:
                raise FormatError(directory, "has no config.json")
            self.config = self.checkpoint.config
            self.groups: dict[str, QuantGroup] = find_groups(self.checkpoint.names(), directory)
            members = {m for g in self.groups.values() for m in g.members}
            self._names = list(self.groups) + [
                n for n in self.checkpoint.names() if n not in members
            ]
        except BaseException:
            self.checkpoint.close()
            raise

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self.groups or name in self.checkpoint

    def read(self, name: str) -> np.ndarray:
        q = self.stored_quantized(name)
        if q is not None:
            return np.asarray(q.dequantize("float32"))
        if name not in self.checkpoint:
            raise FormatError(self.path, "missing", name)
        a = self.checkpoint.read(name)
        if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
            raise FormatError(
                self.checkpoint.file_of(name), f"dtype {a.dtype} is not a float", name
            )
        return a

    def stored_quantized(self, name: str) -> NF4Tensor | None:
        group = self.groups.get(name)
        if group is None:
            return None
        return load_group(group, self.checkpoint.read, self.checkpoint.file_of)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_directory(self.path)

    def close(self) -> None:
        self.checkpoint.close()


class GGUFFiles(ModelFiles):
    """A GGUF file: tensors dequantized to float32 exactly as llama.cpp does, by their HF
    names (Llama's q/k rows back in HF's rotary order)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = gguf.GGUFFile(path)
        try:
            self.config = gguf.hf_config(self.file)
            self._by_hf: dict[str, str] = {}
            for name in self.file.tensors:
                hf = gguf.hf_name(name)
                if hf is None:
                    raise FormatError(path, "is a tensor nybble does not map to the model", name)
                self._by_hf[hf] = name
        except BaseException:
            self.file.close()
            raise

    def names(self) -> list[str]:
        return list(self._by_hf)

    def __contains__(self, name: object) -> bool:
        return name in self._by_hf

    def read(self, name: str) -> np.ndarray:
        found = self._by_hf.get(name)
        if found is None:
            raise FormatError(self.path, "missing", name)
        a = self.file.read(found)
        if self.config["model_type"] == "llama" and ".attn_q." in found:
            a = gguf.unpermute_rotary(a, self.config["num_attention_heads"])
        elif self.config["model_type"] == "llama" and ".attn_k." in found:
            a = gguf.unpermute_rotary(a, self.config["num_key_value_heads"])
        return a

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf(gguf.tokenizer_metadata(self.file), str(self.path))

    def close(self) -> None:
        self.file.close()


def open_model(spec: str | os.PathLike[str]) -> ModelFiles:
    """The files of a model: a checkpoint folder, a .gguf file, or a Hub id in the local
    cache. FormatError naming what is wrong otherwise."""
    path = resolve(spec)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise FormatError(path, "expected a checkpoint folder or a .gguf file")
        return GGUFFiles(path)
    if not path.is_dir():
        raise FormatError(path, "not a file or folder")
    if not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return GGUFFiles(found[0])
    return CheckpointFiles(path)


__all__ = ["CheckpointFiles", "GGUFFiles", "ModelFiles", "open_model"]
