// nybble's CUDA kernels: the blockwise codec (NF4, FP4, int8 and the dynamic 8-bit map of
// double quantization) and the fused 4-bit GEMV. Loaded by nybble.cuda through CuPy (NVRTC).
//
// Self-contained on purpose (no headers): CuPy and a bare NVRTC (the CI compile check) see
// the same source. The f32 <-> f16/bf16 conversions are PTX cvt instructions, which round to
// nearest even like numpy / ml_dtypes.
//
// Bit-exactness with the CPU codec: every rounding of the codec is explicit. __fmul_rn,
// __fadd_rn, __frcp_rn and __fdiv_rn are IEEE operations that the compiler may neither contract
// into an FMA nor replace by an approximation, whatever the compile options. The GEMV is not
// bit-exact (it sums in its own order) and uses FMAs freely.
//
// The tables (codebook values, decision thresholds) are kernel arguments copied from
// nybble.reference, so the numbers live in one place.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define THREADS 256  // every launcher uses blocks of 256 threads

// ---- element types: 0 float32, 1 float16, 2 bfloat16 (nybble.cuda._launch.DTYPES) ---------

template <int D> struct Elem;

template <> struct Elem<0> {
    typedef float T;
    enum { VEC = 4 };  // elements in 16 bytes
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
    // VEC consecutive elements, 16-byte aligned.
    static __device__ __forceinline__ void load_vec(const float* p, float* v) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(p));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    }
    static __device__ __forceinline__ void store_vec(float* p, const float* v) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    }
};

// The two 16-bit formats share their vector moves; only the scalar conversion differs.
template <typename Conv> struct Elem16 {
    typedef u16 T;
    enum { VEC = 8 };
    static __device__ __forceinline__ float load(u16 v) { return Conv::widen(v); }
    static __device__ __forceinline__ u16 store(float v) { return Conv::narrow(v); }
    static __device__ __forceinline__ void load_vec(const u16* p, float* v) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = Conv::widen((u16)(w[k] & 0xffffu));
            v[2 * k + 1] = Conv::widen((u16)(w[k] >> 16));
        }
    }
    static __device__ __forceinline__ void store_vec(u16* p, const float* v) {
        u32 w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            w[k] = (u32)Conv::narrow(v[2 * k]) | ((u32)Conv::narrow(v[2 * k + 1]) << 16);
        *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    }
};

struct HalfConv {
    static __device__ __forceinline__ float widen(u16 h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ __forceinline__ u16 narrow(float f) {
        u16 h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
};

struct BFloatConv {
    static __device__ __forceinline__ float widen(u16 b) { return __uint_as_float((u32)b << 16); }
    static __device__ __forceinline__ u16 narrow(float f) {
        u16 b;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
        return b;
    }
};

template <> struct Elem<1> : Elem16<HalfConv> {};
template <> struct Elem<2> : Elem16<BFloatConv> {};

// ---- per-block scales ----------------------------------------------------------------------

// The scale of quantization block b: a float32 absmax, or under double quantization
// map[qcode[b]] * absmax2[b / 256] + offset, rounded after the multiply and after the add.
struct Scales {
    const float* absmax;   // [nblocks] f32 (unused when nested)
    const u8* qcodes;      // [nblocks] dynamic-map codes (nested)
    const float* absmax2;  // [ceil(nblocks / 256)] f32 (nested)
    const float* dmap;     // [256] the dynamic map (nested)
    float offset;          // the subtracted mean (nested)
    int nested;

    __device__ __forceinline__ float operator()(i64 b) const {
        if (!nested) return __ldg(absmax + b);
        const float m = __ldg(dmap + __ldg(qcodes + b));
        return __fadd_rn(__fmul_rn(m, __ldg(absmax2 + (b >> 8))), offset);
    }
};

#define SCALE_PARAMS                                                                       \
    const float *__restrict__ absmax, const u8 *__restrict__ qcodes,                        \
        const float *__restrict__ absmax2, const float *__restrict__ dmap, float offset,     \
        int nested
#define SCALE_ARGS {absmax, qcodes, absmax2, dmap, offset, nested}

// ---- moving bytes -----------------------------------------------------------------------

// N (2, 4 or 8) bytes from an N-aligned address, as little-endian words.
template <int N> __device__ __forceinline__ void load_bytes(const u8* p, u32* w) {
    if (N == 2) w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
    if (N == 4) w[0] = __ldg(reinterpret_cast<const u32*>(p));
    if (N == 8) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = v.x;
        w[1] = v.y;
    }
}

// The first `valid` of N bytes at p (N = 8, 16 or 32, p N-aligned): vector stores when all are.
template <int N> __device__ __forceinline__ void store_bytes(u8* p, const u32* w, int valid) {
    if (valid == N) {
        if (N == 8) {
            *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
        } else {
#pragma unroll
            for (int k = 0; k < N / 16; ++k)
                reinterpret_cast<uint4*>(p)[k] =
                    make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
        }
    } else {
#pragma unroll
        for (int b = 0; b < N; ++b)
            if (b < valid) p[b] = (u8)(w[b >> 2] >> (8 * (b & 3)));
    }
}

// ---- dequantize ----------------------------------------------------------------------------

// Where 4-bit codes and scales are: nybble's split layout (element 2k in the low nibble,
// scales apart), the 36-byte blocks (per 64 values: f32 absmax, then 32 code bytes), and
// bitsandbytes' packing (element 2k in the high nibble, scales apart).
enum { SPLIT = 0, BLOCKS36 = 1, HIGH_FIRST = 2 };

// 16-byte stores per thread. Store k of thread t writes the VEC outputs from
// i = ((block * STEPS + k) * THREADS + t) * VEC, so a warp's store covers 512 contiguous bytes.
// Outputs out[i..] are the tensor's elements start + i..; start is a multiple of 32 (4-bit) or
// 16 (8-bit) and blocksizes are multiples of 32, so the VEC outputs of a store share a scale.
#define STEPS 4

template <int D> __device__ __forceinline__ i64 step_index(int k) {
    return (((i64)blockIdx.x * STEPS + k) * THREADS + threadIdx.x) * Elem<D>::VEC;
}

// Writes VEC values, or the first `valid` of them at the end of the output.
template <int D>
__device__ __forceinline__ void store_out(typename Elem<D>::T* p, const float* v, int valid) {
    if (valid == Elem<D>::VEC) {
        Elem<D>::store_vec(p, v);
    } else {  // unrolled, so that v is indexed by constants and stays in registers
#pragma unroll
        for (int j = 0; j < Elem<D>::VEC; ++j)
            if (j < valid) p[j] = Elem<D>::store(v[j]);
    }
}

template <int D, int L>
__device__ __forceinline__ void dequant4(const u8* __restrict__ codes, const Scales& scale,
                                         const float* __restrict__ table, i64 start, i64 n,
                                         int log2_bs, typename Elem<D>::T* __restrict__ out) {
    enum { VEC = Elem<D>::VEC, BYTES = VEC / 2 };
    // Every load first; the codebook goes to shared memory while they are in flight.
    u32 w[STEPS];
    float s[STEPS];
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const i64 i = step_index<D>(k);
        w[k] = 0u;
        s[k] = 0.0f;
        if (i >= n) continue;
        const i64 g = start + i;
        const int valid = n - i < VEC ? (int)(n - i) : VEC;
        const u8* p;
        if (L == BLOCKS36) {
            const u8* block = codes + (g >> 6) * 36;
            s[k] = __ldg(reinterpret_cast<const float*>(block));
            p = block + 4 + ((g & 63) >> 1);
        } else {
            s[k] = scale(g >> log2_bs);
            p = codes + (g >> 1);
        }
        if (valid == VEC || L == BLOCKS36) {  // 36-byte blocks are whole in the buffer
            load_bytes<BYTES>(p, &w[k]);
        } else {
#pragma unroll
            for (int b = 0; b < BYTES; ++b)
                if (2 * b < valid) w[k] |= (u32)p[b] << (8 * b);
        }
    }
    __shared__ float lut[16];  // 16 distinct banks: lookups never conflict
    if (threadIdx.x < 16) lut[threadIdx.x] = table[threadIdx.x];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const i64 i = step_index<D>(k);
        if (i >= n) break;
        float v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            const int nibble = L == HIGH_FIRST ? j ^ 1 : j;  // bitsandbytes: 2k high, 2k+1 low
            v[j] = __fmul_rn(lut[(w[k] >> (4 * nibble)) & 15u], s[k]);
        }
        store_out<D>(out + i, v, n - i < VEC ? (int)(n - i) : VEC);
    }
}

#define DEQUANT4(NAME, D, L)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        NAME(const u8* __restrict__ codes, SCALE_PARAMS, const float* __restrict__ table,      \
             i64 start, i64 n, int log2_bs, Elem<D>::T* __restrict__ out) {                    \
        const Scales scale = SCALE_ARGS;                                                       \
        dequant4<D, L>(codes, scale, table, start, n, log2_bs, out);                           \
    }
DEQUANT4(dequant4_split_f32, 0, SPLIT)
DEQUANT4(dequant4_split_f16, 1, SPLIT)
DEQUANT4(dequant4_split_bf16, 2, SPLIT)
DEQUANT4(dequant4_blocks36_f32, 0, BLOCKS36)
DEQUANT4(dequant4_blocks36_f16, 1, BLOCKS36)
DEQUANT4(dequant4_blocks36_bf16, 2, BLOCKS36)
DEQUANT4(dequant4_high_first_f32, 0, HIGH_FIRST)
DEQUANT4(dequant4_high_first_f16, 1, HIGH_FIRST)
DEQUANT4(dequant4_high_first_bf16, 2, HIGH_FIRST)

// 8-bit codes (int8, the dynamic map): one code byte per output.
template <int D>
__device__ __forceinline__ void dequant8(const u8* __restrict__ codes, const Scales& scale,
                                         const float* __restrict__ table, i64 start, i64 n,
                                         int log2_bs, typename Elem<D>::T* __restrict__ out) {
    enum { VEC = Elem<D>::VEC };
    u32 w[STEPS][2];
    float s[STEPS];
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const i64 i = step_index<D>(k);
        w[k][0] = w[k][1] = 0u;
        s[k] = 0.0f;
        if (i >= n) continue;
        const i64 g = start + i;
        const int valid = n - i < VEC ? (int)(n - i) : VEC;
        s[k] = scale(g >> log2_bs);
        if (valid == VEC) {
            load_bytes<VEC>(codes + g, w[k]);
        } else {
#pragma unroll
            for (int b = 0; b < VEC; ++b)
                if (b < valid) w[k][b >> 2] |= (u32)codes[g + b] << (8 * (b & 3));
        }
    }
    __shared__ float lut[256];
    lut[threadIdx.x] = table[threadIdx.x];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const i64 i = step_index<D>(k);
        if (i >= n) break;
        float v[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            v[j] = __fmul_rn(lut[(w[k][j >> 2] >> (8 * (j & 3))) & 255u], s[k]);
        store_out<D>(out + i, v, n - i < VEC ? (int)(n - i) : VEC);
    }
}

#define DEQUANT8(NAME, D)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        NAME(const u8* __restrict__ codes, SCALE_PARAMS, const float* __restrict__ table,      \
             i64 start, i64 n, int log2_bs, Elem<D>::T* __restrict__ out) {                    \
        const Scales scale = SCALE_ARGS;                                                       \
        dequant8<D>(codes, scale, table, start, n, log2_bs, out);                              \
    }
DEQUANT8(dequant8_f32, 0)
DEQUANT8(dequant8_f16, 1)
DEQUANT8(dequant8_bf16, 2)

// ---- quantize ------------------------------------------------------------------------------

// How a normalised value v = x / absmax becomes a code (nybble.reference.encode); the tables
// come from the launcher.
enum { NF4 = 0, FP4 = 1, INT8 = 2, DYNAMIC8 = 3 };

// NF4 and FP4 (its magnitude) use 65 buckets of width 1/32 over [-1, 1]: no two thresholds are
// that close, so bucket b = floor(v * 32) (exact: a power-of-two scaling, then floor) holds at
// most one, thr[b] (+inf if none), and the code is codes[b][v > thr[b]]. A tie (v == thr[b])
// takes the lower code.
#define BUCKETS 65
__device__ __forceinline__ u32 bucket_code(float v, const float* thr, const u8* codes) {
    int b = __float2int_rd(__fmul_rn(v, 32.0f));
    b = min(max(b, -32), 32) + 32;
    return codes[2 * b + (v > thr[b] ? 1 : 0)];
}

// The number of the 255 sorted dynamic-map midpoints (padded with +inf to 256) below v.
__device__ __forceinline__ u32 count_below_256(float v, const float* thr) {
    u32 c = 0;
#pragma unroll
    for (int step = 128; step > 0; step >>= 1)
        if (v > thr[c + step - 1]) c += step;
    return c;
}

template <int F>
__device__ __forceinline__ u32 encode(float v, const float* thr, const u8* codes) {
    if (F == NF4) return bucket_code(v, thr, codes);
    if (F == FP4) return (v < 0.0f ? 8u : 0u) | bucket_code(fabsf(v), thr, codes);
    if (F == INT8) {
        const float q = fminf(fmaxf(rintf(__fmul_rn(v, 127.0f)), -127.0f), 127.0f);
        return (u32)(u8)(signed char)(int)q;
    }
    return count_below_256(v, thr);
}

__device__ __forceinline__ bool finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// One thread reads 64 bytes of input: PER = 16 (f32) or 32 (16-bit) consecutive elements,
// inside one block (blocksizes are >= 32); the blocksize / PER threads of a block reduce its
// absmax together. Non-finite inputs: the smallest flat index goes to *first_bad.
template <int S, int F>
__device__ __forceinline__ void quantize(const typename Elem<S>::T* __restrict__ x, i64 n,
                                         int log2_bs, u32 zero_code,
                                         const float* __restrict__ table,
                                         const u8* __restrict__ table_codes,
                                         u8* __restrict__ codes, float* __restrict__ absmax,
                                         u64* __restrict__ first_bad) {
    enum {
        VEC = Elem<S>::VEC,
        PER = 4 * VEC,
        LOG2_PER = VEC == 4 ? 4 : 5,
        BITS = F == NF4 || F == FP4 ? 4 : 8,
        NTHR = F == DYNAMIC8 ? 256 : F == INT8 ? 0 : BUCKETS,
    };
    const i64 i = ((i64)blockIdx.x * THREADS + threadIdx.x) * PER;
    const int valid = i >= n ? 0 : (n - i < PER ? (int)(n - i) : PER);
    float v[PER];
    if (valid == PER) {
#pragma unroll
        for (int k = 0; k < 4; ++k) Elem<S>::load_vec(x + i + k * VEC, v + k * VEC);
    } else {
#pragma unroll
        for (int e = 0; e < PER; ++e) v[e] = e < valid ? Elem<S>::load(x[i + e]) : 0.0f;
    }
    // The tables go to shared memory while the loads above are in flight.
    __shared__ float thr[NTHR > 0 ? NTHR : 1];
    __shared__ u8 thr_codes[2 * BUCKETS];
    __shared__ float warp_max[THREADS / 32];
    if (threadIdx.x < NTHR) thr[threadIdx.x] = table[threadIdx.x];
    if ((F == NF4 || F == FP4) && threadIdx.x < 2 * BUCKETS)
        thr_codes[threadIdx.x] = table_codes[threadIdx.x];
    __syncthreads();

    float m = 0.0f, probe = 0.0f;  // probe: NaN iff some element is NaN or infinite
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        m = fmaxf(m, fabsf(v[e]));
        probe = fmaf(v[e], 0.0f, probe);
    }
    if (probe != probe) {
        int bad = -1;
#pragma unroll
        for (int e = 0; e < PER; ++e)
            if (bad < 0 && !finite(v[e])) bad = e;
        atomicMin(first_bad, (u64)(i + bad));
    }

    // Every thread takes part in the reduction, also those past the end (their m is 0).
    const int group = 1 << (log2_bs - LOG2_PER);
    for (int o = 1; o < group && o < 32; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (group > 32) {
        const int warp = threadIdx.x >> 5, warps = group >> 5;
        if ((threadIdx.x & 31) == 0) warp_max[warp] = m;
        __syncthreads();
        const int first = warp & ~(warps - 1);
        for (int k = 0; k < warps; ++k) m = fmaxf(m, warp_max[first + k]);
    }
    if (valid == 0) return;
    if ((threadIdx.x & (group - 1)) == 0) absmax[i >> log2_bs] = m;

    // Padding past the end is 0, whose code is zero_code in every format: an odd length's
    // last nibble comes out right. An all-zero block is zero_code throughout.
    u32 w[PER / 4] = {};
    auto put = [&](int e, u32 c) {
        if (BITS == 4) w[e >> 3] |= c << (4 * (e & 7));  // element 2k in the low nibble
        else w[e >> 2] |= c << (8 * (e & 3));
    };
    const float inv = __frcp_rn(m);
    if (m == 0.0f) {
#pragma unroll
        for (int e = 0; e < PER; ++e) put(e, zero_code);
    } else if (finite(inv)) {
#pragma unroll
        for (int e = 0; e < PER; ++e) put(e, encode<F>(__fmul_rn(v[e], inv), thr, thr_codes));
    } else {  // absmax < 2^-128: 1/absmax overflows, so the block is normalised by division
#pragma unroll
        for (int e = 0; e < PER; ++e) put(e, encode<F>(__fdiv_rn(v[e], m), thr, thr_codes));
    }
    if (BITS == 4)
        store_bytes<PER / 2>(codes + (i >> 1), w, (valid + 1) / 2);
    else
        store_bytes<PER>(codes + i, w, valid);
}

#define QUANTIZE(NAME, S, F)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        NAME(const Elem<S>::T* __restrict__ x, i64 n, int log2_bs, u32 zero_code,              \
             const float* __restrict__ table, const u8* __restrict__ table_codes,              \
             u8* __restrict__ codes, float* __restrict__ absmax, u64* __restrict__ first_bad) { \
        quantize<S, F>(x, n, log2_bs, zero_code, table, table_codes, codes, absmax, first_bad); \
    }
#define QUANTIZE_ALL_INPUTS(FORMAT, F)                                                         \
    QUANTIZE(quantize_##FORMAT##_f32, 0, F)                                                    \
    QUANTIZE(quantize_##FORMAT##_f16, 1, F)                                                    \
    QUANTIZE(quantize_##FORMAT##_bf16, 2, F)
QUANTIZE_ALL_INPUTS(nf4, NF4)
QUANTIZE_ALL_INPUTS(fp4, FP4)
QUANTIZE_ALL_INPUTS(int8, INT8)
QUANTIZE_ALL_INPUTS(dynamic8, DYNAMIC8)

// ---- the scales of double quantization, decoded ---------------------------------------------

// out[b] = the scale of block b, for every block (what Scales gives the dequantize kernels:
// one definition of the rounding, and no flush to zero as CuPy's own arithmetic would).
extern "C" __global__ void __launch_bounds__(THREADS)
    decode_scales(SCALE_PARAMS, i64 n, float* __restrict__ out) {
    const Scales scale = SCALE_ARGS;
    const i64 b = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (b < n) out[b] = scale(b);
}

// ---- float64 -> float32 ---------------------------------------------------------------------

// Rounded to nearest even as numpy's astype does, subnormal results kept: CuPy's own astype
// is compiled with -ftz=true and flushes them to zero.
extern "C" __global__ void __launch_bounds__(THREADS)
    narrow_f64(const double* __restrict__ x, i64 n, float* __restrict__ y) {
    const i64 i = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (i < n) y[i] = __double2float_rn(x[i]);
}

// ---- fused 4-bit GEMV: y[t, r] = sum_k x[t, k] * W[r, k] for M <= 4 tokens -------------------

// The shared-memory address of p (its offset in the block's shared window).
__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ float load_shared(u32 address) {
    float v;
    asm("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(address));
    return v;
}

// The 8 codebook values of a word of codes (element j in nibble j), looked up in a 16-entry
// table at `lut` in shared memory, 256-byte aligned. The shared address of entry c is lut | 4c:
// one byte permute per element builds it from a word holding 4c in each byte, which two
// shift-and-masks make for 4 elements at once (the compiler's own indexing takes 3
// instructions per element).
__device__ __forceinline__ void decode8(u32 word, u32 lut, float* v) {
    const u32 even = (word << 2) & 0x3c3c3c3cu;  // byte k: 4 * element 2k
    const u32 odd = (word >> 2) & 0x3c3c3c3cu;   // byte k: 4 * element 2k + 1
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = load_shared(__byte_perm(even, lut, 0x7650u | k));
        v[2 * k + 1] = load_shared(__byte_perm(odd, lut, 0x7650u | k));
    }
}

// A block computes GEMV_ROWS rows of W [rows, cols] (split layout, cols a multiple of 32). Its
// threads take 32-element chunks (16 code bytes, one scale) of those rows, thread t the chunks
// t, t + GEMV_THREADS, ...: a warp reads 512 contiguous bytes of a row, and a row of 4096
// elements is one chunk per thread, all its loads in flight at once. Each chunk is decoded
// through the codebook in shared memory and multiplied by all M tokens (the 4-bit weight is
// read once for all tokens, each load of x serves GEMV_ROWS rows); the scale multiplies the
// chunk's partial sum, not each weight. With more chunks than threads, the next GEMV_UNROLL
// chunks are loaded before the current ones are decoded. The sums meet through warp shuffles
// and shared memory. The parameters are the fastest of benchmarks/gemv_tune.py's sweep on an
// H100, where the kernel is bound by latency (few warps per scheduler, each waiting on memory,
// shared-memory lookups and dependent instructions), not by DRAM bandwidth. The launcher
// (nybble.cuda._launch) knows GEMV_THREADS and GEMV_ROWS.
#ifndef GEMV_THREADS
#define GEMV_THREADS 128
#endif
#ifndef GEMV_ROWS
#define GEMV_ROWS 8
#endif
#ifndef GEMV_UNROLL
#define GEMV_UNROLL 1
#endif

template <int D, int M>
__device__ __forceinline__ void gemv(const typename Elem<D>::T* __restrict__ x,
                                     const u8* __restrict__ codes, const Scales& scale,
                                     const float* __restrict__ table, int rows, int cols,
                                     int log2_bs, typename Elem<D>::T* __restrict__ y) {
    enum { VEC = Elem<D>::VEC, ROWS = GEMV_ROWS, UNROLL = GEMV_UNROLL };
    enum { WARPS = GEMV_THREADS / 32, STRIDE = GEMV_THREADS * UNROLL };
    __shared__ __align__(256) float lut[16];
    __shared__ float partial[WARPS][ROWS][M];
    const u32 lut_base = shared_address(lut);
    const int r0 = blockIdx.x * ROWS;
    const int chunks = cols >> 5;

    // Chunks c0, c0 + GEMV_THREADS, ... of the block's rows into w and s; zeros past the end.
    auto load = [&](int c0, uint4 (&w)[UNROLL][ROWS], float (&s)[UNROLL][ROWS]) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const int c = c0 + GEMV_THREADS * u;
                w[u][r] = make_uint4(0u, 0u, 0u, 0u);
                s[u][r] = 0.0f;
                if (c < chunks && r0 + r < rows) {
                    const i64 e = (i64)(r0 + r) * cols + ((i64)c << 5);
                    w[u][r] = __ldcs(reinterpret_cast<const uint4*>(codes + (e >> 1)));
                    s[u][r] = scale(e >> log2_bs);
                }
            }
    };

    uint4 w[UNROLL][ROWS];
    float s[UNROLL][ROWS];
    load(threadIdx.x, w, s);
    // The codebook reaches shared memory while the first loads are in flight.
    if (threadIdx.x < 16) lut[threadIdx.x] = table[threadIdx.x];
    __syncthreads();

    float acc[ROWS][M];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < M; ++t) acc[r][t] = 0.0f;

    for (int c0 = threadIdx.x; c0 < chunks; c0 += STRIDE) {
        uint4 wn[UNROLL][ROWS];
        float sn[UNROLL][ROWS];
        if (c0 + STRIDE < chunks) load(c0 + STRIDE, wn, sn);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + GEMV_THREADS * u;
            if (c >= chunks) break;
            float part[ROWS][M];
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int t = 0; t < M; ++t) part[r][t] = 0.0f;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float xv[M][8];
#pragma unroll
                for (int t = 0; t < M; ++t) {
                    const typename Elem<D>::T* xp = x + (i64)t * cols + ((i64)c << 5) + 8 * q;
#pragma unroll
                    for (int h = 0; h < 8 / VEC; ++h)
                        Elem<D>::load_vec(xp + h * VEC, xv[t] + h * VEC);
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const uint4 wr = w[u][r];
                    const u32 word = q == 0 ? wr.x : q == 1 ? wr.y : q == 2 ? wr.z : wr.w;
                    float wv[8];
                    decode8(word, lut_base, wv);
#pragma unroll
                    for (int j = 0; j < 8; ++j)
#pragma unroll
                        for (int t = 0; t < M; ++t) part[r][t] = fmaf(wv[j], xv[t][j], part[r][t]);
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int t = 0; t < M; ++t) acc[r][t] = fmaf(s[u][r], part[r][t], acc[r][t]);
        }
        if (c0 + STRIDE < chunks) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    w[u][r] = wn[u][r];
                    s[u][r] = sn[u][r];
                }
        }
    }

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < M; ++t) {
            float a = acc[r][t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0) partial[warp][r][t] = a;
        }
    __syncthreads();
    if (threadIdx.x < ROWS * M) {
        const int r = threadIdx.x / M, t = threadIdx.x % M;
        float a = 0.0f;
#pragma unroll
        for (int k = 0; k < WARPS; ++k) a += partial[k][r][t];
        if (r0 + r < rows) y[(i64)t * rows + r0 + r] = Elem<D>::store(a);
    }
}

#define GEMV(NAME, D, M)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                 \
        NAME(const Elem<D>::T* __restrict__ x, const u8* __restrict__ codes, SCALE_PARAMS,     \
             const float* __restrict__ table, int rows, int cols, int log2_bs,                 \
             Elem<D>::T* __restrict__ y) {                                                     \
        const Scales scale = SCALE_ARGS;                                                       \
        gemv<D, M>(x, codes, scale, table, rows, cols, log2_bs, y);                            \
    }
#define GEMV_ALL_TOKENS(D, SUFFIX)                                                             \
    GEMV(gemv_##SUFFIX##_m1, D, 1)                                                             \
    GEMV(gemv_##SUFFIX##_m2, D, 2)                                                             \
    GEMV(gemv_##SUFFIX##_m3, D, 3)                                                             \
    GEMV(gemv_##SUFFIX##_m4, D, 4)
GEMV_ALL_TOKENS(0, f32)
GEMV_ALL_TOKENS(1, f16)
GEMV_ALL_TOKENS(2, bf16)
