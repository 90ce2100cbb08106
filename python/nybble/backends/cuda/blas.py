"""GEMMs on the GPU: `out = alpha * a @ b + beta * out` through cublasGemmEx, with float32
sums for every input dtype and an output dtype of its own (bfloat16 products into a float32
gradient, say). CuPy's `@` writes a new array and scales or adds in further passes over it;
doing it in the GEMM saves those passes, which in a LoRA layer at 4096 tokens are as long as
its small products. `gemm_batched` is the batched product (cublasGemmStridedBatchedEx) that
attention needs: CuPy's own `matmul` has no bfloat16 path."""

from __future__ import annotations

import ctypes
from typing import Any

from ...formats import dtype_name, numpy_dtype

try:
    import cupy as cp
except ImportError:
    cp = None

#: cudaDataType of each element dtype, and cuBLAS's constants.
_CUDA_TYPE = {"float32": 0, "float16": 2, "bfloat16": 14}
#: The dtypes `gemm` takes.
DTYPES = tuple(_CUDA_TYPE)
#: The same by dtype object: a call looks its arrays' dtypes up without naming them.
_CUDA_TYPE_OF = {numpy_dtype(name): code for name, code in _CUDA_TYPE.items()}
_OP_N, _OP_T = 0, 1
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: float32 sums, no TF32
_GEMM_DEFAULT = -1


class _Cublas:
    """The cuBLAS calls this module makes, into the library CuPy has loaded, through ctypes:
    CuPy's own wrappers refuse to run while a stream is being captured into a CUDA graph, which
    cuBLAS itself allows. Each call is made on CuPy's current stream (set on CuPy's handle for
    the device first, as CuPy's wrappers do)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(_loaded_cublas())
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        i, p, ll = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
        self._gemm = lib.cublasGemmEx
        self._gemm.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        self._batched = lib.cublasGemmStridedBatchedEx
        self._batched.argtypes = [
            *(p, i, i, i, i, i, p),
            *(p, i, i, ll, p, i, i, ll, p, p, i, i, ll, i, i, i),
        ]

    def _handle(self) -> int:
        handle = int(cp.cuda.device.get_cublas_handle())
        _check(self._set_stream(handle, cp.cuda.get_current_stream().ptr), "cublasSetStream")
        return handle

    def gemm(self, *args: Any) -> None:
        _check(self._gemm(self._handle(), *args), "cublasGemmEx")

    def gemm_batched(self, *args: Any) -> None:
        _check(self._batched(self._handle(), *args), "cublasGemmStridedBatchedEx")


def _loaded_cublas() -> str:
    """The path of the libcublas CuPy loaded (the one its handles belong to), from the
    process's memory map; else the library by its versioned name."""
    cp.cuda.device.get_cublas_handle()  # loads it
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcublas.so" in line}
    except OSError:
        paths = set()
    found = sorted(p for p in paths if "libcublasLt" not in p)
    if found:
        return found[0]
    major = cp.cuda.runtime.runtimeGetVersion() // 1000
    return f"libcublas.so.{major}"


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: cublasStatus_t {status}")


_cublas: _Cublas | None = None


def _library() -> _Cublas:
    global _cublas
    if _cublas is None:
        _cublas = _Cublas()
    return _cublas


def _operand(a: Any) -> tuple[int, int] | None:
    """(op, ld) to hand cuBLAS (column-major) the row-major 2-D `a` as `a` transposed: a
    matrix with unit column stride is its own transpose seen column-major (op N); one with
    unit row stride, a transposed view, needs op T. None for other strides."""
    item = a.itemsize
    s0, s1 = a.strides
    rows, cols = a.shape
    if s1 == item and s0 % item == 0 and s0 // item >= max(cols, 1):
        return _OP_N, max(s0 // item, 1)
    if s0 == item and s1 % item == 0 and s1 // item >= max(rows, 1):
        return _OP_T, max(s1 // item, 1)
    return None


def _checked_type(a: Any, b: Any, what: str) -> int:
    """The cudaDataType of a and b, which must share one float dtype."""
    code = _CUDA_TYPE_OF.get(a.dtype)
    if code is None or b.dtype != a.dtype:
        raise ValueError(
            f"{what}: expected two float32/float16/bfloat16 arrays of one dtype, got "
            f"{a.dtype} and {b.dtype}"
        )
    return code


#: alpha and beta as cuBLAS reads them (host float32), for the values the layers pass most.
_SCALARS = {v: ctypes.c_float(v) for v in (0.0, 1.0)}


def _scalar(v: float) -> ctypes.c_float:
    """v as a float32 for cuBLAS to read (kept alive by the caller until the call returns)."""
    held = _SCALARS.get(v)
    return ctypes.c_float(v) if held is None else held


def gemm(
    a: Any,
    b: Any,
    out: Any = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    out_dtype: Any = None,
) -> Any:
    """`out = alpha * a @ b + beta * out` for 2-D CuPy arrays a [m, k], b [k, n] of one float
    dtype (row-major or transposed views; anything else is copied first), summed in float32.
    `out` (C-contiguous rows, [m, n]) may have another float dtype than a and b; without it a
    new array of `out_dtype` (default a's dtype) is made and beta is ignored."""
    in_type = _checked_type(a, b, "gemm")
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"gemm: shapes {a.shape} and {b.shape} do not chain")
    if out is None:
        dtype = a.dtype if out_dtype is None else numpy_dtype(dtype_name(out_dtype))
        out = cp.empty((m, n), dtype)
        beta = 0.0
    elif out.shape != (m, n) or _operand(out) != (_OP_N, out.strides[0] // out.itemsize):
        raise ValueError(f"gemm: out must be a row-major [{m}, {n}] array, got {out.shape}")
    out_type = _CUDA_TYPE_OF.get(out.dtype)
    if out_type is None:
        raise ValueError(f"gemm: out has dtype {dtype_name(out.dtype)}")
    if m == 0 or n == 0:
        return out
    if k == 0:
        if beta == 0.0:
            out.fill(0)
        elif beta != 1.0:
            out *= beta
        return out
    op_a, op_b = _operand(a), _operand(b)
    if op_a is None:
        a, op_a = cp.ascontiguousarray(a), (_OP_N, k)
    if op_b is None:
        b, op_b = cp.ascontiguousarray(b), (_OP_N, n)
    # Row-major out = a @ b is column-major out^T = b^T @ a^T: cuBLAS gets b first.
    c_alpha, c_beta = _scalar(alpha), _scalar(beta)
    _library().gemm(
        op_b[0],
        op_a[0],
        n,
        m,
        k,
        ctypes.addressof(c_alpha),
        b.data.ptr,
        in_type,
        op_b[1],
        a.data.ptr,
        in_type,
        op_a[1],
        ctypes.addressof(c_beta),
        out.data.ptr,
        out_type,
        out.strides[0] // out.itemsize,
        _COMPUTE_32F,
        _GEMM_DEFAULT,
    )
    return out


def _batched_operand(a: Any) -> tuple[int, int, int] | None:
    """(op, ld, batch stride) of a 3-D `a` whose matrices `_operand` takes, all one stride
    apart (0: one matrix for every batch entry); None otherwise."""
    op = _operand(a[0])
    if op is None or a.strides[0] % a.itemsize or a.strides[0] < 0:
        return None
    return op[0], op[1], a.strides[0] // a.itemsize


def gemm_batched(a: Any, b: Any) -> Any:
    """a @ b for 3-D CuPy arrays a [n, m, k], b [n, k, p] of one float dtype, summed in float32:
    a new C-contiguous [n, m, p] array of that dtype. Each operand's matrices may be row-major
    or transposed views at one batch stride (anything else is copied first)."""
    in_type = _checked_type(a, b, "gemm_batched")
    n, m, k = a.shape
    n2, k2, p = b.shape
    if n != n2 or k != k2:
        raise ValueError(f"gemm_batched: shapes {a.shape} and {b.shape} do not chain")
    out = cp.empty((n, m, p), a.dtype)
    if out.size == 0:
        return out
    if k == 0:
        out.fill(0)
        return out
    op_a, op_b = _batched_operand(a), _batched_operand(b)
    if op_a is None:
        a = cp.ascontiguousarray(a)
        op_a = (_OP_N, k, m * k)
    if op_b is None:
        b = cp.ascontiguousarray(b)
        op_b = (_OP_N, p, k * p)
    # As in `gemm`: row-major a @ b is column-major bᵀ @ aᵀ, so cuBLAS gets b first.
    _library().gemm_batched(
        op_b[0],
        op_a[0],
        p,
        m,
        k,
        ctypes.addressof(_SCALARS[1.0]),
        b.data.ptr,
        in_type,
        op_b[1],
        op_b[2],
        a.data.ptr,
        in_type,
        op_a[1],
        op_a[2],
        ctypes.addressof(_SCALARS[0.0]),
        out.data.ptr,
        in_type,
        p,
        m * p,
        n,
        _COMPUTE_32F,
        _GEMM_DEFAULT,
    )
    return out
