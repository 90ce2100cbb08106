"""The device implementations of nybble's torch ops (declared in `_ops`): one body per op,
written once over nybble's backend seam (nybble.backends), run on torch tensors seen as that
backend's arrays without a copy:

- the CPU: numpy views of the tensors (`Tensor.numpy()`), the work done by the Rust core
  (nybble.backends.cpu: SIMD dequantize, tiled products with a quantized weight, GEMM);
- CUDA, 16-bit activations (float16, bfloat16): `_fastpath`, nybble's kernels launched
  through the core's launcher with torch tensors' addresses on torch's current stream, every
  dense product made by torch itself (no CuPy on the per-call path);
- CUDA otherwise (float32, float64, weights whose arrays are not contiguous and aligned):
  CuPy views of the tensors' memory, the work done by kernels/nf4.cu and cuBLAS, launched on
  torch's current stream (CuPy's current stream is set to it), with every temporary the
  backend allocates taken from torch's caching allocator on that stream.

Either way nothing waits for the device, a CUDA graph that torch captures holds nybble's
launches, and its allocations come from the graph's pool like torch's own.

The outputs are torch tensors the op allocates and hands to the backend as `out`. Dtypes: the
CPU multiplies in float32 (16-bit activations are widened for the product and the result
rounded once, as nybble.lora does); CUDA multiplies in the activations' dtype with float32
sums; float64 (gradient checks) runs on either device in float64 over float32 weight tiles,
which are exact in float64, never the whole weight at once.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import backends, formats
from ..formats import BFLOAT16, Codebook, NestedAbsmax, Packed
from . import _fastpath

#: Bytes of float32 weight a float64 product dequantizes at a time.
TILE_BYTES = 16 << 20


@dataclass(frozen=True)
class Weight:
    """A quantized weight W [out, in] as the ops take it: nybble's packing (element 2k in the
    low nibble) and either plain float32 scales or double-quantized ones."""

    codes: torch.Tensor  # uint8 [ceil(n / 2)]
    absmax: torch.Tensor  # float32 [nblocks], or uint8 [nblocks] under double quantization
    absmax2: torch.Tensor | None  # float32 [ceil(nblocks / 256)] under double quantization
    offset: float
    shape: tuple[int, int]
    blocksize: int
    codebook: Codebook

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]


# --- the devices -------------------------------------------------------------------------------


class Device:
    """How one device's tensors reach nybble's backend: views, a context to run in, and the
    weight as the backend's `Packed`."""

    backend: backends.Backend
    #: The dtype the backend multiplies activations of `dtype` in.
    compute: Callable[[torch.dtype], torch.dtype]

    def view(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def packed(self, w: Weight) -> Packed:
        raise NotImplementedError

    @contextmanager
    def running(self, device: torch.device) -> Iterator[None]:
        yield


def _cpu_compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _cuda_compute(dtype: torch.dtype) -> torch.dtype:
    return dtype


class Cpu(Device):
    """numpy views; the Rust core's products are float32."""

    compute = staticmethod(_cpu_compute)

    def __init__(self) -> None:
        self.backend = backends.get("cpu")

    def view(self, t: torch.Tensor) -> Any:
        # Through DLPack rather than Tensor.numpy(), which marks the tensor's storage as not
        # resizable for good: FSDP2 frees and re-allocates its gathered parameters' storage
        # between steps (resize_), and the ops here see those parameters.
        t = t.detach()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, seen as ml_dtypes'
            return np.from_dlpack(t.view(torch.int16)).view(BFLOAT16)
        return np.from_dlpack(t)

    def packed(self, w: Weight) -> Packed:
        nested = None
        absmax = self.view(w.absmax)
        if w.absmax2 is not None:
            nested = NestedAbsmax(absmax, self.view(w.absmax2), w.offset)
            absmax = None
        return Packed(self.view(w.codes), absmax, nested, w.shape, w.blocksize, w.codebook)


class Cuda(Device):
    """CuPy views over torch's memory, on torch's current stream, temporaries from torch's
    caching allocator. Weights seen once are kept by their addresses (see `packed`)."""

    compute = staticmethod(_cuda_compute)

    #: Weights kept prepared, most recently used last.
    MAX_WEIGHTS = 4096

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self.backend = backends.get("cuda")
        self._streams: dict[tuple[int, int], Any] = {}
        self._allocators: dict[int, Callable[[int], Any]] = {}
        self._weights: OrderedDict[tuple[Any, ...], Packed] = OrderedDict()
        self._lock = threading.Lock()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_stream: Callable[[int], int] = (
            raw if raw is not None else lambda d: torch.cuda.current_stream(d).cuda_stream
        )

    def view(self, t: torch.Tensor) -> Any:
        from ..backends.cuda.arrays import as_cupy

        return as_cupy(t.detach(), "tensor")  # torch's stream is CuPy's here: no copy

    @contextmanager
    def running(self, device: torch.device) -> Iterator[None]:
        cp = self.cp
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = int(self._raw_stream(index))
        stream = self._streams.get((index, handle))
        if stream is None:  # handle 0: the legacy default stream, CuPy's null stream too
            made = cp.cuda.Stream.null if handle == 0 else _external_stream(cp, handle, index)
            stream = self._streams[(index, handle)] = made
        allocate = self._allocators.get(index)
        if allocate is None:
            allocate = self._allocators[index] = _torch_allocator(cp, index)
        with cp.cuda.Device(index), stream, cp.cuda.using_allocator(allocate):
            yield

    def packed(self, w: Weight) -> Packed:
        """The weight's Packed over views of its memory that do not hold the tensors (so that
        this cache never keeps a model alive), kept by the tensors' addresses and the format:
        the backend prepares a weight's launches once per Packed (checks, argument buffers),
        which a 1-token GEMV cannot afford per call. What it prepares is addresses and the
        format, never values, so a cached entry is right for any tensors at those addresses
        with that format, and the cache is bounded (MAX_WEIGHTS, least recently used out)."""
        tensors = (w.codes, w.absmax, w.absmax2)
        if not all(t is None or t.is_contiguous() for t in tensors):
            return self._packed(w, keep=False)
        key = (
            *(None if t is None else (t.data_ptr(), t.dtype, t.numel()) for t in tensors),
            w.offset,
            w.shape,
            w.blocksize,
            w.codebook,
            w.codes.device.index,
        )
        with self._lock:
            found = self._weights.get(key)
            if found is not None:
                self._weights.move_to_end(key)
                return found
        made = self._packed(w, keep=True)
        with self._lock:
            self._weights[key] = made
            while len(self._weights) > self.MAX_WEIGHTS:
                self._weights.popitem(last=False)
        return made

    def _packed(self, w: Weight, keep: bool) -> Packed:
        def view(t: torch.Tensor) -> Any:
            if not keep:
                return self.view(t.contiguous())
            cp = self.cp
            dtype = np.dtype(str(t.dtype).removeprefix("torch."))
            memory = cp.cuda.UnownedMemory(
                t.data_ptr(), t.numel() * t.element_size(), None, t.device.index
            )
            return cp.ndarray((t.numel(),), dtype, cp.cuda.MemoryPointer(memory, 0))

        nested = None
        absmax = view(w.absmax)
        if w.absmax2 is not None:
            nested = NestedAbsmax(absmax, view(w.absmax2), w.offset)
            absmax = None
        return Packed(view(w.codes), absmax, nested, w.shape, w.blocksize, w.codebook)


class _StreamHandle:
    """A stream handle in the CUDA stream protocol (`__cuda_stream__`: version, handle)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _external_stream(cp: Any, handle: int, index: int) -> Any:
    """CuPy's view of torch's stream `handle` on device `index` (made once per stream): CuPy
    14 deprecates `ExternalStream` for `Stream.from_external`, which earlier versions lack."""
    external = getattr(cp.cuda, "ExternalStream", None)
    if external is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return external(handle, index)
    return cp.cuda.Stream.from_external(_StreamHandle(handle))


def _torch_allocator(cp: Any, index: int) -> Callable[[int], Any]:
    """A CuPy allocator that takes memory from torch's caching allocator on torch's current
    stream (CuPy's too, inside `Cuda.running`): a block goes back to torch when CuPy drops the
    array, and inside a CUDA graph capture torch serves it from the graph's private pool."""
    device = torch.device("cuda", index)

    def allocate(size: int) -> Any:
        block = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        memory = cp.cuda.UnownedMemory(block.data_ptr(), size, block, index)
        return cp.cuda.MemoryPointer(memory, 0)

    return allocate


_devices: dict[str, Device] = {}


def device_of(t: torch.Tensor) -> Device:
    found = _devices.get(t.device.type)
    if found is None:
        if t.device.type == "cpu":
            found = Cpu()
        elif t.device.type == "cuda":
            found = Cuda()
        else:
            raise ValueError(f"nybble's ops run on the CPU and CUDA, not {t.device.type}")
        _devices[t.device.type] = found
    return found


# --- shared pieces -----------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., k] as a 2-D [m, k] tensor (a view where the strides allow)."""
    return x.reshape(-1, x.shape[-1])


def _operand(dev: Device, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """x as the 2-D tensor the backend multiplies (in the device's compute dtype: a copy only
    where x has another dtype) and its array view."""
    x2 = _rows(x)
    compute = dev.compute(x.dtype)
    if x2.dtype != compute:
        x2 = x2.to(compute)
    return x2, dev.view(x2)


def _dense_rows(dev: Device, w: Packed, r0: int, r1: int) -> Any:
    """Rows [r0, r1) of W dequantized to float32: the blocks covering them dequantized, then
    the rows sliced out (a block can straddle rows)."""
    cols, bs = w.shape[1], w.blocksize
    start, stop = r0 * cols, r1 * cols
    b0, b1 = start // bs, -(-stop // bs)
    e0, e1 = b0 * bs, min(b1 * bs, w.size)  # e0 is a multiple of bs, so of 2
    backend = dev.backend
    scales: Any = w.absmax if w.nested is None else backend.double_dequantize(w.nested)
    part = Packed(w.codes[e0 // 2 : -(-e1 // 2)], scales[b0:b1], None, (e1 - e0,), bs, w.codebook)
    flat = backend.dequantize(part, "float32")
    return flat[start - e0 : stop - e0].reshape(r1 - r0, cols)


def _tiles(w: Packed) -> list[tuple[int, int]]:
    rows, cols = w.shape
    step = max(1, TILE_BYTES // max(4 * cols, 1))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def base_product(
    dev: Device, x: Any, w: Packed, transpose: bool, out: Any, accumulate: bool = False
) -> None:
    """out (+)= x @ W.T (or x @ W when not `transpose`), never all of W dequantized at once."""
    if x.dtype != np.float64:
        dev.backend.quantized_matmul(x, w, transpose, out, accumulate)
        return
    xp = dev.backend.xp
    if not accumulate:
        out[...] = 0
    for r0, r1 in _tiles(w):
        tile = _dense_rows(dev, w, r0, r1).astype(np.float64)
        if transpose:
            out[:, r0:r1] += xp.matmul(x, tile.T)
        else:
            out += xp.matmul(x[:, r0:r1], tile)


def _product(dev: Device, a: Any, b: Any, out: Any, alpha: float = 1.0, add: bool = False) -> None:
    """out (+)= alpha * a @ b for 2-D arrays of one dtype (out may be float32 for 16-bit a, b)."""
    if a.dtype == np.float64:
        r = dev.backend.xp.matmul(a, b)
        if alpha != 1.0:
            r *= alpha
        if add:
            out += r
        else:
            out[...] = r
        return
    dev.backend.matmul(a, b, alpha=alpha, out=out, accumulate=add)


def _lora_pair(
    dev: Device, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype
) -> tuple[Any, Any]:
    """The adapter's A and B as arrays of the compute dtype (cast once per call)."""
    va, vb = dev.view(a), dev.view(b)
    if a.dtype == dtype and b.dtype == dtype:
        return va, vb
    return dev.backend.astype_pair(va, vb, _numpy_dtype(dtype))


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    return formats.numpy_dtype(str(dtype).removeprefix("torch."))


def _product_into(dev: Device, a: Any, b: Any, out: Any, alpha: float = 1.0) -> None:
    """out = alpha * a @ b where out may have another dtype than a and b (an adapter's
    gradient in its parameters' dtype): cuBLAS writes any float dtype from 16-bit or float32
    operands; otherwise the product is made in the operands' dtype and then assigned."""
    cublas = dev.backend.device == "cuda" and np.float64 not in (a.dtype, out.dtype)
    if out.dtype == a.dtype or cublas:
        _product(dev, a, b, out, alpha)
        return
    tmp = dev.backend.xp.empty(out.shape, a.dtype)
    _product(dev, a, b, tmp, alpha)
    out[...] = tmp


def _finish(y: torch.Tensor, dtype: torch.dtype, lead: tuple[int, ...]) -> torch.Tensor:
    """The result in the activations' dtype and leading shape."""
    y = y.reshape(*lead, y.shape[-1])
    return y if y.dtype == dtype else y.to(dtype)


# --- the ops -----------------------------------------------------------------------------------


def quantize(x: torch.Tensor, blocksize: int, codebook: str) -> tuple[torch.Tensor, torch.Tensor]:
    dev = device_of(x)
    with dev.running(x.device):
        codes, absmax = dev.backend.quantize(
            dev.view(x), blocksize, formats.check_codebook(codebook)
        )
        if x.device.type == "cpu":
            return torch.from_numpy(codes), torch.from_numpy(absmax)
        take = torch.utils.dlpack.from_dlpack
        return take(codes), take(absmax)  # CuPy's arrays in torch's memory, one stream


def dequantize(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    if w.codes.is_cuda:
        fast = _fastpath.prepared(w)
        if fast is not None:
            return _fastpath.dequantize(fast, dtype)
    dev = device_of(w.codes)
    out = torch.empty(w.shape, dtype=dtype, device=w.codes.device)
    with dev.running(out.device):
        name = formats.output_dtype(str(dtype).removeprefix("torch."))
        dev.backend.dequantize(dev.packed(w), name, dev.view(out))
    return out


def matmul(x: torch.Tensor, w: Weight, transpose: bool) -> torch.Tensor:
    """x @ W.T ([..., in] -> [..., out]) or, not `transpose`, x @ W ([..., out] -> [..., in])."""
    if x.is_cuda and x.dtype in _fastpath.HALF:
        fast = _fastpath.prepared(w)
        if fast is not None:
            y = _fastpath.matmul(fast, x, transpose)
            if y is not None:
                return y
    dev = device_of(x)
    width = w.rows if transpose else w.cols
    lead = tuple(x.shape[:-1])
    with dev.running(x.device):
        x2, xa = _operand(dev, x)
        y = torch.empty((x2.shape[0], width), dtype=x2.dtype, device=x.device)
        base_product(dev, xa, dev.packed(w), transpose, dev.view(y))
    return _finish(y, x.dtype, lead)


def qlora_linear(
    x: torch.Tensor,
    keep: torch.Tensor | None,
    w: Weight,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """y = x Wᵀ + s·(x ⊙ keep) Aᵀ Bᵀ (+ bias): s·h·Bᵀ first, then the base product adds itself
    to it inside its GEMM (nybble.lora's order; `_fastpath` adds the adapter's product to
    the base product's instead)."""
    if x.is_cuda and x.dtype in _fastpath.HALF:
        fast = _fastpath.prepared(w)
        if fast is not None:
            y = _fastpath.qlora_linear(fast, x, keep, lora_a, lora_b, scaling, bias)
            if y is not None:
                return y
    dev = device_of(x)
    lead = tuple(x.shape[:-1])
    with dev.running(x.device):
        x2, xa = _operand(dev, x)
        xd = xa if keep is None else xa * _operand(dev, keep)[1]
        a, b = _lora_pair(dev, lora_a, lora_b, x2.dtype)
        m = x2.shape[0]
        h = dev.backend.xp.empty((m, a.shape[0]), xa.dtype)
        _product(dev, xd, a.T, h)
        y = torch.empty((m, w.rows), dtype=x2.dtype, device=x.device)
        ya = dev.view(y)
        _product(dev, h, b.T, ya, alpha=scaling)
        base_product(dev, xa, dev.packed(w), True, ya, accumulate=True)
    if bias is not None:
        y += bias.to(y.dtype)
    return _finish(y, x.dtype, lead)


def qlora_linear_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    keep: torch.Tensor | None,
    w: Weight,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dx, dL/dA, dL/dB) of `qlora_linear`: h = (x ⊙ keep) Aᵀ recomputed ([m, r], cheap),
    dB = s·dyᵀh, dh = s·dy B, dA = dhᵀ(x ⊙ keep), dx = (dh A) ⊙ keep + dy W, the last inside
    the base product's GEMM. A and B's gradients are float32 sums in their own dtype."""
    if x.is_cuda and x.dtype in _fastpath.HALF:
        fast = _fastpath.prepared(w)
        if fast is not None:
            grads = _fastpath.qlora_linear_backward(fast, grad_y, x, keep, lora_a, lora_b, scaling)
            if grads is not None:
                return grads
    dev = device_of(x)
    lead = tuple(x.shape[:-1])
    with dev.running(x.device):
        x2, xa = _operand(dev, x)
        dy2 = _rows(grad_y)
        if dy2.dtype != x2.dtype:
            dy2 = dy2.to(x2.dtype)
        dy = dev.view(dy2)
        ka = None if keep is None else _operand(dev, keep)[1]
        xd = xa if ka is None else xa * ka
        a, b = _lora_pair(dev, lora_a, lora_b, x2.dtype)
        xp = dev.backend.xp
        m, r = x2.shape[0], a.shape[0]
        h = xp.empty((m, r), xa.dtype)
        _product(dev, xd, a.T, h)
        grad_b = torch.empty(lora_b.shape, dtype=lora_b.dtype, device=x.device)
        grad_a = torch.empty(lora_a.shape, dtype=lora_a.dtype, device=x.device)
        _product_into(dev, dy.T, h, dev.view(grad_b), alpha=scaling)
        gh = xp.empty((m, r), xa.dtype)
        _product(dev, dy, b, gh, alpha=scaling)
        _product_into(dev, gh.T, xd, dev.view(grad_a))
        dx = torch.empty((m, w.cols), dtype=x2.dtype, device=x.device)
        dxa = dev.view(dx)
        _product(dev, gh, a, dxa)
        if ka is not None:
            dxa *= ka
        base_product(dev, dy, dev.packed(w), False, dxa, accumulate=True)
    return _finish(dx, x.dtype, lead), grad_a, grad_b


__all__ = [
    "TILE_BYTES",
    "Cpu",
    "Cuda",
    "Device",
    "Weight",
    "base_product",
    "dequantize",
    "device_of",
    "matmul",
    "qlora_linear",
    "qlora_linear_backward",
    "quantize",
]
