//! The portable kernels: the plain statement of each block operation, and the twin that
//! the SIMD kernels must match bit for bit.

use crate::codebook::Format;
use crate::element::{Input, Output};
use crate::layout::{code_at, pack};

/// How a block's values are normalised to `[-1, 1]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scale {
    /// absmax is 0: every value is (±)0 and takes the zero code.
    Zero,
    /// `v = x * (1/absmax)` with the reciprocal in f32, as bitsandbytes does.
    Multiply(f32),
    /// `1/absmax` overflows (absmax < 2^-128): `v = x / absmax`, so tiny blocks keep their
    /// information instead of turning into NaN.
    Divide(f32),
}

impl Scale {
    pub fn of(absmax: f32) -> Scale {
        if absmax == 0.0 {
            return Scale::Zero;
        }
        let inv = 1.0 / absmax;
        if inv.is_finite() {
            Scale::Multiply(inv)
        } else {
            Scale::Divide(absmax)
        }
    }
}

/// The bits of `|x|` as an integer: ordered like `|x|` for finite values, and at least
/// `0x7F80_0000` exactly for NaN and ±inf.
#[inline(always)]
pub fn abs_bits(x: f32) -> u32 {
    x.to_bits() & 0x7FFF_FFFF
}
pub const NON_FINITE_BITS: u32 = 0x7F80_0000;

/// Index of the first non-finite value (after conversion to f32), if any.
pub fn first_non_finite<T: Input>(x: &[T]) -> Option<usize> {
    x.iter().position(|v| !v.to_f32().is_finite())
}

/// The index to report for a block whose scan saw a non-finite value: the first one a second
/// scan finds, or the block's start when there is none any more (another thread wrote the
/// input while it was read, which Python allows while the GIL is released).
pub fn non_finite_in<T: Input>(block: &[T]) -> usize {
    first_non_finite(block).unwrap_or(0)
}

/// `max |x|` of a block, or `Err(index)` of its first non-finite value.
#[inline]
pub fn block_absmax<T: Input>(x: &[T]) -> Result<f32, usize> {
    let bits = x.iter().fold(0u32, |m, v| m.max(abs_bits(v.to_f32())));
    if bits >= NON_FINITE_BITS {
        return Err(non_finite_in(x));
    }
    Ok(f32::from_bits(bits))
}

/// Quantizes blocks of `bs` values (the last may be shorter) to `format`.
pub fn quantize<T: Input>(
    format: Format,
    x: &[T],
    bs: usize,
    codes: &mut [u8],
    absmax: &mut [f32],
) -> Result<(), usize> {
    for (b, (xb, am)) in x.chunks(bs).zip(absmax.iter_mut()).enumerate() {
        let start = b * bs;
        *am = block_absmax(xb).map_err(|i| start + i)?;
        let scale = Scale::of(*am);
        let code = |v: T| {
            let v = v.to_f32();
            match scale {
                Scale::Zero => format.zero_code(),
                Scale::Multiply(inv) => format.code(v * inv),
                Scale::Divide(a) => format.code(v / a),
            }
        };
        if format.bits() == 4 {
            // `start` is even (bs is), so this block owns whole bytes.
            let out = &mut codes[start / 2..(start + xb.len()).div_ceil(2)];
            for (byte, pair) in out.iter_mut().zip(xb.chunks(2)) {
                let odd = pair.get(1).map_or(format.zero_code(), |&v| code(v));
                *byte = pack(code(pair[0]), odd);
            }
        } else {
            for (c, &v) in codes[start..start + xb.len()].iter_mut().zip(xb) {
                *c = code(v);
            }
        }
    }
    Ok(())
}

/// Dequantizes blocks: `out = value(code) * absmax` in f32, rounded to the output type.
pub fn dequantize<O: Output>(
    format: Format,
    codes: &[u8],
    absmax: &[f32],
    bs: usize,
    out: &mut [O],
) {
    let values = format.values();
    for (b, (ob, &a)) in out.chunks_mut(bs).zip(absmax).enumerate() {
        let start = b * bs;
        for (i, o) in ob.iter_mut().enumerate() {
            let code = if format.bits() == 4 {
                code_at(codes, start + i)
            } else {
                codes[start + i]
            };
            *o = O::from_f32(values[code as usize] * a);
        }
    }
}

/// The dense products' register tile in plain Rust (see `gemm::Tile`), the twin the SIMD
/// tiles match bit for bit: each output is a chain of fused multiply-adds over the panel's
/// depth from zero, then `alpha * acc` or `alpha * acc + c` (fused).
pub struct ScalarTile;

impl super::gemm::Tile for ScalarTile {
    const MR: usize = 4;
    const NR: usize = 4;

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
        // `mul_add` is one instruction where FMA is enabled, a (correctly rounded, slow)
        // library call where it is not: x86-64 CPUs with FMA get the former.
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("fma") {
            return tile_fma::<ROW_MAJOR_A>(kc, a, lda, b, ldb, c, rs, mr, nr, alpha, overwrite);
        }
        tile_4x4::<ROW_MAJOR_A>(kc, a, lda, b, ldb, c, rs, mr, nr, alpha, overwrite)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_fma<const ROW_MAJOR_A: bool>(
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
    tile_4x4::<ROW_MAJOR_A>(kc, a, lda, b, ldb, c, rs, mr, nr, alpha, overwrite)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_4x4<const ROW_MAJOR_A: bool>(
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
    let mut acc = [[0.0f32; 4]; 4];
    for kk in 0..kc as isize {
        for (i, row) in acc.iter_mut().enumerate() {
            let i = i as isize;
            let ai = if ROW_MAJOR_A {
                *a.offset(i * lda + kk)
            } else {
                *a.offset(kk * lda + i)
            };
            for (j, v) in row.iter_mut().enumerate() {
                *v = ai.mul_add(*b.offset(kk * ldb + j as isize), *v);
            }
        }
    }
    super::gemm::scatter_tile(
        4,
        acc.as_ptr() as *const f32,
        c,
        rs,
        1,
        mr,
        nr,
        alpha,
        overwrite,
    )
}
