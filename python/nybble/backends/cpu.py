"""The CPU backend: numpy arrays in and out, the work done by the Rust core (`nybble._core`:
SIMD codec, GEMM, tiled products with a quantized weight), with the GIL released."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core
from ..errors import NonFiniteError
from ..formats import (
    BFLOAT16,
    FLOAT_DTYPES,
    KernelCodebook,
    NestedAbsmax,
    OutputDtype,
    Packed,
    float_dtype,
    numpy_dtype,
)
from . import Array, Device, KernelModule

if TYPE_CHECKING:
    from typing import TypeVar

    from numpy.typing import DTypeLike

    #: An array handed back as it came (`from_host`: the host's arrays are the CPU's).
    _A = TypeVar("_A", bound=Array)


def as_numpy(x: Any, what: str = "x") -> np.ndarray:
    """A numpy view of a host array (numpy, or any `__dlpack__` / buffer / sequence), in
    native byte order: an array of the other byte order is converted (a copy), since the core
    reads native floats."""
    if isinstance(x, np.ndarray):
        a = x
    elif hasattr(x, "__dlpack__"):
        a = _from_dlpack(x, what)
    else:
        try:
            a = np.asarray(x)
        except Exception as e:
            raise ValueError(f"{what}: expected an array, got {type(x).__name__} ({e})") from None
    if a.dtype == object:
        raise ValueError(f"{what}: expected an array of numbers, got objects")
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return a


def _from_dlpack(x: Any, what: str) -> np.ndarray:
    bf = _torch_bfloat16_view(x)
    if bf is not None:
        return bf
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError) as e:
        raise ValueError(f"{what}: cannot read this array through DLPack ({e})") from None


def _torch_bfloat16_view(x: Any) -> np.ndarray | None:
    """A torch bf16 tensor as a numpy bf16 array without a copy (numpy's DLPack import has
    no bfloat16): view the tensor as int16, import that, view the result as bf16."""
    if (
        type(x).__module__.split(".")[0] != "torch"
        or str(getattr(x, "dtype", "")) != "torch.bfloat16"
    ):
        return None
    import torch  # present: x is a torch tensor

    return np.asarray(np.from_dlpack(x.detach().view(torch.int16))).view(BFLOAT16)


def _flat(a: np.ndarray) -> np.ndarray:
    """A flat C-contiguous, aligned view, or a copy when the strides or the address do not
    allow one (the core reads whole aligned elements)."""
    return np.require(a, requirements=["C", "A"]).reshape(-1)


class CpuBackend:
    device: Device = "cpu"
    xp: ModuleType = np
    float32_products = True
    cuda_kernels = False
    default_compute_dtype: OutputDtype = "float32"

    def kernel_module(self, file: str, options: Sequence[str]) -> KernelModule:
        raise RuntimeError(f"{file}: the CPU runs no CUDA kernels (cuda_kernels is False)")

    def compute_capability(self) -> int | None:
        return None

    def asarray(self, x: object, what: str = "x") -> np.ndarray:
        return as_numpy(x, what)

    def float_array(self, x: object, what: str = "x") -> np.ndarray:
        a = as_numpy(x, what)
        float_dtype(a.dtype, what)
        return a

    def contiguous(self, a: Array) -> np.ndarray:
        return np.require(a, requirements=["C", "A"])

    def to_host(self, a: Array) -> np.ndarray:
        return np.asarray(a)

    def from_host(self, a: _A) -> _A:
        return a

    def memory_in_use(self) -> int | None:
        """None: host memory is not the backend's to count."""
        return None

    def synchronize(self) -> None:
        """Nothing: the CPU's work is done when its call returns."""

    def capture(self, work: Callable[[], object], *buffers: Array) -> None:
        """None: the CPU replays nothing (callers run `work` each time)."""
        return None

    def first_non_finite(self, a: Array) -> int | None:
        flat = np.asarray(a).reshape(-1)
        if flat.size == 0 or (np.isfinite(flat.max()) and np.isfinite(flat.min())):
            return None  # max and min propagate NaN: no temporary the size of `a`
        return int(np.flatnonzero(~np.isfinite(flat))[0])

    def finite_check(self) -> ImmediateFiniteCheck:
        return ImmediateFiniteCheck()

    def random(self, seed: int) -> np.random.Generator:
        return np.random.default_rng(seed)

    # --- the codec ---------------------------------------------------------------------

    def quantize(
        self, x: object, blocksize: int, codebook: KernelCodebook, check_finite: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        a = _flat(self.float_array(x))
        name = a.dtype.name
        if name in ("float16", "bfloat16"):
            return _core.quantize(a.view(np.uint16), blocksize, codebook, name)
        return _core.quantize(a, blocksize, codebook)

    def dequantize(self, q: Packed, dtype: OutputDtype, out: Array | None = None) -> np.ndarray:
        if out is None:
            out = np.empty(q.shape, numpy_dtype(dtype))
        elif (
            not isinstance(out, np.ndarray)
            or out.dtype != numpy_dtype(dtype)
            or out.size != q.size
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise ValueError(
                f"out: expected a writable C-contiguous {dtype} numpy array of {q.size} "
                f"elements, got {type(out).__name__} "
                f"{getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}"
            )
        flat = out.reshape(-1)
        absmax = self._scales(q)
        if dtype == "float32":
            _core.dequantize_into(q.codes, absmax, q.blocksize, q.codebook, flat)
        else:
            bits = flat.view(np.uint16)
            _core.dequantize_into(q.codes, absmax, q.blocksize, q.codebook, bits, dtype)
        return out

    def dequantize_call(self, q: Packed) -> None:
        return None  # the core's dequantize is the whole cost here

    def gemv_call(self, w: Packed) -> None:
        return None  # the fused GEMV is the GPU's

    def _scales(self, q: Packed) -> np.ndarray:
        """The float32 scales, decoded from nested ones."""
        if q.nested is not None:
            return self.double_dequantize(q.nested)
        return np.asarray(q.absmax)

    def double_quantize(self, absmax: Array) -> NestedAbsmax:
        (codes, absmax2), offset = _core.double_quantize(np.ascontiguousarray(absmax, np.float32))
        return NestedAbsmax(codes, absmax2, float(offset))

    def double_dequantize(self, nested: NestedAbsmax) -> np.ndarray:
        return _core.double_dequantize(nested.codes, nested.absmax2, np.float32(nested.offset))

    def to_blocks36(self, q: Packed) -> np.ndarray:
        return _core.to_blocks36(q.codes, self._scales(q), q.size, q.codebook)

    def from_blocks36(self, buf: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        return _core.from_blocks36(buf, n)

    # --- layer math (float32) ------------------------------------------------------------
    # The operands are the protocol's `Array`s, which on the CPU are numpy arrays: typed `Any`
    # here, where they go to numpy's and the core's functions (which take numpy arrays only).

    def batched_matmul(self, a: Any, b: Any) -> np.ndarray:
        if a.dtype != b.dtype:
            raise ValueError(f"batched_matmul: operands of one dtype, got {a.dtype} and {b.dtype}")
        if a.dtype.itemsize == 2:  # numpy has no fast 16-bit product: float32, rounded once
            return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(a.dtype)
        return np.matmul(a, b)

    def matmul(
        self,
        a: Any,
        b: Any,
        alpha: float = 1.0,
        out: Any = None,
        accumulate: bool = False,
        out_dtype: DTypeLike | None = None,
    ) -> np.ndarray:
        """float32 in and out (`out_dtype` other than float32 is refused): the layers' math."""
        if out_dtype is not None and np.dtype(out_dtype) != np.float32:
            raise ValueError(f"the CPU products are float32, not {out_dtype}")
        if a.dtype != np.float32 or b.dtype != np.float32:  # float64 (gradient checks)
            r = alpha * (a @ b)
            if out is None:
                return r
            if accumulate:
                out += r
            else:
                out[...] = r
            return out
        if out is None:
            out = np.empty((a.shape[0], b.shape[1]), np.float32)
            accumulate = False
        _core.matmul(a, b, out, alpha, accumulate)
        return out

    def matmul_in_dtype(self, a: Any, b: Any) -> np.ndarray:
        """float32 to the core, float64 to numpy; 16-bit operands multiplied in float32 (numpy
        has no fast 16-bit product) and the product rounded to their dtype."""
        if a.dtype == np.float32 and b.dtype == np.float32:
            return self.matmul(a, b)
        if a.dtype == np.float64:
            return np.matmul(a, b)
        product = self.matmul(a.astype(np.float32), b.astype(np.float32))
        return product.astype(a.dtype)

    def astype_pair(self, a: Array, b: Array, dtype: DTypeLike) -> tuple[Array, Array]:
        return a.astype(dtype, copy=False), b.astype(dtype, copy=False)

    def quantized_matmul(
        self,
        x: Any,
        w: Packed,
        transpose: bool = True,
        out: Any = None,
        accumulate: bool = False,
    ) -> np.ndarray:
        rows, cols = _matrix_shape(w)
        if out is None:
            out = np.empty((x.shape[0], rows if transpose else cols), np.float32)
            accumulate = False
        absmax = self._scales(w)
        _core.qmatmul(
            x,
            w.codes,
            absmax,
            (rows, cols),
            w.blocksize,
            w.codebook,
            out,
            transpose,
            1.0,
            accumulate,
        )
        return out

    def dora_row_norms(self, w: Any, b: Any, a: Any, scaling: float) -> np.ndarray:
        if isinstance(w, Packed):
            return _core.dora_row_norms_quantized(
                w.codes, self._scales(w), _matrix_shape(w), w.blocksize, w.codebook, b, a, scaling
            )
        return _core.dora_row_norms_dense(w, b, a, scaling)


def _matrix_shape(w: Packed) -> tuple[int, int]:
    if len(w.shape) != 2:
        raise ValueError(f"expected a 2-D quantized weight [out, in], got shape {w.shape}")
    return w.shape[0], w.shape[1]


class ImmediateFiniteCheck:
    """On the CPU a check costs no wait: a non-finite value raises where it is recorded."""

    def record(self, a: Array, what: str, row_stride: int | None = None) -> None:
        bad = BACKEND.first_non_finite(a)
        if bad is not None:
            if row_stride is not None:
                bad = bad // max(int(a.shape[-1]), 1) * row_stride
            raise NonFiniteError(bad, what)

    def raise_pending(self) -> None:
        pass


BACKEND = CpuBackend()

__all__ = ["BACKEND", "FLOAT_DTYPES", "CpuBackend", "ImmediateFiniteCheck", "as_numpy"]
