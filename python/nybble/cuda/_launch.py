"""One launcher per kernel of `kernels/nf4.cu`. A RawKernel checks nothing, so each launcher
checks dtypes, contiguity, alignment (the kernels move 16 bytes at a time) and sizes first, and
raises ValueError: a wrong argument never reaches the GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reference
from .._arrays import dtype_name
from ..tensor import NESTED_BLOCKSIZE, NestedAbsmax
from . import _module

try:
    import cupy as cp
except ImportError:  # importable without CuPy (the CI compile check reads kernel_names)
    cp = None

THREADS = 256  # the kernels' THREADS
#: Element types, in the order of the kernels' Elem<D>.
DTYPES = ("float32", "float16", "bfloat16")
_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_VEC = {"float32": 4, "float16": 8, "bfloat16": 8}  # elements in 16 bytes (Elem<D>::VEC)
#: 16-byte stores per thread when dequantizing (the kernels' Elem<D>::STEPS).
_STEPS = {"float32": 1, "float16": 4, "bfloat16": 4}
LAYOUTS = ("split", "blocks36", "high_first")
QUANT_FORMATS = ("nf4", "fp4", "int8", "dynamic8")
#: Tokens the fused GEMV takes: the tensor-core GEMV (16-bit tokens) multiplies 8 tokens at the
#: cost of one; float32 tokens go 4 at a time through gemv_f32_m1 .. m4. Beyond 8 tokens
#: dequantize + cuBLAS is faster on an H100 (benchmarks/gpu_codec.py measures the crossover).
GEMV_MAX_TOKENS = 8
GEMV_F32_TOKENS = 4
GEMV_THREADS = 128  # the kernels' GEMV_THREADS (float32 GEMV)
GEMV_ROWS_PER_BLOCK = 8  # the kernels' GEMV_ROWS (float32 GEMV)
TC_THREADS = 256  # the kernels' TC_WARPS * 32 (tensor-core GEMV)
TC_ROWS = 16  # the kernels' TC_ROWS
TC_LUT_BYTES = 256 * 256  # the kernels' TC_LUT_BYTES: the pair table
TC_STAGES = 3  # the kernels' TC_STAGES
TC_STAGE_GROUPS = 16  # the kernels' TC_STAGE_GROUPS


def tc_shared_bytes(
    group: int, stages: int = TC_STAGES, stage_groups: int = TC_STAGE_GROUPS
) -> int:
    """Dynamic shared memory of the tensor-core GEMV (the kernels' TC_LUT_BYTES and TcStage):
    the pair table, then `stages` stages of 16 padded rows of codes and of scales."""
    row_bytes = stage_groups * group // 2
    stage = TC_ROWS * (row_bytes + 32) + TC_ROWS * (stage_groups + 1) * 4
    return TC_LUT_BYTES + stages * stage


def tc_blocks(kernel: Any, tiles: int, dynamic_shared: int) -> int:
    """Blocks to launch of the tensor-core GEMV `kernel` for `tiles` tiles of 16 rows: as many as
    the GPU holds at once, at most one per tile. A block takes its tiles in turn (blockIdx.x,
    + gridDim.x, ...) as one stream of stages, so that it fills its table and its pipeline
    once rather than once per tile."""
    return min(tiles, _module.resident_blocks(kernel, TC_THREADS, dynamic_shared))


_NONE = 2**64 - 1  # first_bad before any non-finite value is seen


def kernel_names() -> list[str]:
    """Every kernel a launcher may start."""
    names = [f"dequant4_{lay}_{s}" for lay in LAYOUTS for s in _SUFFIX.values()]
    names += [f"dequant8_{s}" for s in _SUFFIX.values()]
    names += [f"quantize_{f}_{s}" for f in QUANT_FORMATS for s in _SUFFIX.values()]
    names += [f"gemv_f32_m{m}" for m in range(1, GEMV_F32_TOKENS + 1)]
    names += [
        f"gemv_tc_{s}_g{g}{dq}" for s in ("f16", "bf16") for g in (32, 64) for dq in ("", "_dq")
    ]
    return [*names, "narrow_f64", "decode_scales"]


# --- argument checks ---------------------------------------------------------------------


def check_array(a: Any, what: str, dtypes: tuple[str, ...], size: int | None = None) -> None:
    """A C-contiguous, 16-byte aligned CuPy array on the current device, of one of `dtypes`
    (and `size` elements)."""
    if not isinstance(a, cp.ndarray):
        raise ValueError(f"{what}: expected a CuPy array, got {type(a).__name__}")
    if dtype_name(a.dtype) not in dtypes:
        raise ValueError(f"{what}: expected dtype {' or '.join(dtypes)}, got {dtype_name(a.dtype)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous array, got strides {a.strides}")
    if a.data.ptr % 16:
        raise ValueError(f"{what}: expected a 16-byte aligned buffer, got address {a.data.ptr:#x}")
    if a.device.id != cp.cuda.runtime.getDevice():
        raise ValueError(f"{what}: on device {a.device.id}, not the current device")
    if size is not None and a.size != size:
        raise ValueError(f"{what}: expected {size} elements, got {a.size}")


def _log2_blocksize(blocksize: int) -> np.int32:
    if blocksize < 32 or blocksize > 4096 or blocksize & (blocksize - 1):
        raise ValueError(f"blocksize must be a power of two from 32 to 4096, got {blocksize}")
    return np.int32(blocksize.bit_length() - 1)


def _grid(n: int, per_block: int) -> tuple[int]:
    return (-(-n // per_block),)


# --- tables from the oracle, one device copy each ------------------------------------------

_tables: dict[tuple[str, str, int], Any] = {}


def bucket_tables(thresholds: np.ndarray, code_of_rank: np.ndarray) -> tuple[Any, Any]:
    """The kernels' encoding tables for NF4 and FP4 magnitudes: bucket b of [-1, 1] is
    [b/32 - 1, (b+1)/32 - 1); thr[b] is the one threshold inside it (+inf if none) and
    codes[b] the codes below and above it, so code(v) = codes[b][v > thr[b]]."""
    edges = (np.arange(-32, 33, dtype=np.float32) / np.float32(32)).astype(np.float32)
    thr = np.full(edges.size, np.inf, np.float32)
    codes = np.zeros((edges.size, 2), np.uint8)
    for b, lo in enumerate(edges):
        inside = thresholds[(thresholds >= lo) & (thresholds < lo + np.float32(1 / 32))]
        assert inside.size <= 1, "two thresholds in one bucket"
        rank = int(np.count_nonzero(thresholds < lo))
        thr[b] = inside[0] if inside.size else np.inf
        codes[b] = code_of_rank[rank], code_of_rank[min(rank + 1, code_of_rank.size - 1)]
    return thr, codes.ravel()


def _host_table(kind: str, codebook: str) -> np.ndarray:
    if kind == "values":
        return reference.codebook_values(codebook)
    if codebook == "nf4":
        thr, codes = bucket_tables(reference.NF4_MIDPOINTS, np.arange(16, dtype=np.uint8))
    elif codebook == "fp4":
        thr, codes = bucket_tables(reference.FP4_THRESHOLDS, reference.FP4_MAGNITUDE_CODES)
    elif codebook == "dynamic8":  # binary search over the midpoints, padded with +inf to 256
        thr = np.append(reference.DYNAMIC_MIDPOINTS, np.float32(np.inf)).astype(np.float32)
        codes = np.zeros(1, np.uint8)
    else:  # int8 is arithmetic
        thr, codes = np.zeros(1, np.float32), np.zeros(1, np.uint8)
    return thr if kind == "thresholds" else codes


def table(kind: str, codebook: str) -> Any:
    """A table of nybble.reference on the current device: `values` (the codebook), or the
    encoding tables `thresholds` and `codes` the quantize kernels read."""
    key = (kind, codebook, int(cp.cuda.runtime.getDevice()))
    if key not in _tables:
        _tables[key] = cp.asarray(_host_table(kind, codebook))
    return _tables[key]


def _no_scales() -> tuple[Any, ...]:
    """SCALE_PARAMS for a kernel that does not read them (valid pointers all the same)."""
    unused = table("values", "nf4")
    return (unused, unused, unused, unused, np.float32(0), np.int32(0))


def _scale_args(absmax: Any, nested: NestedAbsmax | None, nblocks: int) -> tuple[Any, ...]:
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


# --- launchers ------------------------------------------------------------------------------


def dequantize4(
    codes: Any,
    absmax: Any,
    nested: NestedAbsmax | None,
    codebook: str,
    layout: str,
    blocksize: int,
    total: int,
    start: int,
    out: Any,
) -> None:
    """out[:] = elements [start, start + out.size) of a 4-bit tensor of `total` elements."""
    if codebook not in ("nf4", "fp4"):
        raise ValueError(f"codebook: expected nf4 or fp4, got {codebook!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    log2_bs = _log2_blocksize(blocksize)
    check_array(out, "out", DTYPES)
    n = out.size
    if start % 32 or start < 0 or start + n > total:
        raise ValueError(
            f"elements [{start}, {start + n}) of {total}: start must be a multiple of 32"
        )
    nblocks = -(-total // blocksize)
    if layout == "blocks36":
        if blocksize != 64 or absmax is not None or nested is not None:
            raise ValueError("the 36-byte layout has blocks of 64 and carries its own scales")
        check_array(codes, "buf", ("uint8",), nblocks * 36)
        scales = _no_scales()
    else:
        check_array(codes, "codes", ("uint8",), -(-total // 2))
        scales = _scale_args(absmax, nested, nblocks)
    if n == 0:
        return
    name = dtype_name(out.dtype)
    args = (codes, *scales, table("values", codebook), np.int64(start), np.int64(n), log2_bs, out)
    grid = _grid(n, THREADS * _STEPS[name] * _VEC[name])
    _module.function(f"dequant4_{layout}_{_SUFFIX[name]}")(grid, (THREADS,), args)


def dequantize8(
    codes: Any,
    absmax: Any,
    nested: NestedAbsmax | None,
    codebook: str,
    blocksize: int,
    total: int,
    start: int,
    out: Any,
) -> None:
    """out[:] = elements [start, start + out.size) of an 8-bit (int8 or dynamic8) tensor."""
    if codebook not in ("int8", "dynamic8"):
        raise ValueError(f"codebook: expected int8 or dynamic8, got {codebook!r}")
    log2_bs = _log2_blocksize(blocksize)
    check_array(out, "out", DTYPES)
    n = out.size
    if start % 16 or start < 0 or start + n > total:
        raise ValueError(
            f"elements [{start}, {start + n}) of {total}: start must be a multiple of 16"
        )
    check_array(codes, "codes", ("uint8",), total)
    scales = _scale_args(absmax, nested, -(-total // blocksize))
    if n == 0:
        return
    name = dtype_name(out.dtype)
    args = (codes, *scales, table("values", codebook), np.int64(start), np.int64(n), log2_bs, out)
    grid = _grid(n, THREADS * _STEPS[name] * _VEC[name])
    _module.function(f"dequant8_{_SUFFIX[name]}")(grid, (THREADS,), args)


def quantize(x: Any, blocksize: int, codebook: str, check_finite: bool = True) -> tuple[Any, Any]:
    """(codes, absmax) of a flat f32/f16/bf16 array. A non-finite value is a ValueError naming
    the first flat index; finding out costs one 8-byte read back, and so a wait for the GPU,
    which `check_finite=False` skips (for inputs finite by construction)."""
    if codebook not in QUANT_FORMATS:
        raise ValueError(f"codebook: expected one of {', '.join(QUANT_FORMATS)}, got {codebook!r}")
    log2_bs = _log2_blocksize(blocksize)
    check_array(x, "x", DTYPES)
    if x.ndim != 1:
        raise ValueError(f"x: expected a flat array, got shape {x.shape}")
    n = x.size
    bits = 4 if codebook in ("nf4", "fp4") else 8
    codes = cp.empty(-(-n // 2) if bits == 4 else n, cp.uint8)
    absmax = cp.empty(-(-n // blocksize), cp.float32)
    if n == 0:
        return codes, absmax
    # Filled on the device, no wait; unread without the check, so then not filled at all.
    first_bad = cp.full(1, np.uint64(_NONE), cp.uint64) if check_finite else cp.empty(1, cp.uint64)
    args = (
        x,
        np.int64(n),
        log2_bs,
        np.uint32(reference.ZERO_CODE[codebook]),
        table("thresholds", codebook),
        table("codes", codebook),
        codes,
        absmax,
        first_bad,
    )
    per_thread = 4 * _VEC[dtype_name(x.dtype)]  # 64 bytes of input
    kernel = _module.function(f"quantize_{codebook}_{_SUFFIX[dtype_name(x.dtype)]}")
    kernel(_grid(n, THREADS * per_thread), (THREADS,), args)
    bad = int(first_bad.get()[0]) if check_finite else _NONE
    if bad != _NONE:
        raise ValueError(f"input has a non-finite value (NaN or inf) at flat index {bad}")
    return codes, absmax


def decode_scales(nested: NestedAbsmax, n: int, out: Any) -> None:
    """out[b] = the float32 scale of block b < n of a double-quantized tensor."""
    check_array(out, "out", ("float32",), n)
    scales = _scale_args(None, nested, n)
    if n:
        kernel = _module.function("decode_scales")
        kernel(_grid(n, THREADS), (THREADS,), (*scales, np.int64(n), out))


def narrow_f64(x: Any) -> Any:
    """A flat float64 array rounded to float32 (nearest even), keeping subnormal results,
    which CuPy's `astype` flushes to zero."""
    check_array(x, "x", ("float64",))
    if x.ndim != 1:
        raise ValueError(f"x: expected a flat array, got shape {x.shape}")
    y = cp.empty(x.size, cp.float32)
    if x.size:
        _module.function("narrow_f64")(_grid(x.size, THREADS), (THREADS,), (x, np.int64(x.size), y))
    return y


def gemv_supported(codebook: str, shape: tuple[int, ...]) -> bool:
    """Whether the fused GEMV takes this weight: 4-bit codes, 2-D, rows of 32k elements."""
    return codebook in ("nf4", "fp4") and len(shape) == 2 and shape[1] % 32 == 0 and shape[1] > 0


class GemvWeight:
    """A 4-bit weight W of `shape` [rows, cols] checked once for the fused GEMV, so that each
    call, `weight(x, y)`: y[m, rows] = x[m, cols] @ W.T for 1 <= m <= 8, only checks its
    tokens. Per-call host time matters here: a 1-token GEMV of a 4096 x 4096 weight runs
    about 9 us on an H100, about what the Python around one launch costs."""

    def __init__(
        self,
        codes: Any,
        absmax: Any,
        nested: NestedAbsmax | None,
        codebook: str,
        shape: tuple[int, int],
        blocksize: int,
    ) -> None:
        if not gemv_supported(codebook, shape):
            raise ValueError(
                f"the fused GEMV takes a 2-D nf4/fp4 weight whose rows are a multiple of 32 "
                f"elements, got {codebook} {shape}"
            )
        self.rows, self.cols = rows, cols = shape
        self.log2_bs = _log2_blocksize(blocksize)
        check_array(codes, "codes", ("uint8",), rows * cols // 2)
        self.scales = _scale_args(absmax, nested, -(-(rows * cols) // blocksize))
        self.codes = codes
        self.device = codes.device.id
        self.values = table("values", codebook)
        # Groups of 64 elements need rows and scales that start on 64-element boundaries.
        self.group = 64 if cols % 64 == 0 and blocksize >= 64 else 32
        if rows * cols // self.group >= 2**32:  # the kernel numbers groups in 32 bits
            raise ValueError(f"the fused GEMV takes fewer than 2^37 weights, got shape {shape}")
        self.smem = tc_shared_bytes(self.group)
        self.dims = (np.int32(rows), np.int32(cols))
        # The tensor-core kernels by token dtype; their _dq variants decode nested scales.
        dq = "" if nested is None else "_dq"
        self.tc_names = {d: f"gemv_tc_{_SUFFIX[d]}_g{self.group}{dq}" for d in DTYPES[1:]}
        self.tiles = -(-rows // TC_ROWS)
        self._kernels: dict[str, Any] = {}  # the float32 GEMVs
        self._tc_launches: dict[str, tuple[Any, tuple[int]]] = {}  # tensor-core: kernel, grid

    def __call__(self, x: Any, y: Any) -> None:
        rows, cols = self.rows, self.cols
        check_array(x, "x", DTYPES)
        if x.ndim != 2 or x.shape[1] != cols or not 1 <= x.shape[0] <= GEMV_MAX_TOKENS:
            raise ValueError(
                f"x: expected shape (m, {cols}) with 1 <= m <= {GEMV_MAX_TOKENS}, got {x.shape}"
            )
        m = x.shape[0]
        name = dtype_name(x.dtype)
        check_array(y, "y", (name,), m * rows)
        if y.shape != (m, rows):
            raise ValueError(f"y: expected shape {(m, rows)}, got {y.shape}")
        if x.device.id != self.device:
            raise ValueError(f"x: on device {x.device.id}, the weight on device {self.device}")
        if rows == 0:
            return
        if name == "float32":
            args = (self.codes, *self.scales, self.values, *self.dims, self.log2_bs)
            for t in range(0, m, GEMV_F32_TOKENS):  # rows of x and y: contiguous slices
                xt, yt = x[t : t + GEMV_F32_TOKENS], y[t : t + GEMV_F32_TOKENS]
                kernel = self._kernel(f"gemv_f32_m{xt.shape[0]}")
                kernel(_grid(rows, GEMV_ROWS_PER_BLOCK), (GEMV_THREADS,), (xt, *args, yt))
            return
        kernel, grid = self._tc_launch(self.tc_names[name])
        args = (x, self.codes, *self.scales, self.values, *self.dims, np.int32(m), self.log2_bs, y)
        kernel(grid, (TC_THREADS,), args, shared_mem=self.smem)

    def _kernel(self, name: str) -> Any:
        """`_module.function`, remembered: the weight stays on one device."""
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = _module.function(name)
        return kernel

    def _tc_launch(self, name: str) -> tuple[Any, tuple[int]]:
        """The tensor-core kernel `name` and its grid (tc_blocks), remembered likewise."""
        launch = self._tc_launches.get(name)
        if launch is None:
            kernel = _module.function(name, self.smem)
            launch = (kernel, (tc_blocks(kernel, self.tiles, self.smem),))
            self._tc_launches[name] = launch
        return launch
