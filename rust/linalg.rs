//! Dense f32 matrix products on strided views, through `simd::gemm` (the `gemm` crates'
//! kernels for AVX-512, AVX2, NEON or scalar, chosen at run time; multi-threaded with rayon).
//! Views carry strides in elements, so transposes are free.

use crate::error::{check_len, Error, Result};
use crate::simd::gemm::Strided;
use crate::simd::{self, Level};

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
    pub fn rows(self, start: usize, len: usize) -> Result<MatRef<'a>> {
        let offset = sub_view("rows", self.rows, start, len, self.offset, self.row_stride)?;
        Ok(MatRef {
            rows: len,
            offset,
            ..self
        })
    }

    /// Columns `start..start+len` (no copy).
    pub fn cols(self, start: usize, len: usize) -> Result<MatRef<'a>> {
        let offset = sub_view(
            "columns",
            self.cols,
            start,
            len,
            self.offset,
            self.col_stride,
        )?;
        Ok(MatRef {
            cols: len,
            offset,
            ..self
        })
    }

    /// The view as the products take it: its first element's address and its strides
    /// (in bounds where `check` passed).
    fn strided(&self) -> Strided<*const f32> {
        Strided {
            ptr: self.data.as_ptr().wrapping_add(self.offset),
            row_stride: self.row_stride,
            col_stride: self.col_stride,
        }
    }

    /// Checks that every element lies inside `data`.
    pub fn check(&self, what: &str) -> Result<()> {
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

    /// Appends the elements row by row to `out`.
    pub fn extend_row_major(&self, out: &mut Vec<f32>) -> Result<()> {
        self.check("matrix")?;
        let count = self.rows.saturating_mul(self.cols);
        out.try_reserve(count).map_err(|_| Error::OutOfMemory {
            bytes: count.saturating_mul(std::mem::size_of::<f32>()),
        })?;
        let before = out.len();
        for i in 0..self.rows {
            // In range: `check` bounds every element, and these are elements.
            let start = element_index(self.offset, i, 0, self.row_stride, self.col_stride);
            let row = start.and_then(|s| self.data.get(s..)).unwrap_or_default();
            match usize::try_from(self.col_stride) {
                Ok(1) => out.extend_from_slice(row.get(..self.cols).unwrap_or_default()),
                Ok(0) => out.extend(row.iter().take(1).cycle().take(self.cols)),
                Ok(step) => out.extend(row.iter().step_by(step).take(self.cols)),
                Err(_) => {
                    return Err(Error::InvalidArgument(format!(
                        "a matrix with column stride {} cannot be read row by row",
                        self.col_stride
                    )))
                }
            }
        }
        // `check` passed, so every row was whole; this only keeps a broken invariant visible.
        let copied = out.len().saturating_sub(before);
        check_len("elements copied", count, copied)
    }
}

/// The offset of the sub-view `start..start+len` along an axis of `size` elements.
fn sub_view(
    axis: &str,
    size: usize,
    start: usize,
    len: usize,
    offset: usize,
    stride: isize,
) -> Result<usize> {
    let fits = start.checked_add(len).is_some_and(|end| end <= size);
    let moved = isize::try_from(start)
        .ok()
        .and_then(|s| s.checked_mul(stride))
        .and_then(|d| offset.checked_add_signed(d));
    match moved {
        Some(offset) if fits => Ok(offset),
        _ => Err(Error::InvalidArgument(format!(
            "{axis} {start}..{start}+{len} of a view with {size} {axis}"
        ))),
    }
}

/// `offset + i*rs + j*cs` as an index, if it is one (no overflow, not negative).
fn element_index(offset: usize, i: usize, j: usize, rs: isize, cs: isize) -> Option<usize> {
    let di = isize::try_from(i).ok()?.checked_mul(rs)?;
    let dj = isize::try_from(j).ok()?.checked_mul(cs)?;
    offset.checked_add_signed(di.checked_add(dj)?)
}

/// A writable strided matrix: element (i, j) is `data[offset + i*rs + j*cs]`.
#[derive(Debug)]
pub struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: isize,
    pub col_stride: isize,
    pub offset: usize,
}

impl<'a> MatMut<'a> {
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> MatMut<'a> {
        MatMut {
            data,
            rows,
            cols,
            row_stride: cols as isize,
            col_stride: 1,
            offset: 0,
        }
    }

    /// Columns `start..start+len`, borrowing this view.
    pub fn cols_mut(&mut self, start: usize, len: usize) -> Result<MatMut<'_>> {
        let offset = sub_view(
            "columns",
            self.cols,
            start,
            len,
            self.offset,
            self.col_stride,
        )?;
        Ok(MatMut {
            data: &mut *self.data,
            rows: self.rows,
            cols: len,
            row_stride: self.row_stride,
            col_stride: self.col_stride,
            offset,
        })
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

/// Checks that every element of a strided view lies inside a buffer of `len` elements (an
/// empty view fits anywhere).
fn check_extent(
    what: &str,
    len: usize,
    rows: usize,
    cols: usize,
    rs: isize,
    cs: isize,
    offset: usize,
) -> Result<()> {
    let (Some(last_row), Some(last_col)) = (rows.checked_sub(1), cols.checked_sub(1)) else {
        return Ok(());
    };
    // The extreme elements are at the corners; every corner must be an index below `len`.
    let corners = [(0, 0), (last_row, 0), (0, last_col), (last_row, last_col)];
    let inside = corners
        .iter()
        .all(|&(i, j)| element_index(offset, i, j, rs, cs).is_some_and(|e| e < len));
    if inside {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{what}: a {rows}x{cols} view with strides ({rs}, {cs}) at offset {offset} does not fit in {len} elements"
        )))
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
    matmul_at(simd::matmul_level(), c, a, b, alpha, accumulate)
}

/// `matmul` with the kernels of `level` (or the widest below it that this CPU has).
pub fn matmul_at(
    level: Level,
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
    c.check("output")?;
    if c.rows == 0 || c.cols == 0 {
        return Ok(());
    }
    if a.cols == 0 {
        if !accumulate {
            fill(c, 0.0);
        }
        return Ok(());
    }
    let work = c.rows.saturating_mul(c.cols).saturating_mul(a.cols);
    // SAFETY: the extents of all three views were checked against their buffers above (so
    // the offsets are in bounds); `c` is borrowed mutably, so it cannot overlap the shared
    // borrows `a` and `b`.
    unsafe {
        simd::gemm::gemm(
            level,
            c.rows,
            c.cols,
            a.cols,
            Strided {
                ptr: c.data.as_mut_ptr().add(c.offset),
                row_stride: c.row_stride,
                col_stride: c.col_stride,
            },
            a.strided(),
            b.strided(),
            alpha,
            accumulate,
            threads(work),
        )
    }
}

/// A destination whose column blocks are products written by different threads at once
/// (`matmul_cols`): the raw parts of a checked `MatMut`, borrowed for its lifetime.
pub struct ColumnBlocks<'a> {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
    row_stride: isize,
    col_stride: isize,
    _borrow: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: the threads write disjoint column blocks (the contract of `matmul_cols`).
unsafe impl Send for ColumnBlocks<'_> {}
// SAFETY: as above.
unsafe impl Sync for ColumnBlocks<'_> {}

impl<'a> ColumnBlocks<'a> {
    /// The blocks of `c`, whose extent is checked here.
    pub fn new(c: &'a mut MatMut<'_>) -> Result<ColumnBlocks<'a>> {
        c.check("output")?;
        let ptr = c.data.as_mut_ptr().wrapping_add(c.offset);
        Ok(ColumnBlocks {
            ptr,
            rows: c.rows,
            cols: c.cols,
            row_stride: c.row_stride,
            col_stride: c.col_stride,
            _borrow: std::marker::PhantomData,
        })
    }

    /// `c[:, j0..j0+b.cols] = alpha * a @ b` (`+=` when `accumulate`) on this thread alone.
    ///
    /// # Safety
    /// No other thread reads or writes columns `j0..j0+b.cols` during the call.
    pub unsafe fn matmul_cols(
        &self,
        j0: usize,
        a: MatRef<'_>,
        b: MatRef<'_>,
        alpha: f32,
        accumulate: bool,
    ) -> Result<()> {
        let fits = j0.checked_add(b.cols).is_some_and(|end| end <= self.cols);
        if !fits || a.cols != b.rows || a.rows != self.rows {
            return Err(Error::InvalidArgument(format!(
                "matmul shapes: ({}x{}) @ ({}x{}) into columns {j0}.. of ({}x{})",
                a.rows, a.cols, b.rows, b.cols, self.rows, self.cols
            )));
        }
        a.check("left operand")?;
        b.check("right operand")?;
        if self.rows == 0 || b.cols == 0 || a.cols == 0 {
            return Err(Error::InvalidArgument(
                "matmul_cols: empty products are the caller's".into(),
            ));
        }
        // In bounds: `new` checked the whole view, and these columns lie inside it.
        let ptr = self
            .ptr
            .wrapping_offset((j0 as isize).wrapping_mul(self.col_stride));
        simd::gemm::gemm(
            simd::matmul_level(),
            self.rows,
            b.cols,
            a.cols,
            Strided {
                ptr,
                row_stride: self.row_stride,
                col_stride: self.col_stride,
            },
            a.strided(),
            b.strided(),
            alpha,
            accumulate,
            1,
        )
    }
}

/// Sets every element of a checked view.
fn fill(c: &mut MatMut<'_>, value: f32) {
    for i in 0..c.rows {
        for j in 0..c.cols {
            let at = element_index(c.offset, i, j, c.row_stride, c.col_stride);
            if let Some(e) = at.and_then(|at| c.data.get_mut(at)) {
                *e = value;
            }
        }
    }
}

/// Threads pay off only for products of some size.
pub fn threads(work: usize) -> usize {
    if work >= 1 << 18 {
        rayon::current_num_threads()
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_views_out_of_range_or_overflowing_are_errors() {
        let a = [0.0f32; 6];
        let m = MatRef::row_major(&a, 2, 3);
        assert_eq!(m.rows(1, 1).unwrap().offset, 3);
        assert_eq!(m.cols(2, 1).unwrap().offset, 2);
        assert!(m.rows(1, 2).is_err());
        assert!(m.cols(usize::MAX, 2).is_err());
        let huge = MatRef {
            rows: usize::MAX,
            row_stride: isize::MAX,
            ..m
        };
        assert!(huge.rows(3, 1).is_err(), "the offset overflows");
        let mut c = [0.0f32; 6];
        let mut out = MatMut::row_major(&mut c, 2, 3);
        assert_eq!(out.cols_mut(1, 2).unwrap().offset, 1);
        assert!(out.cols_mut(2, 2).is_err());
    }

    #[test]
    fn column_blocks_of_an_empty_output_write_nothing() {
        // A [0 x 32] output split into column blocks: no element, no slice to cut.
        let mut c: [f32; 0] = [];
        let mut out = MatMut::row_major(&mut c, 0, 32);
        let mut block = out.cols_mut(8, 8).unwrap();
        let x = MatRef::row_major(&[], 0, 4);
        let w = [1.0f32; 32];
        matmul(&mut block, x, MatRef::row_major(&w, 4, 8), 1.0, false).unwrap();
    }

    #[test]
    fn views_whose_corners_overflow_do_not_fit() {
        let a = [0.0f32; 4];
        let v = MatRef {
            data: &a,
            rows: 2,
            cols: 2,
            row_stride: isize::MAX,
            col_stride: isize::MAX,
            offset: 0,
        };
        assert!(v.check("v").is_err());
        let negative = MatRef {
            row_stride: -1,
            ..MatRef::row_major(&a, 2, 2)
        };
        assert!(negative.check("v").is_err(), "row 1 is before the buffer");
    }

    #[test]
    fn row_major_copies_follow_strides_including_zero_ones() {
        let a: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut out = Vec::new();
        MatRef::row_major(&a, 3, 4)
            .t()
            .extend_row_major(&mut out)
            .unwrap();
        assert_eq!(out, [0., 4., 8., 1., 5., 9., 2., 6., 10., 3., 7., 11.]);
        out.clear();
        let broadcast = MatRef {
            data: &a[..1],
            rows: 2,
            cols: 3,
            row_stride: 0,
            col_stride: 0,
            offset: 0,
        };
        broadcast.extend_row_major(&mut out).unwrap();
        assert_eq!(out, [0.0; 6]);
    }

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
