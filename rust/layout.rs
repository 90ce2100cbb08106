//! Where codes sit in memory: the nibble order of packed 4-bit codes, blocksize rules,
//! and the 36-byte GPU block layout.

use crate::buffer::zeroed;
use crate::error::{check_len, checked_mul, Error, Result};

/// Packs two 4-bit codes into one byte: element 2k in the low nibble, 2k+1 in the high one.
#[inline(always)]
pub fn pack(even: u8, odd: u8) -> u8 {
    even | (odd << 4)
}

/// The code of element `i` in a packed buffer. For the kernels, whose callers checked that
/// `codes` holds `ceil(n / 2)` bytes for their `n` elements (`i < n`).
#[inline(always)]
#[allow(clippy::indexing_slicing, clippy::arithmetic_side_effects)]
pub fn code_at(codes: &[u8], i: usize) -> u8 {
    (codes[i / 2] >> ((i % 2) * 4)) & 0x0F
}

/// bitsandbytes packs element 2k in the *high* nibble; converting either way swaps nibbles.
pub fn swap_nibbles(codes: &[u8]) -> Vec<u8> {
    codes.iter().map(|b| b.rotate_left(4)).collect()
}

pub const MIN_BLOCKSIZE: usize = 32;
pub const MAX_BLOCKSIZE: usize = 4096;

/// A quantization block size must be a power of two from 32 to 4096.
pub fn check_blocksize(blocksize: usize) -> Result<()> {
    if blocksize.is_power_of_two() && (MIN_BLOCKSIZE..=MAX_BLOCKSIZE).contains(&blocksize) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "blocksize must be a power of two from {MIN_BLOCKSIZE} to {MAX_BLOCKSIZE}, got {blocksize}"
        )))
    }
}

/// Number of blocks covering `n` elements (the last one may be partial).
pub fn block_count(n: usize, blocksize: usize) -> usize {
    n.div_ceil(blocksize)
}

/// The block size of the 36-byte layout.
pub const BLOCK36_VALUES: usize = 64;

/// One block of the GPU layout: the f32 absmax (little-endian) then 32 bytes of packed codes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Block36 {
    pub absmax_le: [u8; 4],
    pub codes: [u8; BLOCK36_VALUES / 2],
}
const _: () = assert!(std::mem::size_of::<Block36>() == 36);
const _: () = assert!(std::mem::align_of::<Block36>() == 1);
pub const BLOCK36_BYTES: usize = std::mem::size_of::<Block36>();

/// Interleaves split codes and scales (blocksize 64) into `nblocks * 36` bytes. The codes of
/// a partial last block are padded with `pad_code` so every block is whole.
pub fn to_blocks36(codes: &[u8], absmax: &[f32], n: usize, pad_code: u8) -> Result<Vec<u8>> {
    let nblocks = block_count(n, BLOCK36_VALUES);
    check_len("number of scales", nblocks, absmax.len())?;
    check_len("bytes of codes", n.div_ceil(2), codes.len())?;
    let mut out = zeroed(checked_mul(
        "bytes of 36-byte blocks",
        nblocks,
        BLOCK36_BYTES,
    )?)?;
    let pad = pack(pad_code, pad_code);
    // `codes` has `ceil(n / 2)` bytes, so its chunks of 32 are exactly the `nblocks` blocks.
    let blocks = out.chunks_exact_mut(BLOCK36_BYTES).zip(absmax);
    for ((block, a), src) in blocks.zip(codes.chunks(BLOCK36_VALUES / 2)) {
        // A 36-byte chunk: 4 bytes of scale, then 32 of codes, `src` has 1 to 32 of them.
        let (scale, packed) = block.split_at_mut(4);
        scale.copy_from_slice(&a.to_le_bytes());
        let (filled, padding) = packed.split_at_mut(src.len());
        filled.copy_from_slice(src);
        padding.fill(pad);
    }
    if n % 2 == 1 {
        // The odd element's partner nibble (the high one of the last code byte) is padding.
        let last_block = out.chunks_exact_mut(BLOCK36_BYTES).last();
        let packed = last_block.and_then(|block| block.get_mut(4..));
        if let Some(byte) = packed.and_then(|p| p.get_mut((n / 2) % (BLOCK36_VALUES / 2))) {
            *byte = pack(*byte & 0x0F, pad_code);
        }
    }
    Ok(out)
}

/// Splits `nblocks * 36` bytes back into codes (`ceil(n/2)` bytes) and scales.
pub fn from_blocks36(buf: &[u8], n: usize) -> Result<(Vec<u8>, Vec<f32>)> {
    let nblocks = block_count(n, BLOCK36_VALUES);
    check_len(
        "length of the 36-byte block buffer",
        checked_mul("bytes of 36-byte blocks", nblocks, BLOCK36_BYTES)?,
        buf.len(),
    )?;
    let mut codes = zeroed(n.div_ceil(2))?;
    let mut absmax = zeroed(nblocks)?;
    // `codes` has `ceil(n / 2)` bytes: its chunks of 32 are the blocks' codes, the last one
    // perhaps shorter (the padding stays behind).
    let blocks = buf.chunks_exact(BLOCK36_BYTES).zip(absmax.iter_mut());
    for (i, ((block, a), dst)) in blocks.zip(codes.chunks_mut(BLOCK36_VALUES / 2)).enumerate() {
        // A 36-byte chunk: 4 bytes of scale, then 32 of codes (at least `dst.len()`).
        let (scale, packed) = block.split_at(4);
        let (Ok(scale), Some(packed)) = (scale.try_into(), packed.get(..dst.len())) else {
            return Err(Error::InvalidArgument(format!("block {i} is short")));
        };
        *a = f32::from_le_bytes(scale);
        // Finite, of either sign: the layout stores scales as they are, and the decoded
        // scale of a double-quantized all-zero block can fall a hair below zero.
        if !a.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "block {i} of the 36-byte buffer has absmax {a}; expected a finite value"
            )));
        }
        dst.copy_from_slice(packed);
    }
    Ok((codes, absmax))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks36_sizes_that_overflow_are_errors() {
        for n in [usize::MAX, 1 << 63, usize::MAX / 2] {
            assert!(from_blocks36(&[0u8; 36], n).is_err(), "{n}");
            assert!(to_blocks36(&[0u8; 32], &[1.0], n, 7).is_err(), "{n}");
        }
    }

    #[test]
    fn blocks36_rejects_non_finite_scales_and_keeps_negative_ones() {
        let mut buf = [0u8; 36];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            buf[..4].copy_from_slice(&bad.to_le_bytes());
            assert!(matches!(
                from_blocks36(&buf, 64),
                Err(Error::InvalidArgument(_))
            ));
        }
        buf[..4].copy_from_slice(&(-1e-9f32).to_le_bytes());
        assert_eq!(from_blocks36(&buf, 64).map(|(_, a)| a), Ok(vec![-1e-9]));
    }

    #[test]
    fn nibble_order_is_low_first() {
        let b = pack(0x3, 0xA);
        assert_eq!(b, 0xA3);
        assert_eq!(code_at(&[b], 0), 0x3);
        assert_eq!(code_at(&[b], 1), 0xA);
        assert_eq!(swap_nibbles(&[b]), vec![0x3A]);
    }

    #[test]
    fn blocks36_round_trip_with_partial_block() {
        for n in [0usize, 1, 63, 64, 65, 127, 200] {
            let codes: Vec<u8> = (0..n.div_ceil(2)).map(|i| (i * 37 % 256) as u8).collect();
            let mut codes = codes;
            if n % 2 == 1 {
                *codes.last_mut().unwrap() = pack(codes[codes.len() - 1] & 0x0F, 7);
            }
            let absmax: Vec<f32> = (0..block_count(n, 64)).map(|i| i as f32 * 0.5).collect();
            let buf = to_blocks36(&codes, &absmax, n, 7).unwrap();
            assert_eq!(buf.len(), block_count(n, 64) * 36);
            let (c2, a2) = from_blocks36(&buf, n).unwrap();
            assert_eq!((c2, a2), (codes, absmax));
        }
    }

    #[test]
    fn blocks36_rejects_wrong_length() {
        assert!(matches!(
            from_blocks36(&[0u8; 35], 64),
            Err(Error::SizeMismatch {
                expected: 36,
                got: 35,
                ..
            })
        ));
    }
}
