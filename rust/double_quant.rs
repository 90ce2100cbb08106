//! Double quantization of the per-block scales (QLoRA §3, bitsandbytes' `compress_statistics`):
//! subtract their mean, then quantize blockwise (256 scales a block) with the dynamic 8-bit
//! map. The scales come back as `map[code] * absmax2[i / 256] + offset`.

use crate::buffer::zeroed;
use crate::codebook::Format;
use crate::codec;
use crate::error::{Error, Result};

/// Scales per nested block.
pub const NESTED_BLOCKSIZE: usize = 256;

/// Double-quantized scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Nested {
    /// One dynamic-map code per scale.
    pub codes: Vec<u8>,
    /// One f32 absmax per 256 scales.
    pub absmax2: Vec<f32>,
    /// The mean subtracted before quantizing.
    pub offset: f32,
}

/// The mean of the scales, summed in f64 and rounded once to f32.
pub fn mean(values: &[f32]) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    (values.iter().map(|&v| v as f64).sum::<f64>() / values.len() as f64) as f32
}

/// Compresses per-block scales.
pub fn quantize(absmax: &[f32]) -> Result<Nested> {
    let bad = absmax.iter().enumerate();
    if let Some((i, a)) = bad
        .into_iter()
        .find(|(_, a)| !(a.is_finite() && **a >= 0.0))
    {
        return Err(Error::InvalidArgument(format!(
            "scale {i} is {a}; scales must be finite and >= 0"
        )));
    }
    let offset = mean(absmax);
    let mut centered = zeroed(absmax.len())?;
    for (c, &a) in centered.iter_mut().zip(absmax) {
        *c = a - offset;
    }
    let q = codec::quantize(&centered, NESTED_BLOCKSIZE, Format::Dynamic8)?;
    Ok(Nested {
        codes: q.codes,
        absmax2: q.absmax,
        offset,
    })
}

/// The scales back: `map[code] * absmax2[i / 256] + offset`, two f32 roundings (no fused
/// multiply-add, as bitsandbytes computes it).
pub fn dequantize(codes: &[u8], absmax2: &[f32], offset: f32) -> Result<Vec<f32>> {
    if !offset.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "offset is {offset}; expected a finite mean of the scales"
        )));
    }
    let mut out = zeroed(codes.len())?;
    codec::dequantize_into(codes, absmax2, NESTED_BLOCKSIZE, Format::Dynamic8, &mut out)?;
    for v in &mut out {
        *v += offset;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_is_close_and_sizes_follow_the_blocks() {
        let absmax: Vec<f32> = (0..600)
            .map(|i| 0.5 + (i as f32 * 0.37).sin().abs())
            .collect();
        let n = quantize(&absmax).unwrap();
        assert_eq!((n.codes.len(), n.absmax2.len()), (600, 3));
        let back = dequantize(&n.codes, &n.absmax2, n.offset).unwrap();
        for (a, b) in absmax.iter().zip(&back) {
            // One step of the dynamic map near 1.0 is ~1.4% of absmax2.
            assert!(
                (a - b).abs() <= 0.008 * n.absmax2[0].max(n.absmax2[1]),
                "{a} vs {b}"
            );
        }
    }

    #[test]
    fn constant_scales_are_exact() {
        let n = quantize(&[0.25; 300]).unwrap();
        assert_eq!(n.offset, 0.25);
        assert!(n.codes.iter().all(|&c| c == 127));
        assert_eq!(
            dequantize(&n.codes, &n.absmax2, n.offset).unwrap(),
            vec![0.25; 300]
        );
    }

    #[test]
    fn bad_scales_are_rejected() {
        assert!(quantize(&[1.0, f32::NAN]).is_err());
        assert!(quantize(&[-1.0]).is_err());
    }

    #[test]
    fn a_non_finite_offset_is_rejected() {
        let n = quantize(&[0.5; 10]).unwrap();
        for offset in [f32::NAN, f32::INFINITY] {
            assert!(dequantize(&n.codes, &n.absmax2, offset).is_err());
        }
    }
}
