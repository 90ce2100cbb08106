//! Dense f32 products `C = alpha·A·B` (or `C += alpha·A·B`) on strided operands, blocked
//! and packed the way BLIS and OpenBLAS do it, with one register tile per instruction set:
//! AVX-512 (`avx512::Avx512Tile`, 12×32), AVX2+FMA (`avx2::Avx2Tile`, 6×16) and the scalar
//! twin (`scalar::ScalarTile`, 4×4) they match bit for bit. NEON runs the `gemm` crates'
//! kernels (`gemm_neon`).
//!
//! Every output element is computed the same way whatever the tile: a chain of fused
//! multiply-adds over `KC` consecutive depths (in order, from zero), combined into C as
//! `alpha * acc` (the first block, unless accumulating) or `fma(alpha, acc, c)`. The tiles
//! differ only in how many elements they compute at once, so the products are bit-identical
//! on every instruction set.
//!
//! Loops, outermost first: columns of C in blocks of `NC` (B's packed block, `KC × NC`, in
//! the last-level cache); depth in blocks of `KC`; rows in blocks of `MC` (A's packed block,
//! `MC × KC`, in L2); tile columns; tile rows. Threads split the rows (or, when there are too
//! few, the columns) evenly and pack B's block together, meeting once per depth block.
//!
//! Thin products (16 rows or columns of C at most, as LoRA's rank-16 products) are
//! memory-bound and read their large operand once, along its rows: in place when it is A,
//! packed row by row when it is B, transposing the product (C^T = B^T A^T) where that puts
//! it so; they run the AVX2 tile (less padding than 12×32), each thread a part of the long
//! side from start to end.
//!
//! Measured against numpy's OpenBLAS (its SkylakeX kernels) on a 2-core AMD EPYC with
//! AVX-512 (Zen 4: 512-bit operations on 256-bit units, so AVX-512 and AVX2 peak alike
//! there), 2048×4096×4096, one thread: within 1% of it on both tiles (x @ W^T and dy @ W);
//! two threads: the same; LoRA's rank-16 products 0.7-0.85× its time on one thread.

use rayon::prelude::*;

use super::Level;
use crate::error::{Error, Result};

/// The depth of a packed block: the same on every instruction set (it decides where the
/// sums are rounded into C, so the results depend on it).
pub const KC: usize = 256;
/// Rows of A packed at a time (a multiple of every tile's `MR`).
const MC: usize = 144;
/// Columns of B packed at a time (a multiple of every tile's `NR`).
const NC: usize = 4096;

/// A register tile: computes an `MR × NR` block of C from panels of A and B.
pub trait Tile {
    const MR: usize;
    const NR: usize;

    /// For `i < MR`, `j < NR`: `acc = fma(A(i, kk), B(kk, j), acc)` for `kk` in `0..kc`
    /// from `acc = 0`; then for `i < mr`, `j < nr`: `c[i*rs + j] = alpha * acc` when
    /// `overwrite`, else `fma(alpha, acc, c[i*rs + j])`. `A(i, kk)` is `a[i*lda + kk]` when
    /// `ROW_MAJOR_A`, else `a[kk*lda + i]` (a packed panel: `lda = MR`); `B(kk, j)` is
    /// `b[kk*ldb + j]` (a packed panel: `ldb = NR`).
    ///
    /// # Safety
    /// A and B have the `MR × kc` and `kc × NR` elements above readable; `c[i*rs + j]` is
    /// writable for `i < mr <= MR`, `j < nr <= NR`; the CPU has the tile's instruction set.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const ROW_MAJOR_A: bool>(
        kc: usize,
        a: *const f32,
        lda: isize,
        b: *const f32,
        ldb: isize,
        c: *mut f32,
        rs: isize,
        mr: usize,
        nr: usize,
        alpha: f32,
        overwrite: bool,
    );

    /// Combines a tile's `acc` (row-major, `NR` apart) into C with strides `(rs, cs)`: for
    /// `i < mr`, `j < nr`, `c = alpha * acc` when `overwrite`, else `fma(alpha, acc, c)`.
    /// The SIMD tiles override it to run the fused multiply-adds in hardware.
    ///
    /// # Safety
    /// `acc` holds `mr` rows of `NR`; `c[i*rs + j*cs]` is writable for `i < mr`, `j < nr`;
    /// the CPU has the tile's instruction set.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn scatter(
        acc: *const f32,
        c: *mut f32,
        rs: isize,
        cs: isize,
        mr: usize,
        nr: usize,
        alpha: f32,
        overwrite: bool,
    ) {
        scatter_tile(Self::NR, acc, c, rs, cs, mr, nr, alpha, overwrite)
    }
}

/// `Tile::scatter`, in plain Rust (`f32::mul_add` is a fused multiply-add everywhere; the
/// callers that can make it one instruction inline this where FMA is enabled).
///
/// # Safety
/// As `Tile::scatter`, with `width` for `NR`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub unsafe fn scatter_tile(
    width: usize,
    acc: *const f32,
    c: *mut f32,
    rs: isize,
    cs: isize,
    mr: usize,
    nr: usize,
    alpha: f32,
    overwrite: bool,
) {
    for i in 0..mr {
        for j in 0..nr {
            let v = *acc.add(i * width + j);
            let q = c.offset(i as isize * rs + j as isize * cs);
            *q = if overwrite {
                alpha * v
            } else {
                alpha.mul_add(v, *q)
            };
        }
    }
}

/// A strided operand: element (i, j) is at `ptr + i*row_stride + j*col_stride`.
#[derive(Clone, Copy, Debug)]
pub struct Strided<P> {
    pub ptr: P,
    pub row_stride: isize,
    pub col_stride: isize,
}

impl<P: Copy> Strided<P> {
    /// The transposed operand.
    pub fn t(self) -> Strided<P> {
        Strided {
            ptr: self.ptr,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }
}

impl Strided<*const f32> {
    /// Element (i, j).
    #[inline(always)]
    unsafe fn at(&self, i: usize, j: usize) -> f32 {
        *self
            .ptr
            .offset(i as isize * self.row_stride + j as isize * self.col_stride)
    }
}

/// `dst = alpha * lhs @ rhs`, or `dst += alpha * lhs @ rhs` when `accumulate`; `dst` is
/// `m x n`, `lhs` `m x k`, `rhs` `k x n`, all non-empty (`m, n, k >= 1`). Runs the tile of
/// `level`, or of the widest instruction set below it that this CPU has (any `level` is safe
/// to ask for), on up to `threads` threads of rayon's pool. Fails only when the packing
/// buffers cannot be allocated.
///
/// # Safety
/// Every element of the three operands lies inside its allocation; `dst` overlaps neither
/// `lhs` nor `rhs`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    level: Level,
    m: usize,
    n: usize,
    k: usize,
    mut dst: Strided<*mut f32>,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    alpha: f32,
    accumulate: bool,
    threads: usize,
) -> Result<()> {
    // A stride along a dimension of size 1 is never used: call it 1.
    if m == 1 {
        dst.row_stride = 1;
    }
    if n == 1 {
        dst.col_stride = 1;
    }
    // The tiles write rows of C: a column-major C is computed as C^T = B^T A^T.
    let p = Product {
        m,
        n,
        k,
        c: dst,
        a: lhs,
        b: rhs,
        alpha,
        accumulate,
        threads,
    };
    let p = if dst.col_stride != 1 && dst.row_stride == 1 {
        p.t()
    } else {
        p
    };
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 if is_x86_feature_detected!("avx512f") && has_avx2() => {
            p.dispatch::<super::avx512::Avx512Tile>()
        }
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 | Level::Avx2 if has_avx2() => p.dispatch::<super::avx2::Avx2Tile>(),
        #[cfg(target_arch = "aarch64")]
        Level::Neon
            if super::gemm_neon::gemm(m, n, k, dst, lhs, rhs, alpha, accumulate, threads) =>
        {
            Ok(())
        }
        _ => p.dispatch::<super::scalar::ScalarTile>(),
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// A product whose C has unit column stride, or neither stride 1 (then the tiles write a
/// small buffer that is added into C element by element).
#[derive(Clone, Copy)]
struct Product {
    m: usize,
    n: usize,
    k: usize,
    c: Strided<*mut f32>,
    a: Strided<*const f32>,
    b: Strided<*const f32>,
    alpha: f32,
    accumulate: bool,
    threads: usize,
}

// SAFETY: `Product` holds the operands' raw pointers; its threads read A and B and write
// disjoint tiles of C (see `Shared`).
unsafe impl Sync for Product {}

/// Raw pointers handed to the threads of one product, which write disjoint parts of C.
#[derive(Clone, Copy)]
struct Shared<T>(T);

impl<T: Copy> Shared<T> {
    /// The pointer (a method, so closures capture the `Shared`, not the bare pointer).
    fn get(self) -> T {
        self.0
    }
}
// SAFETY: the threads of `Product::run` read A and B and write disjoint tiles of C and of
// the packing buffers; `gemm`'s caller guarantees the operands stay valid throughout.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

/// A cache-line-aligned run of floats (packed panels start on cache lines).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// Room for at least `floats` floats, 64-byte aligned: an empty vector with that capacity
/// (the packing writes every float it later reads through the raw pointer, so the memory
/// needs no zeroing pass).
fn buffer(floats: usize) -> Result<Vec<Line>> {
    let lines = floats.div_ceil(16);
    let mut v = Vec::new();
    v.try_reserve_exact(lines).map_err(|_| Error::OutOfMemory {
        bytes: lines.saturating_mul(64),
    })?;
    Ok(v)
}

/// How the tiles read A, the operand whose rows are broadcast.
#[derive(Clone, Copy)]
struct Plan {
    /// A read in place (its full row panels) rather than packed: when few columns of C
    /// share each panel, so packing would cost a good part of the products, and A is
    /// row-major.
    a_in_place: bool,
}

impl Product {
    /// The transposed product C^T = B^T A^T.
    fn t(self) -> Product {
        Product {
            m: self.n,
            n: self.m,
            c: self.c.t(),
            a: self.b.t(),
            b: self.a.t(),
            ..self
        }
    }

    /// Chooses the orientation, the tile and how A is read, then runs the product. A thin
    /// product (few rows or columns of C) is memory-bound: its large operand is best read
    /// once, along its rows: in place when it is A (its rows are broadcast), packed row by
    /// row when it is B (packing streams B's rows).
    unsafe fn dispatch<T: Tile>(self) -> Result<()> {
        let few = |count: usize| count <= 16;
        let row_major = |x: Strided<*const f32>| x.col_stride == 1;
        let col_major = |x: Strided<*const f32>| x.col_stride != 1 && x.row_stride == 1;
        let p = if (few(self.m) && !few(self.n) && col_major(self.b))
            || (few(self.n) && !few(self.m) && col_major(self.a))
        {
            // x @ W^T for a few tokens, dy^T @ h: the transpose puts the large operand in
            // place (W as a row-major A) or on B's side row-major (dy).
            self.t()
        } else {
            self
        };
        let plan = Plan {
            // Packing A costs about as much as 16 columns of products (and reading it in
            // place costs the 12-row tile address arithmetic): worth it for wide products.
            a_in_place: p.n <= 256 && row_major(p.a),
        };
        // A few columns would fill half of a 32-wide tile at most, a few rows two thirds of
        // two 12-row tiles: the 16×6 one does the same work (bit for bit) with less padding.
        #[cfg(target_arch = "x86_64")]
        if T::NR > 16 && (few(p.n) || few(p.m)) {
            return p.thin::<super::avx2::Avx2Tile>(plan);
        }
        if few(p.n) || few(p.m) {
            return p.thin::<T>(plan);
        }
        p.run::<T>(plan)
    }

    /// A thin product on several threads: each runs a part of the long side (rows, or
    /// columns) from start to end, packing what it needs itself (the short side's operand is
    /// small), with no meeting point per depth block as `run` has.
    unsafe fn thin<T: Tile>(self, plan: Plan) -> Result<()> {
        let parts = self.threads.min(if self.m >= self.n {
            self.m / (2 * T::MR)
        } else {
            self.n / (2 * T::NR)
        });
        if parts <= 1 {
            return self.run::<T>(plan);
        }
        let by_rows = self.m >= self.n;
        (0..parts)
            .into_par_iter()
            .try_for_each(|w| self.part(by_rows, parts, w).run::<T>(plan))
    }

    /// The `w`-th of `parts` near-equal parts of the rows (or columns) of the product, as a
    /// product on one thread.
    unsafe fn part(&self, by_rows: bool, parts: usize, w: usize) -> Product {
        let mut sub = Product {
            threads: 1,
            ..*self
        };
        if by_rows {
            let rows = share(self.m, parts, w);
            sub.m = rows.len();
            sub.a.ptr = self.a.ptr.offset(rows.start as isize * self.a.row_stride);
            sub.c.ptr = self.c.ptr.offset(rows.start as isize * self.c.row_stride);
        } else {
            let cols = share(self.n, parts, w);
            sub.n = cols.len();
            sub.b.ptr = self.b.ptr.offset(cols.start as isize * self.b.col_stride);
            sub.c.ptr = self.c.ptr.offset(cols.start as isize * self.c.col_stride);
        }
        sub
    }

    /// Runs the product with tile `T`.
    unsafe fn run<T: Tile>(&self, plan: Plan) -> Result<()> {
        let (m, n, k) = (self.m, self.n, self.k);
        let (mr, nr) = (T::MR, T::NR);
        let m_panels = m.div_ceil(mr);
        let n_panels = n.min(NC).div_ceil(nr);
        // Threads split the rows when each gets two row panels or more, else the columns.
        let threads = self.threads.max(1);
        let split_rows = threads > 1 && m_panels >= 2 * threads;
        let split_cols = !split_rows && threads > 1 && n_panels >= 2 * threads;
        let workers = if split_rows || split_cols { threads } else { 1 };
        let mut packed_b = buffer(KC * n_panels * nr)?;
        // A read in place needs room for its partial last panel only.
        let a_room = if plan.a_in_place { mr * KC } else { MC * KC };
        let mut packed_a = (0..workers)
            .map(|_| buffer(a_room))
            .collect::<Result<Vec<_>>>()?;
        let b_buf = Shared(packed_b.as_mut_ptr() as *mut f32);
        for jc in (0..n).step_by(NC) {
            let nb = NC.min(n - jc);
            let panels = nb.div_ceil(nr);
            for pc in (0..k).step_by(KC) {
                let kb = KC.min(k - pc);
                let overwrite = pc == 0 && !self.accumulate;
                // B's block [pc.., jc..] into `panels` panels of kb × nr, the threads
                // packing a share of the panels each.
                let pack = |w: usize| {
                    let q = share(panels, workers, w);
                    pack_b::<T>(b_buf.get(), self.b, pc, kb, jc, nb, q);
                };
                if workers > 1 {
                    (0..workers).into_par_iter().for_each(pack);
                } else {
                    pack(0);
                }
                let work = |w: usize, a_buf: &mut Vec<Line>| {
                    let (rows, cols) = if split_rows {
                        (share(m_panels, workers, w), 0..panels)
                    } else if split_cols {
                        (0..m_panels, share(panels, workers, w))
                    } else {
                        (0..m_panels, 0..panels)
                    };
                    let a_buf = a_buf.as_mut_ptr() as *mut f32;
                    let mc_panels = MC / mr;
                    // Where panel `ip` of the block from `ip0` is packed (read in place, A
                    // packs its one partial panel only, at the start).
                    let slot = |ip: usize, ip0: usize| {
                        let index = if plan.a_in_place { 0 } else { ip - ip0 };
                        a_buf.add(index * kb * mr)
                    };
                    let mut ip0 = rows.start;
                    while ip0 < rows.end {
                        let ip1 = rows.end.min(ip0 + mc_panels);
                        // A's panels ip0..ip1: in place (full panels) or packed.
                        for ip in ip0..ip1 {
                            let i = ip * mr;
                            if !(plan.a_in_place && i + mr <= m) {
                                pack_a::<T>(slot(ip, ip0), self.a, i, mr.min(m - i), pc, kb);
                            }
                        }
                        for q in cols.clone() {
                            let b = b_buf.get().add(q * kb * nr) as *const f32;
                            let ldb = nr as isize;
                            let j = jc + q * nr;
                            let nr_here = nr.min(n - j);
                            for ip in ip0..ip1 {
                                let i = ip * mr;
                                let mr_here = mr.min(m - i);
                                if plan.a_in_place && i + mr <= m {
                                    // A row-major A, read along its rows.
                                    let at = i as isize * self.a.row_stride + pc as isize;
                                    let a = (self.a.ptr.offset(at), self.a.row_stride);
                                    self.tile::<T, true>(
                                        kb,
                                        a,
                                        (b, ldb),
                                        i,
                                        j,
                                        mr_here,
                                        nr_here,
                                        overwrite,
                                    );
                                } else {
                                    let a = (slot(ip, ip0) as *const f32, mr as isize);
                                    self.tile::<T, false>(
                                        kb,
                                        a,
                                        (b, ldb),
                                        i,
                                        j,
                                        mr_here,
                                        nr_here,
                                        overwrite,
                                    );
                                }
                            }
                        }
                        ip0 = ip1;
                    }
                };
                if workers > 1 {
                    packed_a
                        .par_iter_mut()
                        .enumerate()
                        .for_each(|(w, buf)| work(w, buf));
                } else if let Some(buf) = packed_a.first_mut() {
                    work(0, buf);
                }
            }
        }
        drop(packed_b); // the tiles read it through `b_buf` until here
        Ok(())
    }

    /// One tile of C at (i, j), `mr × nr` elements.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<T: Tile, const ROW_MAJOR_A: bool>(
        &self,
        kb: usize,
        (a, lda): (*const f32, isize),
        (b, ldb): (*const f32, isize),
        i: usize,
        j: usize,
        mr: usize,
        nr: usize,
        overwrite: bool,
    ) {
        let c = self
            .c
            .ptr
            .offset(i as isize * self.c.row_stride + j as isize * self.c.col_stride);
        if self.c.col_stride == 1 {
            let rs = self.c.row_stride;
            return T::tile::<ROW_MAJOR_A>(
                kb, a, lda, b, ldb, c, rs, mr, nr, self.alpha, overwrite,
            );
        }
        // C has no unit stride: the tile writes `acc` to a buffer (`1 * acc` is exact), and
        // each element is combined as the tiles combine it.
        let mut buf = [0.0f32; 32 * 12];
        let width = T::NR as isize;
        T::tile::<ROW_MAJOR_A>(
            kb,
            a,
            lda,
            b,
            ldb,
            buf.as_mut_ptr(),
            width,
            mr,
            nr,
            1.0,
            true,
        );
        let (rs, cs) = (self.c.row_stride, self.c.col_stride);
        T::scatter(buf.as_ptr(), c, rs, cs, mr, nr, self.alpha, overwrite);
    }
}

/// The `w`-th of `workers` near-equal parts of `0..count`.
fn share(count: usize, workers: usize, w: usize) -> std::ops::Range<usize> {
    count * w / workers..count * (w + 1) / workers
}

/// Packs one panel of A: rows `i0..i0+min(MR, rows)`, depths `p0..p0+kb`, as `kb` groups
/// of `MR` values (zero past the last row), depth by depth.
unsafe fn pack_a<T: Tile>(
    dst: *mut f32,
    a: Strided<*const f32>,
    i0: usize,
    rows: usize,
    p0: usize,
    kb: usize,
) {
    let mr = T::MR;
    let rows = rows.min(mr);
    if a.col_stride == 1 {
        // Row-major A: each row runs along the depth; `interleave` transposes it in.
        let row = |i: usize| a.ptr.offset((i0 + i) as isize * a.row_stride + p0 as isize);
        interleave(dst, mr, rows, kb, row);
    } else {
        for kk in 0..kb {
            for i in 0..mr {
                *dst.add(kk * mr + i) = if i < rows { a.at(i0 + i, p0 + kk) } else { 0.0 };
            }
        }
    }
}

/// Packs panels `q` of B's block at depths `p0..p0+kb`, columns `j0..j0+nb`: panel `q`
/// (at `dst + q*kb*NR`) holds columns `j0 + q*NR ..` as `kb` groups of `NR` values (zero
/// past the block's last column), depth by depth.
unsafe fn pack_b<T: Tile>(
    dst: *mut f32,
    b: Strided<*const f32>,
    p0: usize,
    kb: usize,
    j0: usize,
    nb: usize,
    q: std::ops::Range<usize>,
) {
    let nr = T::NR;
    if b.col_stride == 1 {
        // Row-major B: each row once, from start to end, cut into the panels.
        for kk in 0..kb {
            let src = b
                .ptr
                .offset((p0 + kk) as isize * b.row_stride + j0 as isize);
            for q in q.clone() {
                let cols = nr.min(nb - q * nr);
                let out = dst.add((q * kb + kk) * nr);
                copy_run(src.add(q * nr), out, cols);
                for j in cols..nr {
                    *out.add(j) = 0.0;
                }
            }
        }
        return;
    }
    for q in q {
        let panel = dst.add(q * kb * nr);
        let (j0, cols) = (j0 + q * nr, nr.min(nb - q * nr));
        if b.row_stride == 1 {
            // Column-major B (a transposed row-major matrix): columns run along the depth.
            let column = |j: usize| b.ptr.offset((j0 + j) as isize * b.col_stride + p0 as isize);
            interleave(panel, nr, cols, kb, column);
        } else {
            for kk in 0..kb {
                for j in 0..nr {
                    *panel.add(kk * nr + j) = if j < cols { b.at(p0 + kk, j0 + j) } else { 0.0 };
                }
            }
        }
    }
}

/// Copies `len` floats (a few dozen: a panel's row), in place of a call to `memcpy`.
#[inline(always)]
unsafe fn copy_run(src: *const f32, dst: *mut f32, len: usize) {
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut j = 0;
    #[cfg(target_arch = "x86_64")]
    while j + 4 <= len {
        use std::arch::x86_64::*;
        // SAFETY (SSE is part of x86_64): `j + 4 <= len` floats are readable and writable.
        _mm_storeu_ps(dst.add(j), _mm_loadu_ps(src.add(j)));
        j += 4;
    }
    for j in j..len {
        *dst.add(j) = *src.add(j);
    }
}

/// `out[kk*width + i] = line(i)[kk]` for `i < lines`, `kk < depth`, and 0 for
/// `lines <= i < width`: `lines` runs of `depth` floats written across, a transpose.
unsafe fn interleave(
    out: *mut f32,
    width: usize,
    lines: usize,
    depth: usize,
    line: impl Fn(usize) -> *const f32,
) {
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut i = 0;
    // Groups of four lines, four depths at a time, through 4×4 transposes.
    #[cfg(target_arch = "x86_64")]
    while i + 4 <= lines {
        use std::arch::x86_64::*;
        let src = [line(i), line(i + 1), line(i + 2), line(i + 3)];
        let mut kk = 0;
        while kk + 4 <= depth {
            // SAFETY (SSE is part of x86_64): each line has `depth` readable floats.
            let r0 = _mm_loadu_ps(src[0].add(kk));
            let r1 = _mm_loadu_ps(src[1].add(kk));
            let r2 = _mm_loadu_ps(src[2].add(kk));
            let r3 = _mm_loadu_ps(src[3].add(kk));
            let t0 = _mm_unpacklo_ps(r0, r1);
            let t1 = _mm_unpacklo_ps(r2, r3);
            let t2 = _mm_unpackhi_ps(r0, r1);
            let t3 = _mm_unpackhi_ps(r2, r3);
            let o = out.add(kk * width + i);
            _mm_storeu_ps(o, _mm_movelh_ps(t0, t1));
            _mm_storeu_ps(o.add(width), _mm_movehl_ps(t1, t0));
            _mm_storeu_ps(o.add(2 * width), _mm_movelh_ps(t2, t3));
            _mm_storeu_ps(o.add(3 * width), _mm_movehl_ps(t3, t2));
            kk += 4;
        }
        for kk in kk..depth {
            for (d, s) in src.iter().enumerate() {
                *out.add(kk * width + i + d) = *s.add(kk);
            }
        }
        i += 4;
    }
    for i in i..width {
        if i < lines {
            let src = line(i);
            for kk in 0..depth {
                *out.add(kk * width + i) = *src.add(kk);
            }
        } else {
            for kk in 0..depth {
                *out.add(kk * width + i) = 0.0;
            }
        }
    }
}
