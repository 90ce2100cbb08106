//! Block kernels: a scalar version of each (the twin every SIMD kernel is tested against) and
//! AVX2 (x86_64) or NEON (aarch64) versions chosen at run time. Kernels see whole slices of
//! blocks; the caller in `codec` splits work across threads. The dense f32 products (`gemm`)
//! choose among AVX-512, AVX2, NEON and scalar kernels the same way.
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
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod gemm;
#[cfg(target_arch = "aarch64")]
mod gemm_neon;
#[cfg(target_arch = "aarch64")]
pub mod neon;
pub mod scalar;

/// The instruction sets the kernels can use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512F on top of AVX2 + FMA + F16C. Only the dense products have kernels of their
    /// own for it; the codec's kernels are memory-bound and run their AVX2 versions.
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Neon => "neon",
        }
    }

    fn parse(name: &str) -> Option<Level> {
        [Level::Scalar, Level::Avx2, Level::Avx512, Level::Neon]
            .into_iter()
            .find(|l| name.trim().eq_ignore_ascii_case(l.name()))
    }
}

/// The widest instruction set this CPU has, capped by `NYBBLE_CPU_ISA` (`avx512`, `avx2`,
/// `neon` or `scalar`; read once): a level the CPU has and at most its own is taken as
/// asked, anything else (unset, unknown, a level this CPU lacks) leaves the CPU's own. So
/// `NYBBLE_CPU_ISA=avx2` runs the AVX2 kernels on an AVX-512 machine, to compare the two.
fn cpu_level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let asked = std::env::var("NYBBLE_CPU_ISA").ok();
        capped(detect_wide(), asked.as_deref().and_then(Level::parse))
    })
}

/// `detected`, or `asked` when it is one of the levels below it on the same CPU.
fn capped(detected: Level, asked: Option<Level>) -> Level {
    match (detected, asked) {
        (_, Some(Level::Scalar)) => Level::Scalar,
        (Level::Avx512, Some(Level::Avx2)) => Level::Avx2,
        _ => detected,
    }
}

/// The level of the block kernels (the codec), decided once: `cpu_level()`, with AVX-512
/// running the AVX2 kernels. `NYBBLE_SIMD=scalar` forces the scalar kernels here alone (for
/// comparisons and benchmarks of the codec).
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        if std::env::var("NYBBLE_SIMD").is_ok_and(|v| v == "scalar") {
            return Level::Scalar;
        }
        match cpu_level() {
            Level::Avx512 => Level::Avx2,
            l => l,
        }
    })
}

/// The level of the dense f32 products (`gemm`), decided once: `cpu_level()`.
pub fn matmul_level() -> Level {
    cpu_level()
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

/// `detect()`, widened to AVX-512 where the CPU has AVX-512F besides AVX2.
fn detect_wide() -> Level {
    #[cfg(target_arch = "x86_64")]
    if detect() == Level::Avx2 && is_x86_feature_detected!("avx512f") {
        return Level::Avx512;
    }
    detect()
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
    assert!(bs.is_multiple_of(32) && codes.len() >= full * bs / 2 && absmax.len() >= full);
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
    assert!(bs.is_multiple_of(32) && codes.len() >= full * bs / 2 && absmax.len() >= full);
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
        // SAFETY: `Level::Avx2` and `Level::Avx512` are only chosen when the CPU has AVX2,
        // FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => unsafe { avx2::quantize_nf4(x, bs, codes, absmax) },
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
        Level::Avx2 | Level::Avx512 => unsafe {
            avx2::dequantize_4bit(format, codes, absmax, bs, out)
        },
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        Level::Neon => unsafe { neon::dequantize_4bit(format, codes, absmax, bs, out) },
        _ => scalar::dequantize(format, codes, absmax, bs, out),
    }
}

#[cfg(test)]
mod tests;
