//! AVX2 (+FMA, F16C) kernels for NF4. Each one computes exactly what its twin in `scalar`
//! computes; the same f32 operations in the same order, so results are bit-identical.

use std::arch::x86_64::*;

use half::{bf16, f16};

use crate::codebook::{Format, NF4_MIDPOINTS};

/// Loads 8 consecutive elements widened (or rounded) to f32.
pub trait Load8: Copy {
    /// # Safety
    /// `p` must point to 8 readable elements; the CPU must have AVX2 and F16C.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Load8 for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl Load8 for f64 {
    #[inline(always)]
    unsafe fn load8(p: *const f64) -> __m256 {
        // Rounds to nearest-even under the default MXCSR, as `f64 as f32` does.
        let lo = _mm256_cvtpd_ps(_mm256_loadu_pd(p));
        let hi = _mm256_cvtpd_ps(_mm256_loadu_pd(p.add(4)));
        _mm256_set_m128(hi, lo)
    }
}

impl Load8 for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

impl Load8 for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }
}

#[inline(always)]
unsafe fn hmax_epu32(m: __m256i) -> u32 {
    let m = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
    _mm_cvtsi128_si32(m) as u32
}

/// NF4 codes of 8 normalised values, one per i32 lane: the count of thresholds below each.
#[inline(always)]
unsafe fn nf4_codes8(v: __m256, mids: &[__m256; 15]) -> __m256i {
    let mut c = _mm256_setzero_si256();
    for m in mids {
        // A true comparison is all ones (-1), so subtracting it counts.
        c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(v, *m)));
    }
    c
}

/// Packs 32 codes (4 vectors of 8 lanes, in order) into 16 bytes, low nibble first.
#[inline(always)]
unsafe fn pack32(c: [__m256i; 4], out: *mut u8) {
    // i32 -> u8 with saturating packs; the packs work per 128-bit lane, so the dwords end up
    // as [c0 lo, c1 lo, c2 lo, c3 lo | c0 hi, c1 hi, c2 hi, c3 hi], which the permute orders.
    let bytes = _mm256_packus_epi16(
        _mm256_packs_epi32(c[0], c[1]),
        _mm256_packs_epi32(c[2], c[3]),
    );
    let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // Each i16 lane: even * 1 + odd * 16, i.e. `pack(even, odd)`.
    let pairs = _mm256_maddubs_epi16(ordered, _mm256_set1_epi16(0x1001));
    let packed = _mm256_packus_epi16(pairs, pairs);
    let packed = _mm256_permute4x64_epi64::<0b00_00_10_00>(packed);
    _mm_storeu_si128(out as *mut __m128i, _mm256_castsi256_si128(packed));
}

/// Codes of one block: `v = x * factor`, or `x / factor` when `divide`. `bs` is a multiple of 32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn encode_nf4_block<T: Load8>(
    p: *const T,
    bs: usize,
    factor: f32,
    divide: bool,
    out: *mut u8,
) {
    let mids = NF4_MIDPOINTS.map(|m| _mm256_set1_ps(m));
    let f = _mm256_set1_ps(factor);
    for i in (0..bs).step_by(32) {
        let mut c = [_mm256_setzero_si256(); 4];
        for (k, ck) in c.iter_mut().enumerate() {
            let x = T::load8(p.add(i + 8 * k));
            let v = if divide {
                _mm256_div_ps(x, f)
            } else {
                _mm256_mul_ps(x, f)
            };
            *ck = nf4_codes8(v, &mids);
        }
        pack32(c, out.add(i / 2));
    }
}

/// NF4 quantization of blocks (see the module contract in `simd`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_nf4<T: Load8 + crate::element::Input>(
    x: &[T],
    bs: usize,
    codes: &mut [u8],
    absmax: &mut [f32],
) -> Result<(), usize> {
    let abs_mask = _mm256_set1_epi32(0x7FFF_FFFF);
    let max_abs_bits = |p: *const T| {
        let mut m = _mm256_setzero_si256();
        for i in (0..bs).step_by(8) {
            let bits = _mm256_and_si256(_mm256_castps_si256(T::load8(p.add(i))), abs_mask);
            m = _mm256_max_epu32(m, bits);
        }
        hmax_epu32(m)
    };
    let encode = |p, factor, divide, out| encode_nf4_block(p, bs, factor, divide, out);
    super::quantize_nf4_blocks(x, bs, codes, absmax, max_abs_bits, encode)
}

/// Stores 4-bit table lookups: 32 outputs from 16 bytes of packed codes.
pub trait StoreTable: Copy {
    /// The per-block state (the scaled table in a form ready for lookups).
    type Table: Copy;
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    unsafe fn table(values: &[f32; 16], absmax: f32) -> Self::Table;
    /// # Safety
    /// `codes` must have 16 readable bytes and `out` room for 32 elements; CPU as above.
    unsafe fn store32(t: Self::Table, codes: *const u8, out: *mut Self);
}

/// 32 code indices, one per byte, in element order, from 16 packed bytes.
#[inline(always)]
unsafe fn unpack32(codes: *const u8) -> (__m128i, __m128i) {
    let b = _mm_loadu_si128(codes as *const __m128i);
    let low = _mm_set1_epi8(0x0F);
    let even = _mm_and_si128(b, low);
    let odd = _mm_and_si128(_mm_srli_epi16::<4>(b), low);
    (_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd))
}

/// The 16 products `values[k] * absmax` in f32, as two vectors of 8.
#[inline(always)]
unsafe fn scaled_table(values: &[f32; 16], absmax: f32) -> (__m256, __m256) {
    let a = _mm256_set1_ps(absmax);
    (
        _mm256_mul_ps(_mm256_loadu_ps(values.as_ptr()), a),
        _mm256_mul_ps(_mm256_loadu_ps(values.as_ptr().add(8)), a),
    )
}

impl StoreTable for f32 {
    type Table = (__m256, __m256);

    #[inline(always)]
    unsafe fn table(values: &[f32; 16], absmax: f32) -> Self::Table {
        scaled_table(values, absmax)
    }

    #[inline(always)]
    unsafe fn store32(t: Self::Table, codes: *const u8, out: *mut f32) {
        let (n0, n1) = unpack32(codes);
        let idx = [
            _mm256_cvtepu8_epi32(n0),
            _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(n0)),
            _mm256_cvtepu8_epi32(n1),
            _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(n1)),
        ];
        for (k, i) in idx.into_iter().enumerate() {
            // permutevar uses the low 3 bits; bit 3 (moved to the sign) picks the table half.
            let lo = _mm256_permutevar8x32_ps(t.0, i);
            let hi = _mm256_permutevar8x32_ps(t.1, i);
            let v = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(i)));
            _mm256_storeu_ps(out.add(8 * k), v);
        }
    }
}

/// Byte tables (low bytes, high bytes) of 16 u16 values held as two vectors of 8.
#[inline(always)]
unsafe fn byte_tables(t0: __m128i, t1: __m128i) -> (__m256i, __m256i) {
    let mask = _mm_set1_epi16(0x00FF);
    let lo = _mm_packus_epi16(_mm_and_si128(t0, mask), _mm_and_si128(t1, mask));
    let hi = _mm_packus_epi16(_mm_srli_epi16::<8>(t0), _mm_srli_epi16::<8>(t1));
    (
        _mm256_broadcastsi128_si256(lo),
        _mm256_broadcastsi128_si256(hi),
    )
}

/// 32 u16 lookups through byte tables.
#[inline(always)]
unsafe fn store32_u16(t: (__m256i, __m256i), codes: *const u8, out: *mut u16) {
    let (n0, n1) = unpack32(codes);
    let idx = _mm256_set_m128i(n1, n0);
    let lo = _mm256_shuffle_epi8(t.0, idx);
    let hi = _mm256_shuffle_epi8(t.1, idx);
    let a = _mm256_unpacklo_epi8(lo, hi); // elements 0..8 | 16..24
    let b = _mm256_unpackhi_epi8(lo, hi); // elements 8..16 | 24..32
    _mm256_storeu_si256(out as *mut __m256i, _mm256_permute2x128_si256::<0x20>(a, b));
    _mm256_storeu_si256(
        out.add(16) as *mut __m256i,
        _mm256_permute2x128_si256::<0x31>(a, b),
    );
}

impl StoreTable for f16 {
    type Table = (__m256i, __m256i);

    #[inline(always)]
    unsafe fn table(values: &[f32; 16], absmax: f32) -> Self::Table {
        let (v0, v1) = scaled_table(values, absmax);
        byte_tables(
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v0),
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v1),
        )
    }

    #[inline(always)]
    unsafe fn store32(t: Self::Table, codes: *const u8, out: *mut f16) {
        store32_u16(t, codes, out as *mut u16)
    }
}

/// f32 -> bf16 bits, round to nearest-even (the values are finite).
#[inline(always)]
unsafe fn bf16_bits8(v: __m256) -> __m128i {
    let bits = _mm256_castps_si256(v);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
    let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    let r = _mm256_srli_epi32::<16>(rounded);
    // Unsigned saturation keeps the 16-bit values; the permute undoes the per-lane pack order.
    let packed = _mm256_permute4x64_epi64::<0b00_00_10_00>(_mm256_packus_epi32(r, r));
    _mm256_castsi256_si128(packed)
}

impl StoreTable for bf16 {
    type Table = (__m256i, __m256i);

    #[inline(always)]
    unsafe fn table(values: &[f32; 16], absmax: f32) -> Self::Table {
        let (v0, v1) = scaled_table(values, absmax);
        byte_tables(bf16_bits8(v0), bf16_bits8(v1))
    }

    #[inline(always)]
    unsafe fn store32(t: Self::Table, codes: *const u8, out: *mut bf16) {
        store32_u16(t, codes, out as *mut u16)
    }
}

/// Dequantization of 4-bit blocks through a 16-entry table (see `scalar::dequantize`).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequantize_4bit<O: StoreTable + crate::element::Output>(
    format: Format,
    codes: &[u8],
    absmax: &[f32],
    bs: usize,
    out: &mut [O],
) {
    let table = |values: &[f32; 16], a| O::table(values, a);
    let store32 = |t, codes, out| O::store32(t, codes, out);
    super::dequantize_4bit_blocks(format, codes, absmax, bs, out, table, store32)
}

/// The dense products' 6×16 register tile (12 ymm accumulators; see `gemm::Tile`): exactly
/// what its twin `scalar::ScalarTile` computes, bit for bit.
pub struct Avx2Tile;

impl super::gemm::Tile for Avx2Tile {
    const MR: usize = 6;
    const NR: usize = 16;

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
        tile_6x16::<ROW_MAJOR_A>(kc, a, lda, b, ldb, c, rs, mr, nr, alpha, overwrite)
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
        scatter_avx2(acc, c, rs, cs, mr, nr, alpha, overwrite)
    }
}

#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_6x16<const ROW_MAJOR_A: bool>(
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
    for i in 0..mr.min(6) {
        let row = c.wrapping_offset(i as isize * rs) as *const i8;
        _mm_prefetch::<_MM_HINT_T0>(row);
        _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(60));
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; 6];
    for _ in 0..kc {
        let b0 = _mm256_loadu_ps(b);
        let b1 = _mm256_loadu_ps(b.add(8));
        macro_rules! step {
            ($i:literal) => {
                let ai = if ROW_MAJOR_A {
                    _mm256_broadcast_ss(&*a.offset($i * lda))
                } else {
                    _mm256_broadcast_ss(&*a.offset($i))
                };
                acc[$i][0] = _mm256_fmadd_ps(ai, b0, acc[$i][0]);
                acc[$i][1] = _mm256_fmadd_ps(ai, b1, acc[$i][1]);
            };
        }
        step!(0);
        step!(1);
        step!(2);
        step!(3);
        step!(4);
        step!(5);
        a = a.offset(if ROW_MAJOR_A { 1 } else { lda });
        b = b.offset(ldb);
    }
    let alpha = _mm256_set1_ps(alpha);
    let lanes = |n: usize| {
        let n = n.min(8) as i32;
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    };
    let (m0, m1) = (lanes(nr), lanes(nr.saturating_sub(8)));
    let full = nr >= 16;
    macro_rules! half {
        ($i:literal, $v:literal, $mask:expr) => {
            let q = c.offset($i * rs).add(8 * $v);
            if full {
                let out = if overwrite {
                    _mm256_mul_ps(alpha, acc[$i][$v])
                } else {
                    _mm256_fmadd_ps(alpha, acc[$i][$v], _mm256_loadu_ps(q))
                };
                _mm256_storeu_ps(q, out);
            } else {
                let out = if overwrite {
                    _mm256_mul_ps(alpha, acc[$i][$v])
                } else {
                    _mm256_fmadd_ps(alpha, acc[$i][$v], _mm256_maskload_ps(q, $mask))
                };
                _mm256_maskstore_ps(q, $mask, out);
            }
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
    store!(0);
    store!(1);
    store!(2);
    store!(3);
    store!(4);
    store!(5);
}

/// `Tile::scatter` with the fused multiply-adds in hardware.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn scatter_avx2(
    acc: *const f32,
    c: *mut f32,
    rs: isize,
    cs: isize,
    mr: usize,
    nr: usize,
    alpha: f32,
    overwrite: bool,
) {
    super::gemm::scatter_tile(16, acc, c, rs, cs, mr, nr, alpha, overwrite)
}
