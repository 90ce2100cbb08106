"""The CUDA backend: CuPy arrays in and out (torch CUDA tensors and other CUDA arrays viewed
without a copy), the codec bit-identical to the CPU's, the 4-bit matmuls of a QLoRA base
weight. The kernels (kernels/nf4.cu) compile on first use: importing this package needs
neither CuPy nor a GPU, asking for the backend needs CuPy."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

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
from .. import Array, Device, cpu
from . import blas, kernels, launch
from .arrays import as_cupy, c_contiguous, ready
from .kernels import GEMV_MAX_TOKENS

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from .graph import Graph

try:
    import cupy as cp
except ImportError:
    cp = None

#: In float32 compute the matmuls dequantize the weight in row tiles of at most this many
#: bytes, so the whole f32 weight never exists at once; 16-bit compute takes it whole.
TILE_BYTES = 128 << 20


class CudaBackend:
    device: Device = "cuda"
    float32_products = False
    cuda_kernels = True
    default_compute_dtype: OutputDtype = "bfloat16"

    def __init__(self) -> None:
        self.xp: ModuleType = cp
        #: What each quantized tensor's launches were prepared with (checks done, argument
        #: buffers built), by id(packed): an entry leaves when its tensor dies (a weak
        #: dictionary's look-up makes a weak reference each time, which the per-call fast
        #: paths would feel).
        self._prepared: dict[int, Prepared] = {}
        #: Finite checks of quantize calls made inside a graph capture, raised by check().
        self.captured_checks = DeviceFiniteCheck()

    # --- run-time compiled kernels ----------------------------------------------------------

    def kernel_module(self, file: str, options: Sequence[str]) -> kernels.KernelModule:
        """kernels/`file` compiled with `options` for CuPy's current device (kernels.module:
        NVRTC to the device's machine code, once a device; its kernels launch through the
        core's launcher on CuPy's current stream)."""
        return kernels.module(file=file, options=options)

    def compute_capability(self) -> int | None:
        """CuPy's current device's compute capability (80 for 8.0)."""
        return int(cp.cuda.Device().compute_capability)

    # --- arrays in and out -----------------------------------------------------------------

    def asarray(self, x: object, what: str = "x") -> Any:
        return as_cupy(x, what)

    def float_array(self, x: object, what: str = "x") -> Any:
        a = as_cupy(x, what)
        float_dtype(a.dtype, what)
        return a

    def contiguous(self, a: Array) -> Any:
        return cp.ascontiguousarray(a)  # CuPy allocations are aligned; views are, per launch

    def to_host(self, a: Array) -> np.ndarray:
        return np.asarray(cp.asnumpy(a))

    def from_host(self, a: Array) -> Any:
        return cp.asarray(a)

    def memory_in_use(self) -> int | None:
        """Bytes CuPy's memory pool holds on the current device (what a run keeps)."""
        return int(cp.get_default_memory_pool().total_bytes())

    def synchronize(self) -> None:
        cp.cuda.Device().synchronize()

    def capture(self, work: Callable[[], object], *buffers: Array) -> Graph:
        from .graph import capture

        return capture(work, *buffers)

    def first_non_finite(self, a: Array) -> int | None:
        flat = a.reshape(-1)
        if flat.size == 0 or bool(cp.isfinite(flat).all()):
            return None
        return int(cp.argmin(cp.isfinite(flat)))

    def finite_check(self) -> DeviceFiniteCheck:
        return DeviceFiniteCheck()

    def random(self, seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    # --- the codec -------------------------------------------------------------------------

    def quantize(
        self, x: object, blocksize: int, codebook: KernelCodebook, check_finite: bool = True
    ) -> tuple[Any, Any]:
        a = ready(self.float_array(x))  # C-contiguous: the kernels read it in flat order
        if dtype_name(a.dtype) == "float64":
            a = launch.narrow_f64(a.reshape(-1))  # round to nearest, then as f32
        if check_finite and capturing():
            # No read back inside a capture: the scan's result waits for check().
            codes, absmax = launch.quantize(a, blocksize, codebook, check_finite=False)
            self.captured_checks.record(a, "x of a captured quantize")
            return codes, absmax
        return launch.quantize(a, blocksize, codebook, check_finite)

    def dequantize(self, q: Packed, dtype: OutputDtype, out: Array | None = None) -> Any:
        prepared = self._prepared.get(id(q))
        if prepared is not None:  # checked once: a call checks only `out`
            found = prepared.dequantize.whole(dtype, out)
            if found is not None:
                return found
        if out is None:
            out = cp.ndarray(q.shape, numpy_dtype(dtype))  # see launch._allocate_ahead
        elif (
            type(out) is not cp.ndarray
            or dtype_name(out.dtype) != dtype
            or out.size != q.size
            or not c_contiguous(out)
        ):
            raise ValueError(
                f"out: expected a C-contiguous {dtype} CuPy array of {q.size} elements, got "
                f"{type(out).__name__} {getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}"
            )
        self.dequantize_into(q, 0, out)  # C-contiguous: the kernel sees it flat already
        return out

    def dequantize_into(self, q: Packed, start: int, out: Any) -> None:
        """out (C-contiguous, filled in flat order) = elements [start, start + out.size) of q."""
        self.prepared(q).dequantize(start, out)

    def prepared(self, q: Packed) -> Prepared:
        """q's launches, prepared once (kept while q lives; made afresh per call for arrays
        that had to be copied to be aligned, which nothing could keep valid)."""
        key = id(q)
        found = self._prepared.get(key)
        if found is not None:
            return found
        made = Prepared(q)
        if made.reusable:
            self._prepared[key] = made
            weakref.finalize(q, self._prepared.pop, key, None)
        return made

    def double_quantize(self, absmax: Array) -> NestedAbsmax:
        """The scales' double quantization, on the host by the Rust core: scales are 1/64 of
        the weight, and the mean it starts from is a sum in order, cheap on the host. So it
        cannot run inside a graph capture."""
        if capturing():
            raise RuntimeError(
                "double quantization reads the scales back to the host, which a CUDA graph "
                "capture does not allow: quantize with double_quant=True outside the capture"
            )
        host = cpu.BACKEND.double_quantize(cp.asnumpy(absmax))
        return NestedAbsmax(cp.asarray(host.codes), cp.asarray(host.absmax2), host.offset)

    def double_dequantize(self, nested: NestedAbsmax) -> Any:
        n = int(nested.codes.size)
        out = cp.empty(n, cp.float32)
        launch.decode_scales(_nested_ready(nested), n, out)
        return out

    # --- layer math --------------------------------------------------------------------------

    def matmul(
        self,
        a: Array,
        b: Array,
        alpha: float = 1.0,
        out: Array | None = None,
        accumulate: bool = False,
        out_dtype: DTypeLike | None = None,
    ) -> Any:
        if dtype_name(a.dtype) in blas.DTYPES and a.dtype == b.dtype:
            return blas.gemm(a, b, out, alpha, 1.0 if accumulate else 0.0, out_dtype)
        r = a @ b  # float64 (gradient checks): CuPy's own GEMM, then the scaling and the sum
        if alpha != 1.0:
            r *= alpha
        if out is None:
            return r if out_dtype is None else r.astype(out_dtype)
        if accumulate:
            out += r
        else:
            out[...] = r
        return out

    def matmul_in_dtype(self, a: Array, b: Array) -> Any:
        return self.matmul(a, b)

    def astype_pair(self, a: Array, b: Array, dtype: DTypeLike) -> tuple[Any, Any]:
        pair = launch.narrow_pair(a, b, dtype_name(dtype))  # float32 to 16 bits, one launch
        if pair is not None:
            return pair
        return a.astype(dtype, copy=False), b.astype(dtype, copy=False)

    def batched_matmul(self, a: Array, b: Array) -> Any:
        if dtype_name(a.dtype) in blas.DTYPES and a.dtype == b.dtype:
            return blas.gemm_batched(a, b)
        return a @ b  # float64 (gradient checks): CuPy's own GEMM

    def quantized_matmul(
        self,
        x: Array,
        w: Packed,
        transpose: bool = True,
        out: Array | None = None,
        accumulate: bool = False,
    ) -> Any:
        rows, cols = _matrix_shape(w)
        dtype = output_dtype(x.dtype)
        m = x.shape[0]
        if transpose and 0 < m <= GEMV_MAX_TOKENS and launch.gemv_supported(w.codebook, w.shape):
            return self.gemv(x, w, out, accumulate)
        shape = (m, rows if transpose else cols)
        if out is not None:
            _check_out(out, shape, x.dtype)
        beta = 1.0 if accumulate and out is not None else 0.0
        y = out if out is not None else cp.empty(shape, x.dtype)
        tiles = row_tiles(w, dtype)
        whole = len(tiles) == 1  # no views to make (each costs the host a few microseconds)
        for r0, r1 in tiles:
            dense = self.dense_rows(w, r0, r1, dtype)
            if transpose:  # x @ W.T: a column block of y per tile
                blas.gemm(x, dense.T, y if whole else y[:, r0:r1], beta=beta)
            else:  # x @ W: the tiles' products summed into y, in float32 sums
                blas.gemm(x if whole else x[:, r0:r1], dense, y, beta=beta)
                beta = 1.0
        return y

    def dense_rows(self, w: Packed, r0: int, r1: int, dtype: OutputDtype) -> Any:
        """Rows [r0, r1) of a 2-D quantized W, dequantized to `dtype`."""
        cols = w.shape[1]
        out = cp.empty((r1 - r0, cols), numpy_dtype(dtype))
        self.dequantize_into(w, r0 * cols, out)
        return out

    def gemv(self, x: Any, w: Packed, out: Any = None, accumulate: bool = False) -> Any:
        """x [m, cols] @ W.T by the fused GEMV (see launch.GemvWeight for what it takes), in
        `out` when given (or added to it with `accumulate`)."""
        shape = (x.shape[0], _matrix_shape(w)[0])
        if out is not None:
            _check_out(out, shape, x.dtype)
        # The kernel writes 16 bytes at a time: an `out` off that grain, or one to add to,
        # takes the product from an output of its own.
        direct = out is not None and not accumulate and out.data.ptr % 16 == 0
        y = out if direct else cp.ndarray(shape, x.dtype)
        self.gemv_weight(w)(ready(x), y)
        if out is None or y is out:
            return y
        if accumulate:
            out += y
        else:
            out[...] = y
        return out

    def dequantize_call(self, q: Packed) -> Callable[[str, Array | None], Array | None] | None:
        prepared = self._prepared.get(id(q))
        return None if prepared is None else prepared.dequantize.whole

    def gemv_call(self, w: Packed) -> Callable[[Array, Array | None], Array | None] | None:
        """The fused GEMV's per-token call for `w` (launch.GemvWeight.fast) once a checked
        call prepared it and it is kept (see `prepared`), else None."""
        prepared = self._prepared.get(id(w))
        gemv = None if prepared is None else prepared._gemv
        return None if gemv is None else gemv.fast

    def gemv_weight(self, w: Packed) -> launch.GemvWeight:
        """What the fused GEMV prepared for `w` (checks, launch arguments)."""
        return self.prepared(w).gemv()

    def dora_row_norms(self, w: Array | Packed, b: Array, a: Array, scaling: float) -> Any:
        """Row norms of W + s·B·A; a quantized W is dequantized one row tile at a time."""
        # W + s·B·A in one GEMM per tile (its beta adds W), which also runs inside a graph
        # capture, where CuPy's own `@` refuses to call cuBLAS.
        if not isinstance(w, Packed):
            wide = cp.float64 if cp.float64 in (w.dtype, b.dtype) else cp.float32
            merged = w.astype(wide)  # a copy, in the sum's dtype
            return cp.linalg.norm(self.matmul(b, a, scaling, merged, accumulate=True), axis=1)
        rows = _matrix_shape(w)[0]
        norms = cp.empty(rows, cp.float32)
        for r0, r1 in row_tiles(w, "float32"):
            tile = self.dense_rows(w, r0, r1, "float32")
            self.matmul(b[r0:r1], a, scaling, tile, accumulate=True)
            norms[r0:r1] = cp.linalg.norm(tile, axis=1)
        return norms


class DeviceFiniteCheck:
    """Scans recorded arrays on the GPU (kernels/nf4.cu: scan_non_finite) into one device
    counter per argument name and kind of scan (the array itself, or a product standing for
    its rows); reads them back only in `raise_pending`, one wait for all."""

    def __init__(self) -> None:
        #: (what, row_stride or None) -> uint64[1] on the device: the first bad flat index
        self._first_bad: dict[tuple[str, int | None], Any] = {}
        #: (what, row_stride or None) -> row length of the scanned array
        self._widths: dict[tuple[str, int | None], int] = {}
        self._scans: dict[tuple[str, int | None, Any], launch.ScanLaunch] = {}

    def record(self, a: Array, what: str, row_stride: int | None = None) -> None:
        slot_key = (what, row_stride)
        if row_stride is not None:
            self._widths[slot_key] = max(int(a.shape[-1]), 1)
        scan = self._scans.get((what, row_stride, a.dtype))
        if scan is None:
            slot = self._first_bad.get(slot_key)
            if slot is None:
                slot = cp.full(1, np.uint64(launch.NO_INDEX), cp.uint64)
                self._first_bad[slot_key] = slot
            scan = self._scans[(what, row_stride, a.dtype)] = launch.ScanLaunch(slot, a.dtype)
        scan(a)

    def raise_pending(self) -> None:
        if not self._first_bad:
            return
        keys = list(self._first_bad)
        found = cp.asnumpy(cp.concatenate([self._first_bad[k] for k in keys]))
        for slot in self._first_bad.values():
            slot.fill(np.uint64(launch.NO_INDEX))
        for (what, stride), index in zip(keys, found.tolist(), strict=True):
            if index != launch.NO_INDEX:
                if stride is not None:  # a product's row: the first element of that row
                    index = index // self._widths[(what, stride)] * stride
                raise NonFiniteError(int(index), what)


class Prepared:
    """The launches of one quantized tensor, its arrays checked (and aligned) once."""

    def __init__(self, q: Packed) -> None:
        # Not q itself: the backend keeps this while q lives, keyed on id(q).
        self.codebook, self.shape, self.blocksize = (
            q.codebook,
            _matrix_shape_or_none(q),
            q.blocksize,
        )
        arrays = [q.codes] + ([q.absmax] if q.nested is None else [q.nested.codes,
                                                                  q.nested.absmax2])  # fmt: skip
        aligned = [ready(cp.asarray(a)) for a in arrays]
        #: False when arrays had to be copied: the copies would be kept alive with it.
        self.reusable = all(a is b for a, b in zip(aligned, arrays, strict=True))
        self.codes = aligned[0]
        self.absmax = aligned[1] if q.nested is None else None
        self.nested = (
            None if q.nested is None else NestedAbsmax(aligned[1], aligned[2], q.nested.offset)
        )
        self.dequantize = launch.DequantizeWeight(
            self.codes, self.absmax, self.nested, q.codebook, q.blocksize, q.shape
        )
        self._gemv: launch.GemvWeight | None = None

    def gemv(self) -> launch.GemvWeight:
        if self._gemv is None:
            if self.shape is None:
                raise ValueError("the fused GEMV takes a 2-D weight [out, in]")
            self._gemv = launch.GemvWeight(
                self.codes, self.absmax, self.nested, self.codebook, self.shape, self.blocksize
            )
        return self._gemv


def capturing() -> bool:
    """Whether CuPy's current stream is capturing a CUDA graph."""
    return bool(cp.cuda.get_current_stream().is_capturing())


def _check_out(out: Any, shape: tuple[int, ...], dtype: Any) -> None:
    if (
        type(out) is not cp.ndarray
        or tuple(out.shape) != shape
        or out.dtype != dtype
        or not c_contiguous(out)
    ):
        raise ValueError(
            f"out: expected a C-contiguous CuPy array of shape {shape} and dtype "
            f"{dtype_name(dtype)}, got {type(out).__name__} {getattr(out, 'shape', '')} "
            f"{getattr(out, 'dtype', '')}"
        )


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


def _matrix_shape_or_none(w: Packed) -> tuple[int, int] | None:
    return (w.shape[0], w.shape[1]) if len(w.shape) == 2 else None


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
