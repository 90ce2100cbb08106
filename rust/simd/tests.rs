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

/// Values that stress the rules: exact midpoints at power-of-two scales, signed zeros,
/// subnormals, tiny blocks whose reciprocal overflows, huge magnitudes, plain noise.
fn adversarial(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n);
    while x.len() < n {
        let kind = rng.next() % 6;
        let scale = match kind {
            0 => 1.0,
            1 => 2f32.powi(-140),     // subnormal: 1/absmax overflows
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

fn avx2_available() -> bool {
    detect() == Level::Avx2
}

fn check_quantize<T: SimdInput + std::fmt::Debug>(convert: impl Fn(f32) -> T) {
    if !avx2_available() {
        return;
    }
    let mut rng = Rng(7);
    for &bs in &BLOCKSIZES {
        for &n in &LENGTHS {
            let x: Vec<T> = adversarial(&mut rng, n).into_iter().map(&convert).collect();
            let nb = n.div_ceil(bs);
            let (mut c1, mut a1) = (vec![0u8; n.div_ceil(2)], vec![0f32; nb]);
            let (mut c2, mut a2) = (vec![1u8; n.div_ceil(2)], vec![1f32; nb]);
            scalar::quantize(Format::Nf4, &x, bs, &mut c1, &mut a1).unwrap();
            quantize_nf4(Level::Avx2, &x, bs, &mut c2, &mut a2).unwrap();
            assert_eq!(a1, a2, "absmax, bs {bs} n {n}");
            assert_eq!(c1, c2, "codes, bs {bs} n {n}");
        }
    }
}

#[test]
fn quantize_avx2_matches_scalar_f32() {
    check_quantize(|v| v);
}

#[test]
fn quantize_avx2_matches_scalar_f64() {
    check_quantize(|v| v as f64 * (1.0 + 1e-9));
}

#[test]
fn quantize_avx2_matches_scalar_f16() {
    // Keep within the f16 range: 2^100 would be infinite there.
    check_quantize(|v| f16::from_f32(v.clamp(-65504.0, 65504.0)));
}

#[test]
fn quantize_avx2_matches_scalar_bf16() {
    check_quantize(bf16::from_f32);
}

#[test]
fn quantize_reports_the_first_non_finite_index_like_scalar() {
    if !avx2_available() {
        return;
    }
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
            let e2 = quantize_nf4(Level::Avx2, &x, 64, &mut c, &mut a);
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
    if !avx2_available() {
        return;
    }
    let mut rng = Rng(11);
    for format in [Format::Nf4, Format::Fp4] {
        for &bs in &BLOCKSIZES {
            for &n in &LENGTHS {
                let codes: Vec<u8> = (0..n.div_ceil(2)).map(|_| rng.next() as u8).collect();
                let absmax: Vec<f32> = (0..n.div_ceil(bs))
                    .map(|b| match b % 4 {
                        0 => 0.0,
                        1 => 2f32.powi(-140),
                        2 => 3.0e38,
                        _ => rng.uniform().abs() * 10.0,
                    })
                    .collect();
                let mut o1 = vec![O::default(); n];
                let mut o2 = vec![O::default(); n];
                scalar::dequantize(format, &codes, &absmax, bs, &mut o1);
                dequantize_4bit(Level::Avx2, format, &codes, &absmax, bs, &mut o2);
                assert_eq!(bits(&o1), bits(&o2), "{format:?} bs {bs} n {n}");
            }
        }
    }
}

#[test]
fn dequantize_avx2_matches_scalar_f32() {
    check_dequantize::<f32>();
}

#[test]
fn dequantize_avx2_matches_scalar_f16() {
    check_dequantize::<f16>();
}

#[test]
fn dequantize_avx2_matches_scalar_bf16() {
    check_dequantize::<bf16>();
}
