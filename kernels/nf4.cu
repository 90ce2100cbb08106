// nybble's CUDA kernels: the blockwise codec (NF4, FP4, int8 and the dynamic 8-bit map of
// double quantization) and the fused 4-bit GEMV. Loaded by nybble.backends.cuda through CuPy (NVRTC).
//
// Self-contained on purpose (no headers): CuPy and a bare NVRTC (the CI compile check) see
// the same source. Every launch parameter is defined here once; the host reads the geometry it
// needs back from the loaded module (`launch_facts`, at the end of this file). The f32 <-> f16/bf16 conversions are PTX cvt instructions, which round to
// nearest even like numpy / ml_dtypes.
//
// Bit-exactness with the CPU codec: every rounding of the codec is explicit. __fmul_rn,
// __fadd_rn, __frcp_rn and __fdiv_rn are IEEE operations that the compiler may neither contract
// into an FMA nor replace by an approximation, whatever the compile options. The GEMV is not
// bit-exact (it sums in its own order) and uses FMAs freely.
//
// The tables (codebook values, decision thresholds) are kernel arguments that the launcher
// takes from the Rust core (nybble.formats), so the numbers live in one place.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define THREADS 256  // every launcher uses blocks of 256 threads

// ---- element types: 0 float32, 1 float16, 2 bfloat16 (nybble.formats.OUTPUT_DTYPES) ------

template <int D> struct Elem;

// STEPS: 16-byte stores per thread when dequantizing (see launch_facts), the fastest
// on an H100 at 4096^2 and 14336x4096 of 1-4 (float32) and of 2-8 (16-bit).
template <> struct Elem<0> {
    typedef float T;
    enum { VEC = 4, STEPS = 1 };  // VEC: elements in 16 bytes
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
    // VEC consecutive elements, 16-byte aligned.
    static __device__ __forceinline__ void load_vec(const float* p, float* v) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(p));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    }
    static __device__ __forceinline__ void store_vec(float* p, const float* v) {
        __stcs(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));
    }
};

// The two 16-bit formats share their vector moves; only the scalar conversion differs.
template <typename Conv> struct Elem16 {
    typedef u16 T;
    enum { VEC = 8, STEPS = 4 };
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
        __stcs(reinterpret_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
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
        return decode(__ldg(dmap + __ldg(qcodes + b)), __ldg(absmax2 + (b >> 8)));
    }
    // A nested scale from its map value and its absmax2.
    __device__ __forceinline__ float decode(float map_value, float a2) const {
        return __fadd_rn(__fmul_rn(map_value, a2), offset);
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

// Elem<D>::STEPS 16-byte stores per thread. Store k of thread t writes the VEC outputs from
// i = ((block * STEPS + k) * THREADS + t) * VEC, so a warp's store covers 512 contiguous bytes.
// Outputs out[i..] are the tensor's elements start + i..; start is a multiple of 32 (4-bit) or
// 16 (8-bit) and blocksizes are multiples of 32, so the VEC outputs of a store share a scale.
template <int D> __device__ __forceinline__ i64 step_index(int k) {
    return (((i64)blockIdx.x * Elem<D>::STEPS + k) * THREADS + threadIdx.x) * Elem<D>::VEC;
}

// Writes VEC values, or the first `valid` of them at the end of the output. The full stores
// stream (st.global.cs, evict first): nothing here reads them back, and on an H100 that is up
// to 4% of copy bandwidth faster than plain stores (4096^2, 16-bit outputs).
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
    enum { VEC = Elem<D>::VEC, BYTES = VEC / 2, STEPS = Elem<D>::STEPS };
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
    enum { VEC = Elem<D>::VEC, STEPS = Elem<D>::STEPS };
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

// NF4 and FP4 (its magnitude) use buckets of width 1/32 over [-33/32, 33/32): no two thresholds
// are that close, so bucket b = floor(v * 32) holds at most one, thr[b] (+inf if none), and the
// code is codes[b][v > thr[b]]. A tie (v == thr[b]) takes the lower code. The bucket comes from
// one fused multiply-add rounded down: v * 32 is exact (a power-of-two scaling) and
// 1.5 * 2^23 + 33 has a unit last place, so the sum's low bits are floor(v * 32) + 33: 0..65
// for every v in [-33/32, 33/32), which holds a quantize's v = x * (1 / absmax) (it passes +-1
// by a rounding at most). The table has 128 buckets, so that the mask keeps any index in it (a
// NaN's included: its code is never used).
#define BUCKETS 128
__device__ __forceinline__ u32 bucket_code(float v, const float* thr, const u8* codes) {
    const u32 b = __float_as_uint(__fmaf_rd(v, 32.0f, 12582945.0f)) & (BUCKETS - 1);
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
// absmax together. Non-finite inputs (unless `check` is null: an unchecked quantize): the
// smallest flat index goes to *check, and *found, a word of host memory the device reaches
// directly, is set; so the host learns that all is well from *found after the stream
// synchronize it needs anyway, without a copy, and reads *check only when something was found.
template <int S, int F>
__device__ __forceinline__ void quantize(const typename Elem<S>::T* __restrict__ x, i64 n,
                                         int log2_bs, u32 zero_code,
                                         const float* __restrict__ table,
                                         const u8* __restrict__ table_codes,
                                         u8* __restrict__ codes, float* __restrict__ absmax,
                                         u64* check, volatile u32* found) {
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
    // The tables go to shared memory while the loads above are in flight, an entry a thread.
    static_assert(NTHR <= THREADS && 2 * BUCKETS <= THREADS, "a table entry per thread");
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
        if (check) {
            atomicMin(check, (u64)(i + bad));
            *found = 1u;
        }
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
        // element 2k in the low nibble; the fields are disjoint, so a multiply-add places c
        // (on the FMA pipe, which the encoding leaves idler than the integer one)
        if (BITS == 4) w[e >> 3] = c * (1u << (4 * (e & 7))) + w[e >> 3];
        else w[e >> 2] = c * (1u << (8 * (e & 3))) + w[e >> 2];
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
             u8* __restrict__ codes, float* __restrict__ absmax, u64* check, u32* found) {      \
        quantize<S, F>(x, n, log2_bs, zero_code, table, table_codes, codes, absmax, check,     \
                       found);                                                                 \
    }
#define QUANTIZE_ALL_INPUTS(FORMAT, F)                                                         \
    QUANTIZE(quantize_##FORMAT##_f32, 0, F)                                                    \
    QUANTIZE(quantize_##FORMAT##_f16, 1, F)                                                    \
    QUANTIZE(quantize_##FORMAT##_bf16, 2, F)
QUANTIZE_ALL_INPUTS(nf4, NF4)
QUANTIZE_ALL_INPUTS(fp4, FP4)
QUANTIZE_ALL_INPUTS(int8, INT8)
QUANTIZE_ALL_INPUTS(dynamic8, DYNAMIC8)

// ---- non-finite scan --------------------------------------------------------------------------

// *first_bad = min(*first_bad, flat index of each NaN or +-inf of x): the layers' input check,
// which runs on the device without a wait; the host reads *first_bad when it must sync anyway.
// x is C-contiguous and 16-byte aligned (the launcher sees to it).
template <int D>
__device__ __forceinline__ void scan_non_finite(const typename Elem<D>::T* __restrict__ x, i64 n,
                                                u64* __restrict__ first_bad) {
    enum { VEC = Elem<D>::VEC };
    const i64 i = ((i64)blockIdx.x * THREADS + threadIdx.x) * VEC;
    if (i >= n) return;
    const int valid = n - i < VEC ? (int)(n - i) : VEC;
    float v[VEC];
    if (valid == VEC) {
        Elem<D>::load_vec(x + i, v);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[e] = e < valid ? Elem<D>::load(x[i + e]) : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        if (!finite(v[e])) {
            atomicMin(first_bad, (u64)(i + e));
            return;
        }
    }
}

#define SCAN_NON_FINITE(NAME, D)                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        NAME(const Elem<D>::T* __restrict__ x, i64 n, u64* __restrict__ first_bad) {           \
        scan_non_finite<D>(x, n, first_bad);                                                   \
    }
SCAN_NON_FINITE(scan_non_finite_f32, 0)
SCAN_NON_FINITE(scan_non_finite_f16, 1)
SCAN_NON_FINITE(scan_non_finite_bf16, 2)

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

// ---- float32 -> a 16-bit dtype, two arrays in one launch ------------------------------------

// A LoRA layer's A and B in the activations' dtype for one forward and its backward: one
// launch for both (CuPy's astype costs tens of microseconds of host time a call). Rounded to
// nearest even; subnormals kept, as numpy / ml_dtypes do.
#define NARROW_PAIR(NAME, D)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        NAME(const float* __restrict__ a, i64 na, const float* __restrict__ b, i64 nb,         \
             Elem<D>::T* __restrict__ out_a, Elem<D>::T* __restrict__ out_b) {                 \
        const i64 i = (i64)blockIdx.x * THREADS + threadIdx.x;                                 \
        if (i < na)                                                                            \
            out_a[i] = Elem<D>::store(a[i]);                                                   \
        else if (i - na < nb)                                                                  \
            out_b[i - na] = Elem<D>::store(b[i - na]);                                         \
    }
NARROW_PAIR(narrow_pair_f16, 1)
NARROW_PAIR(narrow_pair_bf16, 2)

// ---- fused 4-bit GEMV: y[t, r] = sum_k x[t, k] * W[r, k] for M <= 4 tokens -------------------

// The shared-memory address of p (its offset in the block's shared window).
__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ u32 load_shared_word(u32 address) {
    u32 v;
    asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(address));
    return v;
}
__device__ __forceinline__ float load_shared(u32 address) {
    return __uint_as_float(load_shared_word(address));
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
// reads GEMV_THREADS and GEMV_ROWS from launch_facts.
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
// float32 tokens, up to GEMV_F32_TOKENS a launch: the 16-bit ones take the tensor-core GEMV.
#define GEMV_F32_TOKENS 4
GEMV(gemv_f32_m1, 0, 1)
GEMV(gemv_f32_m2, 0, 2)
GEMV(gemv_f32_m3, 0, 3)
GEMV(gemv_f32_m4, 0, 4)

// ---- fused 4-bit GEMV on the tensor cores: y[t, r] = sum_k x[t, k] * W[r, k], t < 8 ----------

// d += a * b, mma.sync m16n8k16 with float32 accumulators: a holds 16 rows x 16 k, b 16 k x 8
// tokens, both in the 16-bit format of Elem<D>. Thread (g, t) = (lane / 4, lane % 4) holds
// a[0] = (row g, k 2t, 2t+1), a[1] = (row g+8, k 2t, 2t+1), a[2], a[3] the same at k + 8;
// b[0] = (k 2t, 2t+1; token g), b[1] the same at k + 8; d = (row g; tokens 2t, 2t+1), then
// (row g+8; tokens 2t, 2t+1). The lower k is the lower half of each word.
template <int D> __device__ __forceinline__ void mma_16816(float* d, const u32* a, const u32* b);
template <> __device__ __forceinline__ void mma_16816<1>(float* d, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma_16816<2>(float* d, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Asynchronous copies global -> shared (sm_80+): `bytes` of them read, the rest zero-filled.
// The prefetch-size hints let L2 fetch a code copy's whole 256-byte span (a warp copies 512
// contiguous bytes of a row) and a scale's 128: on an H100, two runs in one process each
// against the copies without them, the GEMV 0.1-1.5% faster at 4096^2, 8192^2, 14336x4096 and
// 4096x14336 for 1 and 8 tokens (8192^2, 1 token: 0.7-1.2%), double-quantized within 0.2%;
// results bit-identical.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(bytes));
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
                 "r"(bytes));
}
// A 16-byte load of data that no thread writes, issued where it stands among the volatile asm
// around it: a plain load, as ptxas moves read-only (.nc) loads past a block barrier.
__device__ __forceinline__ uint4 load_in_place(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// A block computes tiles of 16 rows of W [rows, cols] (split layout) for up to 8 tokens: the
// tiles blockIdx.x, + gridDim.x, ..., as many blocks being launched as the GPU holds at once
// (nybble.backends.cuda.launch.GemvWeight), so that a block builds its table once and its pipeline runs
// on from one tile to the next. On an H100 that was 6-7% faster than a block per tile at
// 14336 x 4096 and up to 4% at 8192^2; at 4096^2 (a tile per block either way) 3% slower.
// The rows stream through shared memory in *stages* of TC_STAGE_GROUPS groups of G = 64 (or 32)
// elements, a group being the span of one scale: TC_STAGES - 1 stages are in flight as
// asynchronous copies (a warp copies 512 contiguous bytes of a row), so the loads are few and
// wide, and how many bytes are in flight does not depend on registers. Each warp multiplies
// TC_STAGE_GROUPS / TC_WARPS groups of a stage on the tensor cores. Within a group, thread
// (g, t) = (lane / 4, lane % 4) takes G/8 code bytes of rows g and g+8 (elements t*G/4 ..) and
// the tokens' values at the same k: the mma's k order is free as long as weights and tokens
// agree on it. A code byte becomes the mma operand (the codebook values of its two nibbles) with
// one byte permute and one shared-memory load: the pair table has 256 entries of 256 bytes,
// entry b holding the pair 32 times (word l for lane l: lookups never conflict), so the permute
// builds the address b * 256 + 4 * lane from the byte and the lane. The mma sums a group
// unscaled; its scale multiplies the group's sum in float32. The codebook values are rounded
// to the tokens' 16-bit format (as the dequantize + cuBLAS path rounds the weights). Threads
// past the rows or the tokens read a real row or token (rows - 1, token m - 1), whose results
// are never written. The warps' sums of a tile meet in shared memory.
// Double-quantized scales (NESTED) arrive as they are stored, 1 byte per block: a row's scale
// area then holds the aligned words of dynamic-map codes that span the row's blocks in the stage
// (TC_NESTED_WORDS of them) and the absmax2 of its first block and of the next one (the stage's
// blocks cross at most one boundary of 256). The block decodes them a stage ahead, one scale per
// thread, into a float32 buffer that the next barrier publishes, so its multiply loop is the
// plain one. Stage s + 1 has then landed while stage s is multiplied, so one stage fewer is in
// flight; on an H100 that was 4% faster than keeping one more stage in shared memory.
#ifndef TC_WARPS
#define TC_WARPS 8
#endif
#ifndef TC_STAGES
#define TC_STAGES 3
#endif
#ifndef TC_STAGE_GROUPS
#define TC_STAGE_GROUPS 16
#endif
#define TC_ROWS 16
// Tokens per launch: an API fact (nybble.cuda.GEMV_MAX_TOKENS) that the host compiles in.
#ifndef TC_TOKENS
#error "TC_TOKENS comes from the launcher: -DTC_TOKENS=<nybble.cuda.GEMV_MAX_TOKENS>"
#endif
static_assert(TC_TOKENS == 8, "the tokens of a launch are the n of one m16n8k16 mma");
#define TC_LUT_BYTES (256 * 256)
#define TC_NESTED_WORDS (TC_STAGE_GROUPS / 4 + 1)

// One stage in shared memory: the codes of 16 rows, each row padded by 32 bytes so that the
// pieces of 4 consecutive rows fall in different banks, then the rows' scales (padded by a
// warp's count of groups in a stage, so that a warp's scales of a row load as one vector, and 8
// rows' vectors fall in different banks). The host reads the total from launch_facts.
template <int G> struct TcStage {
    enum {
        ROW_BYTES = TC_STAGE_GROUPS * G / 2,
        PITCH = ROW_BYTES + 32,
        SCALE_PITCH = TC_STAGE_GROUPS + TC_STAGE_GROUPS / TC_WARPS,
        CODES = TC_ROWS * PITCH,
        BYTES = CODES + TC_ROWS * SCALE_PITCH * 4,
        ROW_CHUNKS = ROW_BYTES / 16,  // 16-byte copies per row
    };
};

// N consecutive floats of shared memory, 4N-byte aligned, in one load.
template <int N> struct SharedFloats;
template <> struct SharedFloats<1> {
    static __device__ __forceinline__ void load(const float* p, float* v) { v[0] = p[0]; }
};
template <> struct SharedFloats<2> {
    static __device__ __forceinline__ void load(const float* p, float* v) {
        const float2 a = *reinterpret_cast<const float2*>(p);
        v[0] = a.x;
        v[1] = a.y;
    }
};
template <> struct SharedFloats<4> {
    static __device__ __forceinline__ void load(const float* p, float* v) {
        const float4 a = *reinterpret_cast<const float4*>(p);
        v[0] = a.x;
        v[1] = a.y;
        v[2] = a.z;
        v[3] = a.w;
    }
};

template <int D, int G, bool NESTED>
__device__ __forceinline__ void gemv_tc(const u16* __restrict__ x, const u8* __restrict__ codes,
                                        const Scales sc, const float* __restrict__ table,
                                        int rows, int cols, int m, int log2_bs,
                                        u16* __restrict__ y) {
    typedef TcStage<G> St;
    enum {
        SK = TC_STAGE_GROUPS,
        NTHREADS = TC_WARPS * 32,
        PIECE = G / 8,                               // code bytes of a thread per row and group
        MMAS = G / 16,                               // mmas per group
        XVECS = G / 64 + 1,                          // 16-byte vectors of token values per group
        CODE_COPIES = TC_ROWS * St::ROW_CHUNKS / NTHREADS,  // 16-byte copies per thread
        SCALE_COPIES = TC_ROWS * SK / NTHREADS,             // 4-byte copies per thread
        SLOTS = TC_STAGES,                                  // stages in shared memory
    };
    static_assert(CODE_COPIES * NTHREADS == TC_ROWS * St::ROW_CHUNKS, "whole code copies");
    static_assert(SCALE_COPIES * NTHREADS == TC_ROWS * SK, "whole scale copies");
    static_assert(SK % TC_WARPS == 0, "whole groups per warp");
    static_assert(SK % 4 == 0 && TC_NESTED_WORDS + 2 <= SK, "a row's nested scales fit its area");
    static_assert(!NESTED || SLOTS >= 3, "nested: stages s and s + 1 landed, one in flight");
    extern __shared__ __align__(16) unsigned char smem[];  // the pair table, then the stages
    __shared__ float partial[TC_WARPS][TC_ROWS][TC_TOKENS];
    __shared__ float dmap[NESTED ? 256 : 1];  // the dynamic map of nested scales
    // Stages s, s + 1; aligned for SharedFloats.
    __shared__ __align__(16) float decoded[NESTED ? 2 : 1][TC_ROWS][St::SCALE_PITCH];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int groups = cols / G;
    const int nstages = (groups + SK - 1) / SK;
    // The block's tiles of 16 rows: blockIdx.x, + gridDim.x, ...; their stages make one stream,
    // step v being stage v % nstages of the block's tile v / nstages.
    const int tiles = (rows + TC_ROWS - 1) / TC_ROWS;
    const int steps = (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x * nstages;
    const u32 stages = shared_address(smem) + TC_LUT_BYTES;
    const int shift = log2_bs - (G == 64 ? 6 : 5);  // a group's block: group number >> shift
    const u32 nblocks = (u32)(((u64)rows * cols + (1u << log2_bs) - 1) >> log2_bs);

    // A step's place: the first row of its tile and its stage. The copies' cursor runs SLOTS - 1
    // steps ahead of the multiply loop's (r0, s); the nested decode takes the step after it.
    struct Step {
        int r0, s;
    };
    auto next = [&](Step at) -> Step {
        return at.s + 1 < nstages ? Step{at.r0, at.s + 1}
                                  : Step{at.r0 + (int)gridDim.x * TC_ROWS, 0};
    };
    // This thread's copies: code chunk c = threadIdx.x + i * NTHREADS of a stage is row
    // c / ROW_CHUNKS, bytes 16 * (c % ROW_CHUNKS); scale copy c is row c / SK, group c % SK.
    // Rows past the last read the last row (never written).
    u32 code_dst[CODE_COPIES];
    int code_row[CODE_COPIES], code_at[CODE_COPIES];  // row of the tile, byte of the row
#pragma unroll
    for (int i = 0; i < CODE_COPIES; ++i) {
        const int c = threadIdx.x + i * NTHREADS;
        code_row[i] = c / St::ROW_CHUNKS;
        code_at[i] = c % St::ROW_CHUNKS * 16;
        code_dst[i] = code_row[i] * St::PITCH + code_at[i];
    }
    // Nested: copy q of a row is its word q (q < TC_NESTED_WORDS) or absmax2 q - TC_NESTED_WORDS.
    // The nested kernel's decode (below) takes the same (row, q) pairs. The scale of group q is
    // word scale_of[i] of its row's area (plain: as copied; nested: as decoded): the groups of
    // warp w, q = w, w + TC_WARPS, ..., side by side (on an H100, in one process against a
    // 4-byte load per group: 1 token within 0.3% plain and 0.3-0.7% faster nested at 8192^2 and
    // 14336 x 4096, 8 tokens nested 0.7-3%; results bit-identical).
    u32 scale_at[SCALE_COPIES], scale_of[SCALE_COPIES];  // word of the scale area
    int scale_row[SCALE_COPIES], scale_q[SCALE_COPIES];
#pragma unroll
    for (int i = 0; i < SCALE_COPIES; ++i) {
        const int c = threadIdx.x + i * NTHREADS;
        scale_row[i] = c / SK;
        scale_q[i] = c % SK;
        scale_at[i] = scale_row[i] * St::SCALE_PITCH + scale_q[i];
        scale_of[i] = scale_row[i] * St::SCALE_PITCH + scale_q[i] % TC_WARPS * (SK / TC_WARPS) +
                      scale_q[i] / TC_WARPS;
    }
    // The first group of stage `at` of this thread's scale copy i (nested: of its row).
    auto first_group = [&](int i, Step at) -> u32 {
        return (u32)min(at.r0 + scale_row[i], rows - 1) * (u32)groups + at.s * SK +
               (NESTED ? 0 : scale_q[i]);
    };
    const u32 nblocks2 = (nblocks + 255) / 256;  // absmax2 entries
    // Copies step v (at `at`) into slot v % SLOTS, zeros past the rows' end. Every thread
    // commits a group of copies each call, also past the last step, so that waiting counts
    // alike.
    auto issue = [&](int v, Step at) {
        if (v < steps) {
            const int s = at.s;
            const u32 slot = stages + (v % SLOTS) * St::BYTES;
#pragma unroll
            for (int i = 0; i < CODE_COPIES; ++i) {
                const bool ok = s * St::ROW_BYTES + code_at[i] < cols / 2;
                const u8* src = codes + (i64)min(at.r0 + code_row[i], rows - 1) * (cols / 2) +
                                s * St::ROW_BYTES + code_at[i];
                cp_async16(slot + code_dst[i], src, ok ? 16 : 0);
            }
#pragma unroll
            for (int i = 0; i < SCALE_COPIES; ++i) {
                const int q = scale_q[i];
                const u32 group = first_group(i, at),
                          dst = slot + St::CODES + 4 * (NESTED ? scale_at[i] : scale_of[i]);
                if (!NESTED) {
                    const bool ok = s * SK + q < groups;
                    cp_async4(dst, sc.absmax + (ok ? group >> shift : 0), ok ? 4 : 0);
                } else {  // a word of codes, an absmax2 or (q past them) nothing; no branches
                    const u32 first = group >> shift;
                    const bool word = q < TC_NESTED_WORDS;
                    const u32 at =
                        word ? (first & ~3u) + 4 * q : (first >> 8) + q - TC_NESTED_WORDS;
                    const u32 end = word ? nblocks : nblocks2;
                    const bool ok = q < TC_NESTED_WORDS + 2 && at < end;
                    const int n = ok ? (word ? (int)min(end - at, 4u) : 4) : 0;  // zeros past end
                    const void* src = word ? (const void*)(sc.qcodes + at) : sc.absmax2 + at;
                    cp_async4(dst, ok ? src : sc.qcodes, n);
                }
            }
        }
        cp_async_commit();
    };
    // Stage 0's copies go first, alone: the blocks' first stages then arrive ahead of their
    // second ones, which are issued once the table is written (on an H100, in one process
    // against all of the first stages issued together: 1 token 2.3% faster at 4096^2, 0.7% at
    // 14336 x 4096, within 0.3% at 8192^2 and 4096 x 14336; results bit-identical).
    Step copying = {(int)blockIdx.x * TC_ROWS, 0};  // the step that the next copies fetch
    issue(0, copying);
    copying = next(copying);
    // The pair table: entry b holds the values of the low nibble (lower half) and the high
    // nibble. Its values (and the nested scales' map) are loaded before the next stages' copies
    // are issued, so that they do not queue behind them (on an H100 up to 4% faster at 4096^2,
    // within the noise at larger weights). Each thread writes 16-byte runs of copies of an
    // entry, rotated so that the 8 threads of a store phase hit different banks.
    static_assert(256 % NTHREADS == 0, "whole table entries per thread");
    u32 entry[256 / NTHREADS];
    float map_value[256 / NTHREADS];
#pragma unroll
    for (int e = 0; e < 256 / NTHREADS; ++e) {
        const int b = threadIdx.x + e * NTHREADS;
        entry[e] = (u32)Elem<D>::store(__ldg(table + (b & 15))) |
                   ((u32)Elem<D>::store(__ldg(table + (b >> 4))) << 16);
        if (NESTED) map_value[e] = __ldg(sc.dmap + b);
    }
#pragma unroll
    for (int e = 0; e < 256 / NTHREADS; ++e) {
        const int b = threadIdx.x + e * NTHREADS;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            *reinterpret_cast<uint4*>(smem + b * 256 + 16 * ((j + b) & 7)) =
                make_uint4(entry[e], entry[e], entry[e], entry[e]);
        if (NESTED) dmap[b] = map_value[e];
    }
#pragma unroll
    for (int v = 1; v < SLOTS - 1; ++v) {
        issue(v, copying);
        copying = next(copying);
    }
    // The scales of step v (landed and published), decoded into decoded[v & 1] by
    // Scales::decode.
    auto decode = [&](int v, Step at) {
        const float* area = reinterpret_cast<const float*>(
            smem + TC_LUT_BYTES + (v % SLOTS) * St::BYTES + St::CODES);
#pragma unroll
        for (int i = 0; i < SCALE_COPIES; ++i) {
            const int q = scale_q[i];
            const u32 group = first_group(i, at);
            const u32 first = group >> shift, block = (group + q) >> shift;
            const float* row = area + scale_at[i] - q;
            const u8 code = reinterpret_cast<const u8*>(row)[block - (first & ~3u)];
            const float a2 = row[TC_NESTED_WORDS + (block >> 8) - (first >> 8)];
            (&decoded[v & 1][0][0])[scale_of[i]] = sc.decode(dmap[code], a2);
        }
    };
    if (NESTED) {
        cp_async_wait<SLOTS - 2>();
        __syncthreads();  // step 0 and the map arrived everywhere
        decode(0, {(int)blockIdx.x * TC_ROWS, 0});
    }
#if __CUDA_ARCH__ >= 900
    // Launched programmatically (nybble.backends.cuda.kernels.PreparedLaunch), the kernel may
    // start while the stream's previous kernel still runs: what it did so far reads only the
    // weight, which no kernel writes once the weight's first launch has run (that launch is a
    // plain one), and the library's tables. The tokens and y wait here for the previous kernel
    // to end and its writes to be visible. The next GEMV may start as this one's blocks end.
    // In a decode loop this hides each kernel's start (the table, the first stages' copies)
    // under the previous one's end: on an H100, 16 Llama-3.1-8B layers replayed from a graph
    // 1040 -> 948 us, 20 GEMVs of 4096^2 back to back 7.6 -> 5.3 us each.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const u32 lane4 = 4 * lane;
    // The pair of byte k of w: one permute makes the address w.byte[k] * 256 + 4 * lane.
    const u32 table_at = shared_address(smem);
    auto pair = [&](u32 w, int k) -> u32 {
        return load_shared_word(table_at + __byte_perm(w, lane4, 0x5504 | (k << 4)));
    };

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const u16* xg = x + (i64)min(g, m - 1) * cols + t * (G / 4);
    int v = 0;  // the step
    for (int r0 = blockIdx.x * TC_ROWS; r0 < rows; r0 += gridDim.x * TC_ROWS) {
        for (int s = 0; s < nstages; ++s, ++v) {
            // The tokens' values of all this warp's groups first, ahead of the stage barrier: their
            // loads (slow while the weights stream; with them issued after the barrier, the first
            // mma's wait for them took a fifth of the warps' stall samples in Nsight Compute) are
            // then in flight while the warps meet. On an H100, in one process against the loads
            // issued after the barrier: 1 token 84.2-84.6 -> 85.2-85.8% of a streaming read at
            // 8192^2, 84.5-85.5 -> 86.0-86.6% at 14336 x 4096, 4096^2 +1.3-2 points, 4096 x 14336
            // +0.6-1.4; 8 tokens 2-4.5 points; nested scales 2.5-3.8 points; bit-identical.
            u32 xw[SK / TC_WARPS][4 * XVECS];
#pragma unroll
            for (int i = 0; i < SK / TC_WARPS; ++i) {
                const int grp = s * SK + warp + i * TC_WARPS;
                const bool live = grp < groups;  // x may end there; codes and scales are zeros
#pragma unroll
                for (int h = 0; h < XVECS; ++h) {
                    const uint4* at = reinterpret_cast<const uint4*>(xg + grp * G) + h;
                    const uint4 xv = live ? load_in_place(at) : make_uint4(0u, 0u, 0u, 0u);
                    xw[i][4 * h] = xv.x;
                    xw[i][4 * h + 1] = xv.y;
                    xw[i][4 * h + 2] = xv.z;
                    xw[i][4 * h + 3] = xv.w;
                }
            }
            cp_async_wait<SLOTS - 2 - NESTED>();
            __syncthreads();  // step v (nested: v + 1) arrived everywhere; v - 1 multiplied
            issue(v + SLOTS - 1, copying);  // into the slot of step v - 1
            copying = next(copying);
            if (NESTED && v + 1 < steps) decode(v + 1, next({r0, s}));
            const unsigned char* slot = smem + TC_LUT_BYTES + (v % SLOTS) * St::BYTES;
            const float* scale =
                NESTED ? &decoded[v & 1][0][0] : reinterpret_cast<const float*>(slot + St::CODES);
            float sa[SK / TC_WARPS], sb[SK / TC_WARPS];  // this warp's scales of rows g, g + 8
            const float* mine = scale + SK / TC_WARPS * warp;
            SharedFloats<SK / TC_WARPS>::load(mine + g * St::SCALE_PITCH, sa);
            SharedFloats<SK / TC_WARPS>::load(mine + (g + 8) * St::SCALE_PITCH, sb);
#pragma unroll
            for (int i = 0; i < SK / TC_WARPS; ++i) {
                const int q = warp + i * TC_WARPS;
                u32 pa[PIECE / 4], pb[PIECE / 4];
                const unsigned char* piece = slot + g * St::PITCH + q * (G / 2) + t * PIECE;
#pragma unroll
                for (int w = 0; w < PIECE / 4; ++w) {
                    pa[w] = reinterpret_cast<const u32*>(piece)[w];
                    pb[w] = reinterpret_cast<const u32*>(piece + 8 * St::PITCH)[w];
                }
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < MMAS; ++j) {
                    // bytes 2j and 2j+1 of the piece: elements 4j, 4j+1 and 4j+2, 4j+3
                    const u32 wa = pa[j >> 1], wb = pb[j >> 1];
                    const int k = 2 * (j & 1);
                    const u32 a[4] = {pair(wa, k), pair(wb, k), pair(wa, k + 1), pair(wb, k + 1)};
                    mma_16816<D>(d, a, xw[i] + 2 * j);
                }
                acc[0] = fmaf(sa[i], d[0], acc[0]);
                acc[1] = fmaf(sa[i], d[1], acc[1]);
                acc[2] = fmaf(sb[i], d[2], acc[2]);
                acc[3] = fmaf(sb[i], d[3], acc[3]);
            }
        }
        // The warps' sums of the tile meet in shared memory. The next writes of `partial`
        // come a barrier (the stage loop's) after these reads.
        partial[warp][g][2 * t] = acc[0];
        partial[warp][g][2 * t + 1] = acc[1];
        partial[warp][g + 8][2 * t] = acc[2];
        partial[warp][g + 8][2 * t + 1] = acc[3];
        acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
        __syncthreads();
        for (int i = threadIdx.x; i < TC_ROWS * TC_TOKENS; i += NTHREADS) {
            const int r = i / TC_TOKENS, tok = i % TC_TOKENS;
            if (tok >= m || r0 + r >= rows) continue;
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < TC_WARPS; ++w) sum += partial[w][r][tok];
            y[(i64)tok * rows + r0 + r] = Elem<D>::store(sum);
        }
    }
}

// The minimum of one block per multiprocessor lets ptxas take the registers it wants (up to
// 106, so that 2 blocks still fit): left to itself it held this kernel to 48 and spilled, 8-12%
// slower on an H100. Shared memory allows 2 blocks per multiprocessor either way.
// On sm_90 the kernels launch as clusters of one block (nothing is shared between blocks):
// the GPU then places the blocks otherwise, and when the tiles run out part way through the
// last round (14336 x 4096: 896 tiles on 264 blocks) the blocks that take the extra tile run
// faster: on an H100, in one process, 18.9 -> 17.5 us (20.5 us from 22.1 with nested scales);
// 4096^2, 8192^2, 4096 x 14336, 28672 x 4096 and 32064 x 4096 within +-1%.
// The plain and the nested kernels take the same arguments (SCALE_PARAMS; `nested` unread).
#if __CUDA_ARCH__ >= 900
#define TC_PLACEMENT __cluster_dims__(1, 1, 1)
#else
#define TC_PLACEMENT
#endif
#define GEMV_TC(NAME, D, G, NESTED)                                                            \
    extern "C" __global__ void TC_PLACEMENT __launch_bounds__(TC_WARPS * 32, 1)                \
        NAME(const u16* __restrict__ x, const u8* __restrict__ codes, SCALE_PARAMS,            \
             const float* __restrict__ table, int rows, int cols, int m, int log2_bs,          \
             u16* __restrict__ y) {                                                            \
        gemv_tc<D, G, NESTED>(x, codes, SCALE_ARGS, table, rows, cols, m, log2_bs, y);         \
    }
GEMV_TC(gemv_tc_f16_g64, 1, 64, false)
GEMV_TC(gemv_tc_bf16_g64, 2, 64, false)
GEMV_TC(gemv_tc_f16_g32, 1, 32, false)
GEMV_TC(gemv_tc_bf16_g32, 2, 32, false)
GEMV_TC(gemv_tc_f16_g64_dq, 1, 64, true)
GEMV_TC(gemv_tc_bf16_g64_dq, 2, 64, true)
GEMV_TC(gemv_tc_f16_g32_dq, 1, 32, true)
GEMV_TC(gemv_tc_bf16_g32_dq, 2, 32, true)

// ---- what the launcher reads back ------------------------------------------------------------

// The launch geometry of the kernels above, read by the host from the loaded module
// (nybble.backends.cuda.kernels.LaunchFacts, fields in this order), so that each number keeps
// its one definition in this file, whatever -D overrides a tuning build compiles with.
extern "C" __device__ long long launch_facts[] = {
    THREADS,                                  // threads of every codec kernel's block
    THREADS * Elem<0>::STEPS * Elem<0>::VEC,  // dequantize: outputs per block, float32
    THREADS * Elem<1>::STEPS * Elem<1>::VEC,  //   float16
    THREADS * Elem<2>::STEPS * Elem<2>::VEC,  //   bfloat16
    THREADS * 4 * Elem<0>::VEC,               // quantize: inputs per block, float32
    THREADS * 4 * Elem<1>::VEC,               //   float16
    THREADS * 4 * Elem<2>::VEC,               //   bfloat16
    THREADS * Elem<0>::VEC,                   // non-finite scan: inputs per block, float32
    THREADS * Elem<1>::VEC,                   //   float16
    THREADS * Elem<2>::VEC,                   //   bfloat16
    BUCKETS,                                  // quantize: NF4 / FP4 encoding table entries
    GEMV_THREADS,                             // float32 GEMV: threads per block
    GEMV_ROWS,                                //   rows per block
    GEMV_F32_TOKENS,                          //   tokens per launch
    TC_WARPS * 32,                            // tensor-core GEMV: threads per block
    TC_ROWS,                                  //   rows per tile
    TC_LUT_BYTES + TC_STAGES * TcStage<32>::BYTES,  //   dynamic shared memory, groups of 32
    TC_LUT_BYTES + TC_STAGES * TcStage<64>::BYTES,  //   dynamic shared memory, groups of 64
};
