"""The backend seam. `of(array)` is the one place that decides which device an array lives
on; each backend implements the same array primitives for its device and takes and returns
arrays of that device:

- `cpu`: numpy arrays, the work done by the Rust core (`nybble._core`);
- `cuda`: CuPy arrays (torch CUDA tensors and other `__cuda_array_interface__` /
  `__dlpack__` arrays are viewed without a copy), the work done by kernels/nf4.cu and cuBLAS.
- `record`: no device and no math: arrays that record their allocations and frees as the
  GPU would make them (`record.RecordingBackend`, which `get("cuda")` is inside
  `record.recording`), for `nybble.memory`'s estimate of the trainer's GPU memory.

`NF4Tensor`, the layers, the optimizer and the trainer call the backend of their arrays and
never ask which device they are on. docs/architecture.md shows the data flow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal, Protocol, SupportsIndex, overload

import numpy as np

from ..formats import (
    Codebook,
    FloatDtype,
    KernelCodebook,
    NestedAbsmax,
    OutputDtype,
    Packed,
    numpy_dtype,
)

if TYPE_CHECKING:
    from types import ModuleType

    from numpy.typing import DTypeLike

    from .cpu import CpuBackend

Device = Literal["cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "cuda")


class Flags(Protocol):
    """An array's memory layout flags (numpy's, CuPy's, a recording's)."""

    @property
    def c_contiguous(self) -> bool: ...


class Array(Protocol):
    """A backend's array as the code above the seam uses it (numpy's on the CPU, CuPy's on
    the GPU, `record.RecordArray` in a recording): its shape and dtype, views, casts,
    reductions, indexing and the elementwise operators. What a backend's array namespace `xp`
    does with arrays (`xp.exp`, `xp.where`, ...) is not part of it."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def ndim(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def flags(self) -> Flags: ...

    @property
    def T(self) -> Array: ...

    @overload
    def reshape(self, shape: tuple[int, ...], /) -> Array: ...

    @overload
    def reshape(self, n0: SupportsIndex, /) -> Array: ...

    @overload
    def reshape(self, n0: SupportsIndex, n1: SupportsIndex, /) -> Array: ...

    @overload
    def reshape(self, n0: SupportsIndex, n1: SupportsIndex, n2: SupportsIndex, /) -> Array: ...

    @overload
    def reshape(
        self, n0: SupportsIndex, n1: SupportsIndex, n2: SupportsIndex, n3: SupportsIndex, /
    ) -> Array: ...

    @overload
    def reshape(
        self,
        n0: SupportsIndex,
        n1: SupportsIndex,
        n2: SupportsIndex,
        n3: SupportsIndex,
        n4: SupportsIndex,
        /,
    ) -> Array: ...

    def transpose(self, *axes: SupportsIndex) -> Array: ...

    def copy(self) -> Array: ...

    def astype(
        self, dtype: DTypeLike, *, order: Literal["K", "A", "C", "F"] = ..., copy: bool = ...
    ) -> Array: ...

    def sum(self, axis: Any = ..., dtype: DTypeLike = ..., *, keepdims: bool = ...) -> Array: ...

    def mean(self, axis: Any = ..., dtype: DTypeLike = ..., *, keepdims: bool = ...) -> Array: ...

    def max(self, axis: Any = ..., *, keepdims: bool = ...) -> Array: ...

    def __getitem__(self, key: Any, /) -> Array: ...

    def __setitem__(self, key: Any, value: Any, /) -> None: ...

    def __float__(self) -> float: ...

    def __neg__(self) -> Array: ...

    def __invert__(self) -> Array: ...

    def __add__(self, other: Any, /) -> Array: ...

    def __radd__(self, other: Any, /) -> Array: ...

    def __iadd__(self, other: Any, /) -> Array: ...

    def __sub__(self, other: Any, /) -> Array: ...

    def __rsub__(self, other: Any, /) -> Array: ...

    def __isub__(self, other: Any, /) -> Array: ...

    def __mul__(self, other: Any, /) -> Array: ...

    def __rmul__(self, other: Any, /) -> Array: ...

    def __imul__(self, other: Any, /) -> Array: ...

    def __truediv__(self, other: Any, /) -> Array: ...

    def __rtruediv__(self, other: Any, /) -> Array: ...

    def __itruediv__(self, other: Any, /) -> Array: ...

    def __matmul__(self, other: Any, /) -> Array: ...

    def __and__(self, other: Any, /) -> Array: ...

    def __or__(self, other: Any, /) -> Array: ...

    def __ior__(self, other: Any, /) -> Array: ...

    def __lt__(self, other: Any, /) -> Array: ...

    def __le__(self, other: Any, /) -> Array: ...

    def __gt__(self, other: Any, /) -> Array: ...

    def __ge__(self, other: Any, /) -> Array: ...


class Random(Protocol):
    """A seeded generator of a layer's initial values (`Backend.random`): numpy's Generator on
    the CPU and the GPU, the recording's draws of shapes only."""

    def uniform(
        self, low: float = ..., high: float = ..., size: int | tuple[int, ...] | None = ...
    ) -> Array: ...

    def normal(
        self, loc: float = ..., scale: float = ..., size: int | tuple[int, ...] | None = ...
    ) -> Array: ...


class FiniteCheck(Protocol):
    """The promise that a non-finite input never passes silently, kept at the cost each device
    allows: on the CPU `record` raises at once; on the GPU it scans on the device, without a
    wait, and `raise_pending` (called where a wait happens anyway, or by the user) raises for
    what was recorded since the last call."""

    def record(self, a: Array, what: str, row_stride: int | None = None) -> None:
        """NonFiniteError (now or at the next `raise_pending`) if `a` holds NaN or ±inf. With
        `row_stride`, `a` stands for another array whose rows it summarises (a product of
        them, non-finite in every row where they are): the error names the flat index of the
        first element of that row in the other array, whose rows are `row_stride` long."""
        ...

    def raise_pending(self) -> None:
        """NonFiniteError naming the argument and the smallest bad flat index among the
        arrays recorded as `what` since the last call (the first such `what` recorded)."""
        ...


class Graph(Protocol):
    """Work captured into a CUDA graph (`Backend.capture`)."""

    def replay(self) -> None:
        """Runs the captured work again, over the same buffers."""
        ...


class Kernel(Protocol):
    """One compiled kernel (`KernelModule.function`), launched as CuPy's kernels are called:
    the grid an int or a tuple of up to 3, the block 1-D, the arguments device arrays (their
    address) or numpy scalars of the kernel's parameter types, on the current stream."""

    def __call__(self, grid: Any, block: Any, args: Sequence[Any], shared_mem: int = 0) -> None: ...


class KernelModule(Protocol):
    """A file of kernels/ compiled for one device (`Backend.kernel_module`): the backend keeps
    one a device, file and options, so callers may key what they keep on it."""

    def __hash__(self) -> int: ...

    def function(self, name: str, dynamic_shared: int = 0) -> Kernel:
        """The kernel `name`, allowed `dynamic_shared` bytes of dynamic shared memory."""
        ...

    def read_facts(self, symbol: str, count: int) -> tuple[int, ...]:
        """The first `count` values of the module's facts array `symbol` (its launch sizes,
        each defined once in the file)."""
        ...


class Backend(Protocol):
    """The array primitives every device implements. Arrays are the backend's own (numpy or
    CuPy); `Packed` carries a quantized tensor's arrays and format."""

    device: Device
    #: The array namespace (numpy or cupy), for elementwise math written once.
    xp: ModuleType
    #: Whether the device's products run in float32 only (the CPU: 16-bit operands widened,
    #: the product rounded once at the end; `matmul` takes float32), rather than in the
    #: operands' dtype with float32 sums (the GPU's cuBLAS).
    float32_products: bool
    #: Whether the device runs CUDA C kernels compiled at run time: where the trainer's fused
    #: kernels (train/_cuda.py) run (a recording of the GPU takes them and launches nothing).
    cuda_kernels: bool
    #: The activations' dtype a trainer on this device computes in unless told otherwise.
    default_compute_dtype: OutputDtype

    # --- run-time compiled kernels (where `cuda_kernels`) ----------------------------------

    def kernel_module(self, file: str, options: Sequence[str]) -> KernelModule:
        """The kernels of kernels/`file` compiled with the NVRTC `options` for the current
        device, once a device (on the GPU backends/cuda/kernels.module, the one compile path
        of every file; a recording's compile and launch nothing). RuntimeError on the CPU."""
        ...

    def compute_capability(self) -> int | None:
        """The current device's compute capability as a number (80 for 8.0), or None where no
        device runs the kernels (the CPU; a recording, which takes every kernel)."""
        ...

    # --- arrays in and out ---------------------------------------------------------------

    def asarray(self, x: object, what: str = "x") -> Array:
        """A view of `x` as this backend's array (a copy only where a view is impossible,
        e.g. another byte order)."""
        ...

    def float_array(self, x: object, what: str = "x") -> Array:
        """`asarray`, checked to be of a float dtype nybble reads (FLOAT_DTYPES)."""
        ...

    def contiguous(self, a: Array) -> Array:
        """`a` C-contiguous and aligned, as the core and the kernels read arrays (itself when
        it is; a copy otherwise)."""
        ...

    def to_host(self, a: Array) -> Array:
        """`a` on the host: a numpy array (`a` itself on the CPU), or in a recording one of
        its host arrays."""
        ...

    def from_host(self, a: Array) -> Array:
        """The host array `a` on this backend's device (`a` itself on the CPU)."""
        ...

    def memory_in_use(self) -> int | None:
        """Bytes of device memory the process's arrays hold (None on the CPU)."""
        ...

    def synchronize(self) -> None:
        """Waits for the device's queued work (nothing to wait for on the CPU)."""
        ...

    def capture(self, work: Callable[[], object], *buffers: Array) -> Graph | None:
        """`work` (GPU work over fixed buffers) captured into a CUDA graph whose `replay()`
        runs it again (nybble.cuda.capture), or None where the device has no graphs."""
        ...

    def first_non_finite(self, a: Array) -> int | None:
        """The first flat index of a NaN or ±inf in `a`, or None. On the GPU this waits for
        the device."""
        ...

    def finite_check(self) -> FiniteCheck:
        """A new check of this device (see FiniteCheck)."""
        ...

    def random(self, seed: int) -> Random:
        """A seeded generator of the values a layer starts from, drawn on the host and moved
        with `from_host` (numpy's on the CPU and the GPU, so both start alike; the recording
        backend's draws shapes only)."""
        ...

    # --- the codec -----------------------------------------------------------------------

    def quantize(
        self, x: object, blocksize: int, codebook: KernelCodebook, check_finite: bool = True
    ) -> tuple[Array, Array]:
        """(codes, absmax) of a float array of any shape, in row-major flat order. A non-finite
        value raises NonFiniteError naming its flat index."""
        ...

    def dequantize(self, q: Packed, dtype: OutputDtype, out: Array | None = None) -> Array:
        """`value(code) * absmax` in float32, rounded to `dtype`, shaped like q (into `out`
        when given: an array of q's size and `dtype`, C-contiguous)."""
        ...

    def dequantize_call(self, q: Packed) -> Callable[[str, Array | None], Array | None] | None:
        """A quicker `dequantize` of all of q for later calls, `call(dtype_name, out)`, which
        returns None for a call it does not take; None where the backend has none (yet)."""
        ...

    def gemv_call(self, w: Packed) -> Callable[[Array, Array | None], Array | None] | None:
        """The fused GEMV's per-token call for w, `call(x, out)`, which returns None for a
        call it does not take; None where the backend has none (yet: a checked GEMV
        prepares it)."""
        ...

    def double_quantize(self, absmax: Array) -> NestedAbsmax: ...

    def double_dequantize(self, nested: NestedAbsmax) -> Array:
        """The float32 scales of double-quantized ones."""
        ...

    # --- layer math (float32 on the CPU; the activation dtype on the GPU) -----------------

    def matmul(
        self,
        a: Array,
        b: Array,
        alpha: float = 1.0,
        out: Array | None = None,
        accumulate: bool = False,
        out_dtype: DTypeLike | None = None,
    ) -> Array:
        """`alpha * a @ b` for 2-D a, b (any strides), into `out` (or added to it when
        `accumulate`), summed in float32; a new array of `out_dtype` (default a's) without
        `out`."""
        ...

    def matmul_in_dtype(self, a: Array, b: Array) -> Array:
        """a @ b for 2-D a, b of one dtype (any strides), a new array of that dtype: on the
        GPU `matmul` (float32 sums); on the CPU float32 in the core, float64 in numpy, and
        16-bit operands multiplied in float32 and the product rounded."""
        ...

    def astype_pair(self, a: Array, b: Array, dtype: DTypeLike) -> tuple[Array, Array]:
        """a and b in `dtype` (each itself when it already is): a LoRA layer's A and B in the
        activations' dtype, made once per forward for it and its backward."""
        ...

    def batched_matmul(self, a: Array, b: Array) -> Array:
        """a @ b for 3-D a [n, m, k], b [n, k, p] of one dtype (any strides): a new [n, m, p]
        array of that dtype (16-bit ones summed in float32)."""
        ...

    def quantized_matmul(
        self,
        x: Array,
        w: Packed,
        transpose: bool = True,
        out: Array | None = None,
        accumulate: bool = False,
    ) -> Array:
        """`x @ W.T` (or `x @ W` when not `transpose`) for a 2-D quantized W [out, in] and a
        2-D x, never holding all of W dequantized at once in float32; into `out` (or added to
        it when `accumulate`)."""
        ...

    def dora_row_norms(self, w: Array | Packed, b: Array, a: Array, scaling: float) -> Array:
        """`||W + scaling * B @ A||` of each row of W [out, in] (dense, or quantized and
        dequantized a tile at a time)."""
        ...


def of(x: Any) -> Backend:
    """The backend of the device `x` lives on: `cuda` for CuPy arrays and any array in CUDA
    memory (`__cuda_array_interface__`, or a `__dlpack__` device that is CUDA), `cpu` for
    everything else. Importing CuPy happens only for CUDA arrays."""
    if isinstance(x, np.ndarray):
        return _cpu()
    if _on_cuda(x):
        return _cuda()
    recorded: Backend | None = getattr(x, "nybble_backend", None)  # the recording's arrays
    return recorded if recorded is not None else _cpu()


@overload
def get(device: Literal["cpu"]) -> CpuBackend: ...


@overload
def get(device: str) -> Backend: ...


def get(device: str) -> Backend:
    """The backend by name ("cpu" or "cuda"); the GPU one needs CuPy (ImportError naming
    the extra to install otherwise). The CPU one also converts the host-only layouts
    (`to_blocks36`, `from_blocks36`)."""
    if device == "cpu":
        return _cpu()
    if device == "cuda":
        override = _gpu_override.get()
        return override if override is not None else _cuda()
    raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")


#: What `get("cuda")` returns instead of the GPU's backend: set inside `record.recording`,
#: where code asking for the GPU gets the recording of a GPU run (nybble.memory's estimate of
#: the trainer's memory).
_gpu_override: ContextVar[Backend | None] = ContextVar("nybble_gpu_override", default=None)


def kernel_source(file: str) -> str:
    """The CUDA source `file` of kernels/ as the extension ships it (`_core.kernel_sources()`),
    or with `NYBBLE_KERNELS_DIR` set, the file in that directory: what `kernel_module`
    compiles (backends/cuda/kernels.source, the one look-up). Needs neither CuPy nor a GPU."""
    from .cuda import kernels

    return kernels.source(file)


def same(*arrays: Any) -> Backend:
    """The one backend of several arrays (None entries skipped), or ValueError naming the two
    devices when they differ."""
    found: Backend | None = None
    for a in arrays:
        if a is None:
            continue
        b = of(a)
        if found is not None and b.device != found.device:
            raise ValueError(f"arrays on different devices: {found.device} and {b.device}")
        found = b
    return found if found is not None else _cpu()


# --- the rules that differ by device, stated once (callers never compare device names) ----


def compute_dtype(backend: Backend, dtype: OutputDtype) -> np.dtype[Any]:
    """The dtype a layer's products run in on `backend` for activations returned in `dtype`:
    float32 on the CPU (every product in float32, rounded once at the end), `dtype` itself on
    the GPU (cuBLAS sums in float32)."""
    return np.dtype(np.float32) if backend.float32_products else numpy_dtype(dtype)


def checks_at_once(backend: Backend) -> bool:
    """Whether `backend`'s finite checks raise where they record (the CPU, where a scan costs
    no wait): a layer then scans its input itself, before any work; on the GPU it scans a
    product of the input instead, a few values a row (FiniteCheck.record's `row_stride`)."""
    return backend.device == "cpu"


_found: dict[str, Backend] = {}


def _cpu() -> Backend:
    found = _found.get("cpu")
    if found is None:
        from . import cpu

        found = _found["cpu"] = cpu.BACKEND
    return found


def _cuda() -> Backend:
    found = _found.get("cuda")
    if found is None:
        from . import cuda

        found = _found["cuda"] = cuda.backend()
    return found


#: DLPack device types of CUDA memory: kDLCUDA, kDLCUDAHost, kDLCUDAManaged.
_DLPACK_CUDA = (2, 3, 13)


def _on_cuda(x: Any) -> bool:
    package = type(x).__module__.split(".", 1)[0]
    if package == "cupy":
        return True
    if package == "torch":  # without touching __cuda_array_interface__, which raises for bf16
        return bool(getattr(x, "is_cuda", False))
    try:
        if hasattr(x, "__cuda_array_interface__"):
            return True
    except Exception:  # torch raises KeyError (bfloat16) or RuntimeError (requires_grad) there
        pass
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return int(device()[0]) in _DLPACK_CUDA
    except Exception:
        return False


__all__ = [
    "DEVICES",
    "Array",
    "Backend",
    "Codebook",
    "Device",
    "FiniteCheck",
    "FloatDtype",
    "Graph",
    "Kernel",
    "KernelModule",
    "Random",
    "checks_at_once",
    "compute_dtype",
    "get",
    "kernel_source",
    "of",
    "same",
]
