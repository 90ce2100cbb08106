"""The GPU functions that have no CPU twin, for NF4Tensors on CUDA (CuPy arrays): the 4-bit
matmuls of a QLoRA base weight, and dequantizing the 36-byte and bitsandbytes layouts held in
GPU memory. `nybble.quantize`, `NF4Tensor.dequantize` and the layers reach the GPU by
themselves (through nybble.backends); this module is what a GPU user adds to them.

CuPy in -> CuPy out. torch CUDA tensors (bfloat16 included) and other CUDA `__dlpack__`
arrays are read without a copy. Importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import math
from typing import Any

from .. import formats
from ..backends.cuda import TILE_BYTES, backend, launch, row_tiles
from ..backends.cuda.arrays import as_cupy, ready, to_device
from ..backends.cuda.graph import Graph, capture
from ..backends.cuda.kernels import GEMV_MAX_TOKENS
from ..formats import Codebook, NestedAbsmax, numpy_dtype, output_dtype
from ..tensor import NF4Tensor

__all__ = [
    "GEMV_MAX_TOKENS",
    "TILE_BYTES",
    "Graph",
    "as_cupy",
    "capture",
    "check",
    "dequantize_blocks",
    "dequantize_bnb",
    "nf4_gemv",
    "nf4_matmul",
    "nf4_matmul_t",
    "row_tiles",
]


def _weight(q: NF4Tensor) -> formats.Packed:
    if not isinstance(q, NF4Tensor):
        raise ValueError(f"q: expected an NF4Tensor, got {type(q).__name__}")
    if q.device != "cuda":
        raise ValueError("q: an NF4Tensor on the CPU; move it with q.cuda()")
    if q.ndim != 2:
        raise ValueError(f"q: expected a 2-D weight [out, in], got shape {q.shape}")
    return q.packed


def _tokens(x: Any, q: NF4Tensor, dim: int, what: str) -> tuple[Any, tuple[int, ...]]:
    """x [..., q.shape[dim]] as a 2-D array, and its leading shape (no new view for a 2-D
    CuPy array: a 1-token GEMV is short enough for that to show)."""
    a = x if type(x) is _ndarray else backend().float_array(x, what)
    output_dtype(a.dtype)
    shape = a.shape
    if not shape or shape[-1] != q.shape[dim]:
        raise ValueError(f"{what}: expected shape (..., {q.shape[dim]}), got {shape}")
    if len(shape) == 2:
        return a, shape[:1]
    lead = tuple(shape[:-1])
    return a.reshape(math.prod(lead), q.shape[dim]), lead


def _out_2d(out: Any, lead: tuple[int, ...], width: int) -> Any:
    """`out` of shape (*lead, width) seen as (prod(lead), width), or None."""
    if out is None:
        return None
    shape = getattr(out, "shape", None)
    if shape is None or tuple(shape) != (*lead, width):
        raise ValueError(f"out: expected shape {(*lead, width)}, got {shape}")
    return out if len(shape) == 2 else out.reshape(math.prod(lead), width)


try:
    from cupy import ndarray as _ndarray
except ImportError:  # importable without CuPy: every call then takes the checked path
    _ndarray = None


def nf4_matmul(x: Any, q: NF4Tensor, out: Any = None) -> Any:
    """x @ dequantize(q).T for x [..., in] in float32/float16/bfloat16, summed in float32,
    returned in x's dtype (in `out`, a C-contiguous array of x's dtype and shape [..., out],
    when given). Up to GEMV_MAX_TOKENS tokens: the fused GEMV, which reads the 4-bit weight
    once (double-quantized scales as stored); more: the weight dequantized to x's dtype
    (whole, or f32 row tiles) and cuBLAS. Captures into a CUDA graph (see `capture`).
    Without `out`, a 16-bit GEMV returns the output that the same thread's previous call on
    the same stream allocated once its kernel was queued (so the allocation runs beside the
    kernel): the weight holds one such array, [tokens, out], per token shape."""
    if type(x) is _ndarray and type(q) is NF4Tensor:  # the decode loop's call: few checks
        fast = q._gemv_call
        if fast is not None:
            y = fast(x, out)
            if y is not None:
                return y
    w = _weight(q)
    x2, lead = _tokens(x, q, 1, "x")
    y = backend().quantized_matmul(x2, w, out=_out_2d(out, lead, q.shape[0]))
    q._keep_gemv_call()
    if out is not None:
        return out
    return y if len(lead) == 1 else y.reshape(*lead, q.shape[0])


def nf4_gemv(x: Any, q: NF4Tensor, out: Any = None) -> Any:
    """The fused GEMV alone (up to GEMV_MAX_TOKENS tokens, rows of 32k elements): x @
    dequantize(q).T summed in float32, returned in x's dtype (or in `out`)."""
    w = _weight(q)
    x2, lead = _tokens(x, q, 1, "x")
    y2 = backend().gemv(x2, w, _out_2d(out, lead, q.shape[0]))
    return out if out is not None else y2.reshape(*lead, q.shape[0])


def nf4_matmul_t(dy: Any, q: NF4Tensor, out: Any = None) -> Any:
    """dy @ dequantize(q) for dy [..., out] (the input gradient of `nf4_matmul`), summed in
    float32, returned in dy's dtype (or in `out`): the weight dequantized to dy's dtype and
    cuBLAS."""
    w = _weight(q)
    d2, lead = _tokens(dy, q, 0, "dy")
    y = backend().quantized_matmul(d2, w, transpose=False, out=_out_2d(out, lead, q.shape[1]))
    return out if out is not None else y.reshape(*lead, q.shape[1])


def check() -> None:
    """NonFiniteError for a non-finite input to a quantize call made inside a graph capture
    (found on the device by the captured work, read here)."""
    backend().captured_checks.raise_pending()


def dequantize_blocks(buf: Any, shape: Any, dtype: Any = "float32", codebook: str = "nf4") -> Any:
    """Dequantizes the 36-byte block layout (`NF4Tensor.to_blocks`) held in GPU memory."""
    dims = formats.check_shape(shape)
    name = output_dtype(dtype)
    cb = _four_bit(codebook)
    b = ready(as_cupy(buf, "buf"))
    if b.dtype.itemsize != 1:
        raise ValueError(f"buf: expected a buffer of bytes (uint8), got dtype {b.dtype}")
    out = backend().xp.empty(dims, numpy_dtype(name))
    flat = b.reshape(-1).view("uint8")
    n = math.prod(dims)
    launch.dequantize(flat, None, None, cb, "blocks36", 64, n, 0, out.reshape(-1))
    return out


def dequantize_bnb(
    codes: Any,
    scales: Any,
    shape: Any,
    dtype: Any = "float32",
    blocksize: int = 64,
    codebook: str = "nf4",
) -> Any:
    """Dequantizes bitsandbytes' packing (element 2k in the high nibble, e.g. a `Linear4bit`
    `weight` of shape [ceil(n/2), 1]) in GPU memory; `scales` is the float32 absmax or a
    NestedAbsmax (bitsandbytes' `absmax` codes, `nested_absmax` and `nested_offset`)."""
    dims = formats.check_shape(shape)
    name = output_dtype(dtype)
    cb = _four_bit(codebook)
    out = backend().xp.empty(dims, numpy_dtype(name))
    packed = ready(as_cupy(codes, "codes")).reshape(-1)
    nested: NestedAbsmax | None = None
    absmax = None
    if isinstance(scales, NestedAbsmax):  # scales may come from the host: they are small
        nested = NestedAbsmax(
            ready(to_device(scales.codes, "scales.codes")),
            ready(to_device(scales.absmax2, "scales.absmax2")),
            scales.offset,
        )
    else:
        absmax = ready(to_device(scales, "scales")).reshape(-1)
    size = math.prod(dims)
    launch.dequantize(packed, absmax, nested, cb, "high_first", blocksize, size, 0, out.reshape(-1))
    return out


def _four_bit(codebook: str) -> Codebook:
    cb = formats.check_codebook(codebook)
    if formats.code_bits(cb) != 4:
        raise ValueError(f"this layout holds 4-bit codes (nf4, fp4), not {cb}")
    return cb
