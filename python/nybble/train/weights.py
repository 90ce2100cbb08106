"""Where a model's initial weights come from: the seam between building a DecoderLM and the
numbers it starts from. `RandomWeights` draws them as Hugging Face initialises a fresh model
(the convergence contracts' random models); `nybble.train.pretrained` reads them from a
checkpoint. The model asks for each weight once, in HF's order, by HF name, and quantizes
(or is handed) its frozen projections one tensor at a time, so a checkpoint never exists
whole in float32 or 16 bits."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..tensor import NF4Tensor, quantize


class WeightSource(Protocol):
    def matrix(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        """A 2-D weight (a projection, the embedding, the LM head) on the host, in any float
        dtype (float32, bfloat16, float16)."""
        ...

    def vector(self, name: str, size: int, fill: float) -> np.ndarray:
        """A norm weight (fresh: `fill` 1) or a bias (fresh: `fill` 0)."""
        ...

    def quantized(
        self, name: str, shape: tuple[int, int], blocksize: int, double_quant: bool
    ) -> NF4Tensor:
        """A frozen projection's weight in 4 bits: quantized from `matrix`, or as a
        checkpoint stores it."""
        ...


class RandomWeights:
    """HF's initialisation: normal(0, std) matrices drawn in the order the model asks for
    them from one seeded generator on the host (so both devices start the same), norms 1,
    biases 0."""

    def __init__(self, seed: int, std: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.std = np.float32(std)

    def matrix(self, name: str, shape: tuple[int, int]) -> np.ndarray:
        return self.rng.standard_normal(shape, dtype=np.float32) * self.std

    def vector(self, name: str, size: int, fill: float) -> np.ndarray:
        return np.full(size, fill, np.float32)

    def quantized(
        self, name: str, shape: tuple[int, int], blocksize: int, double_quant: bool
    ) -> NF4Tensor:
        return quantize(self.matrix(name, shape), blocksize=blocksize, double_quant=double_quant)


__all__ = ["RandomWeights", "WeightSource"]
