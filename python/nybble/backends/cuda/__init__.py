"""The CUDA backend: CuPy arrays in and out (torch CUDA tensors and other CUDA arrays viewed
without a copy), the codec bit-identical to the CPU's, the 4-bit matmuls of a QLoRA base
weight. The kernels (kernels/nf4.cu) compile on first use: importing this package needs
neither CuPy nor a GPU, asking for the backend needs CuPy."""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

import numpy as np

from ...errors import NonFiniteError
from ...formats import (
    KernelCodebook,
    NestedAbsmax,
    OutputDtype,
    Packed,
    dtype_name,
    float_dtype,
    numpy_dtype,
    output_dtype,
)
from .. import Device, cpu
from . import launch
from .arrays import as_cupy, ready
from .kernels import GEMV_MAX_TOKENS

try:
    import cupy as cp
except ImportError:
    cp = None

#: In float32 compute the matmuls dequantize the weight in row tiles of at most this many
#: bytes, so the whole f32 weight never exists at once; 16-bit compute takes it whole.
TILE_BYTES = 128 << 20


class CudaBackend:
    device: Device = "cuda"

    def __init__(self) -> None:
        self.xp: ModuleType = cp
        #: What the fused GEMV prepared for each weight (its checks and launch arguments),
        #: for as long as the weight's arrays live.
        self._gemv_weights: weakref.WeakKeyDictionary[Packed, launch.GemvWeight] = (
            weakref.WeakKeyDictionary()
        )

    # --- arrays in and out -----------------------------------------------------------------

    def asarray(self, x: Any, what: str = "x") -> Any:
        return as_cupy(x, what)

    def float_array(self, x: Any, what: str = "x") -> Any:
        a = as_cupy(x, what)
        float_dtype(a.dtype, what)
        return a

    def to_host(self, a: Any) -> np.ndarray:
        return np.asarray(cp.asnumpy(a))

    def from_host(self, a: np.ndarray) -> Any:
        return cp.asarray(a)

    def first_non_finite(self, a: Any) -> int | None:
        flat = a.reshape(-1)
        if flat.size == 0 or bool(cp.isfinite(flat).all()):
            return None
        return int(cp.argmin(cp.isfinite(flat)))

    def finite_check(self) -> DeviceFiniteCheck:
        return DeviceFiniteCheck()

    # --- the codec -------------------------------------------------------------------------

    def quantize(
        self, x: Any, blocksize: int, codebook: KernelCodebook, check_finite: bool = True
    ) -> tuple[Any, Any]:
        a = self.float_array(x)
        flat = ready(a).reshape(-1)
        if dtype_name(flat.dtype) == "float64":
            flat = launch.narrow_f64(flat)  # round to nearest, then quantize as f32
        return launch.quantize(flat, blocksize, codebook, check_finite)

    def dequantize(self, q: Packed, dtype: OutputDtype, out: Any = None) -> Any:
        if out is None:
            out = cp.empty(q.shape, numpy_dtype(dtype))
        elif (
            not isinstance(out, cp.ndarray)
            or dtype_name(out.dtype) != dtype
            or out.size != q.size
            or not out.flags.c_contiguous
        ):
            raise ValueError(
                f"out: expected a C-contiguous {dtype} CuPy array of {q.size} elements, got "
                f"{type(out).__name__} {getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}"
            )
        self.dequantize_into(q, 0, out.reshape(-1))
        return out

    def dequantize_into(self, q: Packed, start: int, out: Any) -> None:
        """out (flat) = elements [start, start + out.size) of q."""
        absmax = None if q.nested is not None else ready(q.absmax)
        nested = None if q.nested is None else _nested_ready(q.nested)
        launch.dequantize(
            ready(q.codes), absmax, nested, q.codebook, "split", q.blocksize, q.size, start, out
        )

    def double_quantize(self, absmax: Any) -> NestedAbsmax:
        """The scales' double quantization, on the host by the Rust core: scales are 1/64 of
        the weight, and the mean it starts from is a sum in order, cheap on the host."""
        host = cpu.BACKEND.double_quantize(cp.asnumpy(absmax))
        return NestedAbsmax(cp.asarray(host.codes), cp.asarray(host.absmax2), host.offset)

    def double_dequantize(self, nested: NestedAbsmax) -> Any:
        n = int(nested.codes.size)
        out = cp.empty(n, cp.float32)
        launch.decode_scales(_nested_ready(nested), n, out)
        return out

    # --- layer math --------------------------------------------------------------------------

    def matmul(
        self, a: Any, b: Any, alpha: float = 1.0, out: Any = None, accumulate: bool = False
    ) -> Any:
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

    def quantized_matmul(self, x: Any, w: Packed, transpose: bool = True) -> Any:
        rows, cols = _matrix_shape(w)
        x = ready(x)
        dtype = output_dtype(x.dtype)
        m = x.shape[0]
        if not transpose:  # dy @ W: f32 partial sums over row tiles in float32
            y: Any = None
            for r0, r1 in row_tiles(w, dtype):
                part = x[:, r0:r1] @ self.dense_rows(w, r0, r1, dtype)
                y = part if y is None else y + part
            return y if y is not None else cp.zeros((m, cols), x.dtype)
        if 0 < m <= GEMV_MAX_TOKENS and launch.gemv_supported(w.codebook, w.shape):
            y = cp.empty((m, rows), x.dtype)
            self.gemv_weight(w)(x, y)
            return y
        tiles = row_tiles(w, dtype)
        if len(tiles) == 1:
            return x @ self.dense_rows(w, 0, rows, dtype).T
        y = cp.empty((m, rows), x.dtype)
        for r0, r1 in tiles:
            y[:, r0:r1] = x @ self.dense_rows(w, r0, r1, dtype).T
        return y

    def dense_rows(self, w: Packed, r0: int, r1: int, dtype: OutputDtype) -> Any:
        """Rows [r0, r1) of a 2-D quantized W, dequantized to `dtype`."""
        cols = w.shape[1]
        out = cp.empty((r1 - r0, cols), numpy_dtype(dtype))
        self.dequantize_into(w, r0 * cols, out.reshape(-1))
        return out

    def gemv_weight(self, w: Packed) -> launch.GemvWeight:
        """What the fused GEMV prepares for `w` (checks, launch arguments), kept while w lives;
        remade per call when its arrays had to be copied to be aligned."""
        found = self._gemv_weights.get(w)
        if found is not None:
            return found
        arrays = (
            (w.codes, w.absmax) if w.nested is None else (w.codes, w.nested.codes, w.nested.absmax2)
        )
        aligned = [ready(cp.asarray(a)) for a in arrays]
        nested = None
        if w.nested is not None:
            nested = NestedAbsmax(aligned[1], aligned[2], w.nested.offset)
        absmax = aligned[1] if w.nested is None else None
        made = launch.GemvWeight(
            aligned[0], absmax, nested, w.codebook, _matrix_shape(w), w.blocksize
        )
        if all(a is b for a, b in zip(aligned, arrays, strict=True)):  # no copies: reusable
            self._gemv_weights[w] = made
        return made

    def dora_row_norms(self, w: Any, b: Any, a: Any, scaling: float) -> Any:
        """Row norms of W + s·B·A; a quantized W is dequantized one row tile at a time."""
        if not isinstance(w, Packed):
            return cp.linalg.norm(w + scaling * (b @ a), axis=1)
        rows = _matrix_shape(w)[0]
        norms = cp.empty(rows, cp.float32)
        for r0, r1 in row_tiles(w, "float32"):
            tile = self.dense_rows(w, r0, r1, "float32")
            tile += scaling * (b[r0:r1] @ a)
            norms[r0:r1] = cp.linalg.norm(tile, axis=1)
        return norms


class DeviceFiniteCheck:
    """Scans recorded arrays on the GPU (kernels/nf4.cu: scan_non_finite) into one device
    counter per argument name; reads them back only in `raise_pending`, one wait for all."""

    def __init__(self) -> None:
        self._first_bad: dict[str, Any] = {}  # what -> uint64[1] on the device

    def record(self, a: Any, what: str) -> None:
        slot = self._first_bad.get(what)
        if slot is None:
            slot = self._first_bad[what] = cp.full(1, np.uint64(launch.NO_INDEX), cp.uint64)
        launch.scan_non_finite(a, slot)

    def raise_pending(self) -> None:
        if not self._first_bad:
            return
        names = list(self._first_bad)
        found = cp.asnumpy(cp.concatenate([self._first_bad[n] for n in names]))
        for slot in self._first_bad.values():
            slot.fill(np.uint64(launch.NO_INDEX))
        for name, index in zip(names, found.tolist(), strict=True):
            if index != launch.NO_INDEX:
                raise NonFiniteError(int(index), name)


def row_tiles(w: Packed, dtype: str) -> list[tuple[int, int]]:
    """Row ranges that dequantize W a tile of at most TILE_BYTES at a time in float32 (16-bit
    compute takes it whole, as cuBLAS wants it)."""
    rows, cols = _matrix_shape(w)
    if dtype != "float32" or rows * cols * 4 <= TILE_BYTES:
        return [(0, rows)]
    # A multiple of 32 rows, so every tile starts on a 32-element boundary of the codes.
    step = max(32, TILE_BYTES // (4 * cols) // 32 * 32)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _matrix_shape(w: Packed) -> tuple[int, int]:
    if len(w.shape) != 2:
        raise ValueError(f"expected a 2-D quantized weight [out, in], got shape {w.shape}")
    return w.shape[0], w.shape[1]


def _nested_ready(nested: NestedAbsmax) -> NestedAbsmax:
    codes, absmax2 = (ready(cp.asarray(a)) for a in (nested.codes, nested.absmax2))
    return NestedAbsmax(codes, absmax2, nested.offset)


_BACKEND: CudaBackend | None = None


def backend() -> CudaBackend:
    """The CUDA backend; ImportError naming the extra to install when CuPy is missing."""
    global _BACKEND
    if _BACKEND is None:
        if cp is None:
            raise ImportError(
                "the GPU path needs CuPy: pip install 'nybble[gpu]' (or the cupy-cudaXXx "
                "package matching your CUDA)"
            )
        _BACKEND = CudaBackend()
    return _BACKEND


__all__ = ["TILE_BYTES", "CudaBackend", "DeviceFiniteCheck", "backend", "row_tiles"]
