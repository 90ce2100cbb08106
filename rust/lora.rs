//! LoRA-specific products: the DoRA row norms `||W + s·B·A||` per output row, computed a
//! tile of rows at a time so a quantized W is never held whole in f32.

use crate::buffer::zeroed;
use crate::error::{Error, Result};
use crate::linalg::{matmul, MatMut, MatRef};
use crate::qmatmul::QuantizedMatrix;

/// A base weight W [out, in], dense or quantized.
pub enum Weight<'a> {
    Dense(MatRef<'a>),
    Quantized(QuantizedMatrix<'a>),
}

/// Rows per tile of a dense weight (the tile is copied, so keep it small).
const DENSE_TILE_ROWS: usize = 256;

impl Weight<'_> {
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Weight::Dense(w) => (w.rows, w.cols),
            Weight::Quantized(w) => (w.rows, w.cols),
        }
    }

    /// Checks that the weight's storage holds its shape.
    fn check(&self) -> Result<()> {
        match self {
            Weight::Dense(w) => w.check("W"),
            Weight::Quantized(w) => w.check(),
        }
    }

    fn for_each_tile(&self, mut f: impl FnMut(usize, MatRef<'_>) -> Result<()>) -> Result<()> {
        match self {
            Weight::Quantized(w) => w.for_each_tile(f),
            Weight::Dense(w) => {
                let mut r0 = 0;
                while r0 < w.rows {
                    let len = DENSE_TILE_ROWS.min(w.rows.saturating_sub(r0));
                    f(r0, w.rows(r0, len)?)?;
                    r0 = r0.saturating_add(len); // r0 + len <= rows
                }
                Ok(())
            }
        }
    }
}

/// `||W[i, :] + scale * (B @ A)[i, :]||_2` for every row i; B [out, r], A [r, in].
pub fn dora_row_norms(
    w: &Weight<'_>,
    b: MatRef<'_>,
    a: MatRef<'_>,
    scale: f32,
) -> Result<Vec<f32>> {
    let (rows, cols) = w.shape();
    if b.rows != rows || a.cols != cols || b.cols != a.rows {
        return Err(Error::InvalidArgument(format!(
            "DoRA norms: W ({rows}x{cols}), B ({}x{}), A ({}x{}) do not fit together",
            b.rows, b.cols, a.rows, a.cols
        )));
    }
    w.check()?;
    b.check("B")?;
    a.check("A")?;
    // The norm of an empty row is 0; `rows` may be large with nothing behind it (cols == 0).
    let mut norms = zeroed(rows)?;
    if cols == 0 {
        return Ok(norms);
    }
    let mut buf: Vec<f32> = Vec::new();
    w.for_each_tile(|r0, tile| {
        buf.clear();
        tile.extend_row_major(&mut buf)?;
        let mut t = MatMut::row_major(&mut buf, tile.rows, cols);
        matmul(&mut t, b.rows(r0, tile.rows)?, a, scale, true)?;
        let tile_norms = norms.iter_mut().skip(r0).take(tile.rows);
        for (norm, row) in tile_norms.zip(buf.chunks_exact(cols)) {
            *norm = row
                .iter()
                .map(|&v| (v as f64) * (v as f64))
                .sum::<f64>()
                .sqrt() as f32;
        }
        Ok(())
    })?;
    Ok(norms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codebook::Format;
    use crate::codec;

    #[test]
    fn weights_without_columns_have_zero_norms_and_impossible_outputs_are_errors() {
        let w = Weight::Dense(MatRef::row_major(&[], 5, 0));
        let norms = dora_row_norms(
            &w,
            MatRef::row_major(&[1.0; 10], 5, 2),
            MatRef::row_major(&[], 2, 0),
            1.0,
        )
        .unwrap();
        assert_eq!(norms, [0.0; 5]);
        // 2^60 rows of nothing: the output alone cannot be allocated.
        let rows = 1usize << 60;
        let w = Weight::Dense(MatRef::row_major(&[], rows, 0));
        let b = MatRef::row_major(&[], rows, 0);
        let r = dora_row_norms(&w, b, MatRef::row_major(&[], 0, 0), 1.0);
        assert!(matches!(r, Err(Error::OutOfMemory { .. })));
    }

    #[test]
    fn a_dense_weight_that_does_not_fit_its_buffer_is_an_error() {
        let data = [1.0f32; 5];
        let w = Weight::Dense(MatRef {
            data: &data,
            ..MatRef::row_major(&data, 2, 3)
        });
        let r = dora_row_norms(
            &w,
            MatRef::row_major(&[0.0; 2], 2, 1),
            MatRef::row_major(&[0.0; 3], 1, 3),
            1.0,
        );
        assert!(r.is_err());
    }

    #[test]
    fn norms_match_a_direct_computation_for_dense_and_quantized_weights() {
        let (out, inp, r) = (300, 70, 4);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) / 3.0)
            .collect();
        let b: Vec<f32> = (0..out * r).map(|i| (i % 5) as f32 * 0.1).collect();
        let a: Vec<f32> = (0..r * inp).map(|i| (i % 3) as f32 - 1.0).collect();
        let q = codec::quantize(&w, 64, Format::Nf4).unwrap();
        let mut deq = vec![0.0f32; out * inp];
        codec::dequantize_into(&q.codes, &q.absmax, 64, Format::Nf4, &mut deq).unwrap();
        let qm = QuantizedMatrix {
            codes: &q.codes,
            absmax: &q.absmax,
            rows: out,
            cols: inp,
            blocksize: 64,
            format: Format::Nf4,
        };
        for (weight, values) in [
            (Weight::Dense(MatRef::row_major(&w, out, inp)), &w),
            (Weight::Quantized(qm), &deq),
        ] {
            let got = dora_row_norms(
                &weight,
                MatRef::row_major(&b, out, r),
                MatRef::row_major(&a, r, inp),
                0.5,
            )
            .unwrap();
            for i in 0..out {
                let want: f64 = (0..inp)
                    .map(|j| {
                        let delta: f64 = (0..r)
                            .map(|k| b[i * r + k] as f64 * a[k * inp + j] as f64)
                            .sum();
                        let v = values[i * inp + j] as f64 + 0.5 * delta;
                        v * v
                    })
                    .sum::<f64>()
                    .sqrt();
                assert!(
                    (got[i] as f64 - want).abs() <= 1e-4 * want.max(1.0),
                    "row {i}: {} vs {want}",
                    got[i]
                );
            }
        }
    }
}
