//! Every SIMD kernel against its scalar twin, bit for bit, on random and adversarial data.

use half::{bf16, f16};

use super::*;
use crate::codebook::{Format, NF4_MIDPOINTS};

/// SplitMix64: a small deterministic generator for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// 2^-140, a subnormal whose reciprocal overflows. (`2f32.powi(-140)` is 0: it computes
/// `1 / 2^140`, which underflows through infinity.)
const TINY: f32 = f32::from_bits(1 << 9);

/// Values that stress the rules: exact midpoints at power-of-two scales, signed zeros,
/// subnormals, tiny blocks whose reciprocal overflows, huge magnitudes, plain noise.
fn adversarial(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n);
    while x.len() < n {
        let kind = rng.next() % 6;
        let scale = match kind {
            0 => 1.0,
            1 => TINY,                // subnormal: 1/absmax overflows
            2 => 2f32.powi(100),      // huge
            3 => 2f32.powi(-126),     // smallest normal
            4 => 0.0,                 // all-zero block
            _ => rng.uniform() * 1e3, // any scale
        };
        for j in 0..64 {
            let v = match rng.next() % 5 {
                0 => NF4_MIDPOINTS[(rng.next() % 15) as usize],
                1 if j % 2 == 0 => -0.0,
                _ => rng.uniform(),
            };
            x.push(if j == 0 { scale } else { v * scale });
        }
    }
    x.truncate(n);
    x
}

const LENGTHS: [usize; 12] = [0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 1000, 3 * 4096 + 17];
const BLOCKSIZES: [usize; 5] = [32, 64, 128, 256, 4096];

/// The SIMD level under test: what this CPU has (AVX2 on x86_64, NEON on aarch64), or
/// `None` where it has none, and the differential tests have nothing to compare.
fn simd_level() -> Option<Level> {
    Some(detect()).filter(|&l| l != Level::Scalar)
}

/// Every aarch64 CPU has NEON, so the tests below must not skip there.
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_is_detected_on_aarch64() {
    assert_eq!(simd_level(), Some(Level::Neon));
}

fn check_quantize<T: SimdInput + std::fmt::Debug>(convert: impl Fn(f32) -> T) {
    let Some(level) = simd_level() else {
        return;
    };
    let mut rng = Rng(7);
    for &bs in &BLOCKSIZES {
        for &n in &LENGTHS {
            let x: Vec<T> = adversarial(&mut rng, n).into_iter().map(&convert).collect();
            let nb = n.div_ceil(bs);
            let (mut c1, mut a1) = (vec![0u8; n.div_ceil(2)], vec![0f32; nb]);
            let (mut c2, mut a2) = (vec![1u8; n.div_ceil(2)], vec![1f32; nb]);
            scalar::quantize(Format::Nf4, &x, bs, &mut c1, &mut a1).unwrap();
            quantize_nf4(level, &x, bs, &mut c2, &mut a2).unwrap();
            assert_eq!(a1, a2, "absmax, bs {bs} n {n}");
            assert_eq!(c1, c2, "codes, bs {bs} n {n}");
        }
    }
}

#[test]
fn quantize_simd_matches_scalar_f32() {
    check_quantize(|v| v);
}

#[test]
fn quantize_simd_matches_scalar_f64() {
    check_quantize(|v| v as f64 * (1.0 + 1e-9));
}

#[test]
fn quantize_simd_matches_scalar_f16() {
    // Keep within the f16 range: 2^100 would be infinite there.
    check_quantize(|v| f16::from_f32(v.clamp(-65504.0, 65504.0)));
}

#[test]
fn quantize_simd_matches_scalar_bf16() {
    check_quantize(bf16::from_f32);
}

#[test]
fn quantize_simd_matches_scalar_f16_subnormal() {
    // Blocks of f16 subnormals and tiny normals (the widening's special case).
    check_quantize(|v| f16::from_f32((v * 2f32.powi(-16)).clamp(-65504.0, 65504.0)));
}

#[test]
fn quantize_reports_the_first_non_finite_index_like_scalar() {
    let Some(level) = simd_level() else {
        return;
    };
    let mut rng = Rng(3);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for _ in 0..20 {
            let n = 1 + (rng.next() % 3000) as usize;
            let mut x = adversarial(&mut rng, n);
            let first = (rng.next() as usize) % n;
            x[first] = bad;
            if first + 1 < n {
                x[n - 1] = bad;
            }
            let (mut c, mut a) = (vec![0u8; n.div_ceil(2)], vec![0f32; n.div_ceil(64)]);
            let e1 = scalar::quantize(Format::Nf4, &x, 64, &mut c, &mut a);
            let e2 = quantize_nf4(level, &x, 64, &mut c, &mut a);
            assert_eq!(e1, Err(first));
            assert_eq!(e2, Err(first));
        }
    }
}

/// The bits of each output, widened exactly to f32 (so -0.0 and 0.0 differ).
fn bits<O: crate::element::Input>(out: &[O]) -> Vec<u32> {
    out.iter().map(|v| v.to_f32().to_bits()).collect()
}

fn check_dequantize<O: SimdOutput + crate::element::Input>() {
    let Some(level) = simd_level() else {
        return;
    };
    let mut rng = Rng(11);
    for format in [Format::Nf4, Format::Fp4] {
        for &bs in &BLOCKSIZES {
            for &n in &LENGTHS {
                let codes: Vec<u8> = (0..n.div_ceil(2)).map(|_| rng.next() as u8).collect();
                let absmax: Vec<f32> = (0..n.div_ceil(bs))
                    .map(|b| match b % 4 {
                        0 => 0.0,
                        1 => TINY,
                        2 => 3.0e38,
                        _ => rng.uniform().abs() * 10.0,
                    })
                    .collect();
                let mut o1 = vec![O::default(); n];
                let mut o2 = vec![O::default(); n];
                scalar::dequantize(format, &codes, &absmax, bs, &mut o1);
                dequantize_4bit(level, format, &codes, &absmax, bs, &mut o2);
                assert_eq!(bits(&o1), bits(&o2), "{format:?} bs {bs} n {n}");
            }
        }
    }
}

#[test]
fn dequantize_simd_matches_scalar_f32() {
    check_dequantize::<f32>();
}

#[test]
fn dequantize_simd_matches_scalar_f16() {
    check_dequantize::<f16>();
}

#[test]
fn dequantize_simd_matches_scalar_bf16() {
    check_dequantize::<bf16>();
}

/// The NEON loads of `x`, 8 at a time (`x.len()` a multiple of 8).
#[cfg(target_arch = "aarch64")]
fn neon_widened<T: neon::Load8>(x: &[T]) -> Vec<f32> {
    use std::arch::aarch64::vst1q_f32;
    let mut out = vec![0f32; x.len()];
    for (o, c) in out.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
        // SAFETY: 8 elements each side; every aarch64 CPU has NEON.
        unsafe {
            let [a, b] = T::load8(c.as_ptr());
            vst1q_f32(o.as_mut_ptr(), a);
            vst1q_f32(o.as_mut_ptr().add(4), b);
        }
    }
    out
}

/// Widened loads against `Input::to_f32`: bit for bit, NaN only as NaN.
#[cfg(target_arch = "aarch64")]
fn check_widened<T: neon::Load8 + crate::element::Input>(x: &[T]) {
    for (i, (got, v)) in neon_widened(x).into_iter().zip(x).enumerate() {
        let want = v.to_f32();
        if want.is_nan() {
            assert!(got.is_nan(), "element {i}: {got} for NaN");
        } else {
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "element {i}: {got} for {want}"
            );
        }
    }
}

#[cfg(target_arch = "aarch64")]
#[test]
fn neon_loads_every_f16_and_bf16_exactly() {
    let bits: Vec<u16> = (0..=u16::MAX).collect();
    check_widened(&bits.iter().map(|&b| f16::from_bits(b)).collect::<Vec<_>>());
    check_widened(&bits.iter().map(|&b| bf16::from_bits(b)).collect::<Vec<_>>());
}

#[cfg(target_arch = "aarch64")]
#[test]
fn neon_rounds_f64_like_as_f32() {
    let mut rng = Rng(5);
    let mut x = vec![
        0.0,
        -0.0,
        f64::MIN_POSITIVE,
        f64::MAX,
        f64::INFINITY,
        f64::NAN,
        // Halfway from f32::MAX to 2^128 rounds to inf; just below it, to f32::MAX.
        (2.0 - 2f64.powi(-24)) * 2f64.powi(127),
        (2.0 - 2f64.powi(-24) - 2f64.powi(-40)) * 2f64.powi(127),
    ];
    while x.len() % 8 != 0 || x.len() < 4096 {
        // Exact f32 values, halfway points between neighbours (ties to even), and near them.
        let f = f32::from_bits(rng.next() as u32);
        let f = if f.is_finite() { f as f64 } else { 1.0 };
        let half_ulp = (f32::from_bits((f as f32).to_bits() + 1) as f64 - f) / 2.0;
        x.extend([
            f,
            f + half_ulp,
            f + half_ulp * (1.0 + 1e-9),
            f + half_ulp * (1.0 - 1e-9),
        ]);
    }
    x.truncate(x.len() / 8 * 8);
    check_widened(&x);
}

#[test]
fn a_block_whose_non_finite_value_is_gone_reports_its_start() {
    assert_eq!(scalar::non_finite_in(&[1.0f32, f32::NAN, f32::INFINITY]), 1);
    // Another thread overwrote the value between the two scans: the second finds nothing.
    assert_eq!(scalar::non_finite_in(&[1.0f32; 64]), 0);
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[test]
fn the_simd_block_loop_survives_a_value_that_changes_between_scans() {
    // The vector scan of block 1 saw a NaN; by the second (scalar) scan it is 1.0 again.
    let x = [1.0f32; 128];
    let (mut codes, mut absmax) = ([0u8; 64], [0f32; 2]);
    let block1 = x.as_ptr().wrapping_add(64);
    let max_abs_bits = |p: *const f32| {
        if p == block1 {
            scalar::NON_FINITE_BITS
        } else {
            1.0f32.to_bits()
        }
    };
    // SAFETY: neither closure touches memory.
    let r = unsafe {
        quantize_nf4_blocks(
            &x,
            64,
            &mut codes,
            &mut absmax,
            max_abs_bits,
            |_, _, _, _| {},
        )
    };
    assert_eq!(r, Err(64));
}

// --- the dense products (`gemm`) ---------------------------------------------------------

use super::gemm::{gemm, Strided};

/// How an operand of `rows x cols` lies in its buffer: (row stride, column stride, length).
#[derive(Clone, Copy, Debug)]
enum Lay {
    RowMajor,
    ColMajor,
    /// Rows padded by 3 elements.
    Padded,
    /// Neither stride 1: every other element of rows twice as long.
    Sparse,
}

impl Lay {
    fn strides(self, rows: usize, cols: usize) -> (isize, isize, usize) {
        let (r, c) = (rows as isize, cols as isize);
        let (rs, cs) = match self {
            Lay::RowMajor => (c, 1),
            Lay::ColMajor => (1, r),
            Lay::Padded => (c + 3, 1),
            Lay::Sparse => (2 * c + 1, 2),
        };
        let len = if rows == 0 || cols == 0 {
            0
        } else {
            ((r - 1) * rs + (c - 1) * cs + 1) as usize
        };
        (rs, cs, len)
    }
}

const LAYS: [Lay; 4] = [Lay::RowMajor, Lay::ColMajor, Lay::Padded, Lay::Sparse];

/// Values with exact zeros, negative zeros and a spread of magnitudes.
fn operand(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| match rng.next() % 16 {
            0 => 0.0,
            1 => -0.0,
            2 => rng.uniform() * 1e4,
            3 => rng.uniform() * 1e-4,
            _ => rng.uniform(),
        })
        .collect()
}

/// The levels whose products are compared: the scalar twin and every SIMD tile this CPU has.
fn gemm_levels() -> Vec<Level> {
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut levels = vec![Level::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if detect() == Level::Avx2 {
            levels.push(Level::Avx2);
        }
        if detect_wide() == Level::Avx512 {
            levels.push(Level::Avx512);
        }
    }
    levels
}

/// One product `C (+)= alpha A B` at `level`, C starting from `c0` laid out as `lc`.
#[allow(clippy::too_many_arguments)]
fn product(
    level: Level,
    (m, n, k): (usize, usize, usize),
    (a, la): (&[f32], Lay),
    (b, lb): (&[f32], Lay),
    (c0, lc): (&[f32], Lay),
    alpha: f32,
    accumulate: bool,
    threads: usize,
) -> Vec<f32> {
    let (ars, acs, _) = la.strides(m, k);
    let (brs, bcs, _) = lb.strides(k, n);
    let (crs, ccs, _) = lc.strides(m, n);
    let mut c = c0.to_vec();
    // SAFETY: every operand's buffer has the length its layout needs (`Lay::strides`).
    unsafe {
        gemm(
            level,
            m,
            n,
            k,
            Strided {
                ptr: c.as_mut_ptr(),
                row_stride: crs,
                col_stride: ccs,
            },
            Strided {
                ptr: a.as_ptr(),
                row_stride: ars,
                col_stride: acs,
            },
            Strided {
                ptr: b.as_ptr(),
                row_stride: brs,
                col_stride: bcs,
            },
            alpha,
            accumulate,
            threads,
        )
        .unwrap();
    }
    c
}

/// The same bits, NaN for NaN.
fn same_bits(x: &[f32], y: &[f32]) -> bool {
    x.len() == y.len()
        && x.iter()
            .zip(y)
            .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
}

/// Shapes around the tiles' sizes (12×32, 6×16, 4×4), the depth block (256), the thin
/// products' rules (16 rows or columns) and the column block (4096).
const GEMM_SHAPES: [(usize, usize, usize); 16] = [
    (1, 1, 1),
    (1, 37, 5),
    (13, 1, 29),
    (5, 300, 1),
    (37, 29, 53),
    (12, 32, 256),
    (25, 65, 257),
    (16, 17, 700),
    (17, 16, 33),
    (16, 100, 40),
    (100, 16, 40),
    (24, 48, 513),
    (70, 100, 520),
    (145, 33, 20),
    (3, 4100, 7),
    (2, 9, 4),
];

#[test]
fn gemm_simd_matches_scalar_bit_for_bit() {
    let levels = gemm_levels();
    let mut rng = Rng(11);
    for (s, &(m, n, k)) in GEMM_SHAPES.iter().enumerate() {
        for (l, (la, lb)) in LAYS.iter().flat_map(|a| LAYS.map(|b| (*a, b))).enumerate() {
            // Every layout pair for each shape, C's layout and the flags in rotation.
            let lc = LAYS[(s + l) % 4];
            let accumulate = (s + l) % 3 == 0;
            let alpha = if l % 2 == 0 { 1.0 } else { -0.75 };
            let a = operand(&mut rng, la.strides(m, k).2);
            let b = operand(&mut rng, lb.strides(k, n).2);
            let c0 = operand(&mut rng, lc.strides(m, n).2);
            let want = product(
                Level::Scalar,
                (m, n, k),
                (&a, la),
                (&b, lb),
                (&c0, lc),
                alpha,
                accumulate,
                1,
            );
            for &level in &levels {
                for threads in [1, 2] {
                    let got = product(
                        level,
                        (m, n, k),
                        (&a, la),
                        (&b, lb),
                        (&c0, lc),
                        alpha,
                        accumulate,
                        threads,
                    );
                    assert!(
                        same_bits(&got, &want),
                        "{level:?} x{threads}, {m}x{n}x{k}, A {la:?}, B {lb:?}, C {lc:?}, alpha {alpha}, accumulate {accumulate}"
                    );
                }
            }
        }
    }
}

#[test]
fn gemm_matches_a_naive_product_and_leaves_strided_gaps_alone() {
    let mut rng = Rng(5);
    for &(m, n, k) in &GEMM_SHAPES {
        for lc in LAYS {
            let a = operand(&mut rng, m * k);
            let b = operand(&mut rng, k * n);
            let (crs, ccs, len) = lc.strides(m, n);
            // Gaps in C's buffer hold a marker that no product may touch.
            let c0 = vec![7.5f32; len];
            let mut want = c0.clone();
            // The rounding error of a sum is bounded by (a multiple of) its terms' magnitudes.
            let mut bound = vec![0.0f32; len];
            for i in 0..m {
                for j in 0..n {
                    let term = |p: usize| a[i * k + p] as f64 * b[p * n + j] as f64;
                    let dot: f64 = (0..k).map(term).sum();
                    let size: f64 = (0..k).map(|p| term(p).abs()).sum();
                    let at = (i as isize * crs + j as isize * ccs) as usize;
                    want[at] = (7.5 + 0.5 * dot) as f32;
                    bound[at] = (1e-6 * (8.0 + size)) as f32;
                }
            }
            // NEON (the gemm crates' kernels) is no twin, but must give the product.
            #[cfg(target_arch = "aarch64")]
            let levels = [gemm_levels(), vec![Level::Neon]].concat();
            #[cfg(not(target_arch = "aarch64"))]
            let levels = gemm_levels();
            for level in levels {
                let got = product(
                    level,
                    (m, n, k),
                    (&a, Lay::RowMajor),
                    (&b, Lay::RowMajor),
                    (&c0, lc),
                    0.5,
                    true,
                    2,
                );
                for ((g, w), e) in got.iter().zip(&want).zip(&bound) {
                    assert!(
                        (g - w).abs() <= *e,
                        "{level:?} {m}x{n}x{k} C {lc:?}: {g} vs {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn gemm_non_finite_values_reach_only_their_rows_and_columns() {
    // The tiles pad partial panels with zeros; an inf times a padded zero is NaN, which
    // must stay in the padding.
    let (m, n, k) = (13, 35, 9);
    let mut a = vec![1.0f32; m * k];
    let mut b = vec![1.0f32; k * n];
    a[5 * k + 2] = f32::INFINITY; // row 5
    b[4 * n + 33] = f32::NAN; // column 33
    #[cfg(target_arch = "aarch64")]
    let levels = [gemm_levels(), vec![Level::Neon]].concat();
    #[cfg(not(target_arch = "aarch64"))]
    let levels = gemm_levels();
    for level in levels {
        let c = product(
            level,
            (m, n, k),
            (&a, Lay::RowMajor),
            (&b, Lay::RowMajor),
            (&vec![0.0; m * n], Lay::RowMajor),
            1.0,
            false,
            1,
        );
        for i in 0..m {
            for j in 0..n {
                let v = c[i * n + j];
                match (i, j) {
                    (_, 33) => assert!(v.is_nan(), "{level:?} ({i}, {j})"),
                    (5, _) => assert_eq!(v, f32::INFINITY, "{level:?} ({i}, {j})"),
                    _ => assert_eq!(v, k as f32, "{level:?} ({i}, {j})"),
                }
            }
        }
    }
}
