//! Products with a quantized weight W [rows, cols] (row-major, e.g. an NF4 base weight
//! [out, in]) that never hold all of W in f32: a few rows are dequantized into a small tile
//! at a time and multiplied through `linalg::matmul`.

use crate::buffer::zeroed;
use crate::codebook::Format;
use crate::codec;
use crate::error::{check_len, checked_mul, Error, Result};
use crate::layout::{block_count, check_blocksize};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::linalg::{self, matmul, ColumnBlocks, MatMut, MatRef};

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
    /// Checks the blocksize and that codes and scales hold `rows * cols` values.
    pub fn check(&self) -> Result<()> {
        check_blocksize(self.blocksize)?;
        let n = checked_mul("elements of the quantized weight", self.rows, self.cols)?;
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
    /// `min(TILE_MAX_ELEMENTS, size / TILE_MAX_FRACTION) / in_flight` elements, so that
    /// `in_flight` tiles at once stay within the budget. Needs `check()` passed
    /// (`rows * cols` fits) and `cols > 0`.
    fn tile_rows(&self, in_flight: usize) -> usize {
        // Checked and saturating only in form: `rows * cols` fits, the divisors are >= 1.
        let align = (self.blocksize)
            .checked_div(gcd(self.cols.max(1), self.blocksize))
            .unwrap_or(1);
        let target = TILE_MAX_ELEMENTS
            .min(self.rows.saturating_mul(self.cols) / TILE_MAX_FRACTION)
            .checked_div(in_flight)
            .unwrap_or(0);
        let aligned_tiles = target
            .checked_div(self.cols)
            .and_then(|rows| rows.checked_div(align))
            .unwrap_or(0);
        aligned_tiles
            .saturating_mul(align)
            .max(align)
            .min(self.rows.max(1))
    }

    /// Dequantizes rows `r0..r0+len` into `tile` (row-major, `len * cols` elements), on
    /// rayon's threads when `parallel`.
    fn dequantize_rows(
        &self,
        r0: usize,
        len: usize,
        tile: &mut [f32],
        parallel: bool,
    ) -> Result<()> {
        let out_of_range = || {
            Error::InvalidArgument(format!(
                "rows {r0}..{r0}+{len} of a quantized {}x{} weight",
                self.rows, self.cols
            ))
        };
        let start = r0.checked_mul(self.cols).ok_or_else(out_of_range)?;
        let count = len.checked_mul(self.cols).ok_or_else(out_of_range)?;
        let end = start.checked_add(count).ok_or_else(out_of_range)?;
        let code_range = match self.format.bits() {
            4 => start / 2..end.div_ceil(2),
            _ => start..end,
        };
        let first_scale = start.checked_div(self.blocksize).ok_or_else(out_of_range)?;
        let scale_range = first_scale..end.div_ceil(self.blocksize);
        codec::dequantize_into_with(
            self.codes.get(code_range).ok_or_else(out_of_range)?,
            self.absmax.get(scale_range).ok_or_else(out_of_range)?,
            self.blocksize,
            self.format,
            tile.get_mut(..count).ok_or_else(out_of_range)?,
            parallel,
        )
    }

    /// Calls `f(first_row, tile_view)` for each tile of rows, in order (none when the weight
    /// is empty).
    pub fn for_each_tile(&self, mut f: impl FnMut(usize, MatRef<'_>) -> Result<()>) -> Result<()> {
        self.check()?;
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let step = self.tile_rows(1);
        let mut tile = zeroed(checked_mul("elements of a tile", step, self.cols)?)?;
        let mut r0 = 0;
        while r0 < self.rows {
            // `step <= rows`, so neither a tile nor `r0` passes `rows * cols`, which fits.
            let len = step.min(self.rows.saturating_sub(r0));
            self.dequantize_rows(r0, len, &mut tile, true)?;
            let values = tile
                .get(..len.saturating_mul(self.cols))
                .unwrap_or_default();
            f(r0, MatRef::row_major(values, len, self.cols))?;
            r0 = r0.saturating_add(len);
        }
        Ok(())
    }
}

fn gcd(a: usize, b: usize) -> usize {
    match a.checked_rem(b) {
        None => a, // b == 0
        Some(r) => gcd(b, r),
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
    w.check()?;
    if y.rows == 0 || y.cols == 0 {
        return Ok(());
    }
    if w.cols == 0 {
        // An empty reduction: y is zero (or unchanged when accumulating).
        return matmul(y, x, MatRef::row_major(&[], 0, w.rows), alpha, accumulate);
    }
    let threads = linalg::threads(y.rows.saturating_mul(w.rows).saturating_mul(w.cols));
    if threads > 1 {
        return matmul_wt_tiles_in_parallel(y, x, w, alpha, accumulate, threads);
    }
    w.for_each_tile(|r0, tile| {
        matmul(
            &mut y.cols_mut(r0, tile.rows)?,
            x,
            tile.t(),
            alpha,
            accumulate,
        )
    })
}

/// `matmul_wt` with the tiles handed out to `threads` threads as they come free, each
/// dequantizing one and multiplying it on its own: no thread waits on another before the
/// end (on a machine shared with other work, a thread held up holds up no one), and `x` is
/// read in place by every tile (`simd::gemm`). The tiles are `threads` times smaller, so the
/// extra memory is the same.
fn matmul_wt_tiles_in_parallel(
    y: &mut MatMut<'_>,
    x: MatRef<'_>,
    w: &QuantizedMatrix<'_>,
    alpha: f32,
    accumulate: bool,
    threads: usize,
) -> Result<()> {
    let step = w.tile_rows(threads);
    let tile_len = checked_mul("elements of a tile", step, w.cols)?;
    let starts: Vec<usize> = (0..w.rows).step_by(step).collect();
    let out = ColumnBlocks::new(y)?;
    // One buffer per thread, allocated here (not in the threads' own allocator arenas, which
    // keep what they freed): taken by a task, put back after its tile.
    let buffers = (0..threads.min(starts.len()))
        .map(|_| zeroed::<f32>(tile_len))
        .collect::<Result<Vec<_>>>()?;
    let buffers = Mutex::new(buffers);
    starts.par_iter().with_max_len(1).try_for_each(|&r0| {
        let spare = buffers.lock().ok().and_then(|mut free| free.pop());
        let mut tile = match spare {
            Some(buf) => buf,
            None => zeroed(tile_len)?, // only if rayon ran more tasks at once than threads
        };
        let len = step.min(w.rows.saturating_sub(r0));
        // On this thread: a nested parallel loop would let this thread take up another
        // tile while it waits, and hold a third buffer.
        w.dequantize_rows(r0, len, &mut tile, false)?;
        let values = tile.get(..len.saturating_mul(w.cols)).unwrap_or_default();
        let rows = MatRef::row_major(values, len, w.cols);
        // SAFETY: each start is one task's, and the tiles' rows of W are disjoint, so are
        // the columns of y they write.
        let done = unsafe { out.matmul_cols(r0, x, rows.t(), alpha, accumulate) };
        if let Ok(mut free) = buffers.lock() {
            free.push(tile);
        }
        done
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
    w.check()?;
    if dx.rows == 0 || dx.cols == 0 {
        return Ok(());
    }
    if w.rows == 0 {
        // An empty reduction: dx is zero (or unchanged when accumulating).
        return matmul(dx, dy, MatRef::row_major(&[], 0, w.cols), alpha, accumulate);
    }
    // The tiles split the reduction: the first one writes (or accumulates), the rest add.
    w.for_each_tile(|r0, tile| {
        matmul(
            dx,
            dy.cols(r0, tile.rows)?,
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

    fn weight<'a>(q: &'a codec::Quantized, rows: usize, cols: usize) -> QuantizedMatrix<'a> {
        QuantizedMatrix {
            codes: &q.codes,
            absmax: &q.absmax,
            rows,
            cols,
            blocksize: 64,
            format: Format::Nf4,
        }
    }

    #[test]
    fn empty_operands_give_empty_or_zero_products() {
        let (rows, cols) = (32, 24);
        let q = quantize(&vec![1.0f32; rows * cols], 64, Format::Nf4).unwrap();
        let w = weight(&q, rows, cols);
        // Zero tokens: nothing to write, W still checked.
        let mut y: [f32; 0] = [];
        matmul_wt(
            &mut MatMut::row_major(&mut y, 0, rows),
            MatRef::row_major(&[], 0, cols),
            &w,
            1.0,
            false,
        )
        .unwrap();
        matmul_w(
            &mut MatMut::row_major(&mut y, 0, cols),
            MatRef::row_major(&[], 0, rows),
            &w,
            1.0,
            false,
        )
        .unwrap();
        // W with no columns: x @ W^T is an empty sum, zero (or unchanged when accumulating).
        let empty = quantize::<f32>(&[], 64, Format::Nf4).unwrap();
        let mut y = [5.0f32; 3 * 7];
        let mut out = MatMut::row_major(&mut y, 3, 7);
        let x = MatRef::row_major(&[], 3, 0);
        matmul_wt(&mut out, x, &weight(&empty, 7, 0), 1.0, true).unwrap();
        assert_eq!(y, [5.0; 21]);
        let mut out = MatMut::row_major(&mut y, 3, 7);
        matmul_wt(&mut out, x, &weight(&empty, 7, 0), 1.0, false).unwrap();
        assert_eq!(y, [0.0; 21]);
        // W with no rows: dy @ W is an empty sum.
        let mut dx = [5.0f32; 3 * 7];
        let mut out = MatMut::row_major(&mut dx, 3, 7);
        let dy = MatRef::row_major(&[], 3, 0);
        matmul_w(&mut out, dy, &weight(&empty, 0, 7), 1.0, false).unwrap();
        assert_eq!(dx, [0.0; 21]);
    }

    #[test]
    fn shapes_whose_element_count_overflows_are_errors() {
        let empty = quantize::<f32>(&[], 64, Format::Nf4).unwrap();
        let w = weight(&empty, 1 << 32, 1 << 32);
        assert!(matches!(w.check(), Err(Error::InvalidArgument(_))));
        let mut y: [f32; 0] = [];
        let r = matmul_wt(
            &mut MatMut::row_major(&mut y, 0, 1 << 32),
            MatRef::row_major(&[], 0, 1 << 32),
            &w,
            1.0,
            false,
        );
        assert!(r.is_err());
    }

    #[test]
    fn mismatched_codes_scales_and_shapes_are_errors() {
        let q = quantize(&[1.0f32; 64], 64, Format::Nf4).unwrap();
        let mut y = [0.0f32; 8];
        let x = [0.0f32; 8];
        for (rows, cols, blocksize) in [(8, 8, 64), (8, 9, 64), (9, 8, 64), (8, 8, 0), (8, 8, 48)] {
            let w = QuantizedMatrix {
                blocksize,
                ..weight(&q, rows, cols)
            };
            let r = matmul_wt(
                &mut MatMut::row_major(&mut y, 1, rows.min(8)),
                MatRef::row_major(&x, 1, cols.min(8)),
                &w,
                1.0,
                false,
            );
            assert_eq!(r.is_ok(), (rows, cols, blocksize) == (8, 8, 64));
        }
    }

    #[test]
    fn tiles_in_parallel_give_the_bits_of_tiles_in_turn() {
        // Each output column comes from one tile's product, computed the same way whatever
        // the tile's size or thread: the two paths agree bit for bit.
        let (rows, cols, m) = (1000, 320, 37);
        let wv: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 31 % 113) as f32 - 56.0) / 9.0)
            .collect();
        let q = quantize(&wv, 64, Format::Nf4).unwrap();
        let w = weight(&q, rows, cols);
        let x: Vec<f32> = (0..m * cols)
            .map(|i| (i % 17) as f32 / 17.0 - 0.4)
            .collect();
        let x = MatRef::row_major(&x, m, cols);
        for accumulate in [false, true] {
            let mut parallel = vec![0.5f32; m * rows];
            let mut out = MatMut::row_major(&mut parallel, m, rows);
            matmul_wt_tiles_in_parallel(&mut out, x, &w, 0.75, accumulate, 3).unwrap();
            let mut in_turn = vec![0.5f32; m * rows];
            let mut out = MatMut::row_major(&mut in_turn, m, rows);
            w.for_each_tile(|r0, tile| {
                matmul(
                    &mut out.cols_mut(r0, tile.rows)?,
                    x,
                    tile.t(),
                    0.75,
                    accumulate,
                )
            })
            .unwrap();
            assert!(parallel
                .iter()
                .zip(&in_turn)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

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
            assert!(w.tile_rows(1) < rows || rows < 16);
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
