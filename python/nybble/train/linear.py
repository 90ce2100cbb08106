"""The linear projections of the decoder, one interface for the four kinds a model mixes:
a frozen dense weight, a frozen quantized (NF4) weight, a trainable dense weight (full
fine-tuning), and a LoRA / QLoRA layer (nybble.lora) whose base is one of the frozen two.

Each keeps what its backward needs from its last forward (a projection runs once per forward
of the model) until `release()`; `backward(dy)` returns dL/dx and leaves the parameters'
gradients in `gradients()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from ..backends import Array, Backend
from ..lora.layers import LoraLinear, QLoraLinear
from ..tensor import NF4Tensor


def matmul(backend: Backend, a: Array, b: Array) -> Array:
    """a @ b for 2-D operands of one dtype, in that dtype (`Backend.matmul_in_dtype`: the CPU
    takes float32 to the Rust core, float64 to numpy, and rounds the float32 product of 16-bit
    operands; the GPU multiplies in the operands' dtype, cuBLAS with float32 sums)."""
    return backend.matmul_in_dtype(a, b)


class Projection(Protocol):
    """y = x Wᵀ over the last axis of a 2-D x [tokens, in]."""

    name: str

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in]"""
        ...

    def forward(self, x: Array) -> Array: ...

    def backward(self, dy: Array) -> Array: ...

    def release(self) -> None:
        """Drops what the last forward kept for backward."""
        ...

    def gradients(self) -> dict[str, Array | None]:
        """The trainable parameters' gradients of the last backward, by parameter name."""
        ...

    def base_weight(self) -> Array:
        """W [out, in] on the device, dequantized if quantized (for export)."""
        ...


class FrozenDense:
    """A frozen dense W stored in the compute dtype (no float32 master: it never changes)."""

    def __init__(self, name: str, weight: Array, backend: Backend) -> None:
        self.name = name
        self.weight = weight
        self.backend = backend

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.weight.shape[0]), int(self.weight.shape[1]))

    def forward(self, x: Array) -> Array:
        return matmul(self.backend, x, self.weight.T)

    def backward(self, dy: Array) -> Array:
        return matmul(self.backend, dy, self.weight)

    def release(self) -> None:
        pass

    def gradients(self) -> dict[str, Array | None]:
        return {}

    def base_weight(self) -> Array:
        return self.weight


class FrozenQuantized:
    """A frozen W stored quantized (NF4Tensor): products dequantize tiles (nybble.backends'
    quantized_matmul), never the whole W in float32."""

    def __init__(self, name: str, weight: NF4Tensor, backend: Backend) -> None:
        self.name = name
        self.qweight = weight
        self.backend = backend

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.qweight.shape[0]), int(self.qweight.shape[1]))

    def _operand(self, x: Array) -> Array:
        # The CPU core multiplies float32; the GPU takes 16-bit and float32 activations.
        if x.dtype == np.float64 or (self.backend.float32_products and x.dtype != np.float32):
            return self.backend.xp.ascontiguousarray(x, dtype=np.float32)
        return self.backend.xp.ascontiguousarray(x)

    def forward(self, x: Array) -> Array:
        y = self.backend.quantized_matmul(self._operand(x), self.qweight.packed)
        return y.astype(x.dtype, copy=False)

    def backward(self, dy: Array) -> Array:
        dx = self.backend.quantized_matmul(self._operand(dy), self.qweight.packed, transpose=False)
        return dx.astype(dy.dtype, copy=False)

    def release(self) -> None:
        pass

    def gradients(self) -> dict[str, Array | None]:
        return {}

    def base_weight(self) -> Array:
        return self.qweight.dequantize("float32")


@dataclass(frozen=True, slots=True)
class _DenseSaved:
    """What a TrainableDense's backward needs from its forward. Dropped by `release()`, it
    frees w, then x (slots are cleared by name), as the (x, w) pair it replaces did."""

    x: Array  # the input [tokens, in]
    w: Array  # W in the compute dtype, cast for this forward


class TrainableDense:
    """A trainable W (full fine-tuning): `weight` is the float32 master (a view into the
    trainer's flat parameter buffer); products use its cast to the compute dtype, made once
    per forward and kept for backward. dL/dW = dyᵀ·x comes out in the master's dtype."""

    def __init__(self, name: str, weight: Array, backend: Backend, dtype: DTypeLike) -> None:
        self.name = name
        self.weight = weight
        self.backend = backend
        self.dtype = np.dtype(dtype)
        self._saved: _DenseSaved | None = None
        self.grad: Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.weight.shape[0]), int(self.weight.shape[1]))

    def forward(self, x: Array) -> Array:
        w = self.weight.astype(self.dtype, copy=False)
        self._saved = _DenseSaved(x, w)
        return matmul(self.backend, x, w.T)

    def backward(self, dy: Array) -> Array:
        saved = self._saved
        if saved is None:
            raise ValueError(f"{self.name}: backward() needs a forward() first")
        self.grad = matmul(self.backend, dy.T, saved.x).astype(self.weight.dtype, copy=False)
        return matmul(self.backend, dy, saved.w)

    def release(self) -> None:
        self._saved = None

    def gradients(self) -> dict[str, Array | None]:
        return {f"{self.name}.weight": self.grad}

    def base_weight(self) -> Array:
        return self.weight


class LoraProjection:
    """A LoraLinear or QLoraLinear (nybble.lora) as a projection: its base frozen, its A and B
    (and DoRA's magnitude) trainable. The layer keeps its own forward state; results come back
    in the model's compute dtype (the CPU layers compute float32)."""

    def __init__(self, name: str, layer: LoraLinear | QLoraLinear, dtype: DTypeLike) -> None:
        self.name = name
        self.layer = layer
        self.dtype = np.dtype(dtype)
        #: A and B in the compute dtype for this step (the model casts all at once), or None
        self.casts: tuple[Array, Array] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.layer.out_features, self.layer.in_features)

    def forward(self, x: Array) -> Array:
        self.layer.use_casts(self.casts)
        return self.layer.forward(x).astype(self.dtype, copy=False)

    def backward(self, dy: Array) -> Array:
        return self.layer.backward(dy).astype(self.dtype, copy=False)

    def release(self) -> None:
        # The layer keeps its last forward's arrays (its input among them) in its per-thread
        # call state until the next forward; dropping them is what lets gradient
        # checkpointing free a layer's activations. (No public method does this yet.)
        self.layer._calls.cache = None
        self.layer.use_casts(None)

    def gradients(self) -> dict[str, Array | None]:
        return {f"{self.name}.{k}": v for k, v in self.layer.gradients().items()}

    def parameters(self) -> dict[str, Array]:
        return {f"{self.name}.{k}": v for k, v in self.layer.parameters().items()}

    def base_weight(self) -> Array:
        if isinstance(self.layer, QLoraLinear):
            return self.layer.dequantize_weight("float32")
        w = self.layer.weight
        return w.T if self.layer.config.fan_in_fan_out else w

    def dropout_state(self) -> int | None:
        """The layer's dropout draw count (None without dropout), all that decides its next
        mask: gradient checkpointing restores it before recomputing a forward, so the
        recomputed masks are the same, and a checkpoint stores it so a resumed run draws the
        same masks."""
        if self.layer.config.dropout == 0.0:
            return None
        return self.layer.dropout_draws

    def set_dropout_state(self, state: int | None) -> None:
        if state is None:
            return
        if isinstance(state, bool) or not isinstance(state, int) or state < 0:
            raise ValueError(f"a dropout draw count is an integer >= 0, got {state!r}")
        self.layer.dropout_draws = state


__all__ = [
    "FrozenDense",
    "FrozenQuantized",
    "LoraProjection",
    "Projection",
    "TrainableDense",
    "matmul",
]
