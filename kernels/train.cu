// The trainer's fused row kernels (nybble.train._cuda): the causal softmax of a chunk of
// attention scores and its gradient, SwiGLU's gate and its gradient, RMSNorm and its gradient,
// and the query/key heads' norm + rotary positions + move to attention's layout and back. Each
// states the math of its `xp` twin in nybble.train.functional (SoftmaxKernels, GateKernels,
// NormKernels, HeadKernels) in one pass over its arrays.
//
// Compiled by nybble.backends.cuda.kernels (NVRTC) with nybble.train._cuda's COMPILE_OPTIONS
// (--fmad=false: each step rounds as its xp statement does; -ftz=true, as CuPy's RawModule,
// which compiled it before, added). Every kernel comes in bf16 (raw
// 16-bit words, widened exactly, rounded to nearest even) and f32 (ROW_KERNELS, at the end);
// the math is float32. Self-contained (no headers), like every file of kernels/.

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
