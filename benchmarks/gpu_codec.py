"""The GPU path as users call it, against bitsandbytes 0.50.2 + PEFT (through torch), dense bf16
and the measured copy bandwidth, in one process (docs/benchmarks.md gives the targets).

    python benchmarks/gpu_codec.py [--repeat 20] [--out-dir DIR] [--sections a,b,...]

Two kinds of figure for each operation. **kernel**: CUDA-event medians of launches queued
behind a spin kernel, so the events see the GPU alone, not the host's launch work; **per
call**: CUDA events around each call of the public Python API with the GPU idle before it
(nothing queued ahead), so the figure includes everything the host does for the call, as a
user calling nybble from Python gets. Inputs rotate among enough copies that the L2 cache
cannot hold them between runs. Bandwidth figures count the bytes an operation must move
(codes, scales, input, output), as a percentage of the measured copy bandwidth (bytes read +
written). Beside them, what the hardware allows: an empty kernel, a copy of a dequantize's
bytes, a streaming read of a GEMV's bytes. Prints one JSON object per measurement and a
summary of the targets; writes gpu_codec.json and gpu_codec.png.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
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
from nybble import _core, cuda
from nybble.backends.cuda import kernels, launch
from nybble.backends.cuda.arrays import as_cupy
from nybble.formats import NestedAbsmax

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


#: Calls a per-call figure takes the median of, at least: the host's share of a call varies
#: by several microseconds from call to call on the GPU machine.
PER_CALL_REPEAT = 100


def per_call(fn: Callable[[int], Any], repeat: int, warmup: int = 3) -> float:
    """Median GPU time from an event recorded just before fn(i) to one just after it, the GPU
    idle before each call: the call as a user makes it, the host's work included (over at
    least PER_CALL_REPEAT calls)."""
    for i in range(warmup):
        fn(i)
    cp.cuda.Device().synchronize()
    times = []
    for i in range(max(repeat, PER_CALL_REPEAT)):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
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


def gemv_weight(
    q: nybble.NF4Tensor,
    module: kernels.KernelModule | None = None,
    programmatic: bool | None = None,
) -> launch.GemvWeight:
    """The library's own GEMV launcher for q, on the kernels of `module` (default: the
    library's build) and launched programmatically or not (default: where the GPU allows), for
    same-process comparisons."""
    absmax = None if q.nested is not None else q.absmax
    return launch.GemvWeight(
        q.codes, absmax, q.nested, q.codebook, q.shape, q.blocksize, module, programmatic
    )


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
        empty_call = per_call(lambda i: _EMPTY((1,), (32,), ()), self.repeat)
        self.record("per call: an empty CuPy kernel launch", "-", empty_call)
        # The floor of nybble's own launch paths, a kernel with no work (narrow_f64 over 0
        # elements), both through the core's launcher (_core.KernelLaunch): a prepared launch's
        # call (kernels.PreparedLaunch: its lock and slots set in Python, then the core's
        # launch), and the core's launch called directly (what the GEMV's fast path and a whole
        # dequantize use).
        module = kernels.module()
        dummy = cp.empty(2, cp.float64)
        floor = kernels.PreparedLaunch(
            module.function("narrow_f64"), 1, 32, (dummy, np.int64(0), dummy)
        )
        prepared = per_call(lambda i: floor(), self.repeat)
        self.record(
            "per call: an empty kernel, prepared launch (PreparedLaunch, then the core's)",
            "-",
            prepared,
        )
        core = floor.call_setting(())
        stream = cp.cuda.get_current_stream().ptr
        native = per_call(lambda i: core(stream), self.repeat)
        self.record("per call: an empty kernel, the core's launch (the floor)", "-", native)

    def same_bytes_copy(
        self, nbytes: int, measure: Callable[[Callable[[int], Any], int], float] = gpu_median
    ) -> float:
        """GPU time per call (by `measure`) of a device-to-device copy moving `nbytes` (half
        read, half written), from enough buffers that none comes from L2."""
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
        packed, state = bnbf.quantize_4bit(
            torch_view(w16, torch), blocksize=BLOCKSIZE, quant_type="nf4"
        )
        theirs = [(packed, state)] + [(packed.clone(), state) for _ in range(k - 1)]
        for dtype in ("bfloat16", "float32"):
            nbytes = codes_bytes(n) + ITEMSIZE[dtype] * n
            outs = [cp.empty((rows, cols), NP_DTYPE[dtype]) for _ in range(2)]
            same = self.same_bytes_copy(nbytes)
            self.record(f"copy of the bytes of dequantize -> {dtype}", shape, same, nbytes=nbytes)
            kernel = gpu_median(
                lambda i, o=outs: qs[i % k].dequantize(o[0].dtype, o[i % 2]), self.repeat
            )
            self.record(
                f"kernel: nybble dequantize -> {dtype}",
                shape,
                kernel,
                nbytes=nbytes,
                pct_of_same_bytes_copy=round(100 * same / kernel, 1),
            )
            call = per_call(lambda i, d=dtype: qs[i % k].dequantize(d), self.repeat)
            self.record(
                f"per call: nybble q.dequantize({dtype!r})",
                shape,
                call,
                nbytes=nbytes,
                host_us=round((call - kernel) * 1e6, 2),
            )
            into = per_call(
                lambda i, o=outs: qs[i % k].dequantize(o[0].dtype, o[i % 2]), self.repeat
            )
            self.record(
                f"per call: nybble q.dequantize({dtype!r}, out=...)",
                shape,
                into,
                nbytes=nbytes,
                host_us=round((into - kernel) * 1e6, 2),
            )
            states = []
            for p, st in theirs:
                s = copy.copy(st)
                s.dtype = getattr(torch, dtype)
                states.append((p, s))
            their = per_call(lambda i, st=states: bnbf.dequantize_4bit(*st[i % k]), self.repeat)
            self.record(
                f"per call: bnb dequantize_4bit -> {dtype}",
                shape,
                their,
                nbytes=nbytes,
                nybble_speedup=round(their / call, 2),
            )
        for dtype, src in (("bfloat16", w16), ("float32", w32)):
            nbytes = ITEMSIZE[dtype] * n + codes_bytes(n)
            kx = copies(ITEMSIZE[dtype] * n)
            xs = [src] + [clone(src) for _ in range(kx - 1)]
            flats = [x.reshape(-1) for x in xs]
            kernel = gpu_median(
                lambda i, f=flats: launch.quantize(f[i % len(f)], BLOCKSIZE, "nf4", False),
                self.repeat,
            )
            self.record(f"kernel: nybble quantize <- {dtype}", shape, kernel, nbytes=nbytes)
            call = per_call(lambda i, xs=xs: nybble.quantize(xs[i % len(xs)]), self.repeat)
            self.record(
                f"per call: nybble.quantize <- {dtype} (finite check included)",
                shape,
                call,
                nbytes=nbytes,
                host_us=round((call - kernel) * 1e6, 2),
            )
            ts = [torch_view(x, torch) for x in xs]
            their = per_call(
                lambda i, ts=ts: bnbf.quantize_4bit(
                    ts[i % len(ts)], blocksize=BLOCKSIZE, quant_type="nf4"
                ),
                self.repeat,
            )
            self.record(
                f"per call: bnb quantize_4bit <- {dtype}",
                shape,
                their,
                nbytes=nbytes,
                nybble_speedup=round(their / call, 2),
            )

    # --- 1-token GEMV ------------------------------------------------------------------------

    def gemv(self, rows: int, cols: int, bnb: Any, double_quant: bool = False) -> None:
        bitsandbytes, bnbf, torch = bnb
        shape, n = f"{rows}x{cols}", rows * cols
        tag = "DQ " if double_quant else ""
        w16 = host_bf16((rows, cols), 2)
        k = copies(codes_bytes(n, double_quant))
        q = nybble.quantize(w16, double_quant=double_quant)
        qs = [q] + [clone_q(q) for _ in range(k - 1)]
        x = host_bf16((1, cols), 3)
        y = cp.empty((1, rows), x.dtype)
        nbytes = codes_bytes(n, double_quant) + 2 * (cols + rows)
        kernel = gpu_median(lambda i: cuda.nf4_matmul(x, qs[i % k], out=y), self.repeat)
        if not double_quant:
            reads = [cp.empty(nbytes // 16 * 16, cp.uint8) for _ in range(k)]
            sink = cp.zeros(1, cp.uint32)
            read = gpu_median(lambda i: stream_read(reads[i % k], sink), self.repeat)
            self.record("streaming read of the GEMV's bytes", shape, read, nbytes=nbytes)
        self.record(
            f"kernel: nybble {tag}GEMV 1 token bf16",
            shape,
            kernel,
            nbytes=nbytes,
            **({} if double_quant else {"pct_of_streaming_read": round(100 * read / kernel, 1)}),
        )
        call = per_call(lambda i: cuda.nf4_matmul(x, qs[i % k]), self.repeat)
        self.record(
            f"per call: nybble {tag}cuda.nf4_matmul 1 token bf16",
            shape,
            call,
            nbytes=nbytes,
            host_us=round((call - kernel) * 1e6, 2),
        )
        into = per_call(lambda i: cuda.nf4_matmul(x, qs[i % k], out=y), self.repeat)
        self.record(
            f"per call: nybble {tag}cuda.nf4_matmul(out=) 1 token bf16",
            shape,
            into,
            nbytes=nbytes,
            host_us=round((into - kernel) * 1e6, 2),
        )
        packed, state = bnbf.quantize_4bit(
            torch_view(w16, torch),
            blocksize=BLOCKSIZE,
            quant_type="nf4",
            compress_statistics=double_quant,
        )
        theirs = [(packed, state)] + [(packed.clone(), state) for _ in range(k - 1)]
        tx = torch_view(x, torch)

        def bnb_call(i: int) -> Any:
            return bitsandbytes.matmul_4bit(tx, theirs[i % k][0].t(), quant_state=theirs[i % k][1])

        their_kernel = gpu_median(bnb_call, self.repeat)
        self.record(
            f"kernel: bnb {tag}matmul_4bit 1 token bf16",
            shape,
            their_kernel,
            nbytes=nbytes,
            nybble_speedup=round(their_kernel / kernel, 2),
        )
        their = per_call(bnb_call, self.repeat)
        self.record(
            f"per call: bnb {tag}matmul_4bit 1 token bf16",
            shape,
            their,
            nbytes=nbytes,
            nybble_speedup=round(their / call, 2),
        )
        if double_quant:
            return
        kd = copies(2 * n)
        dense = [torch_view(w16, torch)] + [torch_view(clone(w16), torch) for _ in range(kd - 1)]
        dense_call = per_call(lambda i: tx @ dense[i % kd].T, self.repeat)
        self.record(
            "per call: torch bf16 dense GEMV 1 token",
            shape,
            dense_call,
            nbytes=2 * n,
            nybble_speedup=round(dense_call / call, 2),
        )
        row = gpu_in_a_row(lambda i: cuda.nf4_matmul(x, qs[i % k], out=y), self.repeat)
        self.record("in a row: nybble GEMV 1 token bf16", shape, row, nbytes=nbytes)
        # The same launches made plainly: what the programmatic ones (sm_90) gain back to back.
        plain = [gemv_weight(qi, programmatic=False) for qi in qs]
        row_plain = gpu_in_a_row(lambda i: plain[i % k](x, y), self.repeat)
        self.record(
            "in a row: nybble GEMV 1 token bf16, plain launches",
            shape,
            row_plain,
            nbytes=nbytes,
            programmatic_speedup=round(row_plain / row, 2),
        )

    # --- a decode step from a captured graph ------------------------------------------------

    def decode_graph(self, bnb: Any, layers: int = 32) -> None:
        """The 1-token GEMVs of a Llama-3.1-8B-shaped stack (32 layers x q, k, v, o, gate, up,
        down), replayed from one captured CUDA graph, against the sum of the same kernels'
        times and against bitsandbytes' matmul_4bit called eagerly from torch (and under
        torch.cuda.graphs where it captures)."""
        bitsandbytes, bnbf, torch = bnb
        hidden, inter, kv = 4096, 14336, 1024
        shapes = [
            (hidden, hidden),
            (kv, hidden),
            (kv, hidden),
            (hidden, hidden),
            (inter, hidden),
            (inter, hidden),
            (hidden, inter),
        ]
        stack = f"Llama-3.1-8B, {layers} layers x 7 projections"
        qs, theirs = [], []
        gen = torch.Generator(device="cuda").manual_seed(0)
        for _ in range(layers):
            for rows, cols in shapes:
                w = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
                qs.append(nybble.quantize(w * 0.02))
                theirs.append(bnbf.quantize_4bit(w * 0.02, blocksize=BLOCKSIZE, quant_type="nf4"))
                del w
        xs = {hidden: host_bf16((1, hidden), 3), inter: host_bf16((1, inter), 4)}
        outs = [cp.empty((1, q.shape[0]), xs[hidden].dtype) for q in qs]

        def step() -> None:
            for q, out in zip(qs, outs, strict=True):
                cuda.nf4_matmul(xs[q.shape[1]], q, out=out)

        graph = cuda.capture(step, *xs.values(), *outs)
        replay = per_call(lambda i: graph.replay(), self.repeat)
        plain = [gemv_weight(q, programmatic=False) for q in qs]

        def plain_step() -> None:
            for w, out in zip(plain, outs, strict=True):
                w(xs[w.cols], out)

        plain_graph = cuda.capture(plain_step, *xs.values(), *outs)
        replay_plain = per_call(lambda i: plain_graph.replay(), self.repeat)
        eager = per_call(lambda i: step(), self.repeat)
        kernels = 0.0  # the sum of each projection's kernel time, rotated over the layers
        for j, (rows, _) in enumerate(shapes):
            own = qs[j :: len(shapes)]
            out = cp.empty((1, rows), xs[hidden].dtype)
            x = xs[own[0].shape[1]]
            t = gpu_median(
                lambda i, own=own, x=x, out=out: cuda.nf4_matmul(x, own[i % len(own)], out=out),
                self.repeat,
            )
            kernels += t * layers
        self.record("decode graph: sum of the GEMV kernels", stack, kernels)
        self.record(
            "decode graph: nybble per token, replayed graph",
            stack,
            replay,
            ratio_to_kernels=round(replay / kernels, 3),
        )
        self.record(
            "decode graph: nybble per token, replayed graph of plain launches",
            stack,
            replay_plain,
            programmatic_speedup=round(replay_plain / replay, 3),
        )
        self.record("decode graph: nybble per token, eager calls", stack, eager)
        txs = {c: torch_view(x, torch) for c, x in xs.items()}

        def bnb_step() -> None:
            for (packed, state), q in zip(theirs, qs, strict=True):
                bitsandbytes.matmul_4bit(txs[q.shape[1]], packed.t(), quant_state=state)

        bnb_eager = per_call(lambda i: bnb_step(), self.repeat)
        self.record(
            "decode graph: bnb per token, eager matmul_4bit",
            stack,
            bnb_eager,
            nybble_speedup=round(bnb_eager / replay, 2),
        )
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                bnb_step()
            torch.cuda.current_stream().wait_stream(side)
            tgraph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(tgraph):
                bnb_step()
            bnb_graph = per_call(lambda i: tgraph.replay(), self.repeat)
            self.record(
                "decode graph: bnb per token, torch.cuda.graphs replay",
                stack,
                bnb_graph,
                nybble_speedup=round(bnb_graph / replay, 2),
            )
        except Exception as e:  # bnb may not capture; say so
            self.record(
                "decode graph: bnb under torch.cuda.graphs",
                stack,
                float("nan"),
                error=repr(e)[:300],
            )

    # --- the QLoRA layer through its public API, against PEFT --------------------------------

    def qlora_layer(self, out_f: int, in_f: int, bnb: Any, tokens: int = 4096, r: int = 16) -> None:
        """Forward + backward of one layer, bf16, r=16: `QLoraLinear(...).cuda()` called from
        torch, PEFT on a dense nn.Linear (adapters upcast to float32, PEFT's default, and kept
        in bf16), PEFT on a bitsandbytes Linear4bit; CUDA events around each step."""
        bitsandbytes, _, torch = bnb
        import peft

        shape = f"{out_f}x{in_f}, {tokens} tokens, r={r}"
        gen = torch.Generator(device="cuda").manual_seed(5)
        w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16, generator=gen)
        layer = nybble.QLoraLinear(w, nybble.LoraConfig(r=r, lora_alpha=2 * r), double_quant=True)
        layer.set_lora_b(cp.asarray(np.random.default_rng(0).standard_normal((out_f, r)) * 0.01))

        def ours(i: int) -> Any:
            layer.forward(x)
            return layer.backward(dy)

        class Wrapped(torch.nn.Module):
            def __init__(self, proj: Any) -> None:
                super().__init__()
                self.proj = proj

            def forward(self, t: Any) -> Any:
                return self.proj(t)

        def peft_step(model: Any) -> Callable[[int], Any]:
            xg = x.detach().clone().requires_grad_(True)

            def step(i: int) -> Any:
                xg.grad = None
                model(xg).backward(dy)
                return xg.grad

            return step

        config = dict(r=r, lora_alpha=2 * r, target_modules=["proj"], lora_dropout=0.0)
        dense_lin = torch.nn.Linear(in_f, out_f, bias=False, device="cuda", dtype=torch.bfloat16)
        dense_lin.weight.data.copy_(w)
        dense_lin.weight.requires_grad_(False)
        peft_dense = peft.get_peft_model(Wrapped(dense_lin), peft.LoraConfig(**config))
        dense_bf16 = torch.nn.Linear(in_f, out_f, bias=False, device="cuda", dtype=torch.bfloat16)
        dense_bf16.weight.data.copy_(w)
        dense_bf16.weight.requires_grad_(False)
        peft_dense_bf16 = peft.get_peft_model(
            Wrapped(dense_bf16), peft.LoraConfig(**config), autocast_adapter_dtype=False
        )
        lin4 = bitsandbytes.nn.Linear4bit(
            in_f, out_f, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4"
        )
        lin4.weight = bitsandbytes.nn.Params4bit(w.cpu(), requires_grad=False, quant_type="nf4")
        lin4 = lin4.cuda()
        peft_bnb = peft.get_peft_model(Wrapped(lin4), peft.LoraConfig(**config))
        runs = {
            "nybble QLoraLinear.cuda()": ours,
            "PEFT on dense nn.Linear": peft_step(peft_dense),
            "PEFT on dense nn.Linear, bf16 adapters": peft_step(peft_dense_bf16),
            "PEFT on bnb Linear4bit": peft_step(peft_bnb),
        }
        times = {name: per_call(fn, self.repeat) for name, fn in runs.items()}
        mine = times["nybble QLoraLinear.cuda()"]
        kernel = gpu_median(ours, self.repeat)
        self.record("kernel: nybble QLoraLinear fwd+bwd", shape, kernel)
        for name, seconds in times.items():
            extra: dict[str, Any] = {}
            if name != "nybble QLoraLinear.cuda()":
                extra["ratio_nybble_to_this"] = round(mine / seconds, 3)
                extra["nybble_speedup"] = round(seconds / mine, 3)
            self.record(f"layer fwd+bwd: {name}", shape, seconds, **extra)
        # The same step captured once and replayed: what the host's share of the eager step
        # costs (CuPy views of the torch tensors made first, outside the capture).
        xc, dyc = as_cupy(x), as_cupy(dy)
        graph = cuda.capture(lambda: (layer.forward(xc), layer.backward(dyc)), xc, dyc)
        replay = per_call(lambda i: graph.replay(), self.repeat)
        self.record(
            "layer fwd+bwd, replayed graph: nybble QLoraLinear.cuda()",
            shape,
            replay,
            ratio_to_eager=round(replay / mine, 3),
            ratio_to_peft_dense=round(replay / times["PEFT on dense nn.Linear"], 3),
        )


def host_profile(bench: Bench, bnb: Any, calls: int = 50) -> None:
    """Where the host's time goes in the public calls: wall time per call with the GPU kept
    busy (a spin queued first, so no call waits for it unless it must), and the functions
    that take it (cProfile, top entries by own time)."""
    import cProfile
    import io
    import pstats

    _, _, torch = bnb
    w16 = host_bf16((4096, 4096), 1)
    w32 = cp.random.default_rng(1).standard_normal((4096, 4096), dtype=cp.float32)
    q = nybble.quantize(w16)
    x = host_bf16((1, 4096), 3)
    y = cp.empty((1, 4096), x.dtype)
    out = cp.empty((4096, 4096), x.dtype)
    gen = torch.Generator(device="cuda").manual_seed(5)
    tx = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    tdy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    layer = nybble.QLoraLinear(w16, nybble.LoraConfig(r=16, lora_alpha=32))

    def layer_step() -> None:
        layer.forward(tx)
        layer.backward(tdy)

    # The driver's own launch, through CuPy's compiled binding: the host time of a launch that
    # no Python above it can remove.
    from cupy.cuda import driver

    _EMPTY((1,), (32,), ())  # compiled: its function handle exists
    empty_function, stream = int(_EMPTY.kernel.ptr), cp.cuda.get_current_stream().ptr
    args_buffer = (ctypes.c_void_p * 1)()  # the kernel has none; the buffer lives to the end
    no_args = ctypes.addressof(args_buffer)
    core_empty = _core.KernelLaunch(empty_function, 1, 32, 0, [], [], False)

    # (the call, whether it waits for the GPU: those run without the spin ahead of them, and
    # how many calls: few enough of the layer's step, some 20 launches each, that they do not
    # fill the GPU's launch queue behind the spin, where a launch waits for room)
    runs: dict[str, tuple[Callable[[], Any], bool, int]] = {
        "cuda.nf4_matmul(x, q, out=y), 1 token": (
            lambda: cuda.nf4_matmul(x, q, out=y),
            False,
            calls,
        ),
        "cuda.nf4_matmul(x, q), 1 token": (lambda: cuda.nf4_matmul(x, q), False, calls),
        "q.dequantize('bfloat16', out=...)": (lambda: q.dequantize("bfloat16", out), False, calls),
        "nybble.quantize(bf16 4096^2)": (lambda: nybble.quantize(w16), True, calls),
        "nybble.quantize(f32 4096^2)": (lambda: nybble.quantize(w32), True, calls),
        "QLoraLinear fwd+bwd, 4096 tokens": (layer_step, False, 5),
        "an empty CuPy kernel launch": (lambda: _EMPTY((1,), (32,), ()), False, calls),
        "the driver's launch alone (cuLaunchKernel, an empty kernel)": (
            lambda: driver.launchKernel(empty_function, 1, 1, 1, 32, 1, 1, 0, stream, no_args, 0),
            False,
            calls,
        ),
        "the core's launch (_core.KernelLaunch, an empty kernel)": (
            lambda: core_empty(stream),
            False,
            calls,
        ),
    }
    clock_khz = cp.cuda.Device().attributes["ClockRate"]
    for name, (fn, waits, n) in runs.items():
        for _ in range(3):
            fn()
        cp.cuda.Device().synchronize()
        if not waits:
            _SPIN((1,), (1,), (np.int64(200 * clock_khz),))  # 200 ms of a busy GPU
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(n):
            fn()
        profiler.disable()
        cp.cuda.Device().synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
        bench.record(f"host time per call: {name}", "-", host)
        print(f"--- profile: {name} ({n} calls)\n" + text.getvalue(), flush=True)
    # What the layer step asks of the CUDA runtime and driver (allocations, waits, copies),
    # with the GPU idle at each step's start, as the per-call figure sees it.
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        layer_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            layer_step()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    print("--- torch.profiler: QLoraLinear fwd+bwd, 10 steps\n" + table, flush=True)


def summary(records: list[dict[str, Any]], copy_gbs: float) -> dict[str, Any]:
    """The targets of docs/benchmarks.md, each with the worst figure behind it."""

    def values(prefix: str, key: str, shapes: tuple[str, ...] = ()) -> list[float]:
        return [
            r[key]
            for r in records
            if r["what"].startswith(prefix)
            and key in r
            and (not shapes or r["shape"].split(",")[0] in shapes)
        ]

    def target(
        prefix: str, key: str, ok: Callable[[float], bool], worst: Any, shapes: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        found = values(prefix, key, shapes)
        return {
            "worst": worst(found) if found else None,
            "met": bool(found) and all(map(ok, found)),
        }

    big = ("8192x8192", "14336x4096")
    return {
        "copy_gb_per_s": round(copy_gbs, 1),
        "GEMV per call <= kernel + 6 us (host_us)": target(
            "per call: nybble cuda.nf4_matmul 1", "host_us", lambda v: v <= 6, max, big
        ),
        "GEMV per call >= 2x bnb per call": target(
            "per call: bnb matmul_4bit", "nybble_speedup", lambda v: v >= 2, min, big
        ),
        "GEMV kernel >= 85% of a streaming read": target(
            "kernel: nybble GEMV", "pct_of_streaming_read", lambda v: v >= 85, min, big
        ),
        "decode graph per token <= 1.15x the kernels": target(
            "decode graph: nybble per token, replayed", "ratio_to_kernels", lambda v: v <= 1.15, max
        ),
        "decode graph >= 3x bnb eager per token": target(
            "decode graph: bnb per token, eager", "nybble_speedup", lambda v: v >= 3, min
        ),
        "QLoRA layer <= 1.10x PEFT dense": target(
            "layer fwd+bwd: PEFT on dense nn.Linear",
            "ratio_nybble_to_this",
            lambda v: v <= 1.10,
            max,
        ),
        "QLoRA layer >= 1.15x faster than PEFT bnb": target(
            "layer fwd+bwd: PEFT on bnb", "nybble_speedup", lambda v: v >= 1.15, min
        ),
        "dequantize per call >= 80% of copy at 8192^2": target(
            "per call: nybble q.dequantize('bfloat16')",
            "pct_of_copy",
            lambda v: v >= 80,
            min,
            ("8192x8192",),
        ),
        "quantize per call >= 50% of copy at 8192^2": target(
            "per call: nybble.quantize <- bfloat16",
            "pct_of_copy",
            lambda v: v >= 50,
            min,
            ("8192x8192",),
        ),
        "dequantize kernel >= 85% of copy": target(
            "kernel: nybble dequantize", "pct_of_copy", lambda v: v >= 85, min
        ),
    }


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Left: bandwidth figures (% of copy), kernel and per call. Right: the layer step against
    PEFT (time / PEFT on dense nn.Linear)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = [r for r in records if "pct_of_copy" in r and not r["what"].startswith("copy")]
    fig, axes = plt.subplots(
        1, 2, figsize=(16, 0.28 * len(bw) + 2), gridspec_kw={"width_ratios": [3, 1]}
    )
    labels = [f"{r['what']} [{r['shape']}]" for r in bw]
    colors = ["tab:blue" if "nybble" in r["what"] else "tab:gray" for r in bw]
    axes[0].barh(labels, [r["pct_of_copy"] for r in bw], color=colors)
    for x, c in ((85, "green"), (80, "orange"), (50, "red")):
        axes[0].axvline(x, color=c, ls="--", lw=0.8)
    axes[0].set_xlabel("% of measured device-to-device copy bandwidth (bytes that must move)")
    axes[0].invert_yaxis()
    axes[0].tick_params(axis="y", labelsize=7)
    layer = [r for r in records if r["what"].startswith("layer fwd+bwd:")]
    dense = {r["shape"]: r["us"] for r in layer if r["what"].endswith("PEFT on dense nn.Linear")}
    bars = [
        (f"{r['what'][15:]} [{r['shape'].split(',')[0]}]", r["us"] / dense[r["shape"]])
        for r in layer
        if r["shape"] in dense
    ]
    axes[1].barh([b[0] for b in bars], [b[1] for b in bars])
    axes[1].axvline(1.10, color="red", ls="--", lw=0.8)
    axes[1].set_xlabel("layer fwd+bwd time / PEFT on dense nn.Linear")
    axes[1].invert_yaxis()
    axes[1].tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


#: The parts of the run, in order; --sections picks some.
SECTIONS = ("codec", "gemv", "gemv_dq", "decode_graph", "qlora_layer", "profile")
LAYER_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=", ".join(SECTIONS))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    chosen = set(args.sections.split(","))

    bench = Bench(args.repeat)
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    bnb = bnb_modules()
    bench.copy_bandwidth()
    for rows, cols in SHAPES:
        if "codec" in chosen:
            bench.section(bench.codec, rows, cols, bnb)
        if "gemv" in chosen:
            bench.section(bench.gemv, rows, cols, bnb)
        if "gemv_dq" in chosen:
            bench.section(bench.gemv, rows, cols, bnb, True)
    if "decode_graph" in chosen:
        bench.section(bench.decode_graph, bnb)
    if "profile" in chosen:
        bench.section(host_profile, bench, bnb)
    if "qlora_layer" in chosen:
        for out_f, in_f in LAYER_SHAPES:
            bench.section(bench.qlora_layer, out_f, in_f, bnb)
    result = {
        "device": device,
        "bitsandbytes": bnb[0].__version__,
        "torch": bnb[2].__version__,
        "cupy": cp.__version__,
        "gemv_max_tokens": cuda.GEMV_MAX_TOKENS,
        "summary": summary(bench.records, bench.copy_gbs),
        "records": bench.records,
    }
    (args.out_dir / "gpu_codec.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    plot(bench.records, args.out_dir / "gpu_codec.png")


if __name__ == "__main__":
    main()
