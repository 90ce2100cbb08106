//! NEON dense f32 products through the `gemm` crates: their blocked, packed driver
//! (`gemm_common::gemm::gemm_basic_generic`) with the NEON f32 microkernels, called as the
//! `gemm` facade calls them. (The x86 products run nybble's own tiles, `simd::gemm`.)

use gemm_common::gemm::gemm_basic_generic;
use gemm_common::simd::{MixedSimd, Scalar};
use gemm_common::Parallelism;
use gemm_f32::microkernel::neon::f32 as uk;

use super::gemm::Strided;

/// Lanes of the NEON kernels' vectors.
const LANES: usize = 4;

/// `dst = alpha * lhs @ rhs`, or `dst += alpha * lhs @ rhs` when `accumulate` (see
/// `simd::gemm::gemm`); returns `false`, having done nothing, where the CPU lacks NEON.
///
/// # Safety
/// As `simd::gemm::gemm`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: Strided<*mut f32>,
    lhs: Strided<*const f32>,
    rhs: Strided<*const f32>,
    alpha: f32,
    accumulate: bool,
    threads: usize,
) -> bool {
    let Some(simd) = <Scalar as MixedSimd<f32, f32, f32, f32>>::try_new() else {
        return false;
    };
    if !std::arch::is_aarch64_feature_detected!("neon") {
        return false;
    }
    // As the facade does: the kernels prefer a column-major destination, so a row-major
    // product is computed as its transpose (dst^T = rhs^T @ lhs^T) ...
    let (m, n, mut dst, mut lhs, mut rhs) = if dst.col_stride.abs() < dst.row_stride.abs() {
        (n, m, dst.t(), rhs.t(), lhs.t())
    } else {
        (m, n, dst, lhs, rhs)
    };
    // ... and negative strides are walked from the other end.
    if dst.row_stride < 0 && m > 0 {
        dst.ptr = dst.ptr.wrapping_offset((m - 1) as isize * dst.row_stride);
        dst.row_stride = -dst.row_stride;
        lhs.ptr = lhs.ptr.wrapping_offset((m - 1) as isize * lhs.row_stride);
        lhs.row_stride = -lhs.row_stride;
    }
    if dst.col_stride < 0 && n > 0 {
        dst.ptr = dst.ptr.wrapping_offset((n - 1) as isize * dst.col_stride);
        dst.col_stride = -dst.col_stride;
        rhs.ptr = rhs.ptr.wrapping_offset((n - 1) as isize * rhs.col_stride);
        rhs.col_stride = -rhs.col_stride;
    }
    if lhs.col_stride < 0 && k > 0 {
        lhs.ptr = lhs.ptr.wrapping_offset((k - 1) as isize * lhs.col_stride);
        lhs.col_stride = -lhs.col_stride;
        rhs.ptr = rhs.ptr.wrapping_offset((k - 1) as isize * rhs.row_stride);
        rhs.row_stride = -rhs.row_stride;
    }
    let parallelism = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    gemm_basic_generic::<
        _,
        f32,
        LANES,
        { uk::MR_DIV_N * LANES },
        { uk::NR },
        { uk::MR_DIV_N },
        { uk::H_M },
        { uk::H_N },
    >(
        simd,
        m,
        n,
        k,
        dst.ptr,
        dst.col_stride,
        dst.row_stride,
        accumulate,
        lhs.ptr,
        lhs.col_stride,
        lhs.row_stride,
        rhs.ptr,
        rhs.col_stride,
        rhs.row_stride,
        1.0, // dst's factor, read only when accumulating
        alpha,
        false,
        false,
        false,
        |a, b, c| a * b + c,
        &uk::UKR,
        &uk::H_UKR,
        false,
        parallelism,
    );
    true
}
