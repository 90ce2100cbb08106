"""The GPU path: NF4Tensor on CUDA (CuPy arrays), bit-identical to the CPU codec, and the
4-bit matmuls of a QLoRA base weight.

CuPy in -> CuPy out. torch CUDA tensors (bfloat16 included) and other CUDA `__dlpack__`
arrays are read without a copy. The kernels (`kernels/nf4.cu`) compile on first use, so
importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from .. import _arrays
from .._arrays import dtype_name
from ..tensor import CODEBOOKS, NESTED_BLOCKSIZE, NestedAbsmax, NF4Tensor, check_shape
from . import _launch
from ._launch import GEMV_MAX_TOKENS

try:
    import cupy as cp
except ImportError:
    cp = None

__all__ = [
    "GEMV_MAX_TOKENS",
    "TILE_BYTES",
    "as_cupy",
    "dequantize",
    "dequantize_blocks",
    "dequantize_bnb",
    "double_dequantize",
    "double_quantize",
    "nf4_gemv",
    "nf4_matmul",
    "nf4_matmul_t",
    "quantize",
    "to_cpu",
    "to_cuda",
]

#: In float32 compute the matmuls dequantize the weight in row tiles of at most this many
#: bytes, so the whole f32 weight never exists at once; 16-bit compute takes it whole.
TILE_BYTES = 128 << 20

_UINT = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


# --- arrays in ---------------------------------------------------------------------------


def as_cupy(x: Any, what: str = "x") -> Any:
    """A CuPy view of a CUDA array: CuPy itself, a torch tensor (its memory wrapped directly,
    or through DLPack), or any `__cuda_array_interface__` / `__dlpack__` array."""
    if isinstance(x, cp.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch":
        if not x.is_cuda:
            raise ValueError(f"{what}: a torch tensor on {x.device}, expected a CUDA one")
        return _torch_view(x)
    if _arrays.is_cuda(x):
        if hasattr(x, "__cuda_array_interface__"):
            return cp.asarray(x)
        return cp.from_dlpack(x)
    raise ValueError(f"{what}: expected a CUDA array (CuPy, torch, DLPack), got {type(x).__name__}")


#: The dtypes whose torch tensors are wrapped by pointer, by torch's name.
_WRAPPED = ("float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64")
_TORCH_DTYPES = {f"torch.{name}": _arrays.numpy_dtype(name) for name in _WRAPPED}


def _torch_view(t: Any) -> Any:
    """A CuPy array over a CUDA torch tensor's memory, holding the tensor alive. Wrapping the
    pointer costs a few microseconds where DLPack costs tens, which is the whole run time of
    a 1-token GEMV. It is only done when torch and CuPy work on the same stream, so that the
    tensor's pending writes come first; otherwise DLPack, which makes the streams wait."""
    import torch

    dtype = _TORCH_DTYPES.get(str(t.dtype))
    device = t.device.index
    same_stream = torch.cuda.current_stream(device).cuda_stream == _cupy_stream(device)
    if dtype is None or t.numel() == 0 or not same_stream:
        if str(t.dtype) == "torch.bfloat16":  # CuPy's DLPack import lacks bfloat16
            return cp.from_dlpack(t.detach().view(torch.int16)).view(_arrays.BFLOAT16)
        return cp.from_dlpack(t.detach())
    if t.is_neg() or t.is_conj():  # lazily negated or conjugated views: their values
        t = t.resolve_neg().resolve_conj()
    shape, strides, size = tuple(t.shape), t.stride(), dtype.itemsize
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    memory = cp.cuda.UnownedMemory(t.data_ptr(), extent * size, t, device)
    pointer = cp.cuda.MemoryPointer(memory, 0)
    return cp.ndarray(shape, dtype, pointer, tuple(s * size for s in strides))


def _cupy_stream(device: int) -> int:
    """The handle of CuPy's current stream on `device`."""
    if device == cp.cuda.runtime.getDevice():
        return int(cp.cuda.get_current_stream().ptr)
    with cp.cuda.Device(device):
        return int(cp.cuda.get_current_stream().ptr)


def _ready(a: Any) -> Any:
    """`a`, or a C-contiguous 16-byte aligned copy of it when it is not one (the kernels move
    16 bytes at a time). The copy goes through unsigned ints, which CuPy copies in any dtype."""
    if a.flags.c_contiguous and a.data.ptr % 16 == 0:
        return a
    raw = a.view(_UINT[a.dtype.itemsize])
    return cp.array(raw, copy=True, order="C").view(a.dtype)


def _float_input(x: Any, what: str) -> Any:
    a = as_cupy(x, what)
    if dtype_name(a.dtype) not in _launch.DTYPES:
        raise ValueError(
            f"{what} has dtype {dtype_name(a.dtype)}; expected one of {', '.join(_launch.DTYPES)}"
        )
    return a


def _on_device(q: NF4Tensor) -> NF4Tensor:
    if q.device != "cuda":
        raise ValueError("q: an NF4Tensor on the CPU; move it with q.cuda()")
    return q


def _nested_on_device(nested: NestedAbsmax) -> NestedAbsmax:
    codes, absmax2 = (_ready(cp.asarray(a)) for a in (nested.codes, nested.absmax2))
    return NestedAbsmax(codes, absmax2, nested.offset)


def _nested_ready(nested: NestedAbsmax | None) -> NestedAbsmax | None:
    return None if nested is None else _nested_on_device(nested)


# --- the codec ---------------------------------------------------------------------------


def quantize(
    x: Any, blocksize: int = 64, double_quant: bool = False, codebook: str = "nf4"
) -> NF4Tensor:
    """`nybble.quantize` on the GPU: the same codes and scales as the CPU, bit for bit."""
    a = as_cupy(x)
    orig = dtype_name(a.dtype)
    if orig not in _arrays.FLOAT_DTYPES:
        raise ValueError(f"x has dtype {orig}; expected one of {', '.join(_arrays.FLOAT_DTYPES)}")
    flat = _ready(a).reshape(-1)
    if orig == "float64":
        flat = _launch.narrow_f64(flat)  # round to nearest, then quantize as f32
        orig = "float32"
    codes, absmax = _launch.quantize(flat, blocksize, codebook)
    nested = double_quantize(absmax) if double_quant else None
    return NF4Tensor(codes, absmax, a.shape, blocksize, codebook, nested, orig)


def double_quantize(absmax: Any) -> NestedAbsmax:
    """Scales -> NestedAbsmax, as `reference.double_quantize`: the offset is the float32 of
    the float64 sum taken in order over n (computed on the host, where that order is cheap),
    then `absmax - offset` (also on the host) is quantized blockwise (256) with the dynamic
    map on the GPU."""
    host = np.asarray(cp.asnumpy(absmax), dtype=np.float32)
    if not (np.isfinite(host) & (host >= 0)).all():
        raise ValueError("absmax: scales must be finite and >= 0")
    total = np.cumsum(host, dtype=np.float64)[-1] if host.size else 0.0
    offset = np.float32(total / max(host.size, 1))
    # On the host too: CuPy's arithmetic flushes subnormal differences to zero (-ftz=true).
    centered = _ready(cp.asarray(host - offset))  # finite: the scales of a finite tensor
    codes, absmax2 = _launch.quantize(centered, NESTED_BLOCKSIZE, "dynamic8", check_finite=False)
    return NestedAbsmax(codes, absmax2, float(offset))


def double_dequantize(nested: NestedAbsmax) -> Any:
    """map[code] * absmax2[i // 256] + offset in float32, rounded after each operation."""
    n = int(nested.codes.size)
    out = cp.empty(n, cp.float32)
    _launch.decode_scales(_nested_on_device(nested), n, out)
    return out


def _dequantize_into(q: NF4Tensor, start: int, out: Any) -> None:
    """out (flat) = elements [start, start + out.size) of q."""
    absmax = None if q.nested is not None else _ready(q.absmax)
    codes, nested = _ready(q.codes), _nested_ready(q.nested)
    if CODEBOOKS[q.codebook] == 4:
        _launch.dequantize4(
            codes, absmax, nested, q.codebook, "split", q.blocksize, q.size, start, out
        )
    else:
        _launch.dequantize8(codes, absmax, nested, q.codebook, q.blocksize, q.size, start, out)


def dequantize(q: NF4Tensor, dtype: Any = "float32") -> Any:
    """`q.dequantize(dtype)` for a tensor on the GPU: a CuPy array of q.shape, bit-identical
    to the CPU result (the scales of a double-quantized q are decoded on the fly)."""
    name = _arrays.output_dtype(dtype)
    out = cp.empty(_on_device(q).shape, _arrays.numpy_dtype(name))
    _dequantize_into(q, 0, out.reshape(-1))
    return out


def dequantize_blocks(buf: Any, shape: Any, dtype: Any = "float32", codebook: str = "nf4") -> Any:
    """Dequantizes the 36-byte block layout (`NF4Tensor.to_blocks`) held in GPU memory."""
    dims = check_shape(shape)
    n = math.prod(dims)
    b = _ready(as_cupy(buf, "buf"))
    if b.dtype.itemsize != 1:
        raise ValueError(f"buf: expected a buffer of bytes (uint8), got dtype {b.dtype}")
    out = cp.empty(dims, _arrays.numpy_dtype(_arrays.output_dtype(dtype)))
    flat = b.reshape(-1).view(cp.uint8)
    _launch.dequantize4(flat, None, None, codebook, "blocks36", 64, n, 0, out.reshape(-1))
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
    dims = check_shape(shape)
    out = cp.empty(dims, _arrays.numpy_dtype(_arrays.output_dtype(dtype)))
    packed = _ready(as_cupy(codes, "codes")).reshape(-1)
    if isinstance(scales, NestedAbsmax):
        absmax, nested = None, _nested_ready(scales)
    else:
        absmax, nested = _ready(as_cupy(scales, "scales")).reshape(-1), None
    size = math.prod(dims)
    _launch.dequantize4(
        packed, absmax, nested, codebook, "high_first", blocksize, size, 0, out.reshape(-1)
    )
    return out


def _moved(q: NF4Tensor, move: Any) -> NF4Tensor:
    """q with every array passed through `move` (to the host or to the device)."""
    nested = None
    if q.nested is not None:
        nested = NestedAbsmax(move(q.nested.codes), move(q.nested.absmax2), q.nested.offset)
    absmax = None if nested is not None else move(q.absmax)
    return NF4Tensor(move(q.codes), absmax, q.shape, q.blocksize, q.codebook, nested, q.orig_dtype)


def to_cpu(q: NF4Tensor) -> NF4Tensor:
    return q if q.device == "cpu" else _moved(q, cp.asnumpy)


def to_cuda(q: NF4Tensor) -> NF4Tensor:
    return q if q.device == "cuda" else _moved(q, cp.asarray)


# --- matmuls with a 4-bit weight W [out, in] -----------------------------------------------


def _matmul_input(x: Any, q: NF4Tensor, dim: int, what: str) -> tuple[Any, tuple[int, ...]]:
    """x [..., q.shape[dim]] as a 2-D array, and its leading shape."""
    a = _float_input(x, what)
    _on_device(q)
    if q.ndim != 2:
        raise ValueError(f"q: expected a 2-D weight [out, in], got shape {q.shape}")
    if a.ndim == 0 or a.shape[-1] != q.shape[dim]:
        raise ValueError(f"{what}: expected shape (..., {q.shape[dim]}), got {a.shape}")
    lead = a.shape[:-1]
    a = _ready(a)
    return (a if a.ndim == 2 else a.reshape(math.prod(lead), q.shape[dim])), lead


def _row_tiles(q: NF4Tensor, dtype: str) -> list[tuple[int, int]]:
    rows, cols = q.shape
    if dtype != "float32" or rows * cols * 4 <= TILE_BYTES:
        return [(0, rows)]
    # A multiple of 32 rows, so every tile starts on a 32-element boundary of the codes.
    step = max(32, TILE_BYTES // (4 * cols) // 32 * 32)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _dense_rows(q: NF4Tensor, r0: int, r1: int, dtype: str) -> Any:
    cols = q.shape[1]
    out = cp.empty((r1 - r0, cols), _arrays.numpy_dtype(dtype))
    _dequantize_into(q, r0 * cols, out.reshape(-1))
    return out


#: Each weight's GemvWeight (the checks and launch arguments a GEMV call reuses) with the
#: arrays (by identity) and the format it was made from, for as long as the weight lives;
#: remade when any of them changes.
_gemv_weights: weakref.WeakKeyDictionary[
    NF4Tensor, tuple[tuple[Any, ...], tuple[Any, ...], _launch.GemvWeight]
] = weakref.WeakKeyDictionary()


def _gemv_weight(q: NF4Tensor) -> _launch.GemvWeight:
    nested = q.nested
    held = (q.codes, q.absmax if nested is None else nested)
    form = (q.codebook, q.blocksize, q.shape)
    cached = _gemv_weights.get(q)
    if cached is not None and cached[1] == form:
        if all(a is b for a, b in zip(cached[0], held, strict=True)):
            return cached[2]
    arrays = (q.codes, q.absmax) if nested is None else (q.codes, nested.codes, nested.absmax2)
    ready = [_ready(cp.asarray(a)) for a in arrays]
    scales = NestedAbsmax(ready[1], ready[2], nested.offset) if nested is not None else None
    absmax = ready[1] if nested is None else None
    shape = (q.shape[0], q.shape[1])
    w = _launch.GemvWeight(ready[0], absmax, scales, q.codebook, shape, q.blocksize)
    if all(a is b for a, b in zip(ready, arrays, strict=True)):  # no copies: reusable
        _gemv_weights[q] = (held, form, w)
    else:  # copies are made per call; keep nothing that holds old arrays
        _gemv_weights.pop(q, None)
    return w


def _gemv(x2: Any, q: NF4Tensor, lead: tuple[int, ...]) -> Any:
    """y [*lead, out] of x2 [m, in], m = prod(lead)."""
    y = cp.empty((*lead, q.shape[0]), x2.dtype)
    _gemv_weight(q)(x2, y if len(lead) == 1 else y.reshape(x2.shape[0], q.shape[0]))
    return y


def nf4_gemv(x: Any, q: NF4Tensor) -> Any:
    """x @ dequantize(q).T for up to GEMV_MAX_TOKENS rows of x, fused: reads the 4-bit weight
    once, sums in float32, returns x's dtype."""
    x2, lead = _matmul_input(x, q, 1, "x")
    return _gemv(x2, q, lead)


def nf4_matmul(x: Any, q: NF4Tensor) -> Any:
    """x @ dequantize(q).T for x [..., in] in float32/float16/bfloat16, summed in float32,
    returned in x's dtype. Up to GEMV_MAX_TOKENS tokens: the fused GEMV; more: the weight
    dequantized to x's dtype (whole, or f32 row tiles) and cuBLAS."""
    x2, lead = _matmul_input(x, q, 1, "x")
    rows = q.shape[0]
    m = x2.shape[0]
    if 0 < m <= GEMV_MAX_TOKENS and _launch.gemv_supported(q.codebook, q.shape):
        return _gemv(x2, q, lead)
    dtype = dtype_name(x2.dtype)
    tiles = _row_tiles(q, dtype)
    if len(tiles) == 1:
        y = x2 @ _dense_rows(q, 0, rows, dtype).T
    else:
        y = cp.empty((m, rows), x2.dtype)
        for r0, r1 in tiles:
            y[:, r0:r1] = x2 @ _dense_rows(q, r0, r1, dtype).T
    return y.reshape(*lead, rows)


def nf4_matmul_t(dy: Any, q: NF4Tensor) -> Any:
    """dy @ dequantize(q) for dy [..., out] (the input gradient of `nf4_matmul`), summed in
    float32, returned in dy's dtype: the weight dequantized to dy's dtype and cuBLAS."""
    d2, lead = _matmul_input(dy, q, 0, "dy")
    dtype = dtype_name(d2.dtype)
    y: Any = None
    for r0, r1 in _row_tiles(q, dtype):  # several tiles only in float32: f32 partial sums
        part = d2[:, r0:r1] @ _dense_rows(q, r0, r1, dtype)
        y = part if y is None else y + part
    return y.reshape(*lead, q.shape[1])
