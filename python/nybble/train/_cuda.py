"""Fused GPU kernels of the trainer: the causal softmax of a chunk of attention scores and its
gradient, SwiGLU's gate and its gradient, RMSNorm and its gradient, and the query/key heads'
norm + rotary positions + move to attention's layout and back. Each replaces a chain of
elementwise CuPy calls over the same arrays (`functional.SoftmaxKernels`, `GateKernels`,
`NormKernels`, `HeadKernels` state the same math in `xp`, and the GPU tests compare the two):
one read and one write of every element instead of a temporary per step of the formula, and
one launch instead of ten. The whole-model step on the GPU is bound by the host's launches
(docs/training.md), so the launches count as much as the bytes.

Attention in bfloat16 (heads of 64 or 128, sm_80+) runs whole in flash-attention kernels
(`FLASH_SOURCE`: tiles of queries and keys in shared memory, online softmax on the tensor
cores, the [T, T] scores never in memory); `FusedSoftmax.flash_forward` / `flash_backward`,
which `functional.attention_forward` / `attention_backward` try first, launch them.

bfloat16 is handled as raw 16-bit words (widened exactly, rounded to nearest even), float32
as is; the math is float32. Compiled with NVRTC on first use (through CuPy); importing this
module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
import warnings
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
    """`functional.SoftmaxKernels` on the GPU: one launch per chunk for each direction; and,
    with `flash` (the default), the whole attention in the flash kernels where they apply
    (`flash_forward`, `flash_backward`; `FusedSoftmax(flash=False)` keeps every shape on the
    chunked path)."""

    def __init__(self, flash: bool = True) -> None:
        self.flash = flash

    def flash_forward(
        self, q: Any, k: Any, v: Any, scale: float, window: int | None, starts: Any = None
    ) -> tuple[Any, Any] | None:
        """`functional.attention_forward` (same arguments, layouts and results: the output
        [B, T, kv_heads, group, D] and the log-sum-exp [B·kv_heads, T·group] in float32) in
        one launch, or None where the flash kernels do not apply (then the chunked path runs)."""
        if not (self.flash and flash_applies(q, k, v, starts)):
            return None
        return _flash_forward(q, k, v, scale, window, starts)

    def flash_backward(
        self,
        do: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        scale: float,
        window: int | None,
        starts: Any = None,
    ) -> tuple[Any, Any, Any] | None:
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


FLASH_SOURCE = r"""
// Causal grouped-query attention in bfloat16 on the tensor cores (sm_80+): the flash-attention
// forward and backward (FlashAttention-2's tiling). A kv head's query rows are its T positions
// x `group` query heads (row r: position r / group, head r % group), so every tile of keys and
// values in shared memory serves the whole group. Scores, probabilities and their gradients
// live in registers only; the forward keeps each row's log-sum-exp, from which the backward
// recomputes P. The backward is two kernels, both free of atomics (the result does not depend
// on the order blocks run): dQ by query blocks, dK and dV by key blocks (the group's gradients
// summed in registers). Products are mma.sync m16n8k16 (bf16 in, f32 sums); fragments come from
// shared memory through ldmatrix; tiles arrive by cp.async.
typedef unsigned int u32;
typedef unsigned short u16;

#define FLASH_THREADS 128
#define FLASH_WARPS 4
// Query rows of a forward or dQ block, keys of a dK/dV block and of every key tile.
#define FLASH_BLOCK 64
#define FLASH_LOG2E 1.4426950408889634f
#define FLASH_NEG_INF __int_as_float(0xff800000)

#ifndef FLASH_EMULATE
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 16 bytes global -> shared (a shared-space address), asynchronously; zeros where !valid
// (src is then not read).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Four 8x8 bf16 matrices; lanes 8i..8i+7 give the rows of matrix i.
__device__ __forceinline__ void ldsm(u32 (&r)[4], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_t(u32 (&r)[4], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// d += a b: a 16x16 (row), b 16x8 (col), d 16x8 in float32.
__device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats rounded to bfloat16 (nearest even), `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#define FLASH_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#else
inline u32 smem_u32(const void* p) { return (u32)((const unsigned char*)p - emu::g_smem); }
inline void cp_async16(u32 dst, const void* src, bool valid) {
    emu::cp_async16(emu::g_smem + dst, src, valid);
}
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
    emu::cp_async_wait(N);
}
inline void ldsm(u32 (&r)[4], u32 a) { emu::ldsm(r, emu::g_smem + a, false); }
inline void ldsm_t(u32 (&r)[4], u32 a) { emu::ldsm(r, emu::g_smem + a, true); }
inline void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) { emu::mma(d, a, b0, b1); }
inline u16 flash_bf16(float f) {
    u32 u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}
inline u32 pack_bf16(float lo, float hi) {
    return (u32)flash_bf16(lo) | ((u32)flash_bf16(hi) << 16);
}
#define FLASH_SMEM(name) unsigned char* name = emu::g_smem
#endif

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ float bf16_f(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Where row r of a tensor starts: base + (r / group) * t_stride + (r % group) * D.
struct RowMap {
    long long base, t_stride;
    int group;
};
template <int D>
__device__ __forceinline__ long long row_at(const RowMap& m, int r) {
    const int t = r / m.group;
    return m.base + (long long)t * m.t_stride + (long long)(r - t * m.group) * D;
}

// The first key position `pos` (of batch b) sees: the sliding window's, or its sample's start.
__device__ __forceinline__ int first_key(int pos, int b, int T, long long window,
                                         const int* starts) {
    int lo = 0;
    if (window > 0 && (long long)pos - window + 1 > 0) lo = (int)((long long)pos - window + 1);
    if (starts != nullptr) lo = imax(lo, starts[(long long)b * T + pos]);
    return lo;
}

// Rows [r0, r0 + ROWS) of a tensor into shared memory at `s` (a shared-space address, row
// stride D + 8 elements), asynchronously; rows at or past `limit` as zeros. Each thread copies
// one 16-byte column of every (FLASH_THREADS / (D / 8))-th row.
template <int ROWS, int D>
__device__ __forceinline__ void load_tile(u32 s, const u16* g, const RowMap& m, int r0,
                                          int limit, int tid) {
    constexpr int CHUNKS = D / 8, STEP = FLASH_THREADS / CHUNKS;
    static_assert(FLASH_THREADS % CHUNKS == 0 && ROWS % STEP == 0, "whole rounds of copies");
    const int row0 = tid / CHUNKS, col = (tid % CHUNKS) * 8;
#pragma unroll
    for (int i = 0; i < ROWS / STEP; ++i) {
        const int row = row0 + i * STEP, r = r0 + row;
        const bool ok = r < limit;
        cp_async16(s + (u32)(row * (D + 8) + col) * 2u, ok ? g + row_at<D>(m, r) + col : g, ok);
    }
}
// The same for a tensor whose rows are contiguous from `g` (keys, values: rows of D).
template <int ROWS, int D>
__device__ __forceinline__ void load_rows(u32 s, const u16* g, int r0, int limit, int tid) {
    constexpr int CHUNKS = D / 8, STEP = FLASH_THREADS / CHUNKS;
    static_assert(FLASH_THREADS % CHUNKS == 0 && ROWS % STEP == 0, "whole rounds of copies");
    const int row0 = tid / CHUNKS, col = (tid % CHUNKS) * 8;
    const u16* src = g + (long long)(r0 + row0) * D + col;
#pragma unroll
    for (int i = 0; i < ROWS / STEP; ++i) {
        const int row = row0 + i * STEP;
        const bool ok = r0 + row < limit;
        cp_async16(s + (u32)(row * (D + 8) + col) * 2u, ok ? src + i * STEP * D : g, ok);
    }
}

// A lane's ldmatrix address in a row-major tile at `s` (shared space, `stride` elements a
// row), to which the 16x16 block at (row, col) adds (row * stride + col) * 2 bytes:
// for an A operand (ldsm) or a B operand stored [k][n] (ldsm_t) ...
__device__ __forceinline__ u32 lane_rows(u32 s, int stride, int lane) {
    return s + (u32)((lane & 15) * stride + (lane >> 4) * 8) * 2u;
}
// ... and for a B operand stored [n][k] (ldsm): rows n (two n-blocks of 8), columns k.
__device__ __forceinline__ u32 lane_cols(u32 s, int stride, int lane) {
    return s + (u32)(((lane & 7) + (lane >> 4) * 8) * stride + ((lane >> 3) & 1) * 8) * 2u;
}
#define AT(row, col) ((u32)((row) * S + (col)) * 2u)

// The block's smallest and largest first key, from each thread's own (mn, mx); red: 8 ints.
__device__ __forceinline__ void block_lo_range(int mn, int mx, int* red, int warp, int lane,
                                               int& lo_min, int& lo_max) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        mn = imin(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        mx = imax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    }
    if (lane == 0) {
        red[warp] = mn;
        red[FLASH_WARPS + warp] = mx;
    }
    __syncthreads();
    lo_min = red[0];
    lo_max = red[FLASH_WARPS];
#pragma unroll
    for (int w = 1; w < FLASH_WARPS; ++w) {
        lo_min = imin(lo_min, red[w]);
        lo_max = imax(lo_max, red[FLASH_WARPS + w]);
    }
}

// A thread's two rows of a 16-row warp tile (r and r + 8): their positions and first keys
// (rows past the end take the last row's, and are never stored).
__device__ __forceinline__ void row_bounds(int r, int M, int group, int b, int T,
                                           long long window, const int* starts, int (&pos)[2],
                                           int (&lo)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int rr = imin(r + 8 * h, M - 1);
        pos[h] = rr / group;
        lo[h] = first_key(pos[h], b, T, window, starts);
    }
}

// Scores of keys a row may not see -> -inf (accumulator layout: rows g and g + 8, keys
// k0 + 8 nb + 2 t4 + {0, 1}).
template <int N>
__device__ __forceinline__ void mask_rows(float (&s)[N][4], int k0, const int (&pos)[2],
                                          const int (&lo)[2], int t4) {
#pragma unroll
    for (int nb = 0; nb < N; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = k0 + nb * 8 + 2 * t4 + (e & 1);
            if (key > pos[e >> 1] || key < lo[e >> 1]) s[nb][e] = FLASH_NEG_INF;
        }
}

// A16x16 operand for k-step kk from an accumulator tile (16 rows x 8N columns), rounded.
template <int N>
__device__ __forceinline__ void acc_to_a(u32 (&a)[4], const float (&c)[N][4], int kk) {
    a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// ---- forward: one block per 64 query rows of a kv head --------------------------------------
// out [B, T, kv, group, D] (o_proj's layout), lse [B * kv, T * group] (natural log).
template <int D>
__device__ void flash_forward_block(const u16* __restrict__ q, const u16* __restrict__ k,
                                    const u16* __restrict__ v, u16* __restrict__ out,
                                    float* __restrict__ lse, int kv, int T, int group,
                                    long long window, float scale, const int* __restrict__ starts) {
    constexpr int BM = FLASH_BLOCK, BN = FLASH_BLOCK, S = D + 8;
    FLASH_SMEM(smem);
    const u32 sK = smem_u32(smem);
    const u32 sV = sK + BN * S * 2;  // the query tile until its fragments are in registers
    int* red = (int*)(smem + 2 * BN * S * 2);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t4 = lane & 3;
    const int nbh = blockIdx.y, b = nbh / kv, kvh = nbh - b * kv;
    const int M = T * group;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest rows first
    const RowMap qmap = {(long long)nbh * M * D, (long long)group * D, group};
    const RowMap omap = {((long long)b * T * kv + kvh) * group * D, (long long)kv * group * D,
                         group};
    const u16* kh = k + (long long)nbh * T * D;
    const u16* vh = v + (long long)nbh * T * D;
    load_tile<BM, D>(sV, q, qmap, r0, M, tid);
    cp_async_commit();
    int pos[2], lo[2];
    row_bounds(r0 + warp * 16 + (lane >> 2), M, group, b, T, window, starts, pos, lo);
    int lo_min, lo_max;
    block_lo_range(imin(lo[0], lo[1]), imax(lo[0], lo[1]), red, warp, lane, lo_min, lo_max);
    const int pos_first = r0 / group;
    const int j_lo = lo_min / BN, j_hi = ((imin(r0 + BM, M) - 1) / group) / BN;
    load_rows<BN, D>(sK, kh, j_lo * BN, T, tid);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const u32 kc = lane_cols(sK, S, lane), vr = lane_rows(sV, S, lane);
    u32 qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldsm(qf[kk], vr + AT(warp * 16, kk * 16));
    __syncthreads();  // sV is free

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m[2] = {FLASH_NEG_INF, FLASH_NEG_INF}, l[2] = {0.0f, 0.0f};
    const float sl2 = scale * FLASH_LOG2E;
    for (int j = j_lo; j <= j_hi; ++j) {
        const int k0 = j * BN;
        load_rows<BN, D>(sV, vh, k0, T, tid);
        cp_async_commit();
        cp_async_wait<1>();  // K(j)
        __syncthreads();
        float s[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                u32 bk[4];
                ldsm(bk, kc + AT(np * 16, kk * 16));
                mma(s[2 * np], qf[kk], bk[0], bk[1]);
                mma(s[2 * np + 1], qf[kk], bk[2], bk[3]);
            }
        if (!(k0 >= lo_max && k0 + BN - 1 <= pos_first)) mask_rows(s, k0, pos, lo, t4);
        // online softmax: rows g (h = 0) and g + 8 (h = 1), each over a quad of lanes
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float cur = FLASH_NEG_INF;
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb)
                cur = fmaxf(cur, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
            cur = fmaxf(cur, __shfl_xor_sync(0xffffffffu, cur, 1));
            cur = fmaxf(cur, __shfl_xor_sync(0xffffffffu, cur, 2));
            const float m_new = fmaxf(m[h], cur);
            const float m_use = m_new == FLASH_NEG_INF ? 0.0f : m_new;
            const float alpha = exp2f((m[h] - m_use) * sl2);
            const float msl = m_use * sl2;
            float sum = 0.0f;
#pragma unroll
            for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const float p = exp2f(s[nb][2 * h + i] * sl2 - msl);
                    s[nb][2 * h + i] = p;
                    sum += p;
                }
            l[h] = l[h] * alpha + sum;
            m[h] = m_new;
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd) {
                o[nd][2 * h] *= alpha;
                o[nd][2 * h + 1] *= alpha;
            }
        }
        cp_async_wait<0>();  // V(j)
        __syncthreads();     // and every warp is done with K(j)
        if (j < j_hi) {
            load_rows<BN, D>(sK, kh, k0 + BN, T, tid);
            cp_async_commit();
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 pa[4];
            acc_to_a(pa, s, kk);
#pragma unroll
            for (int np = 0; np < D / 16; ++np) {
                u32 bv[4];
                ldsm_t(bv, vr + AT(kk * 16, np * 16));
                mma(o[2 * np], pa, bv[0], bv[1]);
                mma(o[2 * np + 1], pa, bv[2], bv[3]);
            }
        }
        __syncthreads();  // every warp is done with V(j)
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int r = r0 + warp * 16 + (lane >> 2) + 8 * h;
        if (r < M) {
            const float inv = 1.0f / sum;
            u16* orow = out + row_at<D>(omap, r);
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd)
                *(u32*)(orow + nd * 8 + 2 * t4) =
                    pack_bf16(o[nd][2 * h] * inv, o[nd][2 * h + 1] * inv);
            if (t4 == 0) lse[(long long)nbh * M + r] = m[h] * scale + logf(sum);
        }
    }
}

// ---- backward, 1: delta = rowsum(dO * O), and whether each batch's starts ever decrease ---
// One warp per row of dO and O [B, T, kv, group, D]; delta [B * kv, T * group] (float32).
// bad[b] (zeroed by the caller) is set where starts[b] decreases: the dK/dV kernel may stop
// at the first query tile that sees none of its keys only when the starts never decrease.
__device__ void flash_delta_rows(const u16* __restrict__ dout, const u16* __restrict__ out,
                                 float* __restrict__ delta, int* __restrict__ bad,
                                 const int* __restrict__ starts, long long rows, int kv, int T,
                                 int group, int d) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
         row < rows; row += warps) {
        const u32* a = (const u32*)(dout + row * d);
        const u32* o = (const u32*)(out + row * d);
        float s = 0.0f;
        for (int j = lane; j < d / 2; j += 32) {
            const u32 x = a[j], y = o[j];
            s += bf16_f((u16)(x & 0xffffu)) * bf16_f((u16)(y & 0xffffu));
            s += bf16_f((u16)(x >> 16)) * bf16_f((u16)(y >> 16));
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) {
            const long long i = row % group, rest = row / group;
            const long long kvh = rest % kv, bt = rest / kv;
            const long long t = bt % T, b = bt / T;
            delta[((b * kv + kvh) * T + t) * group + i] = s;
        }
    }
    if (starts != nullptr) {
        const long long n = rows / ((long long)kv * group);  // B * T
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
             i += (long long)gridDim.x * blockDim.x)
            if (i % T + 1 < T && starts[i + 1] < starts[i]) bad[i / T] = 1;
    }
}

// ---- backward, 2: dQ, one block per 64 query rows (S and dP recomputed) --------------------
template <int D>
__device__ void flash_dq_block(const u16* __restrict__ q, const u16* __restrict__ k,
                               const u16* __restrict__ v, const u16* __restrict__ dout,
                               const float* __restrict__ lse, const float* __restrict__ delta,
                               u16* __restrict__ dq, int kv, int T, int group, long long window,
                               float scale, const int* __restrict__ starts) {
    constexpr int BM = FLASH_BLOCK, BN = FLASH_BLOCK, S = D + 8;
    FLASH_SMEM(smem);
    const u32 sQ = smem_u32(smem);
    const u32 sO = sQ + BM * S * 2;  // dO
    const u32 sK = sO + BM * S * 2;
    const u32 sV = sK + BN * S * 2;
    int* red = (int*)(smem + (2 * BM + 2 * BN) * S * 2);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t4 = lane & 3;
    const int nbh = blockIdx.y, b = nbh / kv, kvh = nbh - b * kv;
    const int M = T * group;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * BM;  // the longest rows first
    const RowMap qmap = {(long long)nbh * M * D, (long long)group * D, group};
    const u16* kh = k + (long long)nbh * T * D;
    const u16* vh = v + (long long)nbh * T * D;
    const RowMap omap = {((long long)b * T * kv + kvh) * group * D, (long long)kv * group * D,
                         group};
    load_tile<BM, D>(sQ, q, qmap, r0, M, tid);
    load_tile<BM, D>(sO, dout, omap, r0, M, tid);
    cp_async_commit();
    const int r_own = r0 + warp * 16 + (lane >> 2);
    int pos[2], lo[2];
    row_bounds(r_own, M, group, b, T, window, starts, pos, lo);
    float lse2[2], dl[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r_own + 8 * h;
        lse2[h] = r < M ? lse[(long long)nbh * M + r] * FLASH_LOG2E : 0.0f;
        dl[h] = r < M ? delta[(long long)nbh * M + r] : 0.0f;
    }
    int lo_min, lo_max;
    block_lo_range(imin(lo[0], lo[1]), imax(lo[0], lo[1]), red, warp, lane, lo_min, lo_max);
    const int pos_first = r0 / group;
    const int j_lo = lo_min / BN, j_hi = ((imin(r0 + BM, M) - 1) / group) / BN;
    const float sl2 = scale * FLASH_LOG2E;
    const u32 qr = lane_rows(sQ, S, lane), or_ = lane_rows(sO, S, lane);
    const u32 kc = lane_cols(sK, S, lane), vc = lane_cols(sV, S, lane), kr = lane_rows(sK, S, lane);
    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    for (int j = j_lo; j <= j_hi; ++j) {
        const int k0 = j * BN;
        load_rows<BN, D>(sK, kh, k0, T, tid);
        load_rows<BN, D>(sV, vh, k0, T, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 qa[4], da[4];
            ldsm(qa, qr + AT(warp * 16, kk * 16));
            ldsm(da, or_ + AT(warp * 16, kk * 16));
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                u32 bk[4], bv[4];
                ldsm(bk, kc + AT(np * 16, kk * 16));
                mma(s[2 * np], qa, bk[0], bk[1]);
                mma(s[2 * np + 1], qa, bk[2], bk[3]);
                ldsm(bv, vc + AT(np * 16, kk * 16));
                mma(dp[2 * np], da, bv[0], bv[1]);
                mma(dp[2 * np + 1], da, bv[2], bv[3]);
            }
        }
        if (!(k0 >= lo_max && k0 + BN - 1 <= pos_first)) mask_rows(s, k0, pos, lo, t4);
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[nb][e] * sl2 - lse2[e >> 1]);
                s[nb][e] = p * (dp[nb][e] - dl[e >> 1]);  // dS / scale
            }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 sa[4];
            acc_to_a(sa, s, kk);
#pragma unroll
            for (int np = 0; np < D / 16; ++np) {
                u32 bk[4];
                ldsm_t(bk, kr + AT(kk * 16, np * 16));
                mma(acc[2 * np], sa, bk[0], bk[1]);
                mma(acc[2 * np + 1], sa, bk[2], bk[3]);
            }
        }
        __syncthreads();  // every warp is done with K(j) and V(j)
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = r_own + 8 * h;
        if (r < M) {
            u16* row = dq + row_at<D>(omap, r);
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd)
                *(u32*)(row + nd * 8 + 2 * t4) =
                    pack_bf16(acc[nd][2 * h] * scale, acc[nd][2 * h + 1] * scale);
        }
    }
}

// ---- backward, 3: dK and dV, one block per 64 keys of a kv head, over the query rows that
// see them (BQ rows a tile); the group's query heads are rows of the same tiles, so their
// gradients sum in the accumulators. dk, dv [B, T, kv, D].
template <int D, int BQ>
__device__ void flash_dkdv_block(const u16* __restrict__ q, const u16* __restrict__ k,
                                 const u16* __restrict__ v, const u16* __restrict__ dout,
                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                 u16* __restrict__ dk, u16* __restrict__ dv, int kv, int T,
                                 int group, long long window, float scale,
                                 const int* __restrict__ starts, const int* __restrict__ bad) {
    constexpr int BN = FLASH_BLOCK, S = D + 8;
    FLASH_SMEM(smem);
    const u32 sK = smem_u32(smem);
    const u32 sV = sK + BN * S * 2;
    const u32 sQ = sV + BN * S * 2;
    const u32 sO = sQ + BQ * S * 2;  // dO
    float* sLse = (float*)(smem + (2 * BN + 2 * BQ) * S * 2);
    float* sDelta = sLse + BQ;
    int* sPos = (int*)(sDelta + BQ);
    int* sLo = sPos + BQ;
    int* red = sLo + BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, t4 = lane & 3;
    const int nbh = blockIdx.y, b = nbh / kv, kvh = nbh - b * kv;
    const int M = T * group, k0 = blockIdx.x * BN;
    const RowMap qmap = {(long long)nbh * M * D, (long long)group * D, group};
    const RowMap omap = {((long long)b * T * kv + kvh) * group * D, (long long)kv * group * D,
                         group};
    load_rows<BN, D>(sK, k + (long long)nbh * T * D, k0, T, tid);
    load_rows<BN, D>(sV, v + (long long)nbh * T * D, k0, T, tid);
    cp_async_commit();
    const bool monotone = starts == nullptr || bad[b] == 0;
    const int k_last = imin(k0 + BN, T) - 1;
    const int key_own = k0 + warp * 16 + (lane >> 2);  // and key_own + 8
    int r_end = M;
    if (window > 0) {
        const long long e = ((long long)k0 + BN - 1 + window) * group;
        if (e < r_end) r_end = (int)e;
    }
    const float sl2 = scale * FLASH_LOG2E;
    const u32 kr = lane_rows(sK, S, lane), vr = lane_rows(sV, S, lane);
    const u32 qc = lane_cols(sQ, S, lane), oc = lane_cols(sO, S, lane);
    const u32 qr = lane_rows(sQ, S, lane), or_ = lane_rows(sO, S, lane);
    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[i][e] = dva[i][e] = 0.0f;
    for (int rq = k0 * group; rq < r_end; rq += BQ) {
        __syncthreads();  // every warp is done with the last tile
        int mn = 0x7fffffff, mx = -1;
        if (tid < BQ) {
            const int r = rq + tid;
            int p = -1, lo = 0x7fffffff;
            float ls = 0.0f, de = 0.0f;
            if (r < M) {
                p = r / group;
                lo = first_key(p, b, T, window, starts);
                ls = lse[(long long)nbh * M + r] * FLASH_LOG2E;
                de = delta[(long long)nbh * M + r];
                mn = mx = lo;
            }
            sPos[tid] = p;
            sLo[tid] = lo;
            sLse[tid] = ls;
            sDelta[tid] = de;
        }
        int lo_min, lo_max;
        block_lo_range(mn, mx, red, warp, lane, lo_min, lo_max);
        if (lo_min > k_last) {  // no row of this tile sees these keys
            if (monotone) break;  // nor any later one
            continue;
        }
        load_tile<BQ, D>(sQ, q, qmap, rq, M, tid);
        load_tile<BQ, D>(sO, dout, omap, rq, M, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        const bool need_mask = !(rq / group >= k0 + BN - 1 && lo_max <= k0 && rq + BQ <= M);
        float st[BQ / 8][4], dpt[BQ / 8][4];  // S^T and dP^T: 16 keys x BQ rows a warp
#pragma unroll
        for (int i = 0; i < BQ / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 ka[4], va[4];
            ldsm(ka, kr + AT(warp * 16, kk * 16));
            ldsm(va, vr + AT(warp * 16, kk * 16));
#pragma unroll
            for (int np = 0; np < BQ / 16; ++np) {
                u32 bq[4], bo[4];
                ldsm(bq, qc + AT(np * 16, kk * 16));
                mma(st[2 * np], ka, bq[0], bq[1]);
                mma(st[2 * np + 1], ka, bq[2], bq[3]);
                ldsm(bo, oc + AT(np * 16, kk * 16));
                mma(dpt[2 * np], va, bo[0], bo[1]);
                mma(dpt[2 * np + 1], va, bo[2], bo[3]);
            }
        }
#pragma unroll
        for (int nb = 0; nb < BQ / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = nb * 8 + 2 * t4 + (e & 1);  // the query row in the tile
                const int key = key_own + 8 * (e >> 1);
                float p = exp2f(st[nb][e] * sl2 - sLse[c]);
                if (need_mask && (key > sPos[c] || key < sLo[c])) p = 0.0f;
                st[nb][e] = p;
                dpt[nb][e] = p * (dpt[nb][e] - sDelta[c]);  // dS^T / scale
            }
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
            u32 pa[4], sa[4];
            acc_to_a(pa, st, kk);
            acc_to_a(sa, dpt, kk);
#pragma unroll
            for (int np = 0; np < D / 16; ++np) {
                u32 bo[4], bq[4];
                ldsm_t(bo, or_ + AT(kk * 16, np * 16));
                mma(dva[2 * np], pa, bo[0], bo[1]);
                mma(dva[2 * np + 1], pa, bo[2], bo[3]);
                ldsm_t(bq, qr + AT(kk * 16, np * 16));
                mma(dka[2 * np], sa, bq[0], bq[1]);
                mma(dka[2 * np + 1], sa, bq[2], bq[3]);
            }
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = key_own + 8 * h;
        if (key < T) {
            const long long at = (((long long)b * T + key) * kv + kvh) * D;
#pragma unroll
            for (int nd = 0; nd < D / 8; ++nd) {
                const int c = nd * 8 + 2 * t4;
                *(u32*)(dk + at + c) =
                    pack_bf16(dka[nd][2 * h] * scale, dka[nd][2 * h + 1] * scale);
                *(u32*)(dv + at + c) = pack_bf16(dva[nd][2 * h], dva[nd][2 * h + 1]);
            }
        }
    }
}

#define FLASH_KERNELS(D, BQ)                                                                     \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_forward_d##D(              \
        const u16* q, const u16* k, const u16* v, u16* out, float* lse, int kv, int T,           \
        int group, long long window, float scale, const int* starts) {                           \
        flash_forward_block<D>(q, k, v, out, lse, kv, T, group, window, scale, starts);           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_dq_d##D(                   \
        const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,             \
        const float* delta, u16* dq, int kv, int T, int group, long long window, float scale,    \
        const int* starts) {                                                                     \
        flash_dq_block<D>(q, k, v, dout, lse, delta, dq, kv, T, group, window, scale, starts);    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_dkdv_d##D(                 \
        const u16* q, const u16* k, const u16* v, const u16* dout, const float* lse,             \
        const float* delta, u16* dk, u16* dv, int kv, int T, int group, long long window,        \
        float scale, const int* starts, const int* bad) {                                        \
        flash_dkdv_block<D, BQ>(q, k, v, dout, lse, delta, dk, dv, kv, T, group, window, scale,   \
                                starts, bad);                                                    \
    }

FLASH_KERNELS(64, FLASH_DKDV_ROWS_64)
FLASH_KERNELS(128, FLASH_DKDV_ROWS_128)

extern "C" __global__ void flash_delta(const u16* dout, const u16* out, float* delta, int* bad,
                                       const int* starts, long long rows, int kv, int T,
                                       int group, int d) {
    flash_delta_rows(dout, out, delta, bad, starts, rows, kv, T, group, d);
}
"""

#: Head dims the flash kernels are built for.
FLASH_HEAD_DIMS = (64, 128)
#: Threads of a flash block (4 warps of 16 query rows, or of 16 keys in dK/dV).
FLASH_THREADS = 128
#: Query rows of a forward or dQ block, keys of a dK/dV block and of every key tile.
FLASH_BLOCK = 64
#: Query rows of a dK/dV kernel's tile, by head dim (compiled in with -DFLASH_DKDV_ROWS_<d>).
FLASH_DKDV_ROWS = {64: 64, 128: 64}
#: Threads per block of the delta kernel (a warp per row).
FLASH_DELTA_THREADS = 256
#: Shared memory of one block without the opt-in to more.
SHARED_DEFAULT = 48 * 1024
#: NVRTC options of the flash module (the products need no bit-for-bit match with xp).
FLASH_COMPILE_OPTIONS = (
    "-std=c++17",
    *(f"-DFLASH_DKDV_ROWS_{d}={rows}" for d, rows in FLASH_DKDV_ROWS.items()),
)
#: The flash kernels' names, for the compile check.
FLASH_KERNEL_NAMES = (
    *(f"flash_{kind}_d{d}" for d in FLASH_HEAD_DIMS for kind in ("forward", "dq", "dkdv")),
    "flash_delta",
)


def flash_shared_bytes(kind: str, d: int) -> int:
    """Dynamic shared memory of a flash kernel's block (the layouts at the top of each
    kernel): key/value tiles, query/dO tiles (rows padded by 8 elements: ldmatrix reads them
    without bank conflicts), per-row tables and an 8-int reduction."""
    row = (d + 8) * 2
    red = 8 * 4
    if kind == "forward":  # K, V (the query tile first)
        return 2 * FLASH_BLOCK * row + red
    if kind == "dq":  # Q, dO, K, V
        return 4 * FLASH_BLOCK * row + red
    if kind == "dkdv":  # K, V, Q, dO; lse, delta, position, first key of each query row
        bq = FLASH_DKDV_ROWS[d]
        return (2 * FLASH_BLOCK + 2 * bq) * row + 16 * bq + red
    raise ValueError(f"unknown flash kernel {kind!r}")


@functools.cache
def _flash_module(device: int) -> Any:
    import cupy as cp

    return cp.RawModule(code=FLASH_SOURCE, options=FLASH_COMPILE_OPTIONS)


@functools.cache
def _flash_kernel(device: int, name: str, shared: int) -> Any:
    function = _flash_module(device).get_function(name)
    if shared > SHARED_DEFAULT:  # the opt-in to more shared memory than a block gets by default
        with warnings.catch_warnings():  # CuPy versions move this setter between classes
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                function.max_dynamic_shared_size_bytes = shared
            except AttributeError:  # no setter: the driver's call on the function's handle
                import cupy as cp

                handle = getattr(function, "ptr", None) or function.kernel.ptr
                max_dynamic_shared = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                cp.cuda.driver.funcSetAttribute(handle, max_dynamic_shared, shared)
    return function


@functools.cache
def _flash_capable(device: int) -> bool:
    """Whether the device has the flash kernels' instructions (bf16 mma.sync, cp.async:
    compute capability 8.0 or later)."""
    import cupy as cp

    device_type = getattr(cp.cuda, "Device", None)
    if device_type is None:  # a recording's namespace (backends/record): nothing runs
        return True
    return int(device_type(device).compute_capability) >= 80


def _aligned(a: Any) -> bool:
    """C-contiguous with its first element on a 16-byte boundary (the kernels copy rows 16
    bytes at a time)."""
    if not a.flags.c_contiguous:
        return False
    data = getattr(a, "data", None)
    if data is None:  # a recording's array (backends/record) knows its own alignment
        return bool(getattr(a, "aligned16", False))
    return int(data.ptr) % 16 == 0


def flash_applies(q: Any, k: Any, v: Any, starts: Any = None) -> bool:
    """Whether the flash kernels take this attention: CuPy arrays in bfloat16, q
    [B, kv_heads, T, group, D] and k, v [B, kv_heads, T, D] C-contiguous and 16-byte aligned,
    D in FLASH_HEAD_DIMS, sizes within the kernels' int32 indices and grid, `starts` [B, T] or
    None, on a device of compute capability 8.0 or later."""
    import cupy as cp

    if not all(isinstance(a, cp.ndarray) for a in (q, k, v)):
        return False
    if dtype_name(np.dtype(q.dtype)) != "bfloat16" or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if q.ndim != 5 or k.ndim != 4:
        return False
    b, kv, t, group, d = (int(n) for n in q.shape)
    if d not in FLASH_HEAD_DIMS or tuple(k.shape) != (b, kv, t, d) or v.shape != k.shape:
        return False
    if min(b, kv, t, group) < 1 or b * kv > 65535 or t * group >= 2**31 - 2 * FLASH_BLOCK:
        return False
    if starts is not None and tuple(starts.shape) != (b, t):
        return False
    if not all(_aligned(a) for a in (q, k, v)):
        return False
    return _flash_capable(cp.cuda.runtime.getDevice())


def _flash_starts(starts: Any) -> Any:
    """The kernels' starts argument: int32 [B, T], or a null pointer."""
    import cupy as cp

    if starts is None:
        return np.uint64(0)
    return cp.ascontiguousarray(starts.astype(np.int32, copy=False))


def _flash_launch(kind: str, d: int, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
    import cupy as cp

    shared = flash_shared_bytes(kind, d)
    kernel = _flash_kernel(cp.cuda.runtime.getDevice(), f"flash_{kind}_d{d}", shared)
    kernel(grid, (FLASH_THREADS,), args, shared_mem=shared)


def _flash_forward(
    q: Any, k: Any, v: Any, scale: float, window: int | None, starts: Any
) -> tuple[Any, Any]:
    import cupy as cp

    b, kv, t, group, d = (int(n) for n in q.shape)
    m = t * group
    out = cp.empty((b, t, kv, group, d), q.dtype)
    lse = cp.empty((b * kv, m), cp.float32)
    sizes = (np.int32(kv), np.int32(t), np.int32(group), np.int64(window or 0), np.float32(scale))
    grid = ((m + FLASH_BLOCK - 1) // FLASH_BLOCK, b * kv)
    _flash_launch("forward", d, grid, (q, k, v, out, lse, *sizes, _flash_starts(starts)))
    return out, lse


def _flash_backward(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    scale: float,
    window: int | None,
    starts: Any,
) -> tuple[Any, Any, Any]:
    import cupy as cp

    b, kv, t, group, d = (int(n) for n in q.shape)
    m = t * group
    head_starts = _flash_starts(starts)
    # delta = rowsum(dO * O) per query row, and (packed rows) whether a batch's starts ever
    # decrease (then the dK/dV kernel cannot stop early)
    delta = cp.empty((b * kv, m), cp.float32)
    bad = cp.zeros((b,), cp.int32) if starts is not None else np.uint64(0)
    rows = b * t * kv * group
    per_block = FLASH_DELTA_THREADS // 32
    delta_grid = (max(1, min((rows + per_block - 1) // per_block, 1 << 16)),)
    kernel = _flash_kernel(cp.cuda.runtime.getDevice(), "flash_delta", 0)
    kernel(
        delta_grid,
        (FLASH_DELTA_THREADS,),
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
    dq = cp.empty((b, t, kv, group, d), do.dtype)
    grid = ((m + FLASH_BLOCK - 1) // FLASH_BLOCK, b * kv)
    _flash_launch("dq", d, grid, (q, k, v, do, lse, delta, dq, *sizes, head_starts))
    dk = cp.empty((b, t, kv, d), do.dtype)
    dv = cp.empty((b, t, kv, d), do.dtype)
    grid = ((t + FLASH_BLOCK - 1) // FLASH_BLOCK, b * kv)
    _flash_launch("dkdv", d, grid, (q, k, v, do, lse, delta, dk, dv, *sizes, head_starts, bad))
    return dq, dk, dv


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
    "FLASH_COMPILE_OPTIONS",
    "FLASH_HEAD_DIMS",
    "FLASH_KERNEL_NAMES",
    "FLASH_SOURCE",
    "KERNEL_NAMES",
    "SOURCE",
    "FusedGate",
    "FusedHeads",
    "FusedNorm",
    "FusedSoftmax",
    "flash_applies",
    "flash_shared_bytes",
    "supports",
]
