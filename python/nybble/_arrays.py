"""Array inputs: which device an array lives on, and host arrays as flat float buffers."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
OUTPUT_DTYPES = ("float32", "float16", "bfloat16")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


_NAMES: dict[np.dtype[Any], str] = {}


def dtype_name(dtype: Any) -> str:
    """'float32' for "float32", np.float32, np.dtype('float32'), ml_dtypes.bfloat16, ...
    Remembered per dtype object: numpy computes `dtype.name` in Python, slowly enough to
    show in the per-call cost of a GPU launch."""
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, np.dtype):
        name = _NAMES.get(dtype)
        if name is None:
            name = _NAMES[dtype] = str(dtype.name)
        return name
    try:
        return str(np.dtype(dtype).name)
    except TypeError:
        return str(dtype)


def output_dtype(dtype: Any) -> str:
    name = dtype_name(dtype)
    if name not in OUTPUT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {name!r}")
    return name


def numpy_dtype(name: str) -> np.dtype[Any]:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def is_cuda(x: Any) -> bool:
    """True for CuPy arrays and other arrays that live in CUDA memory."""
    try:
        if hasattr(x, "__cuda_array_interface__"):
            return True
    except Exception:  # torch raises KeyError (bfloat16) or RuntimeError (requires_grad) there
        pass
    device = getattr(x, "__dlpack_device__", None)
    if device is not None and not isinstance(x, np.ndarray):
        try:
            return int(device()[0]) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
        except Exception:
            return False
    return False


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


def as_host_array(x: Any, what: str = "x") -> np.ndarray:
    """A numpy view (or, for non-array inputs, a conversion) of a host array."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        bf = _torch_bfloat16_view(x)
        if bf is not None:
            return bf
        try:
            return np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as e:
            raise ValueError(f"{what}: cannot read this array through DLPack ({e})") from None
    try:
        return np.asarray(x)
    except Exception as e:
        raise ValueError(f"{what}: expected an array, got {type(x).__name__} ({e})") from None


def float_input(x: Any, what: str = "x") -> np.ndarray:
    """A host float array checked for a supported dtype, as a flat C-contiguous buffer.
    A non-contiguous input is copied once; a contiguous one is not."""
    a = as_host_array(x, what)
    if a.dtype.name not in FLOAT_DTYPES:
        raise ValueError(
            f"{what} has dtype {a.dtype.name}; expected one of {', '.join(FLOAT_DTYPES)}"
        )
    return np.ascontiguousarray(a).reshape(-1)
