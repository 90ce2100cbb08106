"""GPU codec and 4-bit matmul throughput: nybble against bitsandbytes 0.50.2 (through torch),
dense bf16 (CuPy / cuBLAS) and the measured device-to-device copy bandwidth, in one process.

    python benchmarks/gpu_codec.py [--repeat 20] [--out-dir DIR]

GPU times are CUDA-event medians. All timed launches are queued behind a spin kernel, so the
events measure the GPU alone, not Python's launch overhead; inputs rotate among enough copies
that the L2 cache cannot hold them between runs. Bandwidth figures count the bytes an
operation must move (codes, scales, input, output), as a percentage of the measured copy
bandwidth (bytes read + written). Beside them, what the hardware allows per call: an empty
kernel, a copy of a dequantize's bytes, a streaming read of a GEMV's bytes (the 1 GiB copy runs
at full speed; smaller transfers pay the ramp up and down). Prints one JSON object per
measurement and a summary of the targets in ../shared/BENCHMARKS.md; writes gpu_codec.json
and gpu_codec.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cupy as cp
import ml_dtypes
import numpy as np
from _timing import RESULTS, emit

import nybble
from nybble import cuda
from nybble.cuda import _launch
from nybble.tensor import NestedAbsmax

SHAPES = [(4096, 4096), (14336, 4096), (8192, 8192)]
BLOCKSIZE = 64
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
NP_DTYPE = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}

_SPIN = cp.RawKernel(
    r"""extern "C" __global__ void spin(long long cycles) {
        const long long t0 = clock64();
        while (clock64() - t0 < cycles) {}
    }""",
    "spin",
)
# Per-call ceilings: the time an empty kernel takes from event to event, and a streaming read
# of n 16-byte vectors (one per thread, evict-first), of the read kernels tried on an H100 the
# fastest at the two larger GEMV shapes.
_EMPTY = cp.RawKernel(r"""extern "C" __global__ void empty() {}""", "empty")
_READ = cp.RawKernel(
    r"""extern "C" __global__ void stream_read(const uint4* p, long long n, unsigned* out) {
        const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        if (i >= n) return;
        const uint4 v = __ldcs(p + i);
        if ((v.x ^ v.y ^ v.z ^ v.w) == 0x9e3779b9u) out[0] = 1u;  // keeps the load
    }""",
    "stream_read",
)


def gpu_median(
    fn: Callable[[int], Any], repeat: int, warmup: int = 3, spin_ms: float = 30.0
) -> float:
    """Median GPU time in seconds of fn(i), i = 0, 1, ...; fn must not wait for the GPU."""
    for i in range(warmup):
        fn(i)
    cp.cuda.Device().synchronize()
    clock_khz = cp.cuda.Device().attributes["ClockRate"]
    _SPIN((1,), (1,), (np.int64(spin_ms * clock_khz),))
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeat)]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(i)
        end.record()
    events[-1][1].synchronize()
    return statistics.median(cp.cuda.get_elapsed_time(s, e) for s, e in events) / 1e3


def gpu_in_a_row(
    fn: Callable[[int], Any], repeat: int, calls: int = 20, spin_ms: float = 30.0
) -> float:
    """GPU time per call of `calls` calls of fn made back to back, as a decoding loop makes
    them (each launch overlaps the previous call's run), queued behind a spin so the host's
    launch cost stays out; the median over `repeat` such runs (at least 5)."""
    fn(0)
    cp.cuda.Device().synchronize()
    clock_khz = cp.cuda.Device().attributes["ClockRate"]
    times = []
    for _ in range(max(repeat // 4, 5)):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        _SPIN((1,), (1,), (np.int64(spin_ms * clock_khz),))
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / calls)
    return statistics.median(times)


def wall_median(fn: Callable[[int], Any], repeat: int, warmup: int = 3) -> float:
    """Median wall time of fn(i) up to the GPU's completion (for calls that wait anyway)."""
    for i in range(warmup):
        fn(i)
    cp.cuda.Device().synchronize()
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loop_per_call(fn: Callable[[int], Any], repeat: int, calls: int = 200) -> float:
    """Wall time per call of `calls` calls made back to back with one wait at the end (as in a
    decoding loop: the host's launch cost and the GPU's run time overlap), median of `repeat`."""
    for i in range(3):
        fn(i)
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        cp.cuda.Device().synchronize()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def stream_read(buf: Any, sink: Any) -> None:
    """Reads the uint8 array `buf` (a multiple of 16 bytes) once, on the GPU."""
    n = buf.size // 16
    _READ((-(-n // 256),), (256,), (buf, np.int64(n), sink))


def copies(nbytes: int) -> int:
    """How many input sets to rotate so that they span three times the L2 cache."""
    l2 = cp.cuda.Device().attributes["L2CacheSize"]
    return max(1, min(16, -(-3 * l2 // max(nbytes, 1))))


def host_bf16(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> Any:
    """Random bf16 data made on the host and uploaded (no bf16 arithmetic on the device)."""
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return cp.asarray(x.astype(ml_dtypes.bfloat16))


def clone(a: Any) -> Any:
    """A copy in new memory, made through an unsigned view (a byte copy in any dtype)."""
    raw = a.view({1: cp.uint8, 2: cp.uint16, 4: cp.uint32}[a.dtype.itemsize])
    return raw.copy().view(a.dtype)


def clone_q(q: nybble.NF4Tensor) -> nybble.NF4Tensor:
    if q.nested is None:
        return nybble.NF4Tensor(clone(q.codes), clone(q.absmax), q.shape, q.blocksize, q.codebook)
    nested = NestedAbsmax(clone(q.nested.codes), clone(q.nested.absmax2), q.nested.offset)
    return nybble.NF4Tensor(clone(q.codes), None, q.shape, q.blocksize, q.codebook, nested)


def codes_bytes(n: int, double_quant: bool = False) -> int:
    """Bytes of an NF4 weight of n elements: codes and scales (double-quantized: one byte per
    block, a float32 per 256 blocks)."""
    blocks = n // BLOCKSIZE
    return n // 2 + (blocks + 4 * -(-blocks // 256) if double_quant else 4 * blocks)


def bnb_modules() -> tuple[Any, Any, Any]:
    import bitsandbytes
    import bitsandbytes.functional as bnbf
    import torch

    return bitsandbytes, bnbf, torch


def torch_view(a: Any, torch: Any) -> Any:
    """A torch view of a CuPy array (bf16 through an int16 view)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


class Bench:
    def __init__(self, repeat: int) -> None:
        self.repeat = repeat
        self.records: list[dict[str, Any]] = []
        self.copy_gbs = 0.0

    def section(self, fn: Callable[..., None], *args: Any) -> None:
        """Runs one part; a failure is recorded and the run goes on to the next part."""
        try:
            fn(*args)
        except Exception as e:
            emit({"what": fn.__name__, "args": repr(args[:2]), "error": repr(e)}, self.records)
        cp.get_default_memory_pool().free_all_blocks()

    def record(self, what: str, shape: str, seconds: float, **extra: Any) -> dict[str, Any]:
        r: dict[str, Any] = {"what": what, "shape": shape, "us": round(seconds * 1e6, 2)}
        nbytes = extra.pop("nbytes", None)
        if nbytes is not None:
            r["gb_per_s"] = round(nbytes / seconds / 1e9, 1)
            if self.copy_gbs:
                r["pct_of_copy"] = round(100 * nbytes / seconds / 1e9 / self.copy_gbs, 1)
        r.update(extra)
        emit(r, self.records)
        return r

    def record_against(
        self,
        prefix: str,
        shape: str,
        times: dict[str, float],
        ours: str,
        moved: dict[str, int] | None = None,
    ) -> None:
        """Records the 1-token timings `times` as "{prefix}{name} 1 token bf16", each with the
        bytes it moved (when given) and, but for `ours`, how many times faster ours was."""
        for name, seconds in times.items():
            extra: dict[str, Any] = {"nbytes": moved[name] if moved else None}
            if name != ours:
                extra["nybble_speedup"] = round(seconds / times[ours], 2)
            self.record(f"{prefix}{name} 1 token bf16", shape, seconds, **extra)

    # --- copy ---------------------------------------------------------------------------

    def copy_bandwidth(self) -> None:
        nbytes = 1 << 30
        src = cp.random.default_rng(0).integers(0, 255, nbytes, dtype=cp.uint8)
        dst = cp.empty_like(src)
        memcpy = gpu_median(lambda i: dst.data.copy_from_device_async(src.data, nbytes), 10)
        kernel = gpu_median(lambda i: cp.copyto(dst, src), 10)
        best = min(memcpy, kernel)
        self.record("copy d2d (cudaMemcpy)", "1 GiB", memcpy, nbytes=2 * nbytes)
        self.record("copy d2d (cupy.copyto)", "1 GiB", kernel, nbytes=2 * nbytes)
        self.copy_gbs = 2 * nbytes / best / 1e9
        empty = gpu_median(lambda i: _EMPTY((1,), (32,), ()), self.repeat)
        self.record("empty kernel (the per-call floor of any kernel)", "-", empty)

    def same_bytes_copy(
        self, nbytes: int, measure: Callable[[Callable[[int], Any], int], float] = gpu_median
    ) -> float:
        """GPU time per call (by `measure`: gpu_median or gpu_in_a_row) of a device-to-device
        copy moving `nbytes` (half read, half written), from enough buffers that none comes
        from L2."""
        k = copies(nbytes // 2)
        srcs = [cp.empty(nbytes // 2, cp.uint8) for _ in range(k)]
        dsts = [cp.empty_like(b) for b in srcs]
        return measure(
            lambda i: dsts[i % k].data.copy_from_device_async(srcs[i % k].data, nbytes // 2),
            self.repeat,
        )

    # --- dequantize / quantize ----------------------------------------------------------

    def codec(self, rows: int, cols: int, bnb: Any) -> None:
        _, bnbf, torch = bnb
        shape, n = f"{rows}x{cols}", rows * cols
        w16 = host_bf16((rows, cols), 1)
        w32 = cp.random.default_rng(1).standard_normal((rows, cols), dtype=cp.float32)
        k = copies(codes_bytes(n))
        q = nybble.quantize(w16)
        qs = [q] + [clone_q(q) for _ in range(k - 1)]
        blocks = [cp.asarray(q.to_blocks())]
        blocks += [clone(blocks[0]) for _ in range(k - 1)]
        packed, state = bnbf.quantize_4bit(
            torch_view(w16, torch), blocksize=BLOCKSIZE, quant_type="nf4"
        )
        theirs = [(packed, state)] + [(packed.clone(), state) for _ in range(k - 1)]
        for dtype in ("bfloat16", "float16", "float32"):
            nbytes = codes_bytes(n) + ITEMSIZE[dtype] * n
            ours = gpu_median(lambda i, d=dtype: qs[i % k].dequantize(d), self.repeat)
            same = self.same_bytes_copy(nbytes)
            self.record(f"copy of the bytes of dequantize -> {dtype}", shape, same, nbytes=nbytes)
            self.record(
                f"nybble dequantize -> {dtype}",
                shape,
                ours,
                nbytes=nbytes,
                pct_of_same_bytes_copy=round(100 * same / ours, 1),
            )
            b36 = gpu_median(
                lambda i, d=dtype: cuda.dequantize_blocks(blocks[i % k], (rows, cols), d),
                self.repeat,
            )
            self.record(f"nybble dequantize blocks36 -> {dtype}", shape, b36, nbytes=nbytes)
            states = []
            for packed, state in theirs:
                s = copy.copy(state)
                s.dtype = getattr(torch, dtype)
                states.append((packed, s))
            their = gpu_median(lambda i, st=states: bnbf.dequantize_4bit(*st[i % k]), self.repeat)
            self.record(
                f"bnb dequantize -> {dtype}",
                shape,
                their,
                nbytes=nbytes,
                nybble_speedup=round(their / ours, 2),
            )
        for dtype, src in (("bfloat16", w16), ("float32", w32)):
            nbytes = ITEMSIZE[dtype] * n + codes_bytes(n)
            kx = copies(ITEMSIZE[dtype] * n)
            xs = [src] + [clone(src) for _ in range(kx - 1)]
            flats = [x.reshape(-1) for x in xs]
            kernel = gpu_median(
                lambda i, f=flats: _launch.quantize(
                    f[i % len(f)], BLOCKSIZE, "nf4", check_finite=False
                ),
                self.repeat,
            )
            self.record(f"nybble quantize kernel <- {dtype}", shape, kernel, nbytes=nbytes)
            api = wall_median(lambda i, xs=xs: nybble.quantize(xs[i % len(xs)]), self.repeat)
            self.record(
                f"nybble quantize (API, with the finite check) <- {dtype}",
                shape,
                api,
                nbytes=nbytes,
            )
            ts = [torch_view(x, torch) for x in xs]
            their = gpu_median(
                lambda i, ts=ts: bnbf.quantize_4bit(
                    ts[i % len(ts)], blocksize=BLOCKSIZE, quant_type="nf4"
                ),
                self.repeat,
            )
            self.record(
                f"bnb quantize <- {dtype}",
                shape,
                their,
                nbytes=nbytes,
                nybble_speedup=round(their / kernel, 2),
            )

    # --- 1-token GEMV and the GEMV / cuBLAS crossover -----------------------------------------

    def gemv(self, rows: int, cols: int, bnb: Any) -> None:
        bitsandbytes, bnbf, torch = bnb
        shape, n = f"{rows}x{cols}", rows * cols
        w16 = host_bf16((rows, cols), 2)
        k = copies(codes_bytes(n))
        q = nybble.quantize(w16)
        qs = [q] + [clone_q(q) for _ in range(k - 1)]
        x = host_bf16((1, cols), 3)
        nbytes = codes_bytes(n) + 2 * (cols + rows)
        ours = gpu_median(lambda i: cuda.nf4_matmul(x, qs[i % k]), self.repeat)
        reads = [cp.empty(nbytes // 16 * 16, cp.uint8) for _ in range(k)]
        sink = cp.zeros(1, cp.uint32)
        read = gpu_median(lambda i: stream_read(reads[i % k], sink), self.repeat)
        self.record("streaming read of the GEMV's bytes", shape, read, nbytes=nbytes)
        self.record(
            "nybble GEMV 1 token bf16",
            shape,
            ours,
            nbytes=nbytes,
            pct_of_streaming_read=round(100 * read / ours, 1),
        )
        packed, state = bnbf.quantize_4bit(
            torch_view(w16, torch), blocksize=BLOCKSIZE, quant_type="nf4"
        )
        theirs = [(packed, state)] + [(packed.clone(), state) for _ in range(k - 1)]
        tx = torch_view(x, torch)
        their = gpu_median(
            lambda i: bitsandbytes.matmul_4bit(
                tx, theirs[i % k][0].t(), quant_state=theirs[i % k][1]
            ),
            self.repeat,
        )
        self.record(
            "bnb matmul_4bit 1 token bf16",
            shape,
            their,
            nbytes=nbytes,
            nybble_speedup=round(their / ours, 2),
        )
        kd = copies(2 * n)
        dense = [w16] + [clone(w16) for _ in range(kd - 1)]
        dense_s = gpu_median(lambda i: x @ dense[i % kd].T, self.repeat)
        self.record(
            "dense bf16 GEMV 1 token (cuBLAS)",
            shape,
            dense_s,
            nbytes=2 * n,
            nybble_speedup=round(dense_s / ours, 2),
        )
        # Per call as a caller sees it (launch overhead included, a wait after each call): the
        # way BENCHMARKS.md's anchors were taken.
        calls = {
            "nybble GEMV": lambda i: cuda.nf4_matmul(x, qs[i % k]),
            "bnb matmul_4bit": lambda i: bitsandbytes.matmul_4bit(
                tx, theirs[i % k][0].t(), quant_state=theirs[i % k][1]
            ),
            "dense bf16 GEMV": lambda i: x @ dense[i % kd].T,
        }
        # The same calls in a row on the GPU, and copies moving the GEMV's bytes for scale.
        row = {name: gpu_in_a_row(fn, self.repeat) for name, fn in calls.items()}
        copy = self.same_bytes_copy(nbytes, gpu_in_a_row)
        self.record("in a row: copy of the GEMV's bytes", shape, copy, nbytes=nbytes)
        moved = {"nybble GEMV": nbytes, "bnb matmul_4bit": nbytes, "dense bf16 GEMV": 2 * n}
        self.record_against("in a row: ", shape, row, "nybble GEMV", moved)
        for how, measure in (("wall per call: ", wall_median), ("back to back: ", loop_per_call)):
            times = {name: measure(fn, self.repeat) for name, fn in calls.items()}
            self.record_against(how, shape, times, "nybble GEMV")
        for m in (2, 4, 8):
            xm = host_bf16((m, cols), 4 + m)
            fused = (
                gpu_median(lambda i, xm=xm: cuda.nf4_gemv(xm, qs[i % k]), self.repeat)
                if m <= _launch.GEMV_MAX_TOKENS
                else None
            )
            via_cublas = gpu_median(
                lambda i, xm=xm: xm @ cuda.dequantize(qs[i % k], "bfloat16").T, self.repeat
            )
            extra = {"fused_us": None if fused is None else round(fused * 1e6, 2)}
            self.record(f"{m} tokens: dequantize + cuBLAS", shape, via_cublas, **extra)

    def gemv_double_quant(self, rows: int, cols: int, bnb: Any) -> None:
        """The 1-token GEMV of a double-quantized weight (QLoRA's storage), against bnb's with
        compressed statistics and against decoding the scales first: GPU time per call and in
        a row, wall time per call back to back."""
        bitsandbytes, bnbf, torch = bnb
        shape, n = f"{rows}x{cols}", rows * cols
        w16 = host_bf16((rows, cols), 2)
        k = copies(codes_bytes(n, True))
        q = nybble.quantize(w16, double_quant=True)
        qs = [q] + [clone_q(q) for _ in range(k - 1)]
        x = host_bf16((1, cols), 3)
        nbytes = codes_bytes(n, True) + 2 * (cols + rows)
        packed, state = bnbf.quantize_4bit(
            torch_view(w16, torch), blocksize=BLOCKSIZE, quant_type="nf4", compress_statistics=True
        )
        theirs = [(packed, state)] + [(packed.clone(), state) for _ in range(k - 1)]
        tx = torch_view(x, torch)
        # The unfused way for comparison: the scales decoded by a kernel of their own into a
        # float32 buffer, then the plain GEMV.
        nblocks = n // BLOCKSIZE
        plain = [
            nybble.NF4Tensor(qi.codes, cp.empty(nblocks, cp.float32), q.shape, q.blocksize)
            for qi in qs
        ]

        def two_kernels(i: int) -> Any:
            assert qs[i % k].nested is not None
            _launch.decode_scales(qs[i % k].nested, nblocks, plain[i % k].absmax)
            return cuda.nf4_matmul(x, plain[i % k])

        calls = {
            "nybble DQ GEMV": lambda i: cuda.nf4_matmul(x, qs[i % k]),
            "bnb DQ matmul_4bit": lambda i: bitsandbytes.matmul_4bit(
                tx, theirs[i % k][0].t(), quant_state=theirs[i % k][1]
            ),
            "decode scales + plain GEMV": two_kernels,
        }
        for how, measure in (
            ("", gpu_median),
            ("in a row: ", gpu_in_a_row),
            ("back to back: ", loop_per_call),
        ):
            times = {name: measure(fn, self.repeat) for name, fn in calls.items()}
            moved = None if how == "back to back: " else dict.fromkeys(times, nbytes)
            self.record_against(how, shape, times, "nybble DQ GEMV", moved)

    # --- QLoRA layer forward + backward ---------------------------------------------------

    def qlora(self, rows: int, cols: int, tokens: int = 4096, r: int = 16) -> None:
        shape = f"{rows}x{cols}, {tokens} tokens, r={r}"
        w = host_bf16((rows, cols), 5, 0.02)
        q = nybble.quantize(w)
        a, b = host_bf16((r, cols), 6, 0.01), host_bf16((rows, r), 7, 0.01)
        x, dy = host_bf16((tokens, cols), 8), host_bf16((tokens, rows), 9)
        s = 2.0  # a Python float: the products stay bf16

        def step(base_fwd: Callable[[Any], Any], base_bwd: Callable[[Any], Any]) -> Any:
            h = x @ a.T
            y = base_fwd(x) + (h @ b.T) * s
            dh = (dy @ b) * s
            dx = base_bwd(dy) + dh @ a
            grad_a = dh.T @ x
            grad_b = (dy.T @ h) * s
            return y, dx, grad_a, grad_b

        dense = gpu_median(lambda i: step(lambda t: t @ w.T, lambda g: g @ w), self.repeat)
        ours = gpu_median(
            lambda i: step(lambda t: cuda.nf4_matmul(t, q), lambda g: cuda.nf4_matmul_t(g, q)),
            self.repeat,
        )
        self.record("dense bf16 LoRA fwd+bwd", shape, dense)
        self.record("nybble QLoRA fwd+bwd", shape, ours, ratio_to_dense=round(ours / dense, 3))


def summary(records: list[dict[str, Any]], copy_gbs: float) -> dict[str, Any]:
    """The targets of BENCHMARKS.md, each with the worst figure behind it."""

    def target(prefix: str, key: str, ok: Callable[[float], bool], worst: Any) -> dict[str, Any]:
        values = [r[key] for r in records if r["what"].startswith(prefix) and key in r]
        return {
            "worst": worst(values) if values else None,
            "met": bool(values) and all(map(ok, values)),
        }

    gemv = {}
    # The GEMV timed four ways: GPU time per call, GPU time per call in a row, and wall time
    # per call with a wait after each call or one wait after a loop of calls.
    for how, prefix in (
        ("", ""),
        (", calls in a row", "in a row: "),
        (", wall per call", "wall per call: "),
        (", back to back", "back to back: "),
    ):
        if how in ("", ", calls in a row"):
            gemv[f"GEMV >= 70% of copy{how or ' on bytes read'}"] = target(
                f"{prefix}nybble GEMV 1 token", "pct_of_copy", lambda v: v >= 70, min
            )
        gemv[f"GEMV >= 4x bnb{how}"] = target(
            f"{prefix}bnb matmul_4bit", "nybble_speedup", lambda v: v >= 4, min
        )
        gemv[f"GEMV >= 2.5x dense bf16{how}"] = target(
            f"{prefix}dense bf16 GEMV", "nybble_speedup", lambda v: v >= 2.5, min
        )
        if how in ("", ", calls in a row"):  # double-quantized weights, against bnb's
            gemv[f"DQ GEMV >= 70% of copy{how or ' on bytes read'}"] = target(
                f"{prefix}nybble DQ GEMV", "pct_of_copy", lambda v: v >= 70, min
            )
            gemv[f"DQ GEMV >= 4x bnb DQ{how}"] = target(
                f"{prefix}bnb DQ matmul_4bit", "nybble_speedup", lambda v: v >= 4, min
            )

    def ceiling(prefix: str, key: str) -> dict[str, float]:
        return {r["shape"]: r[key] for r in records if r["what"].startswith(prefix) and key in r}

    return {
        "copy_gb_per_s": round(copy_gbs, 1),
        # What the hardware allows per call, for the % of copy targets: a copy of the
        # dequantize's bytes, and a streaming read of the GEMV's (% of the 1 GiB copy).
        "ceiling: copy of the bytes of dequantize -> float32, % of copy": ceiling(
            "copy of the bytes of dequantize -> float32", "pct_of_copy"
        ),
        "ceiling: streaming read of the GEMV's bytes, % of copy": ceiling(
            "streaming read of the GEMV's bytes", "pct_of_copy"
        ),
        "dequantize >= 85% of copy": target(
            "nybble dequantize", "pct_of_copy", lambda v: v >= 85, min
        ),
        "quantize >= 60% of copy (kernel)": target(
            "nybble quantize kernel", "pct_of_copy", lambda v: v >= 60, min
        ),
        **gemv,
        "QLoRA fwd+bwd <= 1.10x dense": target(
            "nybble QLoRA", "ratio_to_dense", lambda v: v <= 1.10, max
        ),
    }


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = [r for r in records if "pct_of_copy" in r and not r["what"].startswith("copy")]
    fig, axes = plt.subplots(
        1, 2, figsize=(16, 0.28 * len(bw) + 2), gridspec_kw={"width_ratios": [3, 1]}
    )
    labels = [f"{r['what']} [{r['shape']}]" for r in bw]
    colors = ["tab:blue" if r["what"].startswith("nybble") else "tab:gray" for r in bw]
    axes[0].barh(labels, [r["pct_of_copy"] for r in bw], color=colors)
    for x, c in ((85, "green"), (70, "orange"), (60, "red")):
        axes[0].axvline(x, color=c, ls="--", lw=0.8)
    axes[0].set_xlabel("% of measured device-to-device copy bandwidth (bytes that must move)")
    axes[0].invert_yaxis()
    axes[0].tick_params(axis="y", labelsize=7)
    ql = [r for r in records if "ratio_to_dense" in r]
    axes[1].bar([r["shape"].split(",")[0] for r in ql], [r["ratio_to_dense"] for r in ql])
    axes[1].axhline(1.10, color="red", ls="--", lw=0.8)
    axes[1].set_ylabel("QLoRA fwd+bwd time / dense bf16 LoRA")
    axes[1].set_ylim(0.9, max([1.2] + [r["ratio_to_dense"] + 0.05 for r in ql]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    bench = Bench(args.repeat)
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    bnb = bnb_modules()
    bench.copy_bandwidth()
    for rows, cols in SHAPES:
        bench.section(bench.codec, rows, cols, bnb)
    for rows, cols in SHAPES:
        bench.section(bench.gemv, rows, cols, bnb)
    for rows, cols in SHAPES:
        bench.section(bench.gemv_double_quant, rows, cols, bnb)
    for rows, cols in SHAPES[:2]:
        bench.section(bench.qlora, rows, cols)
    result = {
        "device": device,
        "bitsandbytes": bnb[0].__version__,
        "torch": bnb[2].__version__,
        "cupy": cp.__version__,
        "gemv_max_tokens": _launch.GEMV_MAX_TOKENS,
        "summary": summary(bench.records, bench.copy_gbs),
        "records": bench.records,
    }
    (args.out_dir / "gpu_codec.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    plot(bench.records, args.out_dir / "gpu_codec.png")


if __name__ == "__main__":
    main()
