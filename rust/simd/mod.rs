//! Block kernels: a scalar version of each (the twin every SIMD kernel is tested against) and
//! AVX2 (x86_64) or NEON (aarch64) versions chosen at run time. Kernels see whole slices of
//! blocks; the caller in `codec` splits work across threads.
//!
//! Contract of the quantize kernels: `x` holds whole blocks of `bs` values, except perhaps a
//! shorter last one; `codes` and `absmax` are exactly as long as those values need. On a
//! non-finite value they return `Err(index)` of the first one in `x`, and the outputs are
//! unspecified.

// The kernels index and compute offsets freely (see `lib.rs`): `codec` has checked that the
// slices hold exactly what their element count needs and that the blocksize is a power of
// two from 32 to 4096, so every index stays below a slice length.
#![allow(clippy::indexing_slicing, clippy::arithmetic_side_effects)]

use std::sync::OnceLock;

use crate::element::{Input, Output};

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "aarch64")]
pub mod neon;
pub mod scalar;

/// The instruction sets the kernels can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Neon => "neon",
        }
    }
}

/// The best level this CPU supports, decided once. `NYBBLE_SIMD=scalar` forces the scalar
/// kernels (for comparisons and benchmarks).
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        if std::env::var("NYBBLE_SIMD").is_ok_and(|v| v == "scalar") {
            return Level::Scalar;
        }
        detect()
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        Level::Avx2
    } else {
        Level::Scalar
    }
}

#[cfg(target_arch = "aarch64")]
fn detect() -> Level {
    if std::arch::is_aarch64_feature_detected!("neon") {
        Level::Neon
    } else {
        Level::Scalar
    }
}

// Other architectures have no SIMD kernels of their own: they run the portable ones.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn detect() -> Level {
    Level::Scalar
}

/// Input element types the SIMD kernels can load.
#[cfg(target_arch = "x86_64")]
pub trait SimdInput: Input + avx2::Load8 {}
#[cfg(target_arch = "x86_64")]
impl<T: Input + avx2::Load8> SimdInput for T {}
#[cfg(target_arch = "aarch64")]
pub trait SimdInput: Input + neon::Load8 {}
#[cfg(target_arch = "aarch64")]
impl<T: Input + neon::Load8> SimdInput for T {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub trait SimdInput: Input {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
impl<T: Input> SimdInput for T {}

/// Output element types the SIMD kernels can store.
#[cfg(target_arch = "x86_64")]
pub trait SimdOutput: Output + avx2::StoreTable {}
#[cfg(target_arch = "x86_64")]
impl<T: Output + avx2::StoreTable> SimdOutput for T {}
#[cfg(target_arch = "aarch64")]
pub trait SimdOutput: Output + neon::StoreTable {}
#[cfg(target_arch = "aarch64")]
impl<T: Output + neon::StoreTable> SimdOutput for T {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub trait SimdOutput: Output {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
impl<T: Output> SimdOutput for T {}

/// The block loop of the SIMD NF4 quantizers, so that they differ only in vector code:
/// `max_abs_bits(p)` is the largest `abs_bits` of the whole block at `p`, and
/// `encode(p, factor, divide, out)` writes its `bs / 2` code bytes (`x * factor`, or
/// `x / factor` when `divide`). The partial last block goes to the scalar kernel.
///
/// # Safety
/// The two functions must be safe to call on every whole block of `x`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn quantize_nf4_blocks<T: Input>(
    x: &[T],
    bs: usize,
    codes: &mut [u8],
    absmax: &mut [f32],
    max_abs_bits: impl Fn(*const T) -> u32,
    encode: impl Fn(*const T, f32, bool, *mut u8),
) -> Result<(), usize> {
    use crate::codebook::{Format, NF4_ZERO_CODE};
    use crate::layout::pack;
    use scalar::{Scale, NON_FINITE_BITS};

    let full = x.len() / bs;
    // Guards the raw pointers below (soundness, not error handling): `codec` has checked
    // these lengths and the blocksize before any kernel runs, so it cannot fire from Python.
    assert!(bs % 32 == 0 && codes.len() >= full * bs / 2 && absmax.len() >= full);
    for b in 0..full {
        let p = x.as_ptr().add(b * bs);
        let bits = max_abs_bits(p);
        if bits >= NON_FINITE_BITS {
            let block = &x[b * bs..(b + 1) * bs];
            return Err(b * bs + scalar::non_finite_in(block));
        }
        absmax[b] = f32::from_bits(bits);
        let out = codes.as_mut_ptr().add(b * bs / 2);
        match Scale::of(absmax[b]) {
            Scale::Zero => std::ptr::write_bytes(out, pack(NF4_ZERO_CODE, NF4_ZERO_CODE), bs / 2),
            Scale::Multiply(inv) => encode(p, inv, false, out),
            Scale::Divide(a) => encode(p, a, true, out),
        }
    }
    let done = full * bs;
    scalar::quantize(
        Format::Nf4,
        &x[done..],
        bs,
        &mut codes[done / 2..],
        &mut absmax[full..],
    )
    .map_err(|i| done + i)
}

/// The block loop of the SIMD 4-bit dequantizers: per whole block, `table(values, absmax)`
/// prepares the scaled codebook and `store32(table, codes, out)` writes 32 outputs from 16
/// code bytes. The partial last block goes to the scalar kernel.
///
/// # Safety
/// The two functions must be safe to call on every whole block of `out`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
unsafe fn dequantize_4bit_blocks<O: Output, Table: Copy>(
    format: crate::codebook::Format,
    codes: &[u8],
    absmax: &[f32],
    bs: usize,
    out: &mut [O],
    table: impl Fn(&[f32; 16], f32) -> Table,
    store32: impl Fn(Table, *const u8, *mut O),
) {
    let Some(values) = format.table16() else {
        // Not a 4-bit format: the caller chose the wrong kernel; the scalar one serves all.
        return scalar::dequantize(format, codes, absmax, bs, out);
    };
    let full = out.len() / bs;
    // As in `quantize_nf4_blocks`: checked by `codec` first.
    assert!(bs % 32 == 0 && codes.len() >= full * bs / 2 && absmax.len() >= full);
    for (b, &a) in absmax.iter().enumerate().take(full) {
        let t = table(values, a);
        for i in (0..bs).step_by(32) {
            let e = b * bs + i;
            store32(t, codes.as_ptr().add(e / 2), out.as_mut_ptr().add(e));
        }
    }
    let done = full * bs;
    scalar::dequantize(
        format,
        &codes[done / 2..],
        &absmax[full..],
        bs,
        &mut out[done..],
    );
}

/// NF4-quantizes blocks at `level`.
pub fn quantize_nf4<T: SimdInput>(
    level: Level,
    x: &[T],
    bs: usize,
    codes: &mut [u8],
    absmax: &mut [f32],
) -> Result<(), usize> {
    match level {
        // SAFETY: `Level::Avx2` is only chosen when the CPU has AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { avx2::quantize_nf4(x, bs, codes, absmax) },
        // SAFETY: `Level::Neon` is only chosen when the CPU has NEON.
        #[cfg(target_arch = "aarch64")]
        Level::Neon => unsafe { neon::quantize_nf4(x, bs, codes, absmax) },
        _ => scalar::quantize(crate::codebook::Format::Nf4, x, bs, codes, absmax),
    }
}

/// Dequantizes blocks of a 4-bit format at `level`.
pub fn dequantize_4bit<O: SimdOutput>(
    level: Level,
    format: crate::codebook::Format,
    codes: &[u8],
    absmax: &[f32],
    bs: usize,
    out: &mut [O],
) {
    match level {
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { avx2::dequantize_4bit(format, codes, absmax, bs, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Level::Neon => unsafe { neon::dequantize_4bit(format, codes, absmax, bs, out) },
        _ => scalar::dequantize(format, codes, absmax, bs, out),
    }
}

#[cfg(test)]
mod tests;
