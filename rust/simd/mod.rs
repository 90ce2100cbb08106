//! Block kernels: a scalar version of each (the twin every SIMD kernel is tested against) and
//! AVX2 (x86_64) or NEON (aarch64) versions chosen at run time. Kernels see whole slices of
//! blocks; the caller in `codec` splits work across threads.
//!
//! Contract of the quantize kernels: `x` holds whole blocks of `bs` values, except perhaps a
//! shorter last one; `codes` and `absmax` are exactly as long as those values need. On a
//! non-finite value they return `Err(index)` of the first one in `x`, and the outputs are
//! unspecified.

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
