"""The recording backend: the `Backend` protocol with no device and no math. Its arrays have a
shape, a dtype, strides and an owner of their memory, and nothing else; what they record is
when their memory is allocated and freed, with its size, as CuPy's pool would see it on the
GPU. `nybble.memory` runs the trainer's own code on it (framework "nybble") to estimate the
GPU memory of a training step without a GPU, and without allocating what it describes.

Two things stand in for the GPU run:
- `RecordingBackend`, in place of the CUDA backend (`backends.cuda`): each primitive allocates
  what that backend allocates for it (outputs, the copies it makes of operands cuBLAS cannot
  read, the dequantized tiles of a quantized product, the non-finite checks' slots), in the
  same order; its `device` is "cuda" and its capabilities (`float32_products`, `cuda_kernels`,
  `default_compute_dtype`) are the CUDA backend's, so the code above the seam takes its GPU
  paths;
- its `xp` (`arrays.Namespace`), in place of CuPy: array creation, views, elementwise math,
  reductions and indexing, each allocating what CuPy 14 allocates for it;
- its `kernel_module`, in place of the CUDA backend's compiled modules: nothing is compiled,
  its kernels launch nothing, and its launch facts are read from the source text.

A host flavour of the backend (device "cpu", `host()`) holds the host arrays of a run (the
weights as read, before they move to the GPU): they record nothing.

Memory is freed when the last array using it is dropped (a view keeps its base's memory),
which is when CuPy frees it: the trainer's code run on these arrays frees in its own order.
`recording(recorder)` makes `backends.get("cuda")` this backend inside a `with` block, so the
trainer's `device="cuda"` is the recording.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...formats import (
    KernelCodebook,
    NestedAbsmax,
    OutputDtype,
    Packed,
    block_count,
    code_bytes,
    dtype_name,
    float_dtype,
    numpy_dtype,
    output_dtype,
)
from .. import Array, Device, _gpu_override
from .arrays import Namespace, RecordArray, Recorder, _KernelModule

if TYPE_CHECKING:
    from numpy.typing import DTypeLike


@functools.cache
def _kernel_module(file: str, options: tuple[str, ...]) -> _KernelModule:
    return _KernelModule(file, options)


#: The dtypes the CUDA backend's GEMMs take (backends/cuda/blas.py: DTYPES).
_GEMM_DTYPES = ("float32", "float16", "bfloat16")


class _FiniteCheck:
    """The CUDA backend's DeviceFiniteCheck, allocating what it allocates: a uint64 slot per
    argument name and kind of scan, made at its first scan; a contiguous copy of an array the
    scan kernel cannot read as it is; the slots gathered for the read back."""

    def __init__(self, backend: RecordingBackend) -> None:
        self._backend = backend
        self._slots: dict[tuple[str, int | None], RecordArray] = {}

    def record(self, a: Any, what: str, row_stride: int | None = None) -> None:
        # `a` is one of the recording's arrays (its layout is read): `Any`, as in layer math
        key = (what, row_stride)
        if key not in self._slots:
            self._slots[key] = self._backend.xp.full(1, 0, np.uint64)
        if not (a.c_contiguous and a.aligned16):
            self._backend.ready(a)  # the scan's checked path copies it first

    def raise_pending(self) -> None:
        if self._slots:
            gathered = self._backend.xp.concatenate(list(self._slots.values()))
            del gathered


class _ShapeRandom:
    """A seeded generator whose draws are host arrays of the recording (shapes only): drawn on
    the host, as the CUDA backend's are."""

    def __init__(self, backend: RecordingBackend) -> None:
        self._backend = backend

    def _draw(
        self, size: int | tuple[int, ...] | None, dtype: DTypeLike = np.float64
    ) -> RecordArray:
        return self._backend.host().xp.empty(size, dtype)

    def uniform(
        self, low: float = 0.0, high: float = 1.0, size: int | tuple[int, ...] | None = None
    ) -> RecordArray:
        return self._draw(size)

    def normal(
        self, loc: float = 0.0, scale: float = 1.0, size: int | tuple[int, ...] | None = None
    ) -> RecordArray:
        return self._draw(size)

    def standard_normal(
        self, size: int | tuple[int, ...] | None = None, dtype: DTypeLike = np.float64
    ) -> RecordArray:
        return self._draw(size, dtype)


class RecordingBackend:
    """The Backend protocol recorded (see the module docstring). The GPU flavour (`recorder`
    given) stands for the CUDA backend and records; `host()` is its host side, which records
    nothing."""

    def __init__(self, recorder: Recorder | None, host: RecordingBackend | None = None) -> None:
        self.recorder = recorder
        gpu = recorder is not None
        self.device: Device = "cuda" if gpu else "cpu"
        # the capabilities of the device it stands for (backends.cuda's, or the CPU's)
        self.float32_products = not gpu
        self.cuda_kernels = gpu
        self.default_compute_dtype: OutputDtype = "bfloat16" if gpu else "float32"
        #: stands in for the CuPy module (untyped, `Any` in the CUDA backend), not a module itself
        self.xp: Any = Namespace(self)
        self._host = host
        #: the kernels' format tables, made on the GPU at their first use and kept
        self._tables: dict[str, RecordArray] = {}

    # --- run-time compiled kernels ----------------------------------------------------------

    def kernel_module(self, file: str, options: Sequence[str]) -> _KernelModule:
        """The stand-in for the CUDA backend's compiled module of kernels/`file`: nothing is
        compiled and its kernels launch nothing (one for each file and options, as the GPU
        has one a device)."""
        return _kernel_module(file, tuple(options))

    def compute_capability(self) -> int | None:
        """None: no device runs the kernels, so every kernel is taken (the flash kernels'
        sm_80 included)."""
        return None

    def host(self) -> RecordingBackend:
        """The host side of this backend (itself for the host flavour)."""
        if self._host is None:
            return self
        return self._host

    # --- arrays in and out ---------------------------------------------------------------

    def asarray(self, x: Any, what: str = "x") -> RecordArray:
        # `x` is anything with a shape and a dtype (only those are read): `Any`
        if isinstance(x, RecordArray) and x.nybble_backend is self:
            return x
        return self.from_host(x)

    def float_array(self, x: Any, what: str = "x") -> RecordArray:
        a = self.asarray(x, what)
        float_dtype(a.dtype, what)
        return a

    def contiguous(self, a: Array) -> RecordArray:
        return self.xp.ascontiguousarray(a)

    def synchronize(self) -> None:
        pass

    def to_host(self, a: Array) -> RecordArray:
        host = self.host()
        return RecordArray(host, tuple(a.shape), a.dtype)

    def from_host(self, a: Array) -> RecordArray:
        """A copy on this backend's side (C-contiguous), of a host array of the recording or of
        a numpy array (only its shape and dtype are read)."""
        if isinstance(a, RecordArray) and a.nybble_backend is self:
            return a
        return RecordArray(self, tuple(a.shape), a.dtype)

    def memory_in_use(self) -> int | None:
        return None

    def capture(self, work: Callable[[], object], *buffers: Array) -> None:
        return None

    def first_non_finite(self, a: Array) -> int | None:
        return None

    def finite_check(self) -> _FiniteCheck:
        return _FiniteCheck(self)

    def random(self, seed: int) -> _ShapeRandom:
        """A seeded generator of initial values: its draws are shapes only."""
        return _ShapeRandom(self)

    def ready(self, a: RecordArray) -> RecordArray:
        """backends.cuda.arrays.ready: `a`, or a C-contiguous aligned copy of it."""
        if a.c_contiguous and a.aligned16:
            return a
        return a.copy()

    # --- the codec -------------------------------------------------------------------------

    def quantize(
        self, x: Any, blocksize: int, codebook: KernelCodebook, check_finite: bool = True
    ) -> tuple[RecordArray, RecordArray]:
        a = self.ready(self.float_array(x))
        if dtype_name(a.dtype) == "float64":
            a = self.xp.empty(a.size, np.float32)
        n = a.size
        codes = self.xp.empty(code_bytes(n, codebook), np.uint8)
        absmax = self.xp.empty(block_count(n, blocksize), np.float32)
        return codes, absmax

    def dequantize(self, q: Packed, dtype: OutputDtype, out: Array | None = None) -> Array:
        self._prepared(q)
        if out is None:
            out = self.xp.empty(q.shape, numpy_dtype(dtype))
        return out

    def dequantize_call(self, q: Packed) -> None:
        return None

    def gemv_call(self, w: Packed) -> None:
        return None  # the fused GEMV is the GPU's

    def double_quantize(self, absmax: Array) -> NestedAbsmax:
        # made on the host, then copied over (two arrays)
        n = int(absmax.size)
        codes = self.xp.empty(n, np.uint8)
        absmax2 = self.xp.empty(block_count(n, 256), np.float32)
        return NestedAbsmax(codes, absmax2, 0.0)

    def double_dequantize(self, nested: NestedAbsmax) -> RecordArray:
        return self.xp.empty(int(nested.codes.size), np.float32)

    def _table(self, name: str, size: int) -> None:
        if name not in self._tables:
            self._tables[name] = self.xp.empty(size, np.float32)

    def _prepared(self, q: Packed) -> None:
        """The format tables the CUDA backend's launches for q make at their first use."""
        if self.recorder is None:
            return
        self._table("nf4", 16)
        if q.nested is not None:
            self._table("dynamic8", 256)
        self._table(q.codebook, 16 if q.codebook in ("nf4", "fp4") else 256)

    # --- layer math ----------------------------------------------------------------------------
    # The operands are the protocol's `Array`s, which in a recording are `RecordArray`s: typed
    # `Any` where their layout (`c_contiguous`, `aligned16`, `strides`) is read, which only the
    # recording's arrays have.

    @staticmethod
    def _gemm_copy(a: RecordArray) -> RecordArray | None:
        """The copy the CUDA backend makes of a GEMM operand cuBLAS cannot read as it is (its
        matrices with neither rows nor columns at unit stride, or a batch at a stride that is
        no whole number of elements), kept for the call; None when it reads it as it is."""
        item = a.dtype.itemsize
        strides = a.strides
        if len(strides) == 3 and (strides[0] % item or strides[0] < 0):
            return a.copy()
        s0, s1 = strides[-2:]
        rows, cols = a.shape[-2:]
        if s1 == item and s0 % item == 0 and s0 // item >= max(cols, 1):
            return None
        if s0 == item and s1 % item == 0 and s1 // item >= max(rows, 1):
            return None
        return a.copy()

    def matmul(
        self,
        a: Any,
        b: Any,
        alpha: float = 1.0,
        out: Any = None,
        accumulate: bool = False,
        out_dtype: DTypeLike | None = None,
    ) -> Array:
        if dtype_name(a.dtype) in _GEMM_DTYPES and a.dtype == b.dtype:
            m, n = a.shape[0], b.shape[1]
            if out is None:
                out = self.xp.empty((m, n), a.dtype if out_dtype is None else out_dtype)
            if m and n and a.shape[1]:
                copies = (self._gemm_copy(a), self._gemm_copy(b))
                del copies
            return out
        r = a @ b  # float64: CuPy's own product, then the scaling and the sum
        if out is None:
            return r if out_dtype is None else r.astype(out_dtype)
        return out

    def matmul_in_dtype(self, a: Array, b: Array) -> Array:
        return self.matmul(a, b)

    def astype_pair(self, a: Any, b: Any, dtype: DTypeLike) -> tuple[Array, Array]:
        name = dtype_name(np.dtype(dtype))
        if name in ("float16", "bfloat16") and all(
            dtype_name(x.dtype) == "float32" and x.c_contiguous and x.aligned16 for x in (a, b)
        ):
            return self.xp.empty(a.shape, dtype), self.xp.empty(b.shape, dtype)
        return a.astype(dtype, copy=False), b.astype(dtype, copy=False)

    def batched_matmul(self, a: Any, b: Any) -> RecordArray:
        out = self.xp.empty((a.shape[0], a.shape[1], b.shape[2]), a.dtype)
        if dtype_name(a.dtype) in _GEMM_DTYPES and out.size and a.shape[2]:
            copies = (self._gemm_copy(a), self._gemm_copy(b))
            del copies
        return out

    def quantized_matmul(
        self,
        x: Any,
        w: Packed,
        transpose: bool = True,
        out: Any = None,
        accumulate: bool = False,
    ) -> Array:
        from ..cuda import row_tiles
        from ..cuda.kernels import GEMV_MAX_TOKENS
        from ..cuda.launch import gemv_supported

        rows, cols = w.shape[0], w.shape[1]
        dtype = output_dtype(x.dtype)
        m = x.shape[0]
        if transpose and 0 < m <= GEMV_MAX_TOKENS and gemv_supported(w.codebook, w.shape):
            direct = out is not None and not accumulate and out.aligned16
            y = out if direct else self.xp.empty((m, rows), x.dtype)
            self._prepared(w)
            ready = self.ready(x)
            del ready
            return y if out is None else out
        y = out if out is not None else self.xp.empty((m, rows if transpose else cols), x.dtype)
        for r0, r1 in row_tiles(w, dtype):
            # each tile dequantized (the one before dropped once this one exists)
            _dense = self.xp.empty((r1 - r0, cols), numpy_dtype(dtype))
            self._prepared(w)
        return y

    def dora_row_norms(self, w: Array | Packed, b: Array, a: Array, scaling: float) -> RecordArray:
        if not isinstance(w, Packed):
            merged = w.astype(np.float32)
            return self.xp.linalg.norm(self.matmul(b, a, scaling, merged, True), axis=1)
        from ..cuda import row_tiles

        norms = self.xp.empty(w.shape[0], np.float32)
        for r0, r1 in row_tiles(w, "float32"):
            tile = self.xp.empty((r1 - r0, w.shape[1]), np.float32)
            del tile
        return norms

    @classmethod
    def gpu(cls, recorder: Recorder) -> RecordingBackend:
        """A recording of a GPU run into `recorder`, with its own host side."""
        return cls(recorder, host=cls(None))

    @contextlib.contextmanager
    def standing_in(self) -> Iterator[RecordingBackend]:
        """Inside the block, `backends.get("cuda")` is this backend: code that asks for the
        GPU by name (the trainer's `device="cuda"`, a layer's `.cuda()`) gets the recording."""
        token = _gpu_override.set(self)
        try:
            yield self
        finally:
            _gpu_override.reset(token)


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[RecordingBackend]:
    """A recording backend whose GPU arrays go to `recorder`, standing in for the GPU inside
    the block (`RecordingBackend.standing_in`)."""
    with RecordingBackend.gpu(recorder).standing_in() as backend:
        yield backend


__all__ = ["Namespace", "RecordArray", "Recorder", "RecordingBackend", "recording"]
