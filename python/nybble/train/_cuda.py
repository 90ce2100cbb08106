"""Fused GPU kernels of the trainer: the causal softmax of a chunk of attention scores and its
gradient, SwiGLU's gate and its gradient, RMSNorm and its gradient, and the query/key heads'
norm + rotary positions + move to attention's layout and back. Each replaces a chain of
elementwise CuPy calls over the same arrays (`functional.SoftmaxKernels`, `GateKernels`,
`NormKernels`, `HeadKernels` state the same math in `xp`, and the GPU tests compare the two):
one read and one write of every element instead of a temporary per step of the formula, and
one launch instead of ten. The whole-model step on the GPU is bound by the host's launches
(docs/training.md), so the launches count as much as the bytes.

Attention in bfloat16 (heads of 64 or 128, sm_80+) runs whole in flash-attention kernels
(kernels/attention.cu: tiles of queries and keys in shared memory, online softmax on the tensor
cores, the [T, T] scores never in memory); `FusedSoftmax.flash_forward` / `flash_backward`,
which `functional.attention_forward` / `attention_backward` try first, launch them.

bfloat16 is handled as raw 16-bit words (widened exactly, rounded to nearest even), float32
as is; the math is float32. The sources are kernels/train.cu (the row kernels) and
kernels/attention.cu, embedded in the extension (`_core.kernel_sources()`), compiled on first
use and launched as the library's own kernels are, with the options given here: the GPU's
backend (`backends.get("cuda")`) compiles them (`Backend.kernel_module`: NVRTC to the device's
machine code, one module per device, launches through the Rust core's launcher on CuPy's
current stream) and makes their arrays (`xp`); inside a recording (backends/record) that is
the recording, whose modules compile and launch nothing. The flash kernels' launch sizes are
read back from their module (`FlashFacts`). This module imports no device library.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import DTypeLike

from .. import backends
from ..backends import Array
from ..formats import dtype_name
from . import functional as F

#: The fused row kernels' source in kernels/ (embedded in the extension by build.rs, shipped
#: in the wheel, compiled for sm_80 and sm_90 by the CI check).
KERNEL_FILE = "train.cu"


def source(file: str) -> str:
    """The CUDA source `file` of kernels/ as the extension ships it (`_core.kernel_sources()`),
    or with `NYBBLE_KERNELS_DIR` set, the file in that directory: what the modules here
    compile (backends.kernel_source, the one look-up)."""
    return backends.kernel_source(file)


#: The kernels' names, for the compile check.
KERNEL_NAMES = tuple(
    f"{kind}_{name}"
    for name in ("bf16", "f32")
    for kind in (
        "softmax_forward",
        "softmax_backward",
        "gate_forward",
        "gate_backward",
        "rms_forward",
        "rms_backward",
        "heads_forward",
        "heads_backward",
    )
)
#: dtypes the fused kernels take, by name, with their kernel-name suffix.
SUFFIX = {"bfloat16": "bf16", "float32": "f32"}
#: Threads per block of the row kernels (rows are up to tens of thousands of keys).
ROW_THREADS = 256
#: Threads per block of the warp-per-row kernels (RMSNorm, the heads): 8 rows a block.
WARP_ROW_THREADS = 256
#: Threads and the largest grid of the elementwise kernels (grid-stride loops).
ELEMENTWISE_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 65536


def supports(dtype: DTypeLike) -> bool:
    """Whether the fused kernels take arrays of `dtype`."""
    return dtype_name(np.dtype(dtype)) in SUFFIX


#: CuPy's own compile, which built the trainer's files before they were compiled as the
#: library's are, added this to the options it was given (after them; NVRTC takes the last):
#: subnormal floats flushed to zero. The trainer's options keep it, so that their numerics
#: stay as they were.
FLUSH_TO_ZERO = "-ftz=true"
#: NVRTC options of the row kernels: no contraction of a*b+c into an FMA, so each step rounds
#: as its xp statement does; subnormals flushed (FLUSH_TO_ZERO).
COMPILE_OPTIONS = ("-std=c++17", "--fmad=false", FLUSH_TO_ZERO)


def _backend() -> backends.Backend:
    """The GPU's backend, whose device the kernels run on: it compiles them
    (`kernel_module`, one module a device) and makes their arrays (`xp`); inside a recording
    (backends/record) the recording, whose modules compile and launch nothing."""
    return backends.get("cuda")


def _module(backend: backends.Backend) -> backends.KernelModule:
    """The row kernels compiled for the current device (the backend keeps one a device)."""
    return backend.kernel_module(KERNEL_FILE, COMPILE_OPTIONS)


def _kernel(backend: backends.Backend, name: str, dtype: DTypeLike) -> backends.Kernel:
    suffix = SUFFIX[dtype_name(np.dtype(dtype))]
    return _module(backend).function(f"{name}_{suffix}")


def _check(what: str, a: Array, dtype: DTypeLike, shape: tuple[int, ...] | None = None) -> None:
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous {np.dtype(dtype)} array, got {a.dtype}")
    if shape is not None and tuple(a.shape) != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {tuple(a.shape)}")


def _row_args(
    s: Array, row_table: Array, t0: int, group: int, window: int | None, scale: float
) -> tuple[Array, ...]:
    batch, rows, keys = (int(n) for n in s.shape)
    stride = int(row_table.shape[1])
    if t0 * group + rows > stride or row_table.shape[0] != batch:
        raise ValueError(
            f"row table of shape {tuple(row_table.shape)} does not cover rows "
            f"[{t0 * group}, {t0 * group + rows}) of {batch} batches"
        )
    return (
        np.int64(rows),
        np.int32(keys),
        np.int32(group),
        np.int64(t0),
        np.int64(window or 0),
        np.float32(scale),
        np.int64(stride),
        np.int64(t0 * group),
    )


def _starts_args(starts: Array | None, batch: int) -> tuple[Array, np.int64]:
    """The kernels' (starts, positions) arguments: a null pointer without starts."""
    if starts is None:
        return np.uint64(0), np.int64(0)
    _check("starts", starts, np.int32)
    if starts.ndim != 2 or starts.shape[0] != batch:
        raise ValueError(f"starts: expected [{batch}, positions], got {tuple(starts.shape)}")
    return starts, np.int64(starts.shape[1])


class FusedSoftmax:
    """`functional.SoftmaxKernels` on the GPU: one launch per chunk for each direction; and,
    with `flash` (the default), the whole attention in the flash kernels where they apply
    (`flash_forward`, `flash_backward`; `FusedSoftmax(flash=False)` keeps every shape on the
    chunked path)."""

    def __init__(self, flash: bool = True) -> None:
        self.flash = flash

    def flash_forward(
        self,
        q: Array,
        k: Array,
        v: Array,
        scale: float,
        window: int | None,
        starts: Array | None = None,
    ) -> tuple[Array, Array] | None:
        """`functional.attention_forward` (same arguments, layouts and results: the output
        [B, T, kv_heads, group, D] and the log-sum-exp [B·kv_heads, T·group] in float32) in
        one launch, or None where the flash kernels do not apply (then the chunked path runs)."""
        if not (self.flash and flash_applies(q, k, v, starts)):
            return None
        return _flash_forward(q, k, v, scale, window, starts)

    def flash_backward(
        self,
        do: Array,
        q: Array,
        k: Array,
        v: Array,
        out: Array,
        lse: Array,
        scale: float,
        window: int | None,
        starts: Array | None = None,
    ) -> tuple[Array, Array, Array] | None:
        """`functional.attention_backward` (dq [B, T, kv_heads, group, D], dk and dv
        [B, T, kv_heads, D]) in three launches, or None where the flash kernels do not apply."""
        if not (self.flash and flash_applies(q, k, v, starts)):
            return None
        b, kv, t, group, d = (int(n) for n in q.shape)
        rows = (b, t, kv, group, d)
        for a in (do, out):
            if tuple(a.shape) != rows or a.dtype != q.dtype or not _aligned(a):
                return None
        if lse.dtype != np.float32 or tuple(lse.shape) != (b * kv, t * group):
            return None
        if not lse.flags.c_contiguous:
            return None
        return _flash_backward(do, q, k, v, out, lse, scale, window, starts)

    def forward(
        self,
        s: Array,
        lse: Array,
        t0: int,
        group: int,
        window: int | None,
        scale: float,
        starts: Array | None = None,
    ) -> None:
        _check("scores", s, s.dtype)
        _check("lse", lse, np.float32)
        if s.ndim != 3 or s.shape[1] == 0:
            return
        args = _row_args(s, lse, t0, group, window, scale)
        rows = int(s.shape[0] * s.shape[1])
        kernel = _kernel(_backend(), "softmax_forward", s.dtype)
        kernel((rows,), (ROW_THREADS,), (s, lse, *args, *_starts_args(starts, int(s.shape[0]))))

    def backward(
        self,
        s: Array,
        dp: Array,
        lse: Array,
        delta: Array,
        t0: int,
        group: int,
        window: int | None,
        scale: float,
        starts: Array | None = None,
    ) -> None:
        _check("scores", s, s.dtype)
        _check("dp", dp, s.dtype, tuple(s.shape))
        _check("lse", lse, np.float32)
        _check("delta", delta, np.float32, tuple(lse.shape))
        if s.ndim != 3 or s.shape[1] == 0:
            return
        args = _row_args(s, lse, t0, group, window, scale)
        rows = int(s.shape[0] * s.shape[1])
        kernel = _kernel(_backend(), "softmax_backward", s.dtype)
        starts_args = _starts_args(starts, int(s.shape[0]))
        kernel((rows,), (ROW_THREADS,), (s, dp, lse, delta, *args, *starts_args))


#: The flash-attention kernels' source in kernels/ (embedded like KERNEL_FILE).
FLASH_FILE = "attention.cu"

#: Head dims the flash kernels are built for.
FLASH_HEAD_DIMS = (64, 128)
#: Query rows of a dK/dV kernel's tile, by head dim (compiled in with -DFLASH_DKDV_ROWS_<d>:
#: the host's choice, as the GEMV's token count is the library's).
FLASH_DKDV_ROWS = {64: 64, 128: 64}
#: NVRTC options of the flash module (the products need no bit-for-bit match with xp; the
#: flush of subnormals kept from CuPy's compile, FLUSH_TO_ZERO).
FLASH_COMPILE_OPTIONS = (
    "-std=c++17",
    *(f"-DFLASH_DKDV_ROWS_{d}={rows}" for d, rows in FLASH_DKDV_ROWS.items()),
    FLUSH_TO_ZERO,
)
#: The module variable holding the flash kernels' launch sizes (kernels/attention.cu, at its
#: end).
FLASH_FACTS_SYMBOL = "flash_facts"


class FlashFacts(NamedTuple):
    """The flash kernels' launch sizes, read back from their module (kernels/attention.cu's
    `flash_facts`, fields in its order): each has its one definition there. (A named tuple,
    not a dataclass: memory/trainer_run.py runs a copy of this module that is not in
    sys.modules, where a dataclass cannot be made.)"""

    threads: int  # a forward, dQ or dK/dV block (4 warps of 16 query rows, or of 16 keys)
    block: int  # query rows of a forward or dQ block, keys of a dK/dV block and of every tile
    delta_threads: int  # a flash_delta block (a warp per row)
    dkdv_rows_64: int  # query rows of a dK/dV tile, by head dim (FLASH_DKDV_ROWS)
    dkdv_rows_128: int
    shared_forward_d64: int  # dynamic shared memory of a block, by kernel and head dim
    shared_dq_d64: int
    shared_dkdv_d64: int
    shared_forward_d128: int
    shared_dq_d128: int
    shared_dkdv_d128: int

    def shared(self, kind: str, d: int) -> int:
        """Dynamic shared memory of a block of flash kernel `kind` (forward, dq, dkdv) for
        heads of `d`."""
        if kind not in ("forward", "dq", "dkdv") or d not in FLASH_HEAD_DIMS:
            raise ValueError(f"unknown flash kernel {kind!r} for heads of {d}")
        return int(getattr(self, f"shared_{kind}_d{d}"))


#: The flash kernels' names, for the compile check.
FLASH_KERNEL_NAMES = (
    *(f"flash_{kind}_d{d}" for d in FLASH_HEAD_DIMS for kind in ("forward", "dq", "dkdv")),
    "flash_delta",
)


def flash_shared_bytes(kind: str, d: int) -> int:
    """Dynamic shared memory of a block of flash kernel `kind` (forward, dq, dkdv) for heads of
    `d` on the current device (the layouts at the top of each kernel, FlashFacts)."""
    return _flash_facts(_backend()).shared(kind, d)


def _flash_module(backend: backends.Backend) -> backends.KernelModule:
    """The flash kernels compiled for the current device with FLASH_COMPILE_OPTIONS as they
    are now (the backend keeps one a device and options: a build with other options, as
    benchmarks/attention_gpu.py makes, is a module of its own)."""
    return backend.kernel_module(FLASH_FILE, FLASH_COMPILE_OPTIONS)


def _flash_facts(backend: backends.Backend) -> FlashFacts:
    """The launch sizes of the flash module the current device has now."""
    return _module_facts(_flash_module(backend))


@functools.cache
def _module_facts(module: backends.KernelModule) -> FlashFacts:
    return FlashFacts(*module.read_facts(FLASH_FACTS_SYMBOL, len(FlashFacts._fields)))


def _flash_kernel(backend: backends.Backend, name: str, shared: int) -> backends.Kernel:
    """The flash kernel `name`, allowed `shared` bytes of dynamic shared memory (the opt-in to
    more than a block gets by default, 48 KiB, made when it is loaded; the module keeps it)."""
    return _flash_module(backend).function(name, shared)


def _flash_capable(backend: backends.Backend) -> bool:
    """Whether the current device has the flash kernels' instructions (bf16 mma.sync,
    cp.async: compute capability 8.0 or later); a recording (no device) takes them."""
    capability = backend.compute_capability()
    return capability is None or capability >= 80


def _aligned(a: Array) -> bool:
    """C-contiguous with its first element on a 16-byte boundary (the kernels copy rows 16
    bytes at a time)."""
    if not a.flags.c_contiguous:
        return False
    data = getattr(a, "data", None)
    if data is None:  # a recording's array (backends/record) knows its own alignment
        return bool(getattr(a, "aligned16", False))
    return int(data.ptr) % 16 == 0


def flash_applies(q: Array, k: Array, v: Array, starts: Array | None = None) -> bool:
    """Whether the flash kernels take this attention: CuPy arrays in bfloat16, q
    [B, kv_heads, T, group, D] and k, v [B, kv_heads, T, D] C-contiguous and 16-byte aligned,
    D in FLASH_HEAD_DIMS, sizes within the kernels' int32 indices and grid, `starts` [B, T] or
    None, on a device of compute capability 8.0 or later."""
    backend = _backend()
    if not all(isinstance(a, backend.xp.ndarray) for a in (q, k, v)):
        return False
    if dtype_name(np.dtype(q.dtype)) != "bfloat16" or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.ndim != 5 or k.ndim != 4:
        return False
    b, kv, t, group, d = (int(n) for n in q.shape)
    if d not in FLASH_HEAD_DIMS or tuple(k.shape) != (b, kv, t, d) or v.shape != k.shape:
        return False
    if min(b, kv, t, group) < 1 or b * kv > 65535:
        return False
    if starts is not None and tuple(starts.shape) != (b, t):
        return False
    if not all(_aligned(a) for a in (q, k, v)):
        return False
    if not _flash_capable(backend):  # before the module is compiled: it needs sm_80
        return False
    return t * group < 2**31 - 2 * _flash_facts(backend).block


def _flash_starts(xp: ModuleType, starts: Array | None) -> Array:
    """The kernels' starts argument: int32 [B, T], or a null pointer."""
    if starts is None:
        return np.uint64(0)
    return xp.ascontiguousarray(starts.astype(np.int32, copy=False))


def _flash_launch(
    backend: backends.Backend, kind: str, d: int, grid: tuple[int, ...], args: tuple[Any, ...]
) -> None:
    facts = _flash_facts(backend)
    shared = facts.shared(kind, d)
    kernel = _flash_kernel(backend, f"flash_{kind}_d{d}", shared)
    kernel(grid, (facts.threads,), args, shared_mem=shared)


def _flash_forward(
    q: Array, k: Array, v: Array, scale: float, window: int | None, starts: Array | None
) -> tuple[Array, Array]:
    backend = _backend()
    xp = backend.xp
    b, kv, t, group, d = (int(n) for n in q.shape)
    m = t * group
    block = _flash_facts(backend).block
    out = xp.empty((b, t, kv, group, d), q.dtype)
    lse = xp.empty((b * kv, m), xp.float32)
    sizes = (np.int32(kv), np.int32(t), np.int32(group), np.int64(window or 0), np.float32(scale))
    grid = ((m + block - 1) // block, b * kv)
    args = (q, k, v, out, lse, *sizes, _flash_starts(xp, starts))
    _flash_launch(backend, "forward", d, grid, args)
    return out, lse


def _flash_backward(
    do: Array,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    scale: float,
    window: int | None,
    starts: Array | None,
) -> tuple[Array, Array, Array]:
    backend = _backend()
    xp = backend.xp
    b, kv, t, group, d = (int(n) for n in q.shape)
    m = t * group
    facts = _flash_facts(backend)
    head_starts = _flash_starts(xp, starts)
    # delta = rowsum(dO * O) per query row, and (packed rows) whether a batch's starts ever
    # decrease (then the dK/dV kernel cannot stop early)
    delta = xp.empty((b * kv, m), xp.float32)
    bad = xp.zeros((b,), xp.int32) if starts is not None else np.uint64(0)
    rows = b * t * kv * group
    per_block = facts.delta_threads // 32
    delta_grid = (max(1, min((rows + per_block - 1) // per_block, 1 << 16)),)
    kernel = _flash_kernel(backend, "flash_delta", 0)
    kernel(
        delta_grid,
        (facts.delta_threads,),
        (
            do,
            out,
            delta,
            bad,
            head_starts,
            np.int64(rows),
            np.int32(kv),
            np.int32(t),
            np.int32(group),
            np.int32(d),
        ),
    )
    sizes = (np.int32(kv), np.int32(t), np.int32(group), np.int64(window or 0), np.float32(scale))
    dq = xp.empty((b, t, kv, group, d), do.dtype)
    grid = ((m + facts.block - 1) // facts.block, b * kv)
    _flash_launch(backend, "dq", d, grid, (q, k, v, do, lse, delta, dq, *sizes, head_starts))
    dk = xp.empty((b, t, kv, d), do.dtype)
    dv = xp.empty((b, t, kv, d), do.dtype)
    grid = ((t + facts.block - 1) // facts.block, b * kv)
    args = (q, k, v, do, lse, delta, dk, dv, *sizes, head_starts, bad)
    _flash_launch(backend, "dkdv", d, grid, args)
    return dq, dk, dv


class FusedGate:
    """`functional.GateKernels` on the GPU; backward overwrites gate and up with their
    gradients (they are not needed after it)."""

    def _grid(self, n: int) -> tuple[int]:
        blocks = (n + ELEMENTWISE_THREADS - 1) // ELEMENTWISE_THREADS
        return (max(1, min(blocks, ELEMENTWISE_MAX_BLOCKS)),)

    def forward(self, gate: Array, up: Array) -> Array:
        backend = _backend()
        _check("gate", gate, gate.dtype)
        _check("up", up, gate.dtype, tuple(gate.shape))
        out = backend.xp.empty_like(gate)
        n = int(gate.size)
        if n:
            kernel = _kernel(backend, "gate_forward", gate.dtype)
            kernel(self._grid(n), (ELEMENTWISE_THREADS,), (gate, up, out, np.int64(n)))
        return out

    def backward(self, da: Array, gate: Array, up: Array) -> tuple[Array, Array]:
        _check("gate", gate, gate.dtype)
        _check("up", up, gate.dtype, tuple(gate.shape))
        _check("grad", da, gate.dtype, tuple(gate.shape))
        n = int(gate.size)
        if n:
            kernel = _kernel(_backend(), "gate_backward", gate.dtype)
            kernel(self._grid(n), (ELEMENTWISE_THREADS,), (da, gate, up, np.int64(n)))
        return gate, up


def _warp_rows_grid(rows: int) -> tuple[int]:
    per_block = WARP_ROW_THREADS // 32
    return (max(1, (rows + per_block - 1) // per_block),)


def _fusable(dtype: DTypeLike, *arrays: Array) -> bool:
    """Whether the row kernels take these arrays: C-contiguous, of one dtype the kernels
    know, and (the norm weights, given as float32 arrays) float32."""
    if not supports(dtype):
        return False
    return all(a is None or a.flags.c_contiguous for a in arrays)


def _f32_weight(w: Array) -> bool:
    return w is None or (w.dtype == np.float32 and w.flags.c_contiguous)


class FusedNorm:
    """`functional.NormKernels` on the GPU: one launch each way. A trainable weight's gradient
    (full fine-tuning) and other dtypes go to the xp statement."""

    def forward(self, x: Array, weight: Array, eps: float) -> tuple[Array, Array]:
        backend = _backend()
        xp = backend.xp
        if not (_fusable(x.dtype, x) and _f32_weight(weight)) or x.size == 0:
            return F.rms_norm_forward(xp, x, weight, eps)
        width = int(x.shape[-1])
        rows = int(x.size) // width
        y = xp.empty_like(x)
        rstd = xp.empty((*x.shape[:-1], 1), xp.float32)
        kernel = _kernel(backend, "rms_forward", x.dtype)
        args = (x, weight, y, rstd, np.int64(rows), np.int32(width), np.float32(eps))
        kernel(_warp_rows_grid(rows), (WARP_ROW_THREADS,), args)
        return y, rstd

    def backward(
        self, dy: Array, x: Array, rstd: Array, weight: Array, weight_grad: bool
    ) -> tuple[Array, Array | None]:
        backend = _backend()
        xp = backend.xp
        fusable = _fusable(x.dtype, dy, x, rstd) and _f32_weight(weight) and dy.dtype == x.dtype
        if weight_grad or not fusable or x.size == 0:
            return F.rms_norm_backward(xp, dy, x, rstd, weight, weight_grad)
        width = int(x.shape[-1])
        rows = int(x.size) // width
        dx = xp.empty_like(dy)
        kernel = _kernel(backend, "rms_backward", x.dtype)
        args = (dy, x, rstd, weight, dx, np.int64(rows), np.int32(width))
        kernel(_warp_rows_grid(rows), (WARP_ROW_THREADS,), args)
        return dx, None


class FusedHeads:
    """`functional.HeadKernels` on the GPU: norm, rotary positions and the move to attention's
    layout in one launch, and back in one."""

    def __init__(self) -> None:
        #: The one-element stand-ins for a missing norm weight, by the current device's module
        #: of the row kernels (one a device).
        self._no_weight: dict[Any, Any] = {}

    def _weight(self, backend: backends.Backend, w: Array) -> tuple[Array, np.int32]:
        """The norm weight and the has-norm flag (a one-element stand-in without a norm)."""
        if w is not None:
            return w, np.int32(1)
        module = _module(backend)
        if module not in self._no_weight:
            self._no_weight[module] = backend.xp.zeros(1, backend.xp.float32)
        return self._no_weight[module], np.int32(0)

    def forward(
        self, x: Array, weight: Array, eps: float, cos: Array, sin: Array, group: int
    ) -> tuple[Array, Array | None]:
        backend = _backend()
        xp = backend.xp
        b, t, heads, d = (int(n) for n in x.shape)
        fusable = _fusable(x.dtype, x, cos, sin) and _f32_weight(weight)
        if not fusable or cos.dtype != x.dtype or d % 2 or x.size == 0:
            return F.HeadKernels(xp).forward(x, weight, eps, cos, sin, group)
        out = xp.empty((b, heads // group, t, group, d), x.dtype)
        rstd = xp.empty((b, t, heads, 1), xp.float32) if weight is not None else None
        w, has_norm = self._weight(backend, weight)
        rows = b * t * heads
        kernel = _kernel(backend, "heads_forward", x.dtype)
        args = (
            x,
            w,
            has_norm,
            cos,
            sin,
            out,
            rstd if rstd is not None else w,
            np.int64(rows),
            np.int32(heads),
            np.int64(t),
            np.int32(group),
            np.int32(d),
            np.float32(eps),
            np.int32(cos.ndim == 3),
        )
        kernel(_warp_rows_grid(rows), (WARP_ROW_THREADS,), args)
        return out, rstd

    def backward(
        self,
        dy: Array,
        x: Array,
        rstd: Array,
        weight: Array,
        cos: Array,
        sin: Array,
        weight_grad: bool,
    ) -> tuple[Array, Array | None]:
        backend = _backend()
        xp = backend.xp
        b, t, heads, d = (int(n) for n in dy.shape)
        fusable = _fusable(dy.dtype, dy, x, rstd, cos, sin) and _f32_weight(weight)
        fusable = fusable and cos.dtype == dy.dtype and (x is None or x.dtype == dy.dtype)
        if weight_grad or not fusable or d % 2 or dy.size == 0:
            return F.HeadKernels(xp).backward(dy, x, rstd, weight, cos, sin, weight_grad)
        dx = xp.empty_like(dy)
        w, has_norm = self._weight(backend, weight)
        rows = b * t * heads
        kernel = _kernel(backend, "heads_backward", dy.dtype)
        args = (
            dy,
            x if x is not None else dy,
            rstd if rstd is not None else w,
            w,
            has_norm,
            cos,
            sin,
            dx,
            np.int64(rows),
            np.int32(heads),
            np.int64(t),
            np.int32(d),
            np.int32(cos.ndim == 3),
        )
        kernel(_warp_rows_grid(rows), (WARP_ROW_THREADS,), args)
        return dx, None


__all__ = [
    "COMPILE_OPTIONS",
    "FLASH_COMPILE_OPTIONS",
    "FLASH_FACTS_SYMBOL",
    "FLASH_FILE",
    "FLASH_HEAD_DIMS",
    "FLASH_KERNEL_NAMES",
    "KERNEL_FILE",
    "KERNEL_NAMES",
    "FlashFacts",
    "FusedGate",
    "FusedHeads",
    "FusedNorm",
    "FusedSoftmax",
    "flash_applies",
    "flash_shared_bytes",
    "source",
    "supports",
]
