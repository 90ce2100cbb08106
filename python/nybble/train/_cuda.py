"""Fused GPU kernels of the trainer: the causal softmax of a chunk of attention scores and its
gradient, SwiGLU's gate and its gradient, RMSNorm and its gradient, and the query/key heads'
norm + rotary positions + move to attention's layout and back. Each replaces a chain of
elementwise CuPy calls over the same arrays (`functional.SoftmaxKernels`, `GateKernels`,
`NormKernels`, `HeadKernels` state the same math in `xp`, and the GPU tests compare the two):
one read and one write of every element instead of a temporary per step of the formula, and
one launch instead of ten. The whole-model step on the GPU is bound by the host's launches
(docs/training.md), so the launches count as much as the bytes.

bfloat16 is handled as raw 16-bit words (widened exactly, rounded to nearest even), float32
as is; the math is float32. Compiled with NVRTC on first use (through CuPy); importing this
module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..formats import dtype_name
from . import functional as F

SOURCE = r"""
__device__ __forceinline__ float load_f(const unsigned short* p, long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ float load_f(const float* p, long long i) { return p[i]; }

__device__ __forceinline__ unsigned short to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ void store_f(unsigned short* p, long long i, float v) {
    p[i] = to_bf16(v);
}
__device__ __forceinline__ void store_f(float* p, long long i, float v) { p[i] = v; }

// Reductions over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
// the result. The leading barrier lets `shared` be reused by consecutive reductions.
__device__ float block_max(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = shared[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) r = fmaxf(r, shared[w]);
    return r;
}
__device__ float block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = shared[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) r += shared[w];
    return r;
}

// Row `row` of a chunk of scores [batch, rows_per_batch, keys]: its position (the chunk
// starts at position t0; `group` rows per position) and the keys [lo, hi) it may see. With
// `starts` (packed sequences, [batch, positions]: where each position's sample begins), no
// key before the row's sample start.
struct RowSpan {
    long long batch, r, lo, hi;
};
__device__ __forceinline__ RowSpan row_span(long long row, long long rows_per_batch, int keys,
                                            int group, long long t0, long long window,
                                            const int* starts, long long positions) {
    RowSpan s;
    s.batch = row / rows_per_batch;
    s.r = row % rows_per_batch;
    const long long pos = t0 + s.r / group;
    s.lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
    if (starts != nullptr) {
        const long long first = starts[s.batch * positions + pos];
        s.lo = first > s.lo ? first : s.lo;
    }
    s.hi = pos + 1 < keys ? pos + 1 : keys;
    return s;
}

// One block per row: P = softmax(scale * s) over [lo, hi), 0 elsewhere, written over s;
// lse[batch * lse_stride + lse_offset + r] = log-sum-exp of the row.
template <typename T>
__device__ void softmax_forward_row(T* s, float* lse, long long rows_per_batch, int keys,
                                    int group, long long t0, long long window, float scale,
                                    long long lse_stride, long long lse_offset,
                                    const int* starts, long long positions) {
    __shared__ float shared[32];
    const long long row = blockIdx.x;
    const RowSpan span =
        row_span(row, rows_per_batch, keys, group, t0, window, starts, positions);
    T* p = s + row * (long long)keys;
    float m = __int_as_float(0xff800000);  // -inf
    for (long long j = span.lo + threadIdx.x; j < span.hi; j += blockDim.x)
        m = fmaxf(m, load_f(p, j) * scale);
    m = block_max(m, shared);
    float l = 0.0f;
    for (long long j = span.lo + threadIdx.x; j < span.hi; j += blockDim.x)
        l += expf(load_f(p, j) * scale - m);
    l = block_sum(l, shared);
    const float inv = 1.0f / l;
    for (long long j = threadIdx.x; j < keys; j += blockDim.x) {
        const float v = (j >= span.lo && j < span.hi) ? expf(load_f(p, j) * scale - m) * inv : 0.0f;
        store_f(p, j, v);
    }
    if (threadIdx.x == 0) lse[span.batch * lse_stride + lse_offset + span.r] = m + logf(l);
}

// One block per row: P = exp(scale * s - lse) over [lo, hi) (0 elsewhere) written over s,
// dS = P * (dp - delta) * scale written over dp.
template <typename T>
__device__ void softmax_backward_row(T* s, T* dp, const float* lse, const float* delta,
                                     long long rows_per_batch, int keys, int group, long long t0,
                                     long long window, float scale, long long stride,
                                     long long offset, const int* starts, long long positions) {
    const long long row = blockIdx.x;
    const RowSpan span =
        row_span(row, rows_per_batch, keys, group, t0, window, starts, positions);
    const long long at = span.batch * stride + offset + span.r;
    const float row_lse = lse[at];
    const float row_delta = delta[at];
    T* ps = s + row * (long long)keys;
    T* pd = dp + row * (long long)keys;
    for (long long j = threadIdx.x; j < keys; j += blockDim.x) {
        float p = 0.0f, ds = 0.0f;
        if (j >= span.lo && j < span.hi) {
            p = expf(load_f(ps, j) * scale - row_lse);
            ds = p * (load_f(pd, j) - row_delta) * scale;
        }
        store_f(ps, j, p);
        store_f(pd, j, ds);
    }
}

// a = silu(g) * u, with sigmoid(g) = 0.5 * (1 + tanh(g / 2)).
template <typename T>
__device__ void gate_forward_all(const T* g, const T* u, T* a, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gv = load_f(g, i);
        const float sig = 0.5f * (1.0f + tanhf(0.5f * gv));
        store_f(a, i, gv * sig * load_f(u, i));
    }
}

// In place: g <- dL/dg = da * u * sig * (1 + g * (1 - sig)), u <- dL/du = da * silu(g).
template <typename T>
__device__ void gate_backward_all(const T* da, T* g, T* u, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gv = load_f(g, i), uv = load_f(u, i), d = load_f(da, i);
        const float sig = 0.5f * (1.0f + tanhf(0.5f * gv));
        store_f(u, i, d * gv * sig);
        store_f(g, i, d * uv * sig * (1.0f + gv * (1.0f - sig)));
    }
}

#define SOFTMAX_KERNELS(NAME, T)                                                              \
    extern "C" __global__ void softmax_forward_##NAME(                                         \
        T* s, float* lse, long long rows_per_batch, int keys, int group, long long t0,         \
        long long window, float scale, long long lse_stride, long long lse_offset,             \
        const int* starts, long long positions) {                                              \
        softmax_forward_row<T>(s, lse, rows_per_batch, keys, group, t0, window, scale,         \
                               lse_stride, lse_offset, starts, positions);                     \
    }                                                                                          \
    extern "C" __global__ void softmax_backward_##NAME(                                        \
        T* s, T* dp, const float* lse, const float* delta, long long rows_per_batch, int keys, \
        int group, long long t0, long long window, float scale, long long stride,              \
        long long offset, const int* starts, long long positions) {                            \
        softmax_backward_row<T>(s, dp, lse, delta, rows_per_batch, keys, group, t0, window,    \
                                scale, stride, offset, starts, positions);                     \
    }                                                                                          \
    extern "C" __global__ void gate_forward_##NAME(const T* g, const T* u, T* a, long long n) { \
        gate_forward_all<T>(g, u, a, n);                                                       \
    }                                                                                          \
    extern "C" __global__ void gate_backward_##NAME(const T* da, T* g, T* u, long long n) {    \
        gate_backward_all<T>(da, g, u, n);                                                     \
    }

SOFTMAX_KERNELS(bf16, unsigned short)
SOFTMAX_KERNELS(f32, float)

// The value a store of type T would keep: bfloat16 rounding, or none for float32. The xp
// statements (train/functional.py) round every elementwise step to the activations' dtype;
// the fused kernels round at the same steps, so the two agree but for the norms' sums.
template <typename T> __device__ __forceinline__ float round_as(float v);
template <> __device__ __forceinline__ float round_as<unsigned short>(float v) {
    return __uint_as_float(((unsigned int)to_bf16(v)) << 16);
}
template <> __device__ __forceinline__ float round_as<float>(float v) { return v; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One warp per row of `width`: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
template <typename T>
__device__ void rms_forward_rows(const T* x, const float* w, T* y, float* rstd, long long rows,
                                 int width, float eps) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + row * width;
    T* yr = y + row * width;
    float ss = 0.0f;
    for (int j = lane; j < width; j += 32) {
        const float v = load_f(xr, j);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(warp_sum(ss) / (float)width + eps);
    for (int j = lane; j < width; j += 32) store_f(yr, j, load_f(xr, j) * r * w[j]);
    if (lane == 0) rstd[row] = r;
}

// One warp per row: dx = rstd * (g - xhat * mean(g * xhat)), xhat = x * rstd, g = dy * w.
template <typename T>
__device__ void rms_backward_rows(const T* dy, const T* x, const float* rstd, const float* w,
                                  T* dx, long long rows, int width) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const long long at = row * width;
    const float r = rstd[row];
    float dot = 0.0f;
    for (int j = lane; j < width; j += 32)
        dot += load_f(dy, at + j) * w[j] * (load_f(x, at + j) * r);
    dot = warp_sum(dot) / (float)width;
    for (int j = lane; j < width; j += 32) {
        const float xhat = load_f(x, at + j) * r;
        store_f(dx, at + j, (load_f(dy, at + j) * w[j] - xhat * dot) * r);
    }
}

// One warp per (position, head) row of x [B, T, heads, D]: the optional RMSNorm of the head
// (has_norm), rotary positions (the halves of the head are the pairs; tables [T, D], or
// [B, T, D] with per_token: packed sequences), written to out [B, heads / group, T, group, D].
template <typename T>
__device__ void heads_forward_rows(const T* x, const float* w, int has_norm, const T* cos,
                                   const T* sin, T* out, float* rstd, long long rows, int heads,
                                   long long positions, int group, int d, float eps,
                                   int per_token) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int half = d / 2;
    const T* xr = x + row * d;
    float r = 1.0f;
    if (has_norm) {
        float ss = 0.0f;
        for (int j = lane; j < d; j += 32) {
            const float v = load_f(xr, j);
            ss += v * v;
        }
        r = 1.0f / sqrtf(warp_sum(ss) / (float)d + eps);
        if (lane == 0) rstd[row] = r;
    }
    const long long token = row / heads, b = token / positions, t = token % positions;
    const int head = (int)(row % heads);
    const long long kv_head = b * (heads / group) + head / group;
    T* o = out + ((kv_head * positions + t) * group + head % group) * d;
    const T* c = cos + (per_token ? token : t) * d;
    const T* s = sin + (per_token ? token : t) * d;
    for (int i = lane; i < half; i += 32) {
        float a = load_f(xr, i), bb = load_f(xr, i + half);
        if (has_norm) {
            a = round_as<T>(a * r * w[i]);
            bb = round_as<T>(bb * r * w[i + half]);
        }
        const float c1 = load_f(c, i), c2 = load_f(c, i + half);
        const float s1 = load_f(s, i), s2 = load_f(s, i + half);
        store_f(o, i, round_as<T>(a * c1) - round_as<T>(bb * s1));
        store_f(o, i + half, round_as<T>(bb * c2) + round_as<T>(a * s2));
    }
}

// Rotary positions backward for the pair (i, i + half) of a head's gradient g.
template <typename T>
__device__ __forceinline__ float2 rope_back(const T* g, const T* c, const T* s, int i, int half) {
    const float g1 = load_f(g, i), g2 = load_f(g, i + half);
    const float c1 = load_f(c, i), c2 = load_f(c, i + half);
    const float s1 = load_f(s, i), s2 = load_f(s, i + half);
    return make_float2(round_as<T>(round_as<T>(g1 * c1) + round_as<T>(g2 * s2)),
                       round_as<T>(round_as<T>(g2 * c2) - round_as<T>(g1 * s1)));
}

// The transpose of heads_forward_rows for dy [B, T, heads, D] (attention's gradient of the
// rotated heads, in the projection's layout): rotary positions back, then the norm's backward.
template <typename T>
__device__ void heads_backward_rows(const T* dy, const T* x, const float* rstd, const float* w,
                                    int has_norm, const T* cos, const T* sin, T* dx,
                                    long long rows, int heads, long long positions, int d,
                                    int per_token) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const int half = d / 2;
    const long long token = row / heads;
    const long long t = per_token ? token : token % positions;
    const T* g = dy + row * d;
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    const T* xr = x + row * d;
    float r = 1.0f, dot = 0.0f;
    if (has_norm) {
        r = rstd[row];
        for (int i = lane; i < half; i += 32) {
            const float2 dd = rope_back<T>(g, c, s, i, half);
            dot += dd.x * w[i] * (load_f(xr, i) * r);
            dot += dd.y * w[i + half] * (load_f(xr, i + half) * r);
        }
        dot = warp_sum(dot) / (float)d;
    }
    for (int i = lane; i < half; i += 32) {
        float2 dd = rope_back<T>(g, c, s, i, half);
        if (has_norm) {
            dd.x = (dd.x * w[i] - load_f(xr, i) * r * dot) * r;
            dd.y = (dd.y * w[i + half] - load_f(xr, i + half) * r * dot) * r;
        }
        store_f(dx, row * d + i, dd.x);
        store_f(dx, row * d + i + half, dd.y);
    }
}

#define ROW_KERNELS(NAME, T)                                                                   \
    extern "C" __global__ void rms_forward_##NAME(const T* x, const float* w, T* y, float* rstd, \
                                                  long long rows, int width, float eps) {      \
        rms_forward_rows<T>(x, w, y, rstd, rows, width, eps);                                  \
    }                                                                                          \
    extern "C" __global__ void rms_backward_##NAME(const T* dy, const T* x, const float* rstd,  \
                                                   const float* w, T* dx, long long rows,      \
                                                   int width) {                                \
        rms_backward_rows<T>(dy, x, rstd, w, dx, rows, width);                                 \
    }                                                                                          \
    extern "C" __global__ void heads_forward_##NAME(                                           \
        const T* x, const float* w, int has_norm, const T* cos, const T* sin, T* out,          \
        float* rstd, long long rows, int heads, long long positions, int group, int d,         \
        float eps, int per_token) {                                                            \
        heads_forward_rows<T>(x, w, has_norm, cos, sin, out, rstd, rows, heads, positions,     \
                              group, d, eps, per_token);                                       \
    }                                                                                          \
    extern "C" __global__ void heads_backward_##NAME(                                          \
        const T* dy, const T* x, const float* rstd, const float* w, int has_norm,              \
        const T* cos, const T* sin, T* dx, long long rows, int heads, long long positions,     \
        int d, int per_token) {                                                                \
        heads_backward_rows<T>(dy, x, rstd, w, has_norm, cos, sin, dx, rows, heads, positions, \
                               d, per_token);                                                  \
    }

ROW_KERNELS(bf16, unsigned short)
ROW_KERNELS(f32, float)
"""

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


def supports(dtype: Any) -> bool:
    """Whether the fused kernels take arrays of `dtype`."""
    return dtype_name(np.dtype(dtype)) in SUFFIX


#: NVRTC options: no contraction of a*b+c into an FMA, so each step rounds as its xp
#: statement does.
COMPILE_OPTIONS = ("-std=c++17", "--fmad=false")


@functools.cache
def _module(device: int) -> Any:
    import cupy as cp

    return cp.RawModule(code=SOURCE, options=COMPILE_OPTIONS)


def _kernel(name: str, dtype: Any) -> Any:
    import cupy as cp

    suffix = SUFFIX[dtype_name(np.dtype(dtype))]
    return _module(cp.cuda.runtime.getDevice()).get_function(f"{name}_{suffix}")


def _check(what: str, a: Any, dtype: Any, shape: tuple[int, ...] | None = None) -> None:
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected a C-contiguous {np.dtype(dtype)} array, got {a.dtype}")
    if shape is not None and tuple(a.shape) != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {tuple(a.shape)}")


def _row_args(
    s: Any, row_table: Any, t0: int, group: int, window: int | None, scale: float
) -> tuple[Any, ...]:
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


def _starts_args(starts: Any, batch: int) -> tuple[Any, np.int64]:
    """The kernels' (starts, positions) arguments: a null pointer without starts."""
    if starts is None:
        return np.uint64(0), np.int64(0)
    _check("starts", starts, np.int32)
    if starts.ndim != 2 or starts.shape[0] != batch:
        raise ValueError(f"starts: expected [{batch}, positions], got {tuple(starts.shape)}")
    return starts, np.int64(starts.shape[1])


class FusedSoftmax:
    """`functional.SoftmaxKernels` on the GPU: one launch per chunk for each direction."""

    def forward(
        self,
        s: Any,
        lse: Any,
        t0: int,
        group: int,
        window: int | None,
        scale: float,
        starts: Any = None,
    ) -> None:
        _check("scores", s, s.dtype)
        _check("lse", lse, np.float32)
        if s.ndim != 3 or s.shape[1] == 0:
            return
        args = _row_args(s, lse, t0, group, window, scale)
        rows = int(s.shape[0] * s.shape[1])
        kernel = _kernel("softmax_forward", s.dtype)
        kernel((rows,), (ROW_THREADS,), (s, lse, *args, *_starts_args(starts, int(s.shape[0]))))

    def backward(
        self,
        s: Any,
        dp: Any,
        lse: Any,
        delta: Any,
        t0: int,
        group: int,
        window: int | None,
        scale: float,
        starts: Any = None,
    ) -> None:
        _check("scores", s, s.dtype)
        _check("dp", dp, s.dtype, tuple(s.shape))
        _check("lse", lse, np.float32)
        _check("delta", delta, np.float32, tuple(lse.shape))
        if s.ndim != 3 or s.shape[1] == 0:
            return
        args = _row_args(s, lse, t0, group, window, scale)
        rows = int(s.shape[0] * s.shape[1])
        kernel = _kernel("softmax_backward", s.dtype)
        starts_args = _starts_args(starts, int(s.shape[0]))
        kernel((rows,), (ROW_THREADS,), (s, dp, lse, delta, *args, *starts_args))


class FusedGate:
    """`functional.GateKernels` on the GPU; backward overwrites gate and up with their
    gradients (they are not needed after it)."""

    def _grid(self, n: int) -> tuple[int]:
        blocks = (n + ELEMENTWISE_THREADS - 1) // ELEMENTWISE_THREADS
        return (max(1, min(blocks, ELEMENTWISE_MAX_BLOCKS)),)

    def forward(self, gate: Any, up: Any) -> Any:
        import cupy as cp

        _check("gate", gate, gate.dtype)
        _check("up", up, gate.dtype, tuple(gate.shape))
        out = cp.empty_like(gate)
        n = int(gate.size)
        if n:
            kernel = _kernel("gate_forward", gate.dtype)
            kernel(self._grid(n), (ELEMENTWISE_THREADS,), (gate, up, out, np.int64(n)))
        return out

    def backward(self, da: Any, gate: Any, up: Any) -> tuple[Any, Any]:
        _check("gate", gate, gate.dtype)
        _check("up", up, gate.dtype, tuple(gate.shape))
        _check("grad", da, gate.dtype, tuple(gate.shape))
        n = int(gate.size)
        if n:
            kernel = _kernel("gate_backward", gate.dtype)
            kernel(self._grid(n), (ELEMENTWISE_THREADS,), (da, gate, up, np.int64(n)))
        return gate, up


def _warp_rows_grid(rows: int) -> tuple[int]:
    per_block = WARP_ROW_THREADS // 32
    return (max(1, (rows + per_block - 1) // per_block),)


def _fusable(dtype: Any, *arrays: Any) -> bool:
    """Whether the row kernels take these arrays: C-contiguous, of one dtype the kernels
    know, and (the norm weights, given as float32 arrays) float32."""
    if not supports(dtype):
        return False
    return all(a is None or a.flags.c_contiguous for a in arrays)


def _f32_weight(w: Any) -> bool:
    return w is None or (w.dtype == np.float32 and w.flags.c_contiguous)


class FusedNorm:
    """`functional.NormKernels` on the GPU: one launch each way. A trainable weight's gradient
    (full fine-tuning) and other dtypes go to the xp statement."""

    def forward(self, x: Any, weight: Any, eps: float) -> tuple[Any, Any]:
        import cupy as cp

        if not (_fusable(x.dtype, x) and _f32_weight(weight)) or x.size == 0:
            return F.rms_norm_forward(cp, x, weight, eps)
        width = int(x.shape[-1])
        rows = int(x.size) // width
        y = cp.empty_like(x)
        rstd = cp.empty((*x.shape[:-1], 1), cp.float32)
        kernel = _kernel("rms_forward", x.dtype)
        args = (x, weight, y, rstd, np.int64(rows), np.int32(width), np.float32(eps))
        kernel(_warp_rows_grid(rows), (WARP_ROW_THREADS,), args)
        return y, rstd

    def backward(
        self, dy: Any, x: Any, rstd: Any, weight: Any, weight_grad: bool
    ) -> tuple[Any, Any]:
        import cupy as cp

        fusable = _fusable(x.dtype, dy, x, rstd) and _f32_weight(weight) and dy.dtype == x.dtype
        if weight_grad or not fusable or x.size == 0:
            return F.rms_norm_backward(cp, dy, x, rstd, weight, weight_grad)
        width = int(x.shape[-1])
        rows = int(x.size) // width
        dx = cp.empty_like(dy)
        kernel = _kernel("rms_backward", x.dtype)
        args = (dy, x, rstd, weight, dx, np.int64(rows), np.int32(width))
        kernel(_warp_rows_grid(rows), (WARP_ROW_THREADS,), args)
        return dx, None


class FusedHeads:
    """`functional.HeadKernels` on the GPU: norm, rotary positions and the move to attention's
    layout in one launch, and back in one."""

    def __init__(self) -> None:
        self._no_weight: dict[int, Any] = {}

    def _weight(self, w: Any) -> tuple[Any, np.int32]:
        """The norm weight and the has-norm flag (a one-element stand-in without a norm)."""
        import cupy as cp

        if w is not None:
            return w, np.int32(1)
        device = cp.cuda.runtime.getDevice()
        if device not in self._no_weight:
            self._no_weight[device] = cp.zeros(1, cp.float32)
        return self._no_weight[device], np.int32(0)

    def forward(
        self, x: Any, weight: Any, eps: float, cos: Any, sin: Any, group: int
    ) -> tuple[Any, Any]:
        import cupy as cp

        b, t, heads, d = (int(n) for n in x.shape)
        fusable = _fusable(x.dtype, x, cos, sin) and _f32_weight(weight)
        if not fusable or cos.dtype != x.dtype or d % 2 or x.size == 0:
            return F.HeadKernels(cp).forward(x, weight, eps, cos, sin, group)
        out = cp.empty((b, heads // group, t, group, d), x.dtype)
        rstd = cp.empty((b, t, heads, 1), cp.float32) if weight is not None else None
        w, has_norm = self._weight(weight)
        rows = b * t * heads
        kernel = _kernel("heads_forward", x.dtype)
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
        dy: Any,
        x: Any,
        rstd: Any,
        weight: Any,
        cos: Any,
        sin: Any,
        weight_grad: bool,
    ) -> tuple[Any, Any]:
        import cupy as cp

        b, t, heads, d = (int(n) for n in dy.shape)
        fusable = _fusable(dy.dtype, dy, x, rstd, cos, sin) and _f32_weight(weight)
        fusable = fusable and cos.dtype == dy.dtype and (x is None or x.dtype == dy.dtype)
        if weight_grad or not fusable or d % 2 or dy.size == 0:
            return F.HeadKernels(cp).backward(dy, x, rstd, weight, cos, sin, weight_grad)
        dx = cp.empty_like(dy)
        w, has_norm = self._weight(weight)
        rows = b * t * heads
        kernel = _kernel("heads_backward", dy.dtype)
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
    "KERNEL_NAMES",
    "SOURCE",
    "FusedGate",
    "FusedHeads",
    "FusedNorm",
    "FusedSoftmax",
    "supports",
]
