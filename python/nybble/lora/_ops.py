"""The few array primitives the layers need, on either device: numpy arrays go to the Rust
core (GEMM, tiled NF4 products), CuPy arrays to cuBLAS and nybble's CUDA kernels. The layer
math in `layers.py` is written once on top of these."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _core
from ..tensor import NF4Tensor


def is_gpu(a: Any) -> bool:
    return not isinstance(a, np.ndarray)


def xp_of(a: Any) -> Any:
    """numpy for host arrays, cupy for device arrays."""
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def mm(a: Any, b: Any, alpha: float = 1.0, out: Any = None, accumulate: bool = False) -> Any:
    """`alpha * a @ b` (into `out`, or added to it when `accumulate`); a, b 2-D, any strides."""
    if isinstance(a, np.ndarray):
        if out is None:
            out = np.empty((a.shape[0], b.shape[1]), np.float32)
            accumulate = False
        _core.matmul(a, b, out, alpha, accumulate)
        return out
    r = a @ b
    if alpha != 1.0:
        r *= alpha
    if out is None:
        return r
    if accumulate:
        out += r
    else:
        out[...] = r
    return out


class DenseBase:
    """A frozen dense weight W [out, in] (possibly a transposed view of the stored array)."""

    def __init__(self, w: Any) -> None:
        self.w = w

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.w.shape[0]), int(self.w.shape[1]))

    def forward(self, x: Any) -> Any:
        """x @ Wᵀ"""
        return mm(x, self.w.T.astype(x.dtype, copy=False))

    def backward(self, dy: Any) -> Any:
        """dy @ W"""
        return mm(dy, self.w.astype(dy.dtype, copy=False))

    def row_norms(self, b: Any, a: Any, scaling: float) -> Any:
        """||W + s·B·A|| per row."""
        if isinstance(self.w, np.ndarray):
            return _core.dora_row_norms_dense(self.w, b, a, scaling)
        xp = xp_of(self.w)
        return xp.linalg.norm(self.w + scaling * (b @ a), axis=1)

    def dense(self) -> Any:
        return self.w


class QuantBase:
    """A frozen quantized weight W [out, in]; products dequantize tiles, never all of W."""

    def __init__(self, q: NF4Tensor) -> None:
        self.q = q

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def forward(self, x: Any) -> Any:
        if is_gpu(x):
            from .. import cuda

            return cuda.nf4_matmul(x, self.q)
        q = self.q
        out = np.empty((x.shape[0], self.shape[0]), np.float32)
        _core.qmatmul(x, q.codes, q.absmax, self.shape, q.blocksize, q.codebook, out)
        return out

    def backward(self, dy: Any) -> Any:
        if is_gpu(dy):
            from .. import cuda

            return cuda.nf4_matmul_t(dy, self.q)
        q = self.q
        out = np.empty((dy.shape[0], self.shape[1]), np.float32)
        _core.qmatmul(dy, q.codes, q.absmax, self.shape, q.blocksize, q.codebook, out, False)
        return out

    def row_norms(self, b: Any, a: Any, scaling: float) -> Any:
        q = self.q
        if q.device == "cpu":
            return _core.dora_row_norms_quantized(
                q.codes, q.absmax, self.shape, q.blocksize, q.codebook, b, a, scaling
            )
        xp = xp_of(b)
        w = self.q.dequantize("float32")
        return xp.linalg.norm(w + scaling * (b @ a), axis=1)

    def dense(self) -> Any:
        return self.q.dequantize("float32")
