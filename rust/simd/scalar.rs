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
