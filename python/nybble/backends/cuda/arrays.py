"""CUDA arrays in: CuPy arrays as they are, torch CUDA tensors wrapped by pointer (or through
DLPack), any other `__cuda_array_interface__` / `__dlpack__` array viewed without a copy."""

from __future__ import annotations

from typing import Any

from ...formats import BFLOAT16, numpy_dtype

try:
    import cupy as cp
except ImportError:
    cp = None

_UINT = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
#: The dtypes whose torch tensors are wrapped by pointer, by torch's name.
_WRAPPED = ("float32", "float16", "bfloat16", "float64", "uint8", "int8", "int16", "int32", "int64")
#: torch dtype -> numpy dtype of the wrapped ones, filled at the first torch tensor.
_TORCH_DTYPES: dict[Any, Any] = {}


def as_cupy(x: Any, what: str = "x") -> Any:
    """A CuPy view of a CUDA array: CuPy itself, a torch tensor (its memory wrapped directly,
    or through DLPack), or any `__cuda_array_interface__` / `__dlpack__` array."""
    if isinstance(x, cp.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch":
        if not x.is_cuda:
            raise ValueError(f"{what}: a torch tensor on {x.device}, expected a CUDA one")
        return _torch_view(x)
    from .. import of

    if of(x).device != "cuda":
        raise ValueError(
            f"{what}: expected a CUDA array (CuPy, torch, DLPack), got {type(x).__name__}"
        )
    try:
        if hasattr(x, "__cuda_array_interface__"):
            return cp.asarray(x)
        return cp.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError, ValueError) as e:
        raise ValueError(f"{what}: cannot read this array on the GPU ({e})") from None


def to_device(x: Any, what: str) -> Any:
    """A CUDA view of `x`, or a copy on the current GPU of a host array."""
    from .. import of

    if of(x).device == "cuda":
        return as_cupy(x, what)
    from ..cpu import as_numpy

    return cp.asarray(as_numpy(x, what))


def _torch_view(t: Any) -> Any:
    """A CuPy array over a CUDA torch tensor's memory, holding the tensor alive. Wrapping the
    pointer costs a few microseconds where DLPack costs tens, which is the whole run time of
    a 1-token GEMV. It is only done when torch and CuPy work on the same stream, so that the
    tensor's pending writes come first; otherwise DLPack, which makes the streams wait."""
    import torch

    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({getattr(torch, name): numpy_dtype(name) for name in _WRAPPED})
    dtype = _TORCH_DTYPES.get(t.dtype)
    device = t.get_device()
    same_stream = _torch_stream(torch, device) == _cupy_stream(device)
    if dtype is None or t.numel() == 0 or not same_stream:
        if str(t.dtype) == "torch.bfloat16":  # CuPy's DLPack import lacks bfloat16
            return cp.from_dlpack(t.detach().view(torch.int16)).view(BFLOAT16)
        return cp.from_dlpack(t.detach())
    if t.is_neg() or t.is_conj():  # lazily negated or conjugated views: their values
        t = t.resolve_neg().resolve_conj()
    shape, strides, size = tuple(t.shape), t.stride(), dtype.itemsize
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    memory = cp.cuda.UnownedMemory(t.data_ptr(), extent * size, t, device)
    pointer = cp.cuda.MemoryPointer(memory, 0)
    return cp.ndarray(shape, dtype, pointer, tuple(s * size for s in strides))


def _torch_stream(torch: Any, device: int) -> int:
    """The handle of torch's current stream on `device`: through the raw query where torch
    has it (a tenth of a microsecond, against several for a `torch.cuda.Stream` object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(device))
    return int(torch.cuda.current_stream(device).cuda_stream)


def _cupy_stream(device: int) -> int:
    """The handle of CuPy's current stream on `device`."""
    if device == cp.cuda.runtime.getDevice():
        return int(cp.cuda.get_current_stream().ptr)
    with cp.cuda.Device(device):
        return int(cp.cuda.get_current_stream().ptr)


def c_contiguous(a: Any) -> bool:
    """Whether the CuPy array `a` is C-contiguous: CuPy's own flag, read directly (`a.flags`
    builds an object per read, half a microsecond of a call's host time on the GPU machine)."""
    return bool(a._c_contiguous)


def ready(a: Any) -> Any:
    """`a`, or a C-contiguous 16-byte aligned copy of it when it is not one (the kernels move
    16 bytes at a time). The copy goes through unsigned ints, which CuPy copies in any dtype."""
    if c_contiguous(a) and a.data.ptr % 16 == 0:
        return a
    raw = a.view(_UINT[a.dtype.itemsize])
    return cp.array(raw, copy=True, order="C").view(a.dtype)
