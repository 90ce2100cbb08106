"""A pretrained model's weights as the trainer's WeightSource: each weight read from the files
when the model asks for it, checked against the shape the config implies, and (for a frozen
4-bit base) quantized right away, or taken as a 4-bit checkpoint stores it."""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..models.files import ModelFiles
from ..tensor import NF4Tensor, quantize


class PretrainedWeights:
    """`WeightSource` over a model's files. Every weight the model needs must be there with
    the shape its config implies (FormatError naming the first that is not); a tied head
    needs no `lm_head.weight` (one present is ignored, as HF ignores it)."""

    def __init__(self, files: ModelFiles) -> None:
        self.files = files
        self.used: set[str] = set()

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self.files:
            raise FormatError(self.files.path, "missing (the config says the model has it)", name)
        self.used.add(name)

    def matrix(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        self._check(name, shape)
        a = self.files.read(name)
        if tuple(a.shape) != shape:
            raise FormatError(
                self.files.path, f"has shape {list(a.shape)}, the config says {list(shape)}", name
            )
        return a

    def vector(self, name: str, size: int, fill: float) -> np.ndarray:
        self._check(name, (size,))
        a = self.files.read(name)
        if tuple(a.shape) != (size,):
            raise FormatError(
                self.files.path, f"has shape {list(a.shape)}, the config says [{size}]", name
            )
        return np.asarray(a, np.float32)

    def quantized(
        self, name: str, shape: tuple[int, int], blocksize: int, double_quant: bool
    ) -> NF4Tensor:
        self._check(name, shape)
        stored = self.files.stored_quantized(name)
        if stored is not None:
            if tuple(stored.shape) != shape:
                raise FormatError(
                    self.files.path,
                    f"has shape {list(stored.shape)}, the config says {list(shape)}",
                    name,
                )
            return stored
        return quantize(self.matrix(name, shape), blocksize=blocksize, double_quant=double_quant)

    def unused(self) -> list[str]:
        """Tensors of the files the model did not read (a sign of another architecture)."""
        return [n for n in self.files.names() if n not in self.used]


__all__ = ["PretrainedWeights"]
