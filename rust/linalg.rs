//! Dense f32 matrix products on strided views, through the `gemm` crate (multi-threaded with
//! rayon). Views carry strides in elements, so transposes are free.

use gemm::Parallelism;

use crate::error::{Error, Result};

/// A read-only strided matrix: element (i, j) is `data[offset + i*rs + j*cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: isize,
    pub col_stride: isize,
    pub offset: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `rows x cols` matrix over `data`.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> MatRef<'a> {
        MatRef {
            data,
            rows,
            cols,
            row_stride: cols as isize,
            col_stride: 1,
            offset: 0,
        }
    }

    /// The transposed view (no copy).
    pub fn t(self) -> MatRef<'a> {
        MatRef {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Rows `start..start+len` (no copy).
    pub fn rows(self, start: usize, len: usize) -> MatRef<'a> {
        assert!(start + len <= self.rows);
        MatRef {
            rows: len,
            offset: (self.offset as isize + start as isize * self.row_stride) as usize,
            ..self
        }
    }

    /// Columns `start..start+len` (no copy).
    pub fn cols(self, start: usize, len: usize) -> MatRef<'a> {
        assert!(start + len <= self.cols);
        MatRef {
            cols: len,
            offset: (self.offset as isize + start as isize * self.col_stride) as usize,
            ..self
        }
    }

    fn check(&self, what: &str) -> Result<()> {
        check_extent(
            what,
            self.data.len(),
            self.rows,
            self.cols,
            self.row_stride,
            self.col_stride,
            self.offset,
        )
    }
}

/// A writable strided matrix.
#[derive(Debug)]
pub struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: isize,
    pub col_stride: isize,
}

impl<'a> MatMut<'a> {
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> MatMut<'a> {
        MatMut {
            data,
            rows,
            cols,
            row_stride: cols as isize,
            col_stride: 1,
        }
    }

    /// Columns `start..start+len`, borrowing this view.
    pub fn cols_mut(&mut self, start: usize, len: usize) -> MatMut<'_> {
        assert!(start + len <= self.cols);
        let skip = start * self.col_stride as usize;
        MatMut {
            data: &mut self.data[skip..],
            rows: self.rows,
            cols: len,
            row_stride: self.row_stride,
            col_stride: self.col_stride,
        }
    }
}

/// Checks that every element of a strided view lies inside a buffer of `len` elements.
fn check_extent(
    what: &str,
    len: usize,
    rows: usize,
    cols: usize,
    rs: isize,
    cs: isize,
    offset: usize,
) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let corner = |i: usize, j: usize| offset as isize + i as isize * rs + j as isize * cs;
    let ends = [
        corner(0, 0),
        corner(rows - 1, 0),
        corner(0, cols - 1),
        corner(rows - 1, cols - 1),
    ];
    let (lo, hi) = (ends.iter().min().copied(), ends.iter().max().copied());
    match (lo, hi) {
        (Some(lo), Some(hi)) if lo >= 0 && (hi as usize) < len => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "{what}: a {rows}x{cols} view with strides ({rs}, {cs}) does not fit in {len} elements"
        ))),
    }
}

/// `c = alpha * a @ b`, or `c += alpha * a @ b` when `accumulate`.
pub fn matmul(
    c: &mut MatMut<'_>,
    a: MatRef<'_>,
    b: MatRef<'_>,
    alpha: f32,
    accumulate: bool,
) -> Result<()> {
    if a.cols != b.rows || c.rows != a.rows || c.cols != b.cols {
        return Err(Error::InvalidArgument(format!(
            "matmul shapes: ({}x{}) @ ({}x{}) into ({}x{})",
            a.rows, a.cols, b.rows, b.cols, c.rows, c.cols
        )));
    }
    a.check("left operand")?;
    b.check("right operand")?;
    check_extent(
        "output",
        c.data.len(),
        c.rows,
        c.cols,
        c.row_stride,
        c.col_stride,
        0,
    )?;
    if c.rows == 0 || c.cols == 0 {
        return Ok(());
    }
    if a.cols == 0 {
        if !accumulate {
            fill(c, 0.0);
        }
        return Ok(());
    }
    // SAFETY: the extents of all three views were checked against their buffers above; `c`
    // is borrowed mutably, so it cannot overlap the shared borrows `a` and `b`.
    unsafe {
        gemm::gemm(
            c.rows,
            c.cols,
            a.cols,
            c.data.as_mut_ptr(),
            c.col_stride,
            c.row_stride,
            accumulate,
            a.data.as_ptr().add(a.offset),
            a.col_stride,
            a.row_stride,
            b.data.as_ptr().add(b.offset),
            b.col_stride,
            b.row_stride,
            1.0,
            alpha,
            false,
            false,
            false,
            parallelism(c.rows * c.cols * a.cols),
        );
    }
    Ok(())
}

fn fill(c: &mut MatMut<'_>, value: f32) {
    for i in 0..c.rows {
        for j in 0..c.cols {
            let at = i as isize * c.row_stride + j as isize * c.col_stride;
            c.data[at as usize] = value;
        }
    }
}

/// Threads pay off only for products of some size.
fn parallelism(work: usize) -> Parallelism {
    if work >= 1 << 18 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: MatRef<'_>, b: MatRef<'_>) -> Vec<f64> {
        let at = |m: MatRef<'_>, i: usize, j: usize| {
            m.data[(m.offset as isize + i as isize * m.row_stride + j as isize * m.col_stride)
                as usize] as f64
        };
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                out[i * b.cols + j] = (0..a.cols).map(|k| at(a, i, k) * at(b, k, j)).sum();
            }
        }
        out
    }

    #[test]
    fn matmul_matches_a_naive_product_with_transposes_and_accumulation() {
        let (m, k, n) = (37, 53, 29);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 97) as f32 / 50.0 - 1.0)
            .collect();
        let b: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 89) as f32 / 40.0 - 1.0)
            .collect();
        let a_view = MatRef::row_major(&a, m, k);
        let b_t = MatRef::row_major(&b, n, k).t(); // k x n
        let want = naive(a_view, b_t);
        let mut c = vec![1.0f32; m * n];
        matmul(&mut MatMut::row_major(&mut c, m, n), a_view, b_t, 2.0, true).unwrap();
        for (got, w) in c.iter().zip(&want) {
            assert!((*got as f64 - (1.0 + 2.0 * w)).abs() < 1e-4, "{got} vs {w}");
        }
    }

    #[test]
    fn matmul_rejects_mismatched_shapes_and_short_buffers() {
        let a = vec![0.0f32; 6];
        let mut c = vec![0.0f32; 4];
        let r = matmul(
            &mut MatMut::row_major(&mut c, 2, 2),
            MatRef::row_major(&a, 2, 3),
            MatRef::row_major(&a, 2, 3),
            1.0,
            false,
        );
        assert!(r.is_err());
        let short = MatRef {
            data: &a[..5],
            ..MatRef::row_major(&a, 3, 2)
        };
        let r = matmul(
            &mut MatMut::row_major(&mut c, 2, 2),
            MatRef::row_major(&a, 2, 3),
            short,
            1.0,
            false,
        );
        assert!(r.is_err());
    }
}
