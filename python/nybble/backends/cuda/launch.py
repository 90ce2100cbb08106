"""One launcher per kernel of `kernels/nf4.cu`. A kernel launch checks nothing, so each launcher
checks dtypes, contiguity, alignment (the kernels move 16 bytes at a time) and sizes first, and
raises ValueError: a wrong argument never reaches the GPU. Grid sizes come from the module's
launch facts (kernels.LaunchFacts), the tables from the Rust core (nybble.formats)."""

from __future__ import annotations

import math
import threading
import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np

from ... import _core, formats
from ...errors import NonFiniteError
from ...formats import (
    NESTED_BLOCKSIZE,
    OUTPUT_DTYPES,
    KernelCodebook,
    NestedAbsmax,
    dtype_name,
    numpy_dtype,
)
from . import kernels
from .arrays import c_contiguous
from .kernels import GEMV_MAX_TOKENS, SUFFIX, KernelModule

try:
    import cupy as cp
except ImportError:  # importable without CuPy (the CI compile check reads kernel_names)
    cp = None

#: Element dtypes the kernels read and write.
DTYPES = OUTPUT_DTYPES
#: The 16-bit token dtypes of the tensor-core GEMV, in the order `_core.GemvCall` takes them.
_TOKENS_16 = ("float16", "bfloat16")
LAYOUTS = ("split", "blocks36", "high_first")
QUANT_FORMATS: tuple[KernelCodebook, ...] = ("nf4", "fp4", "int8", "dynamic8")
#: Element offsets a dequantize may start at: a store's 16 bytes of output share one scale.
_START_ALIGN = {4: 32, 8: 16}
_NONE = 2**64 - 1  # first_bad before any non-finite value is seen
_HOST_PORTABLE, _HOST_MAPPED = 1, 2  # cudaHostAllocPortable, cudaHostAllocMapped


def kernel_names() -> list[str]:
    """Every kernel a launcher may start."""
    suffixes = SUFFIX.values()
    names = [f"dequant4_{lay}_{s}" for lay in LAYOUTS for s in suffixes]
    names += [f"dequant8_{s}" for s in suffixes]
    names += [f"quantize_{f}_{s}" for f in QUANT_FORMATS for s in suffixes]
    names += [f"gemv_f32_m{m}" for m in range(1, 5)]
    names += [
        f"gemv_tc_{s}_g{g}{dq}" for s in ("f16", "bf16") for g in (32, 64) for dq in ("", "_dq")
    ]
    names += [f"scan_non_finite_{s}" for s in suffixes]
    names += [f"narrow_pair_{s}" for s in ("f16", "bf16")]
    return [*names, "narrow_f64", "decode_scales"]


# --- argument checks ---------------------------------------------------------------------


def check_array(a: Any, what: str, dtypes: tuple[str, ...], size: int | None = None) -> None:
    """A C-contiguous, 16-byte aligned CuPy array on the current device, of one of `dtypes`
    (and `size` elements)."""
    if not isinstance(a, cp.ndarray):
        raise ValueError(f"{what}: expected a CuPy array, got {type(a).__name__}")
    if dtype_name(a.dtype) not in dtypes:
        raise ValueError(f"{what}: expected dtype {' or '.join(dtypes)}, got {dtype_name(a.dtype)}")
    if not c_contiguous(a):
        raise ValueError(f"{what}: expected a C-contiguous array, got strides {a.strides}")
    memory = a.data
    if memory.ptr % 16:
        raise ValueError(f"{what}: expected a 16-byte aligned buffer, got address {memory.ptr:#x}")
    if memory.device_id != cp.cuda.runtime.getDevice():
        raise ValueError(f"{what}: on device {memory.device_id}, not the current device")
    if size is not None and a.size != size:
        raise ValueError(f"{what}: expected {size} elements, got {a.size}")


_log2_blocksizes: dict[int, np.int32] = {}


def log2_blocksize(blocksize: int) -> np.int32:
    """log2 of a checked blocksize (kept per int: checking cost about a microsecond a call)."""
    if type(blocksize) is int:
        found = _log2_blocksizes.get(blocksize)
        if found is not None:
            return found
    log2 = np.int32(formats.check_blocksize(blocksize).bit_length() - 1)
    if type(blocksize) is int:
        _log2_blocksizes[blocksize] = log2
    return log2


def _grid(n: int, per_block: int) -> tuple[int]:
    return (-(-n // per_block),)


# --- tables from the core, one device copy each ----------------------------------------------

_tables: dict[tuple[str, str, int, int], Any] = {}


def bucket_tables(
    thresholds: np.ndarray, code_of_rank: np.ndarray, buckets: int
) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' encoding tables for NF4 and FP4 magnitudes, of `buckets` entries (the
    kernels' BUCKETS): bucket b is [(b - 33)/32, (b - 32)/32), b = floor(v * 32) + 33; thr[b] is
    the one threshold inside it (+inf if none) and codes[b] the codes below and above it, so
    code(v) = codes[b][v > thr[b]]. Buckets 0..65 cover [-33/32, 33/32), where every v of a
    quantize falls; the rest repeat bucket 65."""
    edges = ((np.arange(66, dtype=np.float32) - np.float32(33)) / np.float32(32)).astype(np.float32)
    thr = np.full(buckets, np.inf, np.float32)
    codes = np.zeros((buckets, 2), np.uint8)
    for b in range(buckets):
        lo = edges[min(b, edges.size - 1)]
        inside = thresholds[(thresholds >= lo) & (thresholds < lo + np.float32(1 / 32))]
        if inside.size > 1:
            raise AssertionError("two thresholds in one bucket: the kernels need a finer one")
        rank = int(np.count_nonzero(thresholds < lo))
        thr[b] = inside[0] if inside.size else np.inf
        codes[b] = code_of_rank[rank], code_of_rank[min(rank + 1, code_of_rank.size - 1)]
    return thr, codes.ravel()


def _host_table(kind: str, codebook: KernelCodebook, buckets: int) -> np.ndarray:
    if kind == "values":
        return formats.values(codebook)
    if codebook in ("nf4", "fp4"):  # FP4: its magnitudes, the sign apart
        nf4 = codebook == "nf4"
        ranks = np.arange(16, dtype=np.uint8) if nf4 else formats.fp4_magnitude_codes()
        thr, codes = bucket_tables(formats.thresholds(codebook), ranks, buckets)
    elif codebook == "dynamic8":  # binary search over the midpoints, padded with +inf to 256
        thr = np.append(formats.thresholds("dynamic8"), np.float32(np.inf)).astype(np.float32)
        codes = np.zeros(1, np.uint8)
    else:  # int8 is arithmetic
        thr, codes = np.zeros(1, np.float32), np.zeros(1, np.uint8)
    return thr if kind == "thresholds" else codes


def table(kind: str, codebook: KernelCodebook, buckets: int = 0) -> Any:
    """A format's table on the current device: `values` (the codebook), or the encoding
    tables `thresholds` and `codes` the quantize kernels read (NF4 and FP4: `buckets` of them,
    the kernels' BUCKETS)."""
    key = (kind, codebook, buckets, int(cp.cuda.runtime.getDevice()))
    found = _tables.get(key)
    if found is None:
        found = _tables[key] = cp.asarray(_host_table(kind, codebook, buckets))
    return found


def scale_args(absmax: Any, nested: NestedAbsmax | None, nblocks: int) -> tuple[Any, ...]:
    """The kernels' SCALE_PARAMS: plain f32 scales, or the double-quantized ones."""
    unused = table("values", "nf4")
    if nested is None:
        check_array(absmax, "absmax", ("float32",), nblocks)
        return (absmax, unused, unused, unused, np.float32(0), np.int32(0))
    if absmax is not None:
        raise ValueError("absmax: give plain scales or nested ones, not both")
    check_array(nested.codes, "nested.codes", ("uint8",), nblocks)
    check_array(nested.absmax2, "nested.absmax2", ("float32",), -(-nblocks // NESTED_BLOCKSIZE))
    dmap = table("values", "dynamic8")
    return (unused, nested.codes, nested.absmax2, dmap, np.float32(nested.offset), np.int32(1))


def _no_scales() -> tuple[Any, ...]:
    """SCALE_PARAMS for a kernel that does not read them (valid pointers all the same)."""
    unused = table("values", "nf4")
    return (unused, unused, unused, unused, np.float32(0), np.int32(0))


# --- launchers ------------------------------------------------------------------------------


def dequantize(
    codes: Any,
    absmax: Any,
    nested: NestedAbsmax | None,
    codebook: KernelCodebook,
    layout: str,
    blocksize: int,
    total: int,
    start: int,
    out: Any,
) -> None:
    """out[:] = elements [start, start + out.size) of a tensor of `total` elements: 4-bit
    codes in one of LAYOUTS, or 8-bit codes (int8, the dynamic map; layout "split")."""
    if codebook not in QUANT_FORMATS:
        raise ValueError(f"codebook: expected one of {', '.join(QUANT_FORMATS)}, got {codebook!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    bits = formats.code_bits(codebook)
    if bits == 8 and layout != "split":
        raise ValueError(f"the {layout} layout holds 4-bit codes, not {codebook}")
    log2_bs = log2_blocksize(blocksize)
    check_array(out, "out", DTYPES)
    n = out.size
    align = _START_ALIGN[bits]
    if start % align or start < 0 or start + n > total:
        raise ValueError(
            f"elements [{start}, {start + n}) of {total}: start must be a multiple of {align}"
        )
    nblocks = -(-total // blocksize)
    if layout == "blocks36":
        if blocksize != formats.BLOCK36_VALUES or absmax is not None or nested is not None:
            raise ValueError("the 36-byte layout has blocks of 64 and carries its own scales")
        check_array(codes, "buf", ("uint8",), nblocks * formats.BLOCK36_BYTES)
        scales = _no_scales()
    else:
        check_array(codes, "codes", ("uint8",), formats.code_bytes(total, codebook))
        scales = scale_args(absmax, nested, nblocks)
    if n == 0:
        return
    name = dtype_name(out.dtype)
    module = kernels.module()
    kernel = f"dequant4_{layout}_{SUFFIX[name]}" if bits == 4 else f"dequant8_{SUFFIX[name]}"
    args = (codes, *scales, table("values", codebook), np.int64(start), np.int64(n), log2_bs, out)
    grid = _grid(n, module.facts.dequant_per_block(name))
    module.function(kernel)(grid, (module.facts.threads,), args)


def quantize(
    x: Any, blocksize: int, codebook: KernelCodebook, check_finite: bool = True
) -> tuple[Any, Any]:
    """(codes, absmax) of a C-contiguous f32/f16/bf16 array, in its flat order (any shape: a
    reshape would cost a view's construction, a microsecond or two of the host's time). A
    non-finite value is a NonFiniteError naming the first flat index; finding out costs a wait
    for the GPU (then a read of a host word, FiniteCounter), which `check_finite=False` skips
    (for inputs finite by construction, and inside a graph capture, which must not wait)."""
    if codebook not in QUANT_FORMATS:
        raise ValueError(f"codebook: expected one of {', '.join(QUANT_FORMATS)}, got {codebook!r}")
    log2_bs = log2_blocksize(blocksize)
    check_array(x, "x", DTYPES)
    n = x.size
    codes = cp.ndarray(formats.code_bytes(n, codebook), cp.uint8)  # see _allocate_ahead
    absmax = cp.ndarray(-(-n // blocksize), cp.float32)
    if n == 0:
        return codes, absmax
    device = int(x.data.device_id)
    key = (codebook, x.dtype, device)
    prepared = _quantize_launches.get(key)
    if prepared is None:
        prepared = _quantize_launches[key] = QuantizeLaunch(codebook, dtype_name(x.dtype), device)
    counter = FiniteCounter.of(device) if check_finite else None
    prepared(x, n, log2_bs, codes, absmax, counter)
    if counter is not None:
        bad = counter.read()
        if bad != _NONE:
            raise NonFiniteError(bad)
    return codes, absmax


class QuantizeLaunch:
    """The quantize kernel of one codebook and input dtype on one device, through a prepared
    launch: a call sets its arrays and sizes (CuPy's own launch path costs ~10 us more of the
    host's time, which a per-call figure sees whole)."""

    _X, _N, _LOG2, _CODES, _ABSMAX, _CHECK, _FOUND = 0, 1, 2, 6, 7, 8, 9

    def __init__(self, codebook: KernelCodebook, name: str, device: int) -> None:
        module = kernels.module(device=device)
        self.per_block = module.facts.quant_per_block(name)
        with cp.cuda.Device(device):
            buckets = module.facts.quant_buckets
            thresholds = table("thresholds", codebook, buckets)
            table_codes = table("codes", codebook, buckets)
        prepared = kernels.PreparedLaunch(
            module.function(f"quantize_{codebook}_{SUFFIX[name]}"),
            1,
            module.facts.threads,
            (
                thresholds,  # x, set per call
                np.int64(0),
                np.int32(0),
                np.uint32(formats.zero_code(codebook)),
                thresholds,
                table_codes,
                thresholds,  # codes, absmax, the check's words: set per call
                thresholds,
                thresholds,
                thresholds,
            ),
        )
        self._launch = prepared.call_setting(
            (self._X, self._N, self._LOG2, self._CODES, self._ABSMAX, self._CHECK, self._FOUND)
        )
        self._current_stream = cp.cuda.get_current_stream

    def __call__(
        self,
        x: Any,
        n: int,
        log2_bs: Any,
        codes: Any,
        absmax: Any,
        counter: FiniteCounter | None,
    ) -> None:
        check, found = (0, 0) if counter is None else counter.arm()  # null: unchecked
        self._launch(
            self._current_stream().ptr,
            x.data.ptr,
            n,
            int(log2_bs),
            codes.data.ptr,
            absmax.data.ptr,
            check,
            found,
            grid=_grid(n, self.per_block)[0],
        )


_quantize_launches: dict[tuple[str, Any, int], QuantizeLaunch] = {}


class FiniteCounter:
    """A thread's finite check for quantize on one device: a device word the kernel keeps the
    smallest non-finite index in (all ones: none), and a pinned host word it sets when it
    finds one. After the stream synchronize the check needs anyway, the host reads the host
    word: nothing to copy back unless something was found, and then both are set back. One
    per thread, so that concurrent quantize calls never count in each other's words."""

    _local = threading.local()

    @classmethod
    def of(cls, device: int) -> FiniteCounter:
        mine: dict[int, FiniteCounter] | None = getattr(cls._local, "by_device", None)
        if mine is None:
            mine = cls._local.by_device = {}
        found = mine.get(device)
        if found is None:
            with cp.cuda.Device(device):
                found = mine[device] = cls()
        return found

    def __init__(self) -> None:
        self.device = int(cp.cuda.runtime.getDevice())
        self.index = cp.full(1, np.uint64(_NONE), cp.uint64)
        # A pinned host word mapped into every device's address space (portable, mapped: with
        # unified addressing the device reaches it at the host's address), its own allocation
        # rather than a block of CuPy's pinned pool, which any device's context may have made.
        self._host_word = int(cp.cuda.runtime.hostAlloc(4, _HOST_PORTABLE | _HOST_MAPPED))
        release = weakref.finalize(self, cp.cuda.runtime.freeHost, self._host_word)
        release.atexit = False  # at exit the process's memory goes anyway, CUDA maybe first
        self._found = _host_words(self._host_word, 1)
        self._found[0] = 0
        self._pending = False  # a launch may still be running: its read did not finish

    def arm(self) -> tuple[int, int]:
        """The device and host words' addresses for a launch, after finishing a read that was
        interrupted."""
        if self._pending:
            cp.cuda.Device(self.device).synchronize()
            self._take()
        self._pending = True
        return int(self.index.data.ptr), self._host_word

    def read(self) -> int:
        """Waits for the current stream; the index its checked launch found (all ones: none)."""
        cp.cuda.get_current_stream().synchronize()
        found = self._take()
        self._pending = False
        return found

    def _take(self) -> int:
        """The index found (all ones: none), both words set back."""
        if not self._found[0]:
            return _NONE
        index = int(self.index.get()[0])
        self.index.fill(np.uint64(_NONE))
        cp.cuda.Device(self.device).synchronize()
        self._found[0] = 0
        return index


def _host_words(address: int, count: int) -> np.ndarray:
    """`count` uint32 words of host memory at `address` as a numpy array (a view: what the
    device writes there, the host reads; the memory must outlive it)."""

    words = SimpleNamespace(
        __array_interface__={
            "data": (address, False),
            "shape": (count,),
            "typestr": "<u4",
            "version": 3,
        }
    )
    return np.asarray(words)


NO_INDEX = _NONE  # a scan's result while no non-finite value was seen


def scan_non_finite(x: Any, first_bad: Any) -> None:
    """first_bad[0] = min(first_bad[0], the flat index of each NaN or ±inf of x), on the
    device without a wait. `x` is any f32/f16/bf16 CuPy array (copied first when not
    contiguous and aligned); `first_bad` a uint64 array, its first element updated."""
    check_array(first_bad, "first_bad", ("uint64",))
    if x.dtype.kind != "f" and dtype_name(x.dtype) != "bfloat16":
        raise ValueError(f"x: expected a float array, got {dtype_name(x.dtype)}")
    from .arrays import ready

    flat = ready(x).reshape(-1)
    check_array(flat, "x", DTYPES)
    if flat.size:
        name = dtype_name(flat.dtype)
        module = kernels.module()
        kernel = module.function(f"scan_non_finite_{SUFFIX[name]}")
        grid = _grid(flat.size, module.facts.scan_per_block(name))
        kernel(grid, (module.facts.threads,), (flat, np.int64(flat.size), first_bad))


class ScanLaunch:
    """scan_non_finite for arrays of one dtype into one counter, through a prepared launch
    (a layer scans its activation on every call)."""

    _X, _N = 0, 1

    def __init__(self, first_bad: Any, dtype: Any) -> None:
        check_array(first_bad, "first_bad", ("uint64",))
        self.name = dtype_name(dtype)
        if self.name not in DTYPES:
            raise ValueError(f"x: expected a float array, got {self.name}")
        self.module = kernels.module(device=int(first_bad.data.device_id))
        self.device = self.module.device
        kernel = self.module.function(f"scan_non_finite_{SUFFIX[self.name]}")
        self.per_block = self.module.facts.scan_per_block(self.name)
        self._first_bad = first_bad
        prepared = kernels.PreparedLaunch(
            kernel, 1, self.module.facts.threads, (first_bad, np.int64(0), first_bad)
        )
        self._launch = prepared.call_setting((self._X, self._N))
        self._current_stream = cp.cuda.get_current_stream

    def __call__(self, x: Any) -> None:
        if not _tokens_ok(x, (self.name,), self.device):
            scan_non_finite(x, self._first_bad)  # the checked path (copies if needed)
            return
        n = x.size
        if n:
            grid = _grid(n, self.per_block)[0]
            self._launch(self._current_stream().ptr, x.data.ptr, n, grid=grid)


def decode_scales(nested: NestedAbsmax, n: int, out: Any) -> None:
    """out[b] = the float32 scale of block b < n of a double-quantized tensor."""
    check_array(out, "out", ("float32",), n)
    scales = scale_args(None, nested, n)
    if n:
        module = kernels.module()
        threads = module.facts.threads
        module.function("decode_scales")(_grid(n, threads), (threads,), (*scales, np.int64(n), out))


def narrow_f64(x: Any) -> Any:
    """A flat float64 array rounded to float32 (nearest even), keeping subnormal results,
    which CuPy's `astype` flushes to zero."""
    check_array(x, "x", ("float64",))
    if x.ndim != 1:
        raise ValueError(f"x: expected a flat array, got shape {x.shape}")
    y = cp.empty(x.size, cp.float32)
    if x.size:
        module = kernels.module()
        threads = module.facts.threads
        module.function("narrow_f64")(_grid(x.size, threads), (threads,), (x, np.int64(x.size), y))
    return y


#: narrow_pair's launches by (device, dtype): calls (stream, a, a's size, b, b's size, out_a,
#: out_b, grid=) (kernels.PreparedLaunch.call_setting).
_narrow_pairs: dict[tuple[int, str], Any] = {}


def narrow_pair(a: Any, b: Any, dtype: str) -> tuple[Any, Any] | None:
    """Two float32 arrays rounded (nearest even) to the 16-bit `dtype` in one prepared launch
    (kernels/nf4.cu: narrow_pair): new arrays of their shapes. None when they are not both
    C-contiguous, 16-byte aligned float32 arrays on one device, or `dtype` is not 16-bit:
    the caller then casts them itself."""
    if dtype not in ("float16", "bfloat16") or type(a) is not cp.ndarray:
        return None
    device = a.data.device_id
    if not (_tokens_ok(a, ("float32",), device) and _tokens_ok(b, ("float32",), device)):
        return None
    key = (device, dtype)
    launch = _narrow_pairs.get(key)
    module = kernels.module(device=device)
    if launch is None:
        kernel = module.function(f"narrow_pair_{SUFFIX[dtype]}")
        # Every argument is set per call: null addresses and sizes until then (an array here
        # would be held alive by the launch for good).
        null, zero = np.uint64(0), np.int64(0)
        prepared = kernels.PreparedLaunch(
            kernel, 1, module.facts.threads, (null, zero, null, zero, null, null)
        )
        launch = _narrow_pairs[key] = prepared.call_setting(range(6))
    np_dtype = numpy_dtype(dtype)
    out_a, out_b = cp.empty(a.shape, np_dtype), cp.empty(b.shape, np_dtype)
    n = a.size + b.size
    if n:
        launch(
            cp.cuda.get_current_stream().ptr,
            a.data.ptr,
            a.size,
            b.data.ptr,
            b.size,
            out_a.data.ptr,
            out_b.data.ptr,
            grid=_grid(n, module.facts.threads)[0],
        )
    return out_a, out_b


# --- the fused GEMV ----------------------------------------------------------------------------


def gemv_supported(codebook: str, shape: tuple[int, ...]) -> bool:
    """Whether the fused GEMV takes this weight: 4-bit codes, 2-D, rows of 32k elements."""
    return codebook in ("nf4", "fp4") and len(shape) == 2 and shape[1] % 32 == 0 and shape[1] > 0


def _tokens_ok(a: Any, dtypes: tuple[str, ...], device: int) -> bool:
    """The cheap form of check_array for per-call arguments: a C-contiguous, 16-byte aligned
    CuPy array of one of `dtypes` on `device`. On False the caller runs check_array for the
    message."""
    return (
        type(a) is cp.ndarray
        and dtype_name(a.dtype) in dtypes
        and c_contiguous(a)
        and a.data.ptr % 16 == 0
        and a.data.device_id == device
    )


class GemvWeight:
    """A 4-bit weight W of `shape` [rows, cols] checked once for the fused GEMV, so that each
    call, `weight(x, y)`: y[m, rows] = x[m, cols] @ W.T for 1 <= m <= GEMV_MAX_TOKENS, only
    checks its tokens and launches with a prepared argument buffer (kernels.PreparedLaunch,
    and for 16-bit tokens the launch its call_setting makes).
    Per-call host time matters here: a 1-token GEMV of a 4096 x 4096 weight runs about 9 us on
    an H100, what CuPy's own launch path alone costs.

    `module` selects the compiled kernels (default: the library's; benchmarks/gemv_tune.py
    passes tuning builds compiled with other -D parameters); `programmatic=False` launches
    plainly where the GPU could overlap the launches (benchmarks compare the two)."""

    #: Where the varying arguments sit in the kernels' parameter lists.
    _X, _TC_Y, _F32_Y = 0, 13, 12

    def __init__(
        self,
        codes: Any,
        absmax: Any,
        nested: NestedAbsmax | None,
        codebook: str,
        shape: tuple[int, int],
        blocksize: int,
        module: KernelModule | None = None,
        programmatic: bool | None = None,
    ) -> None:
        if not gemv_supported(codebook, shape):
            raise ValueError(
                f"the fused GEMV takes a 2-D nf4/fp4 weight whose rows are a multiple of 32 "
                f"elements, got {codebook} {shape}"
            )
        self.rows, self.cols = rows, cols = shape
        self.log2_bs = log2_blocksize(blocksize)
        check_array(codes, "codes", ("uint8",), rows * cols // 2)
        self.scales = scale_args(absmax, nested, -(-(rows * cols) // blocksize))
        self.codes = codes
        self.device = int(codes.data.device_id)
        self.module = module or kernels.module(device=self.device)
        #: Whether the tensor-core launches are programmatic (where the GPU allows, unless
        #: `programmatic` is False; kernels.PreparedLaunch): a GEMV then starts under the end of
        #: the kernel before it. The weight's arrays must not be written once it is in use
        #: (nybble never does).
        self.programmatic = self.module.programmatic and programmatic is not False
        facts = self.module.facts
        self.values = table("values", "nf4" if codebook == "nf4" else "fp4")
        # Groups of 64 elements need rows and scales that start on 64-element boundaries.
        self.group = 64 if cols % 64 == 0 and blocksize >= 64 else 32
        if rows * cols // self.group >= 2**32:  # the kernel numbers groups in 32 bits
            raise ValueError(f"the fused GEMV takes fewer than 2^37 weights, got shape {shape}")
        self.smem = facts.tc_shared(self.group)
        self.dims = (np.int32(rows), np.int32(cols))
        # The tensor-core kernels by token dtype; their _dq variants decode nested scales.
        dq = "" if nested is None else "_dq"
        self.tc_names: dict[str, str] = {
            d: f"gemv_tc_{SUFFIX[d]}_g{self.group}{dq}" for d in _TOKENS_16
        }
        self.tiles = -(-rows // facts.tc_rows)
        #: Prepared launches by (token dtype, token count); the 16-bit ones launch only
        #: through their `_fast` entry.
        self._launches: dict[tuple[np.dtype[Any], int], kernels.PreparedLaunch] = {}
        #: The 16-bit ones by (dtype, x's shape): the launch the checked call makes (the
        #: core's), which `fast` makes too.
        self._fast: dict[tuple[np.dtype[Any], tuple[int, int]], Any] = {}
        self._current_stream = cp.cuda.get_current_stream
        #: The decode loop's call, `fast(x, out)` (the core's `GemvCall`): the checks that keep
        #: it safe and the launch, with no Python between, for the 16-bit launches the checked
        #: calls prepared through the core; it returns None for any other call (the checked
        #: path then takes it, and says what is wrong). None where the core launches nothing:
        #: every call is then checked.
        self.fast: Any = None
        if hasattr(_core, "GemvCall"):
            self.fast = _core.GemvCall(
                (codes, self.scales, self.values),  # what its launches point at
                cp.ndarray,
                cp.cuda.get_current_stream,
                _allocate_ahead,
                (numpy_dtype(_TOKENS_16[0]), numpy_dtype(_TOKENS_16[1])),
                self.device,
                rows,
                cols,
            )

    def tc_blocks(self, kernel: Any) -> int:
        """Blocks to launch of a tensor-core GEMV kernel: as many as the GPU holds at once, at
        most one per tile of rows. A block takes its tiles in turn (blockIdx.x, + gridDim.x,
        ...) as one stream of stages, so that it fills its table and its pipeline once rather
        than once per tile."""
        held = self.module.resident_blocks(kernel, self.module.facts.tc_threads, self.smem)
        return min(self.tiles, held)

    def __call__(self, x: Any, y: Any) -> None:
        rows, cols = self.rows, self.cols
        if not _tokens_ok(x, DTYPES, self.device):
            check_array(x, "x", DTYPES)
            raise ValueError(f"x: on device {x.data.device_id}, the weight on {self.device}")
        shape = x.shape
        if len(shape) != 2 or shape[1] != cols or not 1 <= shape[0] <= GEMV_MAX_TOKENS:
            raise ValueError(
                f"x: expected shape (m, {cols}) with 1 <= m <= {GEMV_MAX_TOKENS}, got {shape}"
            )
        m = shape[0]
        name = dtype_name(x.dtype)
        if not _tokens_ok(y, (name,), self.device) or y.shape != (m, rows):
            check_array(y, "y", (name,), m * rows)
            raise ValueError(
                f"y: expected shape {(m, rows)} on device {self.device}, got "
                f"{y.shape} on {y.data.device_id}"
            )
        if rows == 0:
            return
        if name != "float32":
            # Through the fast path's launch, so that both paths share one: its first launch is
            # plain and the later ones programmatic (kernels.PreparedLaunch), so a decode step
            # warmed up by checked calls captures programmatic launches.
            found = self._fast.get((x.dtype, shape))
            if found is None:
                self._launch(name, m)
                found = self._fast[(x.dtype, shape)]
            found(self._current_stream().ptr, x.data.ptr, y.data.ptr)
            return
        step = self.module.facts.gemv_tokens
        row_bytes = cols * 4
        for t in range(0, m, step):  # rows t.. of x and y: contiguous
            self._launch(name, min(step, m - t))(
                (self._X, x.data.ptr + t * row_bytes), (self._F32_Y, y.data.ptr + t * rows * 4)
            )

    def _launch(self, dtype: str, m: int) -> kernels.PreparedLaunch:
        """The prepared launch for m tokens of `dtype`: a tensor-core kernel takes m as an
        argument, fixed in its launch (one per count, so that a call sets only addresses);
        the float32 kernels are one per count of up to GEMV_F32 tokens. A 16-bit one is
        launched only through the call made from it (its `_fast` entry), whose first launch
        alone is plain: launching it directly as well would make two first launches."""
        key = (numpy_dtype(dtype), m)
        found = self._launches.get(key)
        if found is not None:
            return found
        facts = self.module.facts
        placeholder = self.codes  # any device address: the token arguments are set per call
        if dtype == "float32":
            kernel = self.module.function(f"gemv_f32_m{m}")
            args = (
                placeholder,
                self.codes,
                *self.scales,
                self.values,
                *self.dims,
                self.log2_bs,
                placeholder,
            )
            made = kernels.PreparedLaunch(
                kernel, _grid(self.rows, facts.gemv_rows)[0], facts.gemv_threads, args
            )
        else:
            kernel = self.module.function(self.tc_names[dtype], self.smem)
            args = (
                placeholder,
                self.codes,
                *self.scales,
                self.values,
                *self.dims,
                np.int32(m),
                self.log2_bs,
                placeholder,
            )
            made = kernels.PreparedLaunch(
                kernel,
                self.tc_blocks(kernel),
                facts.tc_threads,
                args,
                self.smem,
                programmatic=self.programmatic,
            )
            call = made.call_setting((self._X, self._TC_Y))
            self._fast[(key[0], (m, self.cols))] = call
            if self.fast is not None:
                ahead: list[Any] = []  # ((stream, thread, generation), output) of later calls
                self.fast.add(_TOKENS_16.index(dtype), m, call, ahead)
        self._launches[key] = made
        return made


def forget_outputs_ahead() -> None:
    """No output allocated ahead before this call (GemvWeight.fast) is handed out after it
    (`cuda.capture` calls it: a capture's stream may have a handle that an earlier stream had,
    and must own every output it writes). Outputs are for the thread, the stream handle and
    the generation they were made in; this starts a new generation."""
    if hasattr(_core, "GemvCall"):
        _core.GemvCall.forget_outputs_ahead()


def _allocate_ahead(
    ahead: list[Any], stream: Any, made_for: tuple[int, int, int], shape: Any, dtype: Any
) -> None:
    """Allocates the next call's output on `stream` for `made_for`, unless one is waiting, the
    stream is capturing a graph (whose allocations `cuda.capture` must see made inside it), or
    memory has run out (this call's result is already on its way). A call takes its output
    off the list and this appends under the GIL, so threads sharing a weight never take the
    same output; there is one waiting for each weight and token shape, or one for each thread
    calling it at once."""
    if ahead:
        return
    try:
        if stream.is_capturing():
            return
        # cp.ndarray is what cp.empty makes, without cp.empty's Python wrapper: 0.3-0.8 us
        # less host time a call (H100 host, a loop of 20000 allocations).
        ahead.append((made_for, cp.ndarray(shape, dtype)))
    except cp.cuda.memory.OutOfMemoryError:
        return
    except cp.cuda.runtime.CUDARuntimeError:  # e.g. another thread's capture (implicit)
        return


class DequantizeWeight:
    """The dequantize launch of one quantized tensor in the split layout, checked once: a
    call, `weight(start, out)`, fills `out` with elements [start, start + out.size) after
    checking only `out` and the range, through a prepared argument buffer; `whole` dequantizes
    all of it with fewer checks still."""

    _START, _N, _OUT = 8, 9, 11

    def __init__(
        self,
        codes: Any,
        absmax: Any,
        nested: NestedAbsmax | None,
        codebook: KernelCodebook,
        blocksize: int,
        shape: tuple[int, ...],
    ) -> None:
        if codebook not in QUANT_FORMATS:
            raise ValueError(
                f"codebook: expected one of {', '.join(QUANT_FORMATS)}, got {codebook!r}"
            )
        self.bits = formats.code_bits(codebook)
        self.log2_bs = log2_blocksize(blocksize)
        self.shape = shape
        self.total = total = math.prod(shape)
        check_array(codes, "codes", ("uint8",), formats.code_bytes(total, codebook))
        self.scales = scale_args(absmax, nested, -(-total // blocksize))
        self.codes = codes
        self.values = table("values", codebook)
        self.device = int(codes.data.device_id)
        self.module = kernels.module(device=self.device)
        #: Launches of a range by output dtype name: calls (stream, start, n, out, grid=)
        #: (kernels.PreparedLaunch.call_setting).
        self._launches: dict[str, Any] = {}
        #: Launches over the whole tensor by output dtype name (calls of the output's address,
        #: kernels.PreparedLaunch.call_setting), with the dtype and the output's bytes.
        self._whole: dict[str, tuple[Any, Any, int]] = {}
        self._current_stream = cp.cuda.get_current_stream

    def _launch(self, name: str, n: int = 0, grid: int = 1) -> kernels.PreparedLaunch:
        """A prepared launch of n elements into `name` outputs (its start, output, and size
        when n is 0, set per call) over `grid` blocks (or as a call says)."""
        kernel = f"dequant4_split_{SUFFIX[name]}" if self.bits == 4 else f"dequant8_{SUFFIX[name]}"
        args = (
            self.codes,
            *self.scales,
            self.values,
            np.int64(0),  # start
            np.int64(n),
            self.log2_bs,
            self.codes,  # the output, set per call
        )
        return kernels.PreparedLaunch(
            self.module.function(kernel), grid, self.module.facts.threads, args
        )

    def __call__(self, start: int, out: Any) -> None:
        if not _tokens_ok(out, DTYPES, self.device):
            check_array(out, "out", DTYPES)
            raise ValueError(f"out: on device {out.data.device_id}, the tensor on {self.device}")
        n = out.size
        align = _START_ALIGN[self.bits]
        if start % align or start < 0 or start + n > self.total:
            raise ValueError(
                f"elements [{start}, {start + n}) of {self.total}: start must be a multiple "
                f"of {align}"
            )
        if n == 0:
            return
        name = dtype_name(out.dtype)
        launch = self._launches.get(name)
        if launch is None:
            varying = (self._START, self._N, self._OUT)
            launch = self._launches[name] = self._launch(name).call_setting(varying)
        grid = _grid(n, self.module.facts.dequant_per_block(name))[0]
        launch(self._current_stream().ptr, start, n, out.data.ptr, grid=grid)

    def whole(self, dtype: str, out: Any) -> Any:
        """The whole tensor as `dtype` (one of DTYPES) in `out`, or in a new array of the
        tensor's shape when `out` is None; returns it. None when `out` is not a C-contiguous,
        16-byte aligned CuPy array of `dtype` and the tensor's size on its device (the checked
        path then says what is wrong), or the tensor is empty."""
        found = self._whole.get(dtype)
        if found is None:
            if self.total == 0 or dtype not in DTYPES:
                return None
            grid = _grid(self.total, self.module.facts.dequant_per_block(dtype))[0]
            launch = self._launch(dtype, self.total, grid).call_setting((self._OUT,))
            np_dtype = numpy_dtype(dtype)
            found = self._whole[dtype] = (launch, np_dtype, self.total * np_dtype.itemsize)
        launch, np_dtype, nbytes = found
        if out is None:
            # The memory first, launched into, and the array made around it while the kernel
            # runs (cp.empty's array: see _allocate_ahead).
            memory = cp.cuda.alloc(nbytes)
            launch(self._current_stream().ptr, memory.ptr)
            return cp.ndarray(self.shape, np_dtype, memory)
        if (
            type(out) is not cp.ndarray
            or out.dtype != np_dtype
            or out.size != self.total
            or not c_contiguous(out)
            or out.data.ptr % 16
            or out.data.device_id != self.device
        ):
            return None
        launch(self._current_stream().ptr, out.data.ptr)
        return out
