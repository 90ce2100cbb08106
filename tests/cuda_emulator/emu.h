// A CPU emulator of the CUDA that kernels/attention.cu uses, so that the shipped flash-attention
// kernels run unmodified as C++ (tests/train/test_attention_emulated.py, docs/testing.md). Include
// this before the kernel file: it defines FLASH_EMULATE, which leaves out the file's inline-PTX
// helpers, and defines its own under the same names and signatures (cp.async, ldmatrix,
// mma.sync m16n8k16 bf16, the bf16 conversion, the dynamic shared memory), with the CUDA
// built-ins the kernels use (threadIdx, __syncthreads, __shfl_xor_sync, ...).
//
// The model of a launch:
//   - the blocks of the grid run one after another, in a random order;
//   - each thread of a block is a coroutine (ucontext) that runs until it reaches
//     __syncthreads or a warp collective (shfl, ldmatrix, mma), where it yields; the scheduler
//     lets either every thread take a step in a random order, or one warp take many steps, so
//     that warps drift as far apart as the barriers let them;
//   - __syncthreads waits for every thread of the block, a collective for every lane of the
//     warp, all at the same collective;
//   - a cp.async copy lands at a random yield of its thread after its group is committed, at
//     the latest at the cp.async.wait_group that covers it;
//   - shared memory starts as garbage (bytes 0x7f or 0xff: huge or NaN as bf16 and float);
//   - ldmatrix rows and cp.async destinations must be 16-byte aligned inside the block's shared
//     memory, cp.async sources inside one of the arrays the launch was given.
// A deadlock (every thread waiting at a barrier no other will reach), a barrier after a thread
// of the block exited, lanes at different collectives, cp.async copies never waited for or any
// check above ends the launch with a message. Values only: nothing here models time.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#define FLASH_EMULATE

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace emu {

struct Dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// One 16-byte cp.async: `bytes` (16, or 0 where the source is not valid) copied, the rest of
// the 16 zero-filled.
struct Copy {
    unsigned char* dst;
    const unsigned char* src;
    int bytes;
};

// A committed cp.async group. A lazy one lands only at the wait that covers it (a missing
// barrier before its data is read shows), an eager one at any yield (so does a missing barrier
// before its destination is free).
struct Group {
    std::vector<Copy> copies;
    long number;  // its thread's commits so far, this one included
    bool lazy;
};

struct Thread {
    ucontext_t context;
    Dim3 index;
    bool done = false;
    std::vector<Copy> open;     // issued since the last commit
    std::vector<Group> groups;  // committed, not landed, oldest first
    long committed = 0;
};

struct Barrier {
    int arrived = 0;
    long generation = 0;  // how many times it has completed
};

// A warp's barrier, and the slots where its lanes leave their operands for a collective.
struct Warp {
    Barrier barrier;
    int collective = 0;  // the one its lanes are gathering at
    int exited = 0;      // lanes that have returned
    uint32_t a[32][4], b[32][2];
    float c[32][4];
    const unsigned char* row[32];
    uint64_t value[32];
};

constexpr size_t kStackBytes = 1 << 17;
constexpr size_t kSharedMax = 227 * 1024;  // the most shared memory an sm_90 block may have
// A block that completes more __syncthreads than this is taken for a runaway loop (the tests'
// small shapes take a few dozen).
constexpr long kMaxBlockBarriers = 1 << 12;

alignas(128) inline unsigned char g_smem[kSharedMax];
inline size_t g_smem_bytes = 0;
inline Dim3 g_grid, g_block, g_block_index;
inline std::vector<Thread> g_threads;
inline std::vector<std::unique_ptr<char[]>> g_stacks;
inline std::vector<Warp> g_warps;
inline Barrier g_block_barrier;
inline int g_cur = 0;      // the running thread
inline int g_live = 0;     // threads of the block not yet returned
inline int g_blocked = 0;  // threads waiting at a barrier that has not completed
inline ucontext_t g_scheduler;
inline std::mt19937_64 g_rng;
inline std::function<void()> g_body;
inline std::vector<std::pair<uintptr_t, size_t>> g_arrays;  // where cp.async may read
inline bool g_failed = false;
inline char g_error[512];

// Ends the launch from inside a thread: the message is kept and the scheduler takes over for
// good (the thread's stack is abandoned).
[[noreturn]] inline void fail(const char* what) {
    std::snprintf(g_error, sizeof g_error, "%s (block %u,%u, thread %d)", what, g_block_index.x,
                  g_block_index.y, g_cur);
    g_failed = true;
    setcontext(&g_scheduler);
    std::abort();  // setcontext returns only if it could not switch
}

inline bool inside(const void* p, size_t n, uintptr_t base, size_t size) {
    const auto at = reinterpret_cast<uintptr_t>(p);
    return at >= base && at + n <= base + size;
}
inline bool in_shared(const void* p, size_t n) {
    return inside(p, n, reinterpret_cast<uintptr_t>(g_smem), g_smem_bytes);
}
inline bool in_arrays(const void* p, size_t n) {
    for (const auto& [base, size] : g_arrays)
        if (inside(p, n, base, size)) return true;
    return false;
}

// Lands the thread's groups for which `now` holds.
template <class When>
void land(Thread& t, When now) {
    if (t.groups.empty()) return;
    std::vector<Group> pending;
    for (Group& g : t.groups) {
        if (!now(g)) {
            pending.push_back(std::move(g));
            continue;
        }
        for (const Copy& c : g.copies) {
            std::memcpy(c.dst, c.src, c.bytes);
            std::memset(c.dst + c.bytes, 0, 16 - c.bytes);
        }
    }
    t.groups = std::move(pending);
}

// Back to the scheduler, after landing each of the thread's eager groups half the time.
inline void yield() {
    Thread& t = g_threads[g_cur];
    land(t, [](const Group& g) { return !g.lazy && (g_rng() & 1); });
    swapcontext(&t.context, &g_scheduler);
}

// The running thread waits at `b` until `needed` threads (itself included) have arrived.
inline void arrive(Barrier& b, int needed) {
    const long generation = b.generation;
    if (++b.arrived == needed) {
        b.arrived = 0;
        ++b.generation;
        g_blocked -= needed - 1;  // the others may go on
        yield();
        return;
    }
    if (++g_blocked == g_live) fail("deadlock: every thread waits at a barrier");
    while (b.generation == generation) yield();
}

inline void syncthreads() {
    if (g_live < static_cast<int>(g_threads.size()))
        fail("__syncthreads after a thread of the block returned");
    if (g_block_barrier.generation >= kMaxBlockBarriers)
        fail("too many __syncthreads in one block: a runaway loop");
    arrive(g_block_barrier, static_cast<int>(g_threads.size()));
}

inline int lane() { return g_cur % 32; }
inline Warp& warp() { return g_warps[g_cur / 32]; }

// Every lane of the running thread's warp at collective step `which`.
inline void gather(int which) {
    Warp& w = warp();
    if (w.exited) fail("a warp collective after a lane of the warp returned");
    if (w.barrier.arrived == 0) w.collective = which;
    else if (w.collective != which) fail("lanes of a warp at different collectives");
    arrive(w.barrier, 32);
}

// A collective: each lane leaves its operands in its Warp slots, gathers at step 2k (every
// operand in), reads what it needs, gathers at step 2k + 1 (every operand read: the slots may
// be written again).
enum Collective { kShfl = 1, kLdsm = 2, kLdsmTrans = 3, kMma = 4 };

template <class T>
T shfl_xor(unsigned mask, T v, int offset) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffle of one register");
    if (mask != 0xffffffffu) fail("a shuffle of part of a warp");
    Warp& w = warp();
    std::memcpy(&w.value[lane()], &v, sizeof(T));
    gather(2 * kShfl);
    T r;
    std::memcpy(&r, &w.value[lane() ^ offset], sizeof(T));
    gather(2 * kShfl + 1);
    return r;
}

inline float bf16_value(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to the nearest bfloat16, ties to even (cvt.rn.bf16.f32); NaN stays NaN.
inline uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).b16: lanes 8j..8j+7 give the rows of matrix j; lane l
// receives, of each matrix, row l/4 at columns 2(l%4) and 2(l%4)+1 (transposed: those rows
// at column l/4).
inline void ldmatrix(uint32_t (&r)[4], const unsigned char* row, bool trans) {
    if (!in_shared(row, 16)) fail("ldmatrix row outside the block's shared memory");
    if (reinterpret_cast<uintptr_t>(row) % 16) fail("ldmatrix row not 16-byte aligned");
    const int which = trans ? kLdsmTrans : kLdsm;
    Warp& w = warp();
    w.row[lane()] = row;
    gather(2 * which);
    const int l = lane(), g = l / 4, t = l % 4;
    uint32_t out[4];
    for (int j = 0; j < 4; ++j) {
        uint16_t e[2];
        for (int i = 0; i < 2; ++i) {
            const int r_ = trans ? 2 * t + i : g, c = trans ? g : 2 * t + i;
            std::memcpy(&e[i], w.row[8 * j + r_] + 2 * c, 2);
        }
        out[j] = e[0] | (static_cast<uint32_t>(e[1]) << 16);
    }
    gather(2 * which + 1);
    std::copy(out, out + 4, r);
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a b, with lane l = 4g + t holding
// a: (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..); b: (2t..2t+1, g), (2t+8.., g);
// c, d: (g, 2t..2t+1), (g+8, 2t..2t+1). Sums in double, rounded once to float.
inline void mma_sync(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    Warp& w = warp();
    const int l = lane();
    std::copy(a, a + 4, w.a[l]);
    std::copy(d, d + 4, w.c[l]);
    w.b[l][0] = b0;
    w.b[l][1] = b1;
    gather(2 * kMma);
    float A[16][16], B[16][8];
    for (int x = 0; x < 32; ++x) {
        const int g = x / 4, t = x % 4;
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
            A[row][col] = bf16_value(w.a[x][i] & 0xffffu);
            A[row][col + 1] = bf16_value(w.a[x][i] >> 16);
        }
        for (int i = 0; i < 2; ++i) {
            B[2 * t + 8 * i][g] = bf16_value(w.b[x][i] & 0xffffu);
            B[2 * t + 8 * i + 1][g] = bf16_value(w.b[x][i] >> 16);
        }
    }
    const int g = l / 4, t = l % 4;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        double s = w.c[l][i];
        for (int k = 0; k < 16; ++k) s += static_cast<double>(A[row][k]) * B[k][col];
        out[i] = static_cast<float>(s);
    }
    gather(2 * kMma + 1);
    std::copy(out, out + 4, d);
}

// cp.async.cg.shared.global of 16 bytes (none read where !valid: zeros), queued until its
// group lands.
inline void cp_async(unsigned char* dst, const void* src, bool valid) {
    if (!in_shared(dst, 16)) fail("cp.async destination outside the block's shared memory");
    if (reinterpret_cast<uintptr_t>(dst) % 16) fail("cp.async destination not 16-byte aligned");
    if (valid && reinterpret_cast<uintptr_t>(src) % 16) fail("cp.async source not 16-byte aligned");
    if (valid && !in_arrays(src, 16)) fail("cp.async source outside the kernel's arrays");
    g_threads[g_cur].open.push_back({dst, static_cast<const unsigned char*>(src), valid ? 16 : 0});
}

inline void cp_async_commit_group() {
    Thread& t = g_threads[g_cur];
    t.groups.push_back({std::move(t.open), ++t.committed, static_cast<bool>(g_rng() & 1)});
    t.open.clear();
}

inline void cp_async_wait_group(int pending) {
    Thread& t = g_threads[g_cur];
    land(t, [&](const Group& g) { return g.number <= t.committed - pending; });
}

// A thread: the kernel, then the checks of a clean return.
inline void thread_main() {
    g_body();
    Thread& t = g_threads[g_cur];
    Warp& w = g_warps[g_cur / 32];
    if (!t.open.empty() || !t.groups.empty()) fail("a thread returns with cp.async copies pending");
    if (g_block_barrier.arrived) fail("a thread returns while others wait at __syncthreads");
    if (w.barrier.arrived) fail("a lane returns while others of its warp wait at a collective");
    t.done = true;
    ++w.exited;
    if (--g_live > 0 && g_blocked == g_live) fail("deadlock: every thread waits at a barrier");
}  // back to the scheduler (uc_link)

// Runs thread i until it yields or returns; false once the launch has failed.
inline bool step(int i) {
    if (g_threads[i].done) return true;
    g_cur = i;
    swapcontext(&g_scheduler, &g_threads[i].context);
    return !g_failed;
}

// Runs one block of n threads to its end, or to the first failure.
inline void run_block(Dim3 index, int n) {
    g_block_index = index;
    for (size_t i = 0; i < g_smem_bytes; ++i)
        g_smem[i] = static_cast<unsigned char>(g_rng() | 0x7f);  // garbage, as on a device
    g_threads.assign(n, Thread());
    g_warps.assign(n / 32, Warp());
    g_block_barrier = Barrier();
    g_live = n;
    g_blocked = 0;
    for (int i = 0; i < n; ++i) {
        Thread& t = g_threads[i];
        t.index.x = i;
        getcontext(&t.context);
        t.context.uc_stack.ss_sp = g_stacks[i].get();
        t.context.uc_stack.ss_size = kStackBytes;
        t.context.uc_link = &g_scheduler;
        makecontext(&t.context, thread_main, 0);
    }
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    const int warps = n / 32;
    while (g_live > 0) {
        if (g_rng() & 1) {  // every thread one step, in a random order
            std::shuffle(order.begin(), order.end(), g_rng);
            for (int i : order)
                if (!step(i)) return;
        } else {  // one warp, up to 48 steps
            const int w = static_cast<int>(g_rng() % warps), steps = 1 + g_rng() % 48;
            for (int s = 0; s < steps; ++s)
                for (int l = 0; l < 32; ++l)
                    if (!step(32 * w + l)) return;
        }
    }
}

// Runs `body` as every thread of every block of `grid`, each block with `shared` bytes of
// shared memory, cp.async reading only inside `arrays`; the order of blocks, of threads and of
// copies' landing drawn from `seed`. Returns nullptr, or what went wrong.
inline const char* launch(Dim3 grid, Dim3 block, size_t shared,
                          std::vector<std::pair<uintptr_t, size_t>> arrays, uint64_t seed,
                          std::function<void()> body) {
    const int n = static_cast<int>(block.x);
    if (block.y != 1 || block.z != 1 || grid.z != 1) return "blocks of one dimension, grids of two";
    if (n == 0 || n % 32) return "a block of whole warps";
    if (shared > kSharedMax) return "more shared memory than a block may have";
    g_rng.seed(seed);
    g_grid = grid;
    g_block = block;
    g_smem_bytes = shared;
    g_arrays = std::move(arrays);
    g_body = std::move(body);
    g_failed = false;
    while (g_stacks.size() < static_cast<size_t>(n))
        g_stacks.emplace_back(new char[kStackBytes]);
    std::vector<Dim3> blocks;
    for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) blocks.push_back({x, y, 0});
    std::shuffle(blocks.begin(), blocks.end(), g_rng);
    for (const Dim3& b : blocks) {
        run_block(b, n);
        if (g_failed) return g_error;
    }
    return nullptr;
}

}  // namespace emu

// ---- the CUDA built-ins the kernels use -----------------------------------------------------
#define threadIdx (emu::g_threads[emu::g_cur].index)
#define blockIdx (emu::g_block_index)
#define blockDim (emu::g_block)
#define gridDim (emu::g_grid)
#define __syncthreads() emu::syncthreads()
#define __shfl_xor_sync(mask, v, offset) emu::shfl_xor((mask), (v), (offset))

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}

// ---- kernels/attention.cu's PTX helpers (left out under FLASH_EMULATE) ----------------------
// A shared-space address is an offset into the emulated shared memory.
#define FLASH_SMEM(name) unsigned char* name = emu::g_smem
inline uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(static_cast<const unsigned char*>(p) - emu::g_smem);
}
inline void cp_async16(uint32_t dst, const void* src, bool valid) {
    emu::cp_async(emu::g_smem + dst, src, valid);
}
inline void cp_async_commit() { emu::cp_async_commit_group(); }
template <int N>
inline void cp_async_wait() {
    emu::cp_async_wait_group(N);
}
inline void ldsm(uint32_t (&r)[4], uint32_t a) { emu::ldmatrix(r, emu::g_smem + a, false); }
inline void ldsm_t(uint32_t (&r)[4], uint32_t a) { emu::ldmatrix(r, emu::g_smem + a, true); }
inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    emu::mma_sync(d, a, b0, b1);
}
inline uint32_t pack_bf16(float lo, float hi) {
    return emu::to_bf16(lo) | (static_cast<uint32_t>(emu::to_bf16(hi)) << 16);
}
