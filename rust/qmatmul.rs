//! Products with a quantized weight W [rows, cols] (row-major, e.g. an NF4 base weight
//! [out, in]) that never hold all of W in f32: a few rows are dequantized into a small tile
//! at a time and multiplied through `linalg::matmul`.

use crate::codebook::Format;
use crate::codec;
use crate::error::{check_len, Error, Result};
use crate::layout::{block_count, check_blocksize};
use crate::linalg::{matmul, MatMut, MatRef};

/// A quantized row-major matrix.
#[derive(Clone, Copy, Debug)]
pub struct QuantizedMatrix<'a> {
    pub codes: &'a [u8],
    pub absmax: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub blocksize: usize,
    pub format: Format,
}

/// The most f32 elements a tile holds (4 MiB) ...
const TILE_MAX_ELEMENTS: usize = 1 << 20;
/// ... and at most this fraction of the weight, so the extra memory stays small.
const TILE_MAX_FRACTION: usize = 8;

impl QuantizedMatrix<'_> {
    fn check(&self) -> Result<()> {
        check_blocksize(self.blocksize)?;
        let n = self.rows * self.cols;
        check_len(
            "bytes of codes",
            self.format.code_bytes(n),
            self.codes.len(),
        )?;
        check_len(
            "number of scales",
            block_count(n, self.blocksize),
            self.absmax.len(),
        )
    }

    /// Rows per tile: a multiple of `align` (so every tile starts on a block boundary) near
    /// `min(TILE_MAX_ELEMENTS, size / TILE_MAX_FRACTION)` elements.
    fn tile_rows(&self) -> usize {
        let align = self.blocksize / gcd(self.cols.max(1), self.blocksize);
        let target = TILE_MAX_ELEMENTS.min(self.rows * self.cols / TILE_MAX_FRACTION);
        let rows = (target / self.cols.max(1)) / align * align;
        rows.max(align).min(self.rows.max(1))
    }

    /// Dequantizes rows `r0..r0+len` into `tile` (row-major, `len * cols` elements).
    fn dequantize_rows(&self, r0: usize, len: usize, tile: &mut [f32]) -> Result<()> {
        let (start, count) = (r0 * self.cols, len * self.cols);
        let codes = match self.format.bits() {
            4 => &self.codes[start / 2..(start + count).div_ceil(2)],
            _ => &self.codes[start..start + count],
        };
        let scales = &self.absmax[start / self.blocksize..(start + count).div_ceil(self.blocksize)];
        codec::dequantize_into(
            codes,
            scales,
            self.blocksize,
            self.format,
            &mut tile[..count],
        )
    }

    /// Calls `f(first_row, tile_view)` for each tile of rows, in order.
    pub fn for_each_tile(&self, mut f: impl FnMut(usize, MatRef<'_>) -> Result<()>) -> Result<()> {
        self.check()?;
        let step = self.tile_rows();
        let mut tile = vec![0.0f32; step * self.cols];
        let mut r0 = 0;
        while r0 < self.rows {
            let len = step.min(self.rows - r0);
            self.dequantize_rows(r0, len, &mut tile)?;
            f(
                r0,
                MatRef::row_major(&tile[..len * self.cols], len, self.cols),
            )?;
            r0 += len;
        }
        Ok(())
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `y = alpha * x @ W^T` (`+= ...` when `accumulate`); x [m, cols], y [m, rows].
pub fn matmul_wt(
    y: &mut MatMut<'_>,
    x: MatRef<'_>,
    w: &QuantizedMatrix<'_>,
    alpha: f32,
    accumulate: bool,
) -> Result<()> {
    check_shapes(
        "x @ W^T",
        (x.rows, x.cols),
        (w.cols, w.rows),
        (y.rows, y.cols),
    )?;
    w.for_each_tile(|r0, tile| {
        matmul(
            &mut y.cols_mut(r0, tile.rows),
            x,
            tile.t(),
            alpha,
            accumulate,
        )
    })
}

/// `dx = alpha * dy @ W` (`+= ...` when `accumulate`); dy [m, rows], dx [m, cols].
pub fn matmul_w(
    dx: &mut MatMut<'_>,
    dy: MatRef<'_>,
    w: &QuantizedMatrix<'_>,
    alpha: f32,
    accumulate: bool,
) -> Result<()> {
    check_shapes(
        "dy @ W",
        (dy.rows, dy.cols),
        (w.rows, w.cols),
        (dx.rows, dx.cols),
    )?;
    if w.rows == 0 {
        return matmul(dx, dy, MatRef::row_major(&[], 0, w.cols), alpha, accumulate);
    }
    // The tiles split the reduction: the first one writes (or accumulates), the rest add.
    w.for_each_tile(|r0, tile| {
        matmul(
            dx,
            dy.cols(r0, tile.rows),
            tile,
            alpha,
            accumulate || r0 > 0,
        )
    })
}

fn check_shapes(what: &str, a: (usize, usize), b: (usize, usize), c: (usize, usize)) -> Result<()> {
    if a.1 == b.0 && c == (a.0, b.1) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: shapes ({}x{}) @ ({}x{}) into ({}x{})",
            a.0, a.1, b.0, b.1, c.0, c.1
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::quantize;

    fn dense(w: &QuantizedMatrix<'_>) -> Vec<f32> {
        let mut out = vec![0.0; w.rows * w.cols];
        codec::dequantize_into(w.codes, w.absmax, w.blocksize, w.format, &mut out).unwrap();
        out
    }

    #[test]
    fn tiled_products_equal_products_with_the_dequantized_weight() {
        // cols not a multiple of the blocksize: blocks straddle rows, tiles must still align.
        for &(rows, cols, bs) in &[
            (300, 40, 64),
            (2048, 600, 64),
            (7, 3, 32),
            (1030, 1024, 128),
        ] {
            let m = 5;
            let wv: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let q = quantize(&wv, bs, Format::Nf4).unwrap();
            let w = QuantizedMatrix {
                codes: &q.codes,
                absmax: &q.absmax,
                rows,
                cols,
                blocksize: bs,
                format: Format::Nf4,
            };
            assert!(w.tile_rows() < rows || rows < 16);
            let wd = dense(&w);
            let x: Vec<f32> = (0..m * cols).map(|i| (i % 13) as f32 / 13.0).collect();
            let mut y = vec![0.0f32; m * rows];
            matmul_wt(
                &mut MatMut::row_major(&mut y, m, rows),
                MatRef::row_major(&x, m, cols),
                &w,
                1.0,
                false,
            )
            .unwrap();
            let mut want = vec![0.0f32; m * rows];
            matmul(
                &mut MatMut::row_major(&mut want, m, rows),
                MatRef::row_major(&x, m, cols),
                MatRef::row_major(&wd, rows, cols).t(),
                1.0,
                false,
            )
            .unwrap();
            for (a, b) in y.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-3 * (1.0 + b.abs()), "{a} vs {b}");
            }
            let dy: Vec<f32> = (0..m * rows).map(|i| (i % 7) as f32 - 3.0).collect();
            let mut dx = vec![1.0f32; m * cols];
            matmul_w(
                &mut MatMut::row_major(&mut dx, m, cols),
                MatRef::row_major(&dy, m, rows),
                &w,
                0.5,
                false,
            )
            .unwrap();
            let mut want = vec![0.0f32; m * cols];
            matmul(
                &mut MatMut::row_major(&mut want, m, cols),
                MatRef::row_major(&dy, m, rows),
                MatRef::row_major(&wd, rows, cols),
                0.5,
                false,
            )
            .unwrap();
            for (a, b) in dx.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-3 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }
}
