"""Fused GPU kernels of the trainer: the causal softmax of a chunk of attention scores and its
gradient, and SwiGLU's gate and its gradient. Each replaces a chain of elementwise CuPy
calls over the same arrays (`functional.SoftmaxKernels` / `GateKernels` state the same math
in `xp`, and the GPU tests compare the two): one read and one write of every element instead
of a float32 temporary per step of the formula.

bfloat16 is handled as raw 16-bit words (widened exactly, rounded to nearest even), float32
as is; the math is float32. Compiled with NVRTC on first use (through CuPy); importing this
module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..formats import dtype_name

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
// starts at position t0; `group` rows per position) and the keys [lo, hi) it may see.
struct RowSpan {
    long long batch, r, lo, hi;
};
__device__ __forceinline__ RowSpan row_span(long long row, long long rows_per_batch, int keys,
                                            int group, long long t0, long long window) {
    RowSpan s;
    s.batch = row / rows_per_batch;
    s.r = row % rows_per_batch;
    const long long pos = t0 + s.r / group;
    s.lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
    s.hi = pos + 1 < keys ? pos + 1 : keys;
    return s;
}

// One block per row: P = softmax(scale * s) over [lo, hi), 0 elsewhere, written over s;
// lse[batch * lse_stride + lse_offset + r] = log-sum-exp of the row.
template <typename T>
__device__ void softmax_forward_row(T* s, float* lse, long long rows_per_batch, int keys,
                                    int group, long long t0, long long window, float scale,
                                    long long lse_stride, long long lse_offset) {
    __shared__ float shared[32];
    const long long row = blockIdx.x;
    const RowSpan span = row_span(row, rows_per_batch, keys, group, t0, window);
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
                                     long long offset) {
    const long long row = blockIdx.x;
    const RowSpan span = row_span(row, rows_per_batch, keys, group, t0, window);
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
        long long window, float scale, long long lse_stride, long long lse_offset) {           \
        softmax_forward_row<T>(s, lse, rows_per_batch, keys, group, t0, window, scale,         \
                               lse_stride, lse_offset);                                        \
    }                                                                                          \
    extern "C" __global__ void softmax_backward_##NAME(                                        \
        T* s, T* dp, const float* lse, const float* delta, long long rows_per_batch, int keys, \
        int group, long long t0, long long window, float scale, long long stride,              \
        long long offset) {                                                                    \
        softmax_backward_row<T>(s, dp, lse, delta, rows_per_batch, keys, group, t0, window,    \
                                scale, stride, offset);                                        \
    }                                                                                          \
    extern "C" __global__ void gate_forward_##NAME(const T* g, const T* u, T* a, long long n) { \
        gate_forward_all<T>(g, u, a, n);                                                       \
    }                                                                                          \
    extern "C" __global__ void gate_backward_##NAME(const T* da, T* g, T* u, long long n) {    \
        gate_backward_all<T>(da, g, u, n);                                                     \
    }

SOFTMAX_KERNELS(bf16, unsigned short)
SOFTMAX_KERNELS(f32, float)
"""

#: The kernels' names, for the compile check.
KERNEL_NAMES = tuple(
    f"{kind}_{name}"
    for name in ("bf16", "f32")
    for kind in ("softmax_forward", "softmax_backward", "gate_forward", "gate_backward")
)
#: dtypes the fused kernels take, by name, with their kernel-name suffix.
SUFFIX = {"bfloat16": "bf16", "float32": "f32"}
#: Threads per block of the row kernels (rows are up to tens of thousands of keys).
ROW_THREADS = 256
#: Threads and the largest grid of the elementwise kernels (grid-stride loops).
ELEMENTWISE_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 65536


def supports(dtype: Any) -> bool:
    """Whether the fused kernels take arrays of `dtype`."""
    return dtype_name(np.dtype(dtype)) in SUFFIX


@functools.cache
def _module(device: int) -> Any:
    import cupy as cp

    return cp.RawModule(code=SOURCE, options=("-std=c++17",))


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


class FusedSoftmax:
    """`functional.SoftmaxKernels` on the GPU: one launch per chunk for each direction."""

    def forward(
        self, s: Any, lse: Any, t0: int, group: int, window: int | None, scale: float
    ) -> None:
        _check("scores", s, s.dtype)
        _check("lse", lse, np.float32)
        if s.ndim != 3 or s.shape[1] == 0:
            return
        args = _row_args(s, lse, t0, group, window, scale)
        rows = int(s.shape[0] * s.shape[1])
        kernel = _kernel("softmax_forward", s.dtype)
        kernel((rows,), (ROW_THREADS,), (s, lse, *args))

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
        kernel((rows,), (ROW_THREADS,), (s, dp, lse, delta, *args))


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


__all__ = ["KERNEL_NAMES", "SOURCE", "FusedGate", "FusedSoftmax", "supports"]
