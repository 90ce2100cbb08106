"""The CUDA route of nybble's torch ops for 16-bit activations (float16, bfloat16): nothing
but torch and the core's launcher on the per-call path.

The backend route of `_kernels` (CuPy views of torch's memory, CuPy's device, stream and
allocator entered per call, then the backend's checks and GEMMs) spends 100+ us of host time
on a call whose GPU work is a few us (a decode step's GEMV). Here a call

- launches nybble's kernels through `_core.KernelLaunch`, the core's prepared launch (the
  argument slots held in Rust, the driver called with the GIL released): the dequantize
  kernel into a buffer of torch's allocator, and the fused GEMV for 1..GEMV_MAX_TOKENS rows,
  given torch tensors' addresses and torch's current stream;
- makes every dense product with torch (`mm`, `addmm_`, `mm` with `out_dtype=float32`), in
  the activations' dtype with float32 sums (cuBLAS's default), so that torch's allocator,
  streams, CUDA graphs and torch.compile see ordinary torch ops.

What a weight's launches need is prepared once (`FastWeight`: the backend's checked arrays
of the weight and its compiled module, the kernels' handles, grids and argument slots) and
kept by the weight's addresses and format, as `_kernels.Cuda.packed` keeps its views: a
launch holds addresses and the format, never values nor the tensors, so an entry is right
for any tensors at those addresses with that format. float32 and float64 activations,
weights whose arrays are not contiguous and 16-byte aligned, and empty inputs take the
backend route of `_kernels`.

Host time of a call, as reasoned on an H100 host (a torch op's dispatch 3-8 us, a PyO3 call
and the driver's launch 2-3 us, a C attribute read 0.1 us):
- `Linear4bit` at 1 row, eager without autograd (`linear`, no op dispatch): the layer's
  checks ~2 us, `torch.empty` ~2 us, the GEMV's launch ~3 us: ~8 us (was 131 us).
- the QLoRA backward at any size: the op's dispatch and checks ~15 us, then two casts of the
  adapter, five GEMMs and a scaling by torch (~8 ops, ~45 us), the dequantize launch ~3 us:
  ~65 us (was 713 us).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.autograd.profiler as _profiler

from .. import _core

if TYPE_CHECKING:
    from ._kernels import Weight

#: The activation dtypes this route multiplies.
HALF = (torch.float16, torch.bfloat16)
#: The float dtypes nybble's torch ops take for activations, adapters and masks (`_ops` checks
#: them by this tuple, in this order; `fits` asks the same).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: The dequantize kernel's output dtypes: (kernel suffix, launch facts' name).
_DEQUANT = {
    torch.float32: ("f32", "float32"),
    torch.float16: ("f16", "float16"),
    torch.bfloat16: ("bf16", "bfloat16"),
}
#: Where the arguments a call sets sit in the kernels' parameter lists (kernels/nf4.cu): the
#: dequantize kernel's output; the tensor-core GEMV's tokens and output.
_DEQUANT_OUT = 11
_GEMV_X, _GEMV_Y = 0, 13
#: Weights kept prepared, most recently used last (as `_kernels.Cuda.MAX_WEIGHTS`).
MAX_WEIGHTS = 4096

#: torch's GEMM with a float32 result from 16-bit operands (torch >= 2.8), else None.
_MM_FLOAT = getattr(torch.ops.aten.mm, "dtype", None)


def _fallback_stream(index: int) -> int:
    return int(torch.cuda.current_stream(index).cuda_stream)


#: The handle of torch's current stream on a device (the raw query where torch has it: a
#: tenth of a microsecond, against several for a `torch.cuda.Stream` object).
_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", _fallback_stream)
_current_device: Callable[[], int] = getattr(
    torch._C, "_cuda_getDevice", lambda: torch.cuda.current_device()
)

# --- where a call may launch -------------------------------------------------------------------

#: Per thread: the devices whose context this thread has made current (`_bind`).
_local = threading.local()


def _bind(index: int) -> None:
    """Makes device `index`'s context current on this thread (its current device already):
    the driver launches in the thread's current context, which the runtime makes current only
    at a thread's first runtime call that needs one (an autograd worker may not have made one
    yet)."""
    bound = getattr(_local, "bound", None)
    if bound is None:
        bound = _local.bound = set()
    if index not in bound:
        import cupy

        cupy.cuda.runtime.setDevice(index)  # cudaSetDevice: the primary context, current
        bound.add(index)


def _run(index: int, dtype: torch.dtype | None, body: Callable[..., Any], *args: Any) -> Any:
    """body(*args) where its launches and torch's ops go to device `index`: at once when that
    is the current device and this thread launched there before, and autocast (which would
    recast the body's 16-bit products) is off or casts to `dtype`; otherwise inside the guards
    that make it so."""
    bound = getattr(_local, "bound", None)
    if (
        bound is not None
        and index in bound
        and _current_device() == index
        and (dtype is None or not _autocast_other(dtype))
    ):
        return body(*args)
    with ExitStack() as stack:
        if _current_device() != index:
            stack.enter_context(torch.cuda.device(index))
        _bind(index)
        if dtype is not None and torch.is_autocast_enabled("cuda"):
            stack.enter_context(torch.autocast("cuda", enabled=False))
        return body(*args)


def _autocast_other(dtype: torch.dtype) -> bool:
    """Whether CUDA autocast is on with a dtype other than `dtype`."""
    return torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") != dtype


def eager(x: torch.Tensor) -> bool:
    """Whether a layer may run this route itself rather than through nybble's ops, autograd
    following through `QLoraLinear` / `Matmul` (the caller checks
    `torch.compiler.is_compiling()` first): a plain 16-bit CUDA tensor with rows, with nothing
    watching torch's ops (no torch function or dispatch mode, functorch transform, profiler or
    JIT trace). There the ops would only add their dispatch: a custom op's Python autograd
    wrapper costs ~400 us of host time per call (torch 2.11, H100 host), more than a QLoRA
    layer's whole GPU work at a decode step, and a training step is host-bound."""
    return (
        type(x) is torch.Tensor
        and x.is_cuda
        and x.dtype in HALF
        and x.numel() > 0
        and not torch._C._is_torch_function_mode_enabled()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._are_functorch_transforms_active()
        and not _profiler._is_profiler_enabled
        and torch._C._get_tracing_state() is None
    )


# --- a weight's launches -----------------------------------------------------------------------


def _slots(args: tuple[Any, ...]) -> list[int]:
    """A kernel's arguments as `_core.KernelLaunch` slots: a CuPy array's address, a numpy
    scalar's bytes (little-endian, in the slot's low bytes), as
    `backends.cuda.kernels.PreparedLaunch.call_setting` makes them."""
    slots = []
    for a in args:
        if isinstance(a, np.generic):
            slots.append(int.from_bytes(a.tobytes().ljust(8, b"\0"), "little"))
        else:
            slots.append(int(a.data.ptr))
    return slots


class FastWeight:
    """One quantized weight W [rows, cols] on CUDA device `index`, its launches made once
    over the backend's checked arrays (`prepared`, the backend's `Prepared` of the `Packed`
    in `keep`): the dequantize kernel over all of W by output dtype, and the fused GEMV by
    token dtype and count. A call gives addresses and torch's current stream."""

    def __init__(
        self,
        keep: Any,
        prepared: Any,
        shape: tuple[int, int],
        index: int,
        max_tokens: int,
        cupy: Any,
    ) -> None:
        self.rows, self.cols = shape
        self.index = index
        self.device = torch.device("cuda", index)
        self._keep = keep  # the Packed that `prepared` was made for (the backend keeps it by id)
        self._prepared = prepared
        self._cupy = cupy
        #: The backend's GEMV weight, None where the fused GEMV does not take W.
        self.gemv_weight: Any = None
        self.max_tokens = 0
        if len(shape) == 2 and shape[1] % 32 == 0:
            try:
                self.gemv_weight = prepared.gemv()
                self.max_tokens = max_tokens
            except ValueError:  # e.g. 2^37 weights or more
                self.gemv_weight = None
        self._dequant: dict[torch.dtype, Any] = {}
        self._gemv: dict[tuple[torch.dtype, int], Any] = {}

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [rows, cols] as `dtype` in a new tensor of torch's allocator, launched on torch's
        current stream."""
        launch = self._dequant.get(dtype)
        if launch is None:
            launch = self.dequantize_launch(dtype)
        out = torch.empty((self.rows, self.cols), dtype=dtype, device=self.device)
        launch(_stream(self.index), out.data_ptr())
        return out

    def gemv(self, x: torch.Tensor, m: int, shape: Any) -> torch.Tensor:
        """x @ W.T by the fused GEMV for x holding m rows of `cols` elements (1 <= m <=
        max_tokens, 16-bit) into a new tensor of `shape` (m * rows elements)."""
        dtype = x.dtype
        launch = self._gemv.get((dtype, m))
        if launch is None:
            launch = self._gemv_launch(dtype, m)
        if not x.is_contiguous() or x.data_ptr() % 16:  # the kernel reads 16 bytes at a time
            x = x.clone(memory_format=torch.contiguous_format)
        y = torch.empty(shape, dtype=dtype, device=self.device)
        launch(_stream(self.index), x.data_ptr(), y.data_ptr())
        return y

    def dequantize_launch(self, dtype: torch.dtype) -> Any:
        """The dequantize kernel over all of W into `dtype` (the launch of the backend's
        `DequantizeWeight.whole`): a call sets the output's address."""
        suffix, name = _DEQUANT[dtype]
        weight = self._prepared.dequantize
        with self._cupy.cuda.Device(self.index):
            module = weight.module
            kernel = module.function(f"dequant4_split_{suffix}")
            total = self.rows * self.cols
            args = (
                weight.codes,
                *weight.scales,
                weight.values,
                np.int64(0),  # start
                np.int64(total),
                weight.log2_bs,
                weight.codes,  # the output, set per call
            )
            grid = -(-total // module.facts.dequant_per_block(name))
            launch = _core.KernelLaunch(
                int(kernel.ptr), grid, module.facts.threads, 0, _slots(args), [_DEQUANT_OUT], False
            )
        self._dequant[dtype] = launch
        return launch

    def _gemv_launch(self, dtype: torch.dtype, m: int) -> Any:
        """The tensor-core GEMV for m tokens of `dtype` (the launch of the backend's
        `GemvWeight`, programmatic where it is): a call sets the tokens' and output's
        addresses."""
        weight = self.gemv_weight
        name = _DEQUANT[dtype][1]
        with self._cupy.cuda.Device(self.index):
            kernel = weight.module.function(weight.tc_names[name], weight.smem)
            args = (
                weight.codes,  # x, set per call
                weight.codes,
                *weight.scales,
                weight.values,
                *weight.dims,
                np.int32(m),
                weight.log2_bs,
                weight.codes,  # y, set per call
            )
            launch = _core.KernelLaunch(
                int(kernel.ptr),
                weight.tc_blocks(kernel),
                weight.module.facts.tc_threads,
                weight.smem,
                _slots(args),
                [_GEMV_X, _GEMV_Y],
                bool(weight.programmatic),
            )
        self._gemv[(dtype, m)] = launch
        return launch


_weights: OrderedDict[tuple[Any, ...], FastWeight] = OrderedDict()
_lock = threading.Lock()
#: Set once the core turns out unable to launch (no KernelLaunch on this platform, or no
#: driver library): every call then takes the backend route.
_unavailable = False


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def prepared(w: Weight) -> FastWeight | None:
    """The launches of a checked CUDA weight, made the first time its addresses and format
    are seen; None where this route does not take it (the backend route then does)."""
    if _unavailable:
        return None
    codes, absmax, absmax2 = w.codes, w.absmax, w.absmax2
    if (
        w.shape[0] * w.shape[1] == 0
        or not _aligned(codes)
        or not _aligned(absmax)
        or (absmax2 is not None and not _aligned(absmax2))
    ):
        return None
    key = (
        codes.data_ptr(),
        codes.numel(),
        absmax.data_ptr(),
        absmax.dtype,
        absmax.numel(),
        None if absmax2 is None else (absmax2.data_ptr(), absmax2.numel()),
        w.offset,
        w.shape,
        w.blocksize,
        w.codebook,
        codes.get_device(),
    )
    found = _weights.get(key)
    if found is not None:
        try:
            _weights.move_to_end(key)
        except KeyError:  # another thread's insertion pushed it out meanwhile
            pass
        return found
    return _prepare(w, key)


def _prepare(w: Weight, key: tuple[Any, ...]) -> FastWeight | None:
    global _unavailable
    if not hasattr(_core, "KernelLaunch"):  # no dlopen on this platform
        _unavailable = True
        return None
    from ..cuda import GEMV_MAX_TOKENS
    from . import _kernels

    dev: Any = _kernels.device_of(w.codes)  # the Cuda device: its backend's Prepared
    index = w.codes.get_device()
    with dev.running(w.codes.device):
        packed = dev.packed(w)  # views of the weight's memory that do not hold it
        prepared = dev.backend.prepared(packed)  # checked once, kept while packed lives
        made = FastWeight(packed, prepared, w.shape, index, GEMV_MAX_TOKENS, dev.cp)
        try:
            made.dequantize_launch(torch.bfloat16)  # the core's launcher, tried once
        except RuntimeError:  # the driver library does not load
            _unavailable = True
            return None
    with _lock:
        _weights[key] = made
        while len(_weights) > MAX_WEIGHTS:
            _weights.popitem(last=False)
    return made


# --- the ops' bodies ---------------------------------------------------------------------------
# Each takes a prepared weight and the op's checked arguments, and returns None where the
# backend route must take the call (no rows).


def _base(fw: FastWeight, x2: torch.Tensor) -> torch.Tensor:
    """x2 [m, cols] @ W.T -> a new [m, rows]: the fused GEMV for up to max_tokens rows,
    otherwise W dequantized whole in x2's dtype (a temporary of torch's allocator) and
    torch's GEMM."""
    m = x2.shape[0]
    if m <= fw.max_tokens:
        return fw.gemv(x2, m, (m, fw.rows))
    return torch.mm(x2, fw.dequantize(x2.dtype).t())


def _product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, alpha: float = 1.0) -> Any:
    """alpha * a @ b as a new tensor of `dtype` (an adapter's gradient in its parameters'
    dtype), summed in float32: in the operands' dtype; as float32 straight from cuBLAS
    (torch's mm with out_dtype); other dtypes from the float32 result."""
    if dtype == a.dtype:
        if alpha == 1.0:
            return torch.mm(a, b)
        out = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
        return out.addmm_(a, b, beta=0, alpha=alpha)  # beta 0: out's contents are not read
    r = _MM_FLOAT(a, b, torch.float32) if _MM_FLOAT is not None else torch.mm(a, b).float()
    if alpha != 1.0:
        r.mul_(alpha)
    return r if dtype == torch.float32 else r.to(dtype)


def dequantize(fw: FastWeight, dtype: torch.dtype) -> torch.Tensor:
    result: torch.Tensor = _run(fw.index, None, fw.dequantize, dtype)
    return result


def linear(fw: FastWeight, x: torch.Tensor) -> torch.Tensor | None:
    """x [..., cols] @ W.T for `Linear4bit`'s own calls (`eager(x)`, autograd not following x):
    None where the op must take x (for its checks' message, or no rows)."""
    if x.dim() == 0 or x.shape[-1] != fw.cols or x.get_device() != fw.index or x.numel() == 0:
        return None
    result: torch.Tensor = _run(fw.index, x.dtype, _linear, fw, x)
    return result


def _linear(fw: FastWeight, x: torch.Tensor) -> torch.Tensor:
    cols = fw.cols
    m = x.numel() // cols
    if m <= fw.max_tokens:  # no view of x to make: the GEMV reads its rows in place
        return fw.gemv(x, m, (*x.shape[:-1], fw.rows))
    return torch.matmul(x, fw.dequantize(x.dtype).t())


def matmul(fw: FastWeight, x: torch.Tensor, transpose: bool) -> torch.Tensor | None:
    """x @ W.T ([..., cols] -> [..., rows]) or, not `transpose`, x @ W."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return None
    result: torch.Tensor = _run(fw.index, x.dtype, _matmul, fw, x, x2, transpose)
    return result


def _matmul(fw: FastWeight, x: torch.Tensor, x2: torch.Tensor, transpose: bool) -> torch.Tensor:
    if transpose:
        return _base(fw, x2).view(*x.shape[:-1], fw.rows)
    return torch.mm(x2, fw.dequantize(x.dtype)).view(*x.shape[:-1], fw.cols)


def _keep_rows(keep: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    k = keep.reshape(-1, cols)
    return k if k.dtype == dtype else k.to(dtype)


def _adapter(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def qlora_linear(
    fw: FastWeight,
    x: torch.Tensor,
    keep: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """y = x Wᵀ (+ bias) + s·(x ⊙ keep) Aᵀ Bᵀ: the base product first (the bias in its GEMM
    where W is dequantized), then the adapter's product added to it by its GEMM."""
    x2 = x.reshape(-1, fw.cols)
    if x2.shape[0] == 0:
        return None
    args = (fw, x, x2, keep, lora_a, lora_b, scaling, bias)
    result: torch.Tensor = _run(fw.index, x.dtype, _qlora_linear, *args)
    return result


def _qlora_linear(
    fw: FastWeight,
    x: torch.Tensor,
    x2: torch.Tensor,
    keep: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    dtype = x.dtype
    a, b = _adapter(lora_a, dtype), _adapter(lora_b, dtype)
    xd = x2 if keep is None else x2 * _keep_rows(keep, fw.cols, dtype)
    h = torch.mm(xd, a.t())  # [m, r]
    m = x2.shape[0]
    if m <= fw.max_tokens:
        y = fw.gemv(x2, m, (m, fw.rows))
        if bias is not None:
            y.add_(_adapter(bias, dtype))
    else:
        wt = fw.dequantize(dtype).t()
        if bias is not None:
            y = torch.addmm(_adapter(bias, dtype), x2, wt)
        else:
            y = torch.mm(x2, wt)
        del wt
    y.addmm_(h, b.t(), alpha=scaling)
    return y.view(*x.shape[:-1], fw.rows)


def qlora_linear_backward(
    fw: FastWeight,
    grad_y: torch.Tensor,
    x: torch.Tensor,
    keep: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(dx, dA, dB) of `qlora_linear`: h = (x ⊙ keep) Aᵀ recomputed, dB = s·dyᵀh,
    dh = s·dy B, dA = dhᵀ(x ⊙ keep), dx = (dh A) ⊙ keep + dy W (W dequantized, its GEMM
    adding to dx); A and B's gradients in their own dtype, summed in float32."""
    x2 = x.reshape(-1, fw.cols)
    if x2.shape[0] == 0:
        return None
    args = (fw, grad_y, x, x2, keep, lora_a, lora_b, scaling)
    result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _run(
        fw.index, x.dtype, _qlora_linear_backward, *args
    )
    return result


def _qlora_linear_backward(
    fw: FastWeight,
    grad_y: torch.Tensor,
    x: torch.Tensor,
    x2: torch.Tensor,
    keep: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = x.dtype
    dy = grad_y.reshape(-1, fw.rows)
    if dy.dtype != dtype:
        dy = dy.to(dtype)
    k = None if keep is None else _keep_rows(keep, fw.cols, dtype)
    xd = x2 if k is None else x2 * k
    a, b = _adapter(lora_a, dtype), _adapter(lora_b, dtype)
    h = torch.mm(xd, a.t())  # [m, r]
    grad_b = _product(dy.t(), h, lora_b.dtype, scaling)  # [rows, r]
    gh = torch.empty(h.shape, dtype=dtype, device=fw.device)
    gh.addmm_(dy, b, beta=0, alpha=scaling)  # s·dy B [m, r]; beta 0: gh is not read
    grad_a = _product(gh.t(), xd, lora_a.dtype)  # [r, cols]
    dx = torch.mm(gh, a)  # [m, cols]
    if k is not None:
        dx.mul_(k)
    dx.addmm_(dy, fw.dequantize(dtype))  # + dy W
    return dx.view(*x.shape[:-1], fw.cols), grad_a, grad_b


# --- autograd over this route, for eager training steps ---------------------------------------


def fits(
    fw: FastWeight,
    x: torch.Tensor,
    keep: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bias: torch.Tensor | None,
) -> bool:
    """Whether `QLoraLinear` takes these arguments as they are (`eager(x)` holding): x's width
    the weight's, x, the adapter, the mask and the bias float tensors of the weight's device
    in the shapes the op checks. Anything else goes to `torch.ops.nybble.qlora_linear`, whose
    checks then name what is wrong."""
    index = fw.index
    rows, cols = fw.rows, fw.cols
    return (
        x.shape[-1] == cols
        and x.get_device() == index
        and lora_a.dim() == 2
        and lora_b.dim() == 2
        and lora_a.shape[1] == cols
        and lora_b.shape[0] == rows
        and lora_b.shape[1] == lora_a.shape[0]
        and lora_a.dtype in FLOAT_DTYPES
        and lora_b.dtype in FLOAT_DTYPES
        and lora_a.get_device() == index
        and lora_b.get_device() == index
        and (
            keep is None
            or (keep.shape == x.shape and keep.dtype in FLOAT_DTYPES and keep.get_device() == index)
        )
        and (
            bias is None
            or (bias.dim() == 1 and bias.shape[0] == rows and bias.get_device() == index)
        )
    )


class QLoraLinear(torch.autograd.Function):
    """`torch.ops.nybble.qlora_linear` with its autograd, minus the ops' dispatch: the same
    bodies as the op's CUDA route (`qlora_linear`, `qlora_linear_backward`), so the same
    results bit for bit. `hold` keeps the weight's tensors alive until the backward (a
    `FastWeight` holds only their addresses)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        keep: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        bias: torch.Tensor | None,
        fw: FastWeight,
        scaling: float,
        hold: tuple[Any, ...],
    ) -> torch.Tensor:
        y = qlora_linear(fw, x, keep, lora_a, lora_b, scaling, bias)
        assert y is not None  # `eager` gave x rows
        ctx.save_for_backward(x, keep, lora_a, lora_b)
        ctx.fw, ctx.scaling, ctx.hold = fw, scaling, hold
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, keep, lora_a, lora_b = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx = da = db = dbias = None
        if needs[0] or needs[2] or needs[3]:
            grads = qlora_linear_backward(ctx.fw, grad_y, x, keep, lora_a, lora_b, ctx.scaling)
            assert grads is not None
            dx, da, db = grads
        if needs[4]:  # as the op's backward
            dbias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0).to(ctx.bias_dtype)
        return (
            dx if needs[0] else None,
            None,
            da if needs[2] else None,
            db if needs[3] else None,
            dbias,
            None,
            None,
            None,
        )


class Matmul(torch.autograd.Function):
    """`torch.ops.nybble.matmul` (x @ W.T) with its autograd (dx = dy @ W), minus the ops'
    dispatch: the bodies of the op's CUDA route. The caller checked x's width and device."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, fw: FastWeight, hold: tuple[Any, ...]
    ) -> torch.Tensor:
        y = matmul(fw, x, True)
        assert y is not None
        ctx.fw, ctx.hold = fw, hold
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        dx = None
        if ctx.needs_input_grad[0]:
            dx = matmul(ctx.fw, grad_y, False)
        return dx, None, None


__all__ = [
    "FLOAT_DTYPES",
    "HALF",
    "MAX_WEIGHTS",
    "FastWeight",
    "Matmul",
    "QLoraLinear",
    "dequantize",
    "eager",
    "fits",
    "linear",
    "matmul",
    "prepared",
    "qlora_linear",
    "qlora_linear_backward",
]
