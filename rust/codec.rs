//! Blockwise quantization and dequantization of whole tensors (flat, row-major): argument
//! checks, the split of the work across threads, and the choice of kernel.

use rayon::prelude::*;

use crate::buffer::zeroed;
use crate::codebook::Format;
use crate::error::{check_len, Error, Result};
use crate::layout::{block_count, check_blocksize};
use crate::simd::{self, scalar, SimdInput, SimdOutput};

/// Codes and per-block scales of a quantized tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    /// 4-bit formats: `ceil(n/2)` bytes, low nibble first; int8: `n` bytes.
    pub codes: Vec<u8>,
    /// One f32 absmax per block.
    pub absmax: Vec<f32>,
}

/// Elements per parallel task: a multiple of every block size, large enough to amortise
/// the scheduling, small enough to balance two to a few dozen cores.
const TASK_ELEMENTS: usize = 1 << 16;
/// Below this many elements one thread does the whole job.
const PARALLEL_MIN: usize = 1 << 18;

/// Blocks per parallel task, for a blocksize that `check_blocksize` accepted (a power of two
/// that divides `TASK_ELEMENTS`).
fn scales_per_task(blocksize: usize) -> usize {
    TASK_ELEMENTS.checked_div(blocksize).unwrap_or(1)
}

/// Quantizes `x` into freshly allocated codes and scales.
pub fn quantize<T: SimdInput>(x: &[T], blocksize: usize, format: Format) -> Result<Quantized> {
    check_blocksize(blocksize)?;
    let mut q = Quantized {
        codes: zeroed(format.code_bytes(x.len()))?,
        absmax: zeroed(block_count(x.len(), blocksize))?,
    };
    quantize_into(x, blocksize, format, &mut q.codes, &mut q.absmax)?;
    Ok(q)
}

/// Quantizes `x` into `codes` (`format.code_bytes(n)` bytes) and `absmax` (one per block).
/// On error (a non-finite input) the outputs hold garbage.
pub fn quantize_into<T: SimdInput>(
    x: &[T],
    blocksize: usize,
    format: Format,
    codes: &mut [u8],
    absmax: &mut [f32],
) -> Result<()> {
    check_blocksize(blocksize)?;
    check_len("bytes of codes", format.code_bytes(x.len()), codes.len())?;
    check_len(
        "number of scales",
        block_count(x.len(), blocksize),
        absmax.len(),
    )?;
    let scales_per_task = scales_per_task(blocksize);
    let level = simd::level();
    let kernel = |x: &[T], c: &mut [u8], a: &mut [f32]| match format {
        Format::Nf4 => simd::quantize_nf4(level, x, blocksize, c, a),
        _ => scalar::quantize(format, x, blocksize, c, a),
    };
    let bad = if x.len() < PARALLEL_MIN {
        kernel(x, codes, absmax).err()
    } else {
        // Each task reports its first bad index; the smallest overall is the first one (an
        // index into `x`, so the saturating arithmetic never saturates).
        x.par_chunks(TASK_ELEMENTS)
            .zip(codes.par_chunks_mut(format.code_bytes(TASK_ELEMENTS)))
            .zip(absmax.par_chunks_mut(scales_per_task))
            .enumerate()
            .filter_map(|(t, ((x, c), a))| {
                let task_start = t.saturating_mul(TASK_ELEMENTS);
                kernel(x, c, a).err().map(|i| task_start.saturating_add(i))
            })
            .min()
    };
    match bad {
        Some(index) => Err(Error::NonFinite { index }),
        None => Ok(()),
    }
}

/// Dequantizes into `out` (its length is the element count):
/// `out[i] = value(code[i]) * absmax[i / blocksize]`, in f32, rounded to `O`.
pub fn dequantize_into<O: SimdOutput>(
    codes: &[u8],
    absmax: &[f32],
    blocksize: usize,
    format: Format,
    out: &mut [O],
) -> Result<()> {
    dequantize_into_with(codes, absmax, blocksize, format, out, true)
}

/// `dequantize_into`, on rayon's threads when `parallel` (and `out` is large), else on this
/// one (for callers that already run one task per thread).
pub fn dequantize_into_with<O: SimdOutput>(
    codes: &[u8],
    absmax: &[f32],
    blocksize: usize,
    format: Format,
    out: &mut [O],
    parallel: bool,
) -> Result<()> {
    check_blocksize(blocksize)?;
    let n = out.len();
    check_len("bytes of codes", format.code_bytes(n), codes.len())?;
    check_len("number of scales", block_count(n, blocksize), absmax.len())?;
    let scales_per_task = scales_per_task(blocksize);
    let level = simd::level();
    let kernel = |c: &[u8], a: &[f32], o: &mut [O]| match format.bits() {
        4 => simd::dequantize_4bit(level, format, c, a, blocksize, o),
        _ => scalar::dequantize(format, c, a, blocksize, o),
    };
    if n < PARALLEL_MIN || !parallel {
        kernel(codes, absmax, out);
    } else {
        out.par_chunks_mut(TASK_ELEMENTS)
            .zip(codes.par_chunks(format.code_bytes(TASK_ELEMENTS)))
            .zip(absmax.par_chunks(scales_per_task))
            .for_each(|((o, c), a)| kernel(c, a, o));
    }
    Ok(())
}
