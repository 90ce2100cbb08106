//! NEON kernels for NF4 on aarch64. Each one computes exactly what its twin in `scalar`
//! computes; the same f32 operations in the same order, so results are bit-identical.
//!
//! Tables and packed codes are handled as bytes (`u8` loads, stores and lookups), which
//! keep memory order whatever the endianness.

use std::arch::aarch64::*;

use half::{bf16, f16};

use crate::codebook::{Format, NF4_MIDPOINTS};
use crate::element::{Input, Output};

/// Loads 8 consecutive elements widened (or rounded) to f32, as two vectors of 4.
pub trait Load8: Copy {
    /// # Safety
    /// `p` must point to 8 readable elements; the CPU must have NEON.
    unsafe fn load8(p: *const Self) -> [float32x4_t; 2];
}

impl Load8 for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> [float32x4_t; 2] {
        [vld1q_f32(p), vld1q_f32(p.add(4))]
    }
}

impl Load8 for f64 {
    #[inline(always)]
    unsafe fn load8(p: *const f64) -> [float32x4_t; 2] {
        // FCVTN rounds by FPCR, nearest-even by default, as `f64 as f32` does.
        let lo = vcvt_high_f32_f64(vcvt_f32_f64(vld1q_f64(p)), vld1q_f64(p.add(2)));
        let hi = vcvt_high_f32_f64(vcvt_f32_f64(vld1q_f64(p.add(4))), vld1q_f64(p.add(6)));
        [lo, hi]
    }
}

/// Exact f16 -> f32 of 4 values given as zero-extended bits. Integer work only for normal
/// values and non-finite ones (the f16 vector types are unstable in Rust); subnormals go
/// through an exact int -> float conversion, so FPCR's flush-to-zero cannot matter.
#[inline(always)]
unsafe fn f16_bits_to_f32(h: uint32x4_t) -> float32x4_t {
    let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
    let em = vandq_u32(h, vdupq_n_u32(0x7FFF));
    let shifted = vshlq_n_u32::<13>(em);
    // Normal: rebias the exponent from 15 to 127.
    let normal = vaddq_u32(shifted, vdupq_n_u32((127 - 15) << 23));
    // Subnormal (and zero): mantissa * 2^-24, a normal f32 (or 0).
    let sub = vmulq_f32(
        vcvtq_f32_u32(em),
        vdupq_n_f32(f32::from_bits((127 - 24) << 23)),
    );
    // Infinity and NaN keep their mantissa under an all-ones exponent.
    let inf_nan = vorrq_u32(shifted, vdupq_n_u32(0x7F80_0000));
    let mut bits = vbslq_u32(
        vcltq_u32(em, vdupq_n_u32(0x0400)),
        vreinterpretq_u32_f32(sub),
        normal,
    );
    bits = vbslq_u32(vcgeq_u32(em, vdupq_n_u32(0x7C00)), inf_nan, bits);
    vreinterpretq_f32_u32(vorrq_u32(bits, sign))
}

impl Load8 for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> [float32x4_t; 2] {
        let h = vld1q_u16(p as *const u16);
        [
            f16_bits_to_f32(vmovl_u16(vget_low_u16(h))),
            f16_bits_to_f32(vmovl_high_u16(h)),
        ]
    }
}

impl Load8 for bf16 {
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> [float32x4_t; 2] {
        // bf16 is the high half of an f32.
        let h = vld1q_u16(p as *const u16);
        [
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h))),
            vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h)),
        ]
    }
}

/// NF4 codes of 4 normalised values, one per u32 lane: the count of thresholds below each.
#[inline(always)]
unsafe fn nf4_codes4(v: float32x4_t, mids: &[float32x4_t; 15]) -> uint32x4_t {
    let mut c = vdupq_n_u32(0);
    for m in mids {
        // A true comparison is all ones (-1), so subtracting it counts.
        c = vsubq_u32(c, vcgtq_f32(v, *m));
    }
    c
}

/// Packs 32 codes (8 vectors of 4 lanes, in order) into 16 bytes, low nibble first.
#[inline(always)]
unsafe fn pack32(c: &[uint32x4_t; 8], out: *mut u8) {
    let h = |a: uint32x4_t, b: uint32x4_t| vcombine_u16(vmovn_u32(a), vmovn_u32(b));
    let b0 = vcombine_u8(vmovn_u16(h(c[0], c[1])), vmovn_u16(h(c[2], c[3])));
    let b1 = vcombine_u8(vmovn_u16(h(c[4], c[5])), vmovn_u16(h(c[6], c[7])));
    let even = vuzp1q_u8(b0, b1);
    let odd = vuzp2q_u8(b0, b1);
    // (odd << 4) | (even & 0x0F), i.e. `layout::pack(even, odd)`.
    vst1q_u8(out, vsliq_n_u8::<4>(even, odd));
}

/// Codes of one block: `v = x * factor`, or `x / factor` when `divide`. `bs` is a multiple of 32.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn encode_nf4_block<T: Load8>(
    p: *const T,
    bs: usize,
    factor: f32,
    divide: bool,
    out: *mut u8,
) {
    let mids = NF4_MIDPOINTS.map(|m| vdupq_n_f32(m));
    let f = vdupq_n_f32(factor);
    for i in (0..bs).step_by(32) {
        let mut c = [vdupq_n_u32(0); 8];
        for k in 0..4 {
            for (j, x) in T::load8(p.add(i + 8 * k)).into_iter().enumerate() {
                let v = if divide {
                    vdivq_f32(x, f)
                } else {
                    vmulq_f32(x, f)
                };
                c[2 * k + j] = nf4_codes4(v, &mids);
            }
        }
        pack32(&c, out.add(i / 2));
    }
}

/// NF4 quantization of blocks (see the module contract in `simd`).
///
/// # Safety
/// The CPU must have NEON.
#[target_feature(enable = "neon")]
pub unsafe fn quantize_nf4<T: Load8 + Input>(
    x: &[T],
    bs: usize,
    codes: &mut [u8],
    absmax: &mut [f32],
) -> Result<(), usize> {
    let abs_mask = vdupq_n_u32(0x7FFF_FFFF);
    let max_abs_bits = |p: *const T| {
        let mut m = vdupq_n_u32(0);
        for i in (0..bs).step_by(8) {
            for v in T::load8(p.add(i)) {
                m = vmaxq_u32(m, vandq_u32(vreinterpretq_u32_f32(v), abs_mask));
            }
        }
        vmaxvq_u32(m)
    };
    let encode = |p, factor, divide, out| encode_nf4_block(p, bs, factor, divide, out);
    super::quantize_nf4_blocks(x, bs, codes, absmax, max_abs_bits, encode)
}

/// Stores 4-bit table lookups: 32 outputs from 16 bytes of packed codes.
pub trait StoreTable: Output {
    /// The per-block state: the 16 outputs' bytes, ready for byte lookups.
    type Table: Copy;
    /// # Safety
    /// The CPU must have NEON.
    unsafe fn table(values: &[f32; 16], absmax: f32) -> Self::Table;
    /// # Safety
    /// `codes` must have 16 readable bytes and `out` room for 32 elements; CPU as above.
    unsafe fn store32(t: Self::Table, codes: *const u8, out: *mut Self);
}

/// The 16 outputs `from_f32(values[k] * absmax)`, computed as `scalar::dequantize` does.
#[inline(always)]
fn scaled_outputs<O: Output>(values: &[f32; 16], absmax: f32) -> [O; 16] {
    values.map(|v| O::from_f32(v * absmax))
}

/// 32 code indices, one per byte, in element order (0..16, 16..32), from 16 packed bytes.
#[inline(always)]
unsafe fn unpack32(codes: *const u8) -> [uint8x16_t; 2] {
    let b = vld1q_u8(codes);
    let even = vandq_u8(b, vdupq_n_u8(0x0F));
    let odd = vshrq_n_u8::<4>(b);
    [vzip1q_u8(even, odd), vzip2q_u8(even, odd)]
}

/// Byte offsets within an element of 4 (f32) or 2 (f16, bf16) bytes, repeated across a vector.
const OFFSETS4: [u8; 16] = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3];
const OFFSETS2: [u8; 16] = [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1];

impl StoreTable for f32 {
    type Table = uint8x16x4_t;

    #[inline(always)]
    unsafe fn table(values: &[f32; 16], absmax: f32) -> Self::Table {
        let t = scaled_outputs::<f32>(values, absmax);
        vld1q_u8_x4(t.as_ptr() as *const u8)
    }

    #[inline(always)]
    unsafe fn store32(t: Self::Table, codes: *const u8, out: *mut f32) {
        let offsets = vld1q_u8(OFFSETS4.as_ptr());
        let out = out as *mut u8;
        for (h, n) in unpack32(codes).into_iter().enumerate() {
            // Byte indices 4c..4c+3 of each code c: 4c repeated 4 times, plus 0..4.
            let c4 = vshlq_n_u8::<2>(n);
            let pairs = [vzip1q_u8(c4, c4), vzip2q_u8(c4, c4)];
            for (q, z) in pairs.into_iter().enumerate() {
                for (r, quad) in [vzip1q_u8(z, z), vzip2q_u8(z, z)].into_iter().enumerate() {
                    let v = vqtbl4q_u8(t, vorrq_u8(quad, offsets));
                    vst1q_u8(out.add(64 * h + 32 * q + 16 * r), v);
                }
            }
        }
    }
}

/// 32 16-bit lookups through the 32-byte table of 16 values.
#[inline(always)]
unsafe fn store32_u16(t: uint8x16x2_t, codes: *const u8, out: *mut u8) {
    let offsets = vld1q_u8(OFFSETS2.as_ptr());
    for (h, n) in unpack32(codes).into_iter().enumerate() {
        // Byte indices 2c, 2c+1 of each code c.
        let c2 = vshlq_n_u8::<1>(n);
        for (q, pair) in [vzip1q_u8(c2, c2), vzip2q_u8(c2, c2)]
            .into_iter()
            .enumerate()
        {
            let v = vqtbl2q_u8(t, vorrq_u8(pair, offsets));
            vst1q_u8(out.add(32 * h + 16 * q), v);
        }
    }
}

/// The 16-bit outputs: a 32-byte table of their bits, looked up two bytes per element.
macro_rules! store_table_16 {
    ($($t:ty),*) => {$(
        impl StoreTable for $t {
            type Table = uint8x16x2_t;

            #[inline(always)]
            unsafe fn table(values: &[f32; 16], absmax: f32) -> Self::Table {
                let t = scaled_outputs::<$t>(values, absmax);
                vld1q_u8_x2(t.as_ptr() as *const u8)
            }

            #[inline(always)]
            unsafe fn store32(t: Self::Table, codes: *const u8, out: *mut $t) {
                store32_u16(t, codes, out as *mut u8)
            }
        }
    )*};
}
store_table_16!(f16, bf16);

/// Dequantization of 4-bit blocks through a 16-entry table (see `scalar::dequantize`).
///
/// # Safety
/// The CPU must have NEON.
#[target_feature(enable = "neon")]
pub unsafe fn dequantize_4bit<O: StoreTable>(
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
