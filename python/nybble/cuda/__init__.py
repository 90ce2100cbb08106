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
from ..backends.cuda import TILE_BYTES, backend, row_tiles
from ..backends.cuda.arrays import as_cupy, ready
from ..backends.cuda.kernels import GEMV_MAX_TOKENS
from ..formats import Codebook, NestedAbsmax, numpy_dtype, output_dtype
from ..tensor import NF4Tensor

__all__ = [
    "GEMV_MAX_TOKENS",
    "TILE_BYTES",
    "as_cupy",
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
    """x [..., q.shape[dim]] as a 2-D array, and its leading shape."""
    a = backend().float_array(x, what)
    output_dtype(a.dtype)
    if a.ndim == 0 or a.shape[-1] != q.shape[dim]:
        raise ValueError(f"{what}: expected shape (..., {q.shape[dim]}), got {a.shape}")
    lead = tuple(a.shape[:-1])
    return a.reshape(math.prod(lead), q.shape[dim]), lead


def nf4_matmul(x: Any, q: NF4Tensor) -> Any:
    """x @ dequantize(q).T for x [..., in] in float32/float16/bfloat16, summed in float32,
    returned in x's dtype. Up to GEMV_MAX_TOKENS tokens: the fused GEMV, which reads the 4-bit
    weight once (double-quantized scales as stored); more: the weight dequantized to x's dtype
    (whole, or f32 row tiles) and cuBLAS."""
    w = _weight(q)
    x2, lead = _tokens(x, q, 1, "x")
    return backend().quantized_matmul(x2, w).reshape(*lead, q.shape[0])


def nf4_gemv(x: Any, q: NF4Tensor) -> Any:
    """The fused GEMV alone (up to GEMV_MAX_TOKENS tokens, rows of 32k elements): x @
    dequantize(q).T summed in float32, returned in x's dtype."""
    w = _weight(q)
    x2, lead = _tokens(x, q, 1, "x")
    y = backend().xp.empty((x2.shape[0], q.shape[0]), x2.dtype)
    backend().gemv_weight(w)(ready(x2), y)
    return y.reshape(*lead, q.shape[0])


def nf4_matmul_t(dy: Any, q: NF4Tensor) -> Any:
    """dy @ dequantize(q) for dy [..., out] (the input gradient of `nf4_matmul`), summed in
    float32, returned in dy's dtype: the weight dequantized to dy's dtype and cuBLAS."""
    w = _weight(q)
    d2, lead = _tokens(dy, q, 0, "dy")
    return backend().quantized_matmul(d2, w, transpose=False).reshape(*lead, q.shape[1])


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
    from ..backends.cuda import launch

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
    if isinstance(scales, NestedAbsmax):
        nested = NestedAbsmax(
            ready(as_cupy(scales.codes, "scales.codes")),
            ready(as_cupy(scales.absmax2, "scales.absmax2")),
            scales.offset,
        )
    else:
        absmax = ready(as_cupy(scales, "scales")).reshape(-1)
    from ..backends.cuda import launch

    size = math.prod(dims)
    launch.dequantize(packed, absmax, nested, cb, "high_first", blocksize, size, 0, out.reshape(-1))
    return out


def _four_bit(codebook: str) -> Codebook:
    cb = formats.check_codebook(codebook)
    if formats.code_bits(cb) != 4:
        raise ValueError(f"this layout holds 4-bit codes (nf4, fp4), not {cb}")
    return cb
