// The trainer's flash attention (nybble.train._cuda, FusedSoftmax.flash_forward/flash_backward).
// Compiled by nybble.backends.cuda.kernels (NVRTC) with FLASH_COMPILE_OPTIONS, which define
// FLASH_DKDV_ROWS_64 and FLASH_DKDV_ROWS_128 (the dK/dV tiles' query rows); self-contained. The
// host reads the launch sizes back from the module (`flash_facts`, at the end of this file).
//
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
// Threads of a flash_delta block (a warp per row; the kernel reads blockDim).
#define FLASH_DELTA_THREADS 256
#define FLASH_LOG2E 1.4426950408889634f
#define FLASH_NEG_INF __int_as_float(0xff800000)

// The PTX helpers. The CPU emulator the tests run these kernels in (tests/cuda_emulator/emu.h)
// defines FLASH_EMULATE and its own.
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

// ---- what the launcher reads back ------------------------------------------------------------

// The launch sizes of the kernels above, read by the host from the loaded module
// (nybble.train._cuda.FlashFacts, fields in this order), so that each keeps its one definition
// in this file. Written with integers and the #defines above only: a recording, which compiles
// nothing, works them out from this text (nybble.backends.cuda.kernels.source_facts). The
// dynamic shared memory of a block is the layout at the top of its kernel: tiles of rows of
// D + 8 bf16 elements (padded: ldmatrix reads them without bank conflicts), per-row tables and
// an 8-int reduction.
extern "C" __device__ long long flash_facts[] = {
    FLASH_THREADS,        // threads of a forward, dQ or dK/dV block
    FLASH_BLOCK,          // query rows of a forward or dQ block, keys of a dK/dV block and tile
    FLASH_DELTA_THREADS,  // threads of a flash_delta block
    FLASH_DKDV_ROWS_64,   // query rows of a dK/dV tile, heads of 64
    FLASH_DKDV_ROWS_128,  //   heads of 128
    // heads of 64: forward (K, V; the query tile first), dQ (Q, dO, K, V), dK/dV (K, V, Q, dO;
    // lse, delta, position and first key of each query row)
    2 * FLASH_BLOCK * (64 + 8) * 2 + 8 * 4,
    4 * FLASH_BLOCK * (64 + 8) * 2 + 8 * 4,
    (2 * FLASH_BLOCK + 2 * FLASH_DKDV_ROWS_64) * (64 + 8) * 2 + 16 * FLASH_DKDV_ROWS_64 + 8 * 4,
    // heads of 128: the same
    2 * FLASH_BLOCK * (128 + 8) * 2 + 8 * 4,
    4 * FLASH_BLOCK * (128 + 8) * 2 + 8 * 4,
    (2 * FLASH_BLOCK + 2 * FLASH_DKDV_ROWS_128) * (128 + 8) * 2 + 16 * FLASH_DKDV_ROWS_128 + 8 * 4,
};
