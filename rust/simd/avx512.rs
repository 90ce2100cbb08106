//! AVX-512F kernel of the dense f32 products: a 12×32 register tile (24 zmm accumulators).
//! It computes exactly what its twin in `scalar` computes, per output element the same fused
//! multiply-adds in the same order, so results are bit-identical (`simd::tests`).

use std::arch::x86_64::*;

use super::gemm::Tile;

/// The 12×32 tile (see `Tile`); the CPU must have AVX-512F.
pub struct Avx512Tile;

impl Tile for Avx512Tile {
    const MR: usize = 12;
    const NR: usize = 32;

    #[inline(always)]
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
    ) {
        tile_12x32::<ROW_MAJOR_A>(kc, a, lda, b, ldb, c, rs, mr, nr, alpha, overwrite)
    }

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
        scatter_avx512(acc, c, rs, cs, mr, nr, alpha, overwrite)
    }
}

/// Calls `$body!(i)` for each row of the tile, with `i` a literal (so the accumulators are
/// registers, never an array indexed at run time).
macro_rules! rows {
    ($body:ident) => {
        $body!(0);
        $body!(1);
        $body!(2);
        $body!(3);
        $body!(4);
        $body!(5);
        $body!(6);
        $body!(7);
        $body!(8);
        $body!(9);
        $body!(10);
        $body!(11);
    };
}

#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_12x32<const ROW_MAJOR_A: bool>(
    kc: usize,
    mut a: *const f32,
    lda: isize,
    mut b: *const f32,
    ldb: isize,
    c: *mut f32,
    rs: isize,
    mr: usize,
    nr: usize,
    alpha: f32,
    overwrite: bool,
) {
    // The rows of C this tile ends in, fetched while the products are computed.
    for i in 0..mr.min(12) {
        let row = c.wrapping_offset(i as isize * rs) as *const i8;
        _mm_prefetch::<_MM_HINT_T0>(row);
        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(64));
        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(124));
    }
    let mut acc = [[_mm512_setzero_ps(); 2]; 12];
    for _ in 0..kc {
        let b0 = _mm512_loadu_ps(b);
        let b1 = _mm512_loadu_ps(b.add(16));
        macro_rules! step {
            ($i:literal) => {
                let ai = if ROW_MAJOR_A {
                    _mm512_set1_ps(*a.offset($i * lda))
                } else {
                    _mm512_set1_ps(*a.offset($i))
                };
                acc[$i][0] = _mm512_fmadd_ps(ai, b0, acc[$i][0]);
                acc[$i][1] = _mm512_fmadd_ps(ai, b1, acc[$i][1]);
            };
        }
        rows!(step);
        a = a.offset(if ROW_MAJOR_A { 1 } else { lda });
        b = b.offset(ldb);
    }
    let alpha = _mm512_set1_ps(alpha);
    let lanes = |n: usize| -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as u16
        }
    };
    let (m0, m1) = (lanes(nr), lanes(nr.saturating_sub(16)));
    macro_rules! half {
        ($i:literal, $v:literal, $mask:expr) => {
            let q = c.offset($i * rs).add(16 * $v);
            let out = if overwrite {
                _mm512_mul_ps(alpha, acc[$i][$v])
            } else {
                _mm512_fmadd_ps(alpha, acc[$i][$v], _mm512_maskz_loadu_ps($mask, q))
            };
            _mm512_mask_storeu_ps(q, $mask, out);
        };
    }
    macro_rules! store {
        ($i:literal) => {
            if $i < mr {
                half!($i, 0, m0);
                half!($i, 1, m1);
            }
        };
    }
    rows!(store);
}

/// `Tile::scatter` with the fused multiply-adds in hardware.
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn scatter_avx512(
    acc: *const f32,
    c: *mut f32,
    rs: isize,
    cs: isize,
    mr: usize,
    nr: usize,
    alpha: f32,
    overwrite: bool,
) {
    super::gemm::scatter_tile(32, acc, c, rs, cs, mr, nr, alpha, overwrite)
}
