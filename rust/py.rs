//! The Python binding (`nybble._core`): converts arrays, releases the GIL around the work,
//! and maps core errors to Python exceptions. No logic of its own lives here.
//!
//! No input from Python may panic or abort: every argument is checked before the core sees
//! it (sizes as `Size`, arrays for dtype, alignment and layout) and the core checks sizes
//! with checked arithmetic and allocates outputs fallibly (see `lib.rs` for the lints that
//! hold the crate to this). Arrays are read and written with the GIL released, so another
//! Python thread may write them meanwhile; the kernels never derive an index or a length from
//! an element's value, so such a race gives a result or an error, never a panic.

use half::slice::HalfBitsSliceExt;
use half::{bf16, f16};
use numpy::{
    IntoPyArray, PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray1,
    PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyMemoryError, PyOverflowError, PyValueError};
use pyo3::prelude::*;

use crate::codebook::Format;
use crate::error::Error;
use crate::linalg::{self, MatMut, MatRef};
use crate::lora::{self, Weight};
use crate::qmatmul::{matmul_w, matmul_wt, QuantizedMatrix};
use crate::{codec, double_quant, layout};

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        match e {
            Error::NonFinite { index } => Python::attach(|py| non_finite_error(py, index)),
            Error::OutOfMemory { .. } => PyMemoryError::new_err(e.to_string()),
            other => PyValueError::new_err(other.to_string()),
        }
    }
}

/// `nybble.errors.NonFiniteError(index)`, imported when first needed (the binding loads
/// before the Python package finishes importing); a plain ValueError if that import fails.
fn non_finite_error(py: Python<'_>, index: usize) -> PyErr {
    let typed = py
        .import("nybble.errors")
        .and_then(|m| m.getattr("NonFiniteError"))
        .and_then(|t| t.call1((index,)));
    match typed {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyValueError::new_err(Error::NonFinite { index }.to_string()),
    }
}

fn parse_format(name: &str) -> PyResult<Format> {
    Format::parse(name).ok_or_else(|| {
        let valid: Vec<String> = Format::ALL
            .iter()
            .map(|f| format!("'{}'", f.name()))
            .collect();
        PyValueError::new_err(format!(
            "codebook must be one of {}, got {name:?}",
            valid.join(", ")
        ))
    })
}

/// A size or count from Python: a non-negative integer that fits in a `usize`. PyO3 would
/// raise OverflowError for a negative or huge one; this raises ValueError (PyO3 adds a note
/// naming the argument).
#[derive(Clone, Copy, Debug)]
struct Size(usize);

impl<'a, 'py> FromPyObject<'a, 'py> for Size {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<usize>() {
            Ok(n) => Ok(Size(n)),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
                Err(PyValueError::new_err(format!(
                    "expected a size from 0 to {}, got {}",
                    usize::MAX,
                    shown(obj)
                )))
            }
            Err(e) => Err(e),
        }
    }
}

/// `repr(obj)` for a message; an int too long for `repr` (Python refuses > 4300 digits) is
/// named, not printed.
fn shown(obj: Borrowed<'_, '_, PyAny>) -> String {
    obj.repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "an integer too long to print".to_owned())
}

/// A float argument (`alpha`, `scale`, `offset`): finite once rounded to f32. An int too
/// large for a float is a ValueError, as is NaN or inf (they would only make every output
/// NaN or inf).
#[derive(Clone, Copy, Debug)]
struct Finite(f32);

impl<'a, 'py> FromPyObject<'a, 'py> for Finite {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let bad =
            || PyValueError::new_err(format!("expected a finite float32, got {}", shown(obj)));
        match obj.extract::<f64>() {
            Ok(v) if (v as f32).is_finite() => Ok(Finite(v as f32)),
            Ok(_) => Err(bad()),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Err(bad()),
            Err(e) => Err(e),
        }
    }
}

/// A 1-D array's elements as a slice (it must be contiguous; numpy's `aligned` flag is
/// checked by `as_slice`).
fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{what} must be C-contiguous and aligned")))
}

/// A flat input array: f32, f64, or 16-bit floats passed as their uint16 bits.
#[derive(FromPyObject)]
enum FloatArray<'py> {
    F32(PyReadonlyArray1<'py, f32>),
    F64(PyReadonlyArray1<'py, f64>),
    Bits16(PyReadonlyArray1<'py, u16>),
}

type Pair<'py> = (Bound<'py, PyArray1<u8>>, Bound<'py, PyArray1<f32>>);

fn into_pair(py: Python<'_>, q: codec::Quantized) -> Pair<'_> {
    (q.codes.into_pyarray(py), q.absmax.into_pyarray(py))
}

/// Quantizes a flat array; `bits16` says how to read uint16 input ("float16" or "bfloat16").
#[pyfunction]
#[pyo3(signature = (x, blocksize, codebook, bits16 = None))]
fn quantize<'py>(
    py: Python<'py>,
    x: FloatArray<'py>,
    blocksize: Size,
    codebook: &str,
    bits16: Option<&str>,
) -> PyResult<Pair<'py>> {
    let format = parse_format(codebook)?;
    let Size(blocksize) = blocksize;
    let q = match &x {
        FloatArray::F32(a) => {
            let s = slice(a, "x")?;
            py.detach(|| codec::quantize(s, blocksize, format))
        }
        FloatArray::F64(a) => {
            let s = slice(a, "x")?;
            py.detach(|| codec::quantize(s, blocksize, format))
        }
        FloatArray::Bits16(a) => {
            let s = slice(a, "x")?;
            match bits16 {
                Some("float16") => {
                    let s: &[f16] = s.reinterpret_cast();
                    py.detach(|| codec::quantize(s, blocksize, format))
                }
                Some("bfloat16") => {
                    let s: &[bf16] = s.reinterpret_cast();
                    py.detach(|| codec::quantize(s, blocksize, format))
                }
                other => return Err(bits16_error(other)),
            }
        }
    }?;
    Ok(into_pair(py, q))
}

/// A flat output array: f32, or 16-bit floats written as their uint16 bits.
#[derive(FromPyObject)]
enum FloatArrayMut<'py> {
    F32(PyReadwriteArray1<'py, f32>),
    Bits16(PyReadwriteArray1<'py, u16>),
}

/// Dequantizes into `out` (its length is the element count). The caller allocates `out`
/// with numpy, whose allocator asks for huge pages: far fewer page faults on big outputs.
#[pyfunction]
#[pyo3(signature = (codes, absmax, blocksize, codebook, out, bits16 = None))]
fn dequantize_into<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    absmax: PyReadonlyArray1<'py, f32>,
    blocksize: Size,
    codebook: &str,
    mut out: FloatArrayMut<'py>,
    bits16: Option<&str>,
) -> PyResult<()> {
    let format = parse_format(codebook)?;
    let Size(blocksize) = blocksize;
    let (c, a) = (slice(&codes, "codes")?, slice(&absmax, "absmax")?);
    let not_contiguous = || PyValueError::new_err("out must be C-contiguous and aligned");
    match &mut out {
        FloatArrayMut::F32(o) => {
            let o = o.as_slice_mut().map_err(|_| not_contiguous())?;
            py.detach(|| codec::dequantize_into(c, a, blocksize, format, o))?;
        }
        FloatArrayMut::Bits16(o) => {
            let o = o.as_slice_mut().map_err(|_| not_contiguous())?;
            match bits16 {
                Some("float16") => {
                    let o: &mut [f16] = o.reinterpret_cast_mut();
                    py.detach(|| codec::dequantize_into(c, a, blocksize, format, o))?;
                }
                Some("bfloat16") => {
                    let o: &mut [bf16] = o.reinterpret_cast_mut();
                    py.detach(|| codec::dequantize_into(c, a, blocksize, format, o))?;
                }
                other => return Err(bits16_error(other)),
            }
        }
    }
    Ok(())
}

fn bits16_error(got: Option<&str>) -> PyErr {
    PyValueError::new_err(format!(
        "uint16 arrays need bits16='float16' or 'bfloat16', got {got:?}"
    ))
}

/// Split layout (blocksize 64) -> `nblocks * 36` bytes.
#[pyfunction]
fn to_blocks36<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    absmax: PyReadonlyArray1<'py, f32>,
    n: Size,
    codebook: &str,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let format = parse_format(codebook)?;
    if format.bits() != 4 {
        return Err(PyValueError::new_err(format!(
            "the 36-byte block layout holds 4-bit codes; codebook {:?} has {}-bit codes",
            format.name(),
            format.bits()
        )));
    }
    let (pad, Size(n)) = (format.zero_code(), n);
    let (c, a) = (slice(&codes, "codes")?, slice(&absmax, "absmax")?);
    Ok(py
        .detach(|| layout::to_blocks36(c, a, n, pad))?
        .into_pyarray(py))
}

/// `nblocks * 36` bytes -> split layout (codes, absmax) for `n` values.
#[pyfunction]
fn from_blocks36<'py>(
    py: Python<'py>,
    buf: PyReadonlyArray1<'py, u8>,
    n: Size,
) -> PyResult<Pair<'py>> {
    let (b, Size(n)) = (slice(&buf, "buf")?, n);
    let (codes, absmax) = py.detach(|| layout::from_blocks36(b, n))?;
    Ok(into_pair(py, codec::Quantized { codes, absmax }))
}

/// A read-only strided view of a 2-D array (strides in elements, non-negative).
fn mat_ref<'a>(a: &'a PyReadonlyArray2<'_, f32>, what: &str) -> PyResult<MatRef<'a>> {
    // numpy's `aligned` flag also says every stride is a whole number of elements.
    if !a.is_aligned() {
        return Err(PyValueError::new_err(format!("{what} must be aligned")));
    }
    let v = a.as_array();
    let (rows, cols) = v.dim();
    let &[rs, cs] = v.strides() else {
        return Err(PyValueError::new_err(format!("{what} must be 2-D")));
    };
    if rs < 0 || cs < 0 {
        return Err(PyValueError::new_err(format!(
            "{what} has negative strides"
        )));
    }
    // One past the last element; no overflow for an array numpy holds in memory.
    let extent = match (rows.checked_sub(1), cols.checked_sub(1)) {
        (Some(last_row), Some(last_col)) => last_row
            .checked_mul(rs.unsigned_abs())
            .zip(last_col.checked_mul(cs.unsigned_abs()))
            .and_then(|(r, c)| r.checked_add(c)?.checked_add(1)),
        _ => Some(0),
    };
    let Some(extent) = extent else {
        return Err(PyValueError::new_err(format!(
            "{what}: a {rows}x{cols} view with strides ({rs}, {cs}) spans more than 2**64 elements"
        )));
    };
    let data = if extent == 0 {
        &[]
    } else {
        // SAFETY: the pointer is aligned (checked above) and every element of the view lies
        // in `[ptr, ptr + extent)`, all inside the one buffer numpy allocated for the array's
        // base, which stays borrowed for `'a`.
        unsafe { std::slice::from_raw_parts(v.as_ptr(), extent) }
    };
    Ok(MatRef {
        data,
        rows,
        cols,
        row_stride: rs,
        col_stride: cs,
        offset: 0,
    })
}

/// A writable C-contiguous 2-D array (a Fortran-ordered one is refused, not misread).
fn mat_mut<'a>(a: &'a mut PyReadwriteArray2<'_, f32>) -> PyResult<MatMut<'a>> {
    let (rows, cols) = a.as_array().dim();
    let not_contiguous = || PyValueError::new_err("out must be C-contiguous and aligned");
    if !a.is_c_contiguous() {
        return Err(not_contiguous());
    }
    let data = a.as_slice_mut().map_err(|_| not_contiguous())?;
    Ok(MatMut::row_major(data, rows, cols))
}

/// `out = alpha * a @ b` (or `out += ...` when `accumulate`), f32, any input strides.
#[pyfunction]
#[pyo3(
    signature = (a, b, out, alpha = Finite(1.0), accumulate = false),
    text_signature = "(a, b, out, alpha=1.0, accumulate=False)"
)]
fn matmul<'py>(
    py: Python<'py>,
    a: PyReadonlyArray2<'py, f32>,
    b: PyReadonlyArray2<'py, f32>,
    mut out: PyReadwriteArray2<'py, f32>,
    alpha: Finite,
    accumulate: bool,
) -> PyResult<()> {
    let Finite(alpha) = alpha;
    let (a, b) = (mat_ref(&a, "a")?, mat_ref(&b, "b")?);
    let mut c = mat_mut(&mut out)?;
    py.detach(|| linalg::matmul(&mut c, a, b, alpha, accumulate))?;
    Ok(())
}

/// A quantized weight [rows, cols] as the core sees it.
fn quantized<'a>(
    codes: &'a PyReadonlyArray1<'_, u8>,
    absmax: &'a PyReadonlyArray1<'_, f32>,
    shape: (Size, Size),
    blocksize: Size,
    codebook: &str,
) -> PyResult<QuantizedMatrix<'a>> {
    Ok(QuantizedMatrix {
        codes: slice(codes, "codes")?,
        absmax: slice(absmax, "absmax")?,
        rows: shape.0 .0,
        cols: shape.1 .0,
        blocksize: blocksize.0,
        format: parse_format(codebook)?,
    })
}

/// `out = alpha * x @ W^T` (or `x @ W` when `transpose` is false) for a quantized W of
/// `shape` [rows, cols], dequantized a few rows at a time.
#[pyfunction]
#[pyo3(
    signature = (x, codes, absmax, shape, blocksize, codebook, out, transpose = true, alpha = Finite(1.0), accumulate = false),
    text_signature = "(x, codes, absmax, shape, blocksize, codebook, out, transpose=True, alpha=1.0, accumulate=False)"
)]
#[allow(clippy::too_many_arguments)]
fn qmatmul<'py>(
    py: Python<'py>,
    x: PyReadonlyArray2<'py, f32>,
    codes: PyReadonlyArray1<'py, u8>,
    absmax: PyReadonlyArray1<'py, f32>,
    shape: (Size, Size),
    blocksize: Size,
    codebook: &str,
    mut out: PyReadwriteArray2<'py, f32>,
    transpose: bool,
    alpha: Finite,
    accumulate: bool,
) -> PyResult<()> {
    let Finite(alpha) = alpha;
    let w = quantized(&codes, &absmax, shape, blocksize, codebook)?;
    let x = mat_ref(&x, "x")?;
    let mut y = mat_mut(&mut out)?;
    py.detach(|| {
        if transpose {
            matmul_wt(&mut y, x, &w, alpha, accumulate)
        } else {
            matmul_w(&mut y, x, &w, alpha, accumulate)
        }
    })?;
    Ok(())
}

/// DoRA: `||W[i] + scale * (B @ A)[i]||` per row of a dense W.
#[pyfunction]
fn dora_row_norms_dense<'py>(
    py: Python<'py>,
    w: PyReadonlyArray2<'py, f32>,
    b: PyReadonlyArray2<'py, f32>,
    a: PyReadonlyArray2<'py, f32>,
    scale: Finite,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let Finite(scale) = scale;
    let w = Weight::Dense(mat_ref(&w, "w")?);
    let (b, a) = (mat_ref(&b, "b")?, mat_ref(&a, "a")?);
    Ok(py
        .detach(|| lora::dora_row_norms(&w, b, a, scale))?
        .into_pyarray(py))
}

/// DoRA: `||W[i] + scale * (B @ A)[i]||` per row of a quantized W, dequantized in tiles.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn dora_row_norms_quantized<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    absmax: PyReadonlyArray1<'py, f32>,
    shape: (Size, Size),
    blocksize: Size,
    codebook: &str,
    b: PyReadonlyArray2<'py, f32>,
    a: PyReadonlyArray2<'py, f32>,
    scale: Finite,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let Finite(scale) = scale;
    let w = Weight::Quantized(quantized(&codes, &absmax, shape, blocksize, codebook)?);
    let (b, a) = (mat_ref(&b, "b")?, mat_ref(&a, "a")?);
    Ok(py
        .detach(|| lora::dora_row_norms(&w, b, a, scale))?
        .into_pyarray(py))
}

/// Double-quantizes per-block scales -> (codes, absmax2, offset).
#[pyfunction]
fn double_quantize<'py>(
    py: Python<'py>,
    absmax: PyReadonlyArray1<'py, f32>,
) -> PyResult<(Pair<'py>, f32)> {
    let a = slice(&absmax, "absmax")?;
    let n = py.detach(|| double_quant::quantize(a))?;
    Ok((
        (n.codes.into_pyarray(py), n.absmax2.into_pyarray(py)),
        n.offset,
    ))
}

/// The scales of double-quantized `codes`.
#[pyfunction]
fn double_dequantize<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    absmax2: PyReadonlyArray1<'py, f32>,
    offset: Finite,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let Finite(offset) = offset;
    let (c, a) = (slice(&codes, "codes")?, slice(&absmax2, "absmax2")?);
    Ok(py
        .detach(|| double_quant::dequantize(c, a, offset))?
        .into_pyarray(py))
}

/// The value table of a format, indexed by code.
#[pyfunction]
fn codebook_values(codebook: &str) -> PyResult<Vec<f32>> {
    Ok(parse_format(codebook)?.values())
}

/// The decision thresholds of a format, ascending, as the core compares against them (FP4:
/// on the magnitude; int8: none, its code is arithmetic).
#[pyfunction]
fn codebook_thresholds(codebook: &str) -> PyResult<Vec<f32>> {
    Ok(parse_format(codebook)?.thresholds().to_vec())
}

/// The FP4 code of the k-th smallest magnitude (sign bit clear).
#[pyfunction]
fn fp4_magnitude_codes() -> Vec<u32> {
    // Widened: PyO3 would turn a Vec<u8> into `bytes`, not a list of ints.
    crate::codebook::FP4_MAGNITUDE_CODES.map(u32::from).to_vec()
}

/// The code that decodes to zero (all-zero blocks, padding nibbles).
#[pyfunction]
fn zero_code(codebook: &str) -> PyResult<u8> {
    Ok(parse_format(codebook)?.zero_code())
}

/// Bits per stored code (4 or 8).
#[pyfunction]
fn code_bits(codebook: &str) -> PyResult<usize> {
    Ok(parse_format(codebook)?.bits())
}

mod kernels {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// The CUDA sources of `kernels/` (file name -> source), compiled lazily by the GPU backend.
#[pyfunction]
fn kernel_sources() -> std::collections::HashMap<&'static str, &'static str> {
    kernels::KERNEL_SOURCES.iter().copied().collect()
}

/// The instruction set the codec's block kernels use on this CPU ("avx2", "neon" or "scalar").
#[pyfunction]
fn simd_level() -> &'static str {
    crate::simd::level().name()
}

/// The instruction set of the dense f32 products' kernels on this CPU ("avx512", "avx2",
/// "neon" or "scalar"; `NYBBLE_CPU_ISA=avx2` or `scalar` caps it, read once).
#[pyfunction]
fn matmul_isa() -> &'static str {
    crate::simd::matmul_level().name()
}

/// Panics on purpose: the tests use it to prove a Rust panic reaches Python as an
/// exception, never as an abort.
#[pyfunction]
#[allow(clippy::panic)] // the one panic on purpose
fn _panic(message: &str) {
    panic!("{message}");
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_into, m)?)?;
    m.add_function(wrap_pyfunction!(to_blocks36, m)?)?;
    m.add_function(wrap_pyfunction!(from_blocks36, m)?)?;
    m.add_function(wrap_pyfunction!(matmul, m)?)?;
    m.add_function(wrap_pyfunction!(qmatmul, m)?)?;
    m.add_function(wrap_pyfunction!(dora_row_norms_dense, m)?)?;
    m.add_function(wrap_pyfunction!(dora_row_norms_quantized, m)?)?;
    m.add_function(wrap_pyfunction!(double_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(double_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(codebook_values, m)?)?;
    m.add_function(wrap_pyfunction!(codebook_thresholds, m)?)?;
    m.add_function(wrap_pyfunction!(fp4_magnitude_codes, m)?)?;
    m.add_function(wrap_pyfunction!(zero_code, m)?)?;
    m.add_function(wrap_pyfunction!(code_bits, m)?)?;
    m.add("NESTED_BLOCKSIZE", double_quant::NESTED_BLOCKSIZE)?;
    m.add("MIN_BLOCKSIZE", layout::MIN_BLOCKSIZE)?;
    m.add("MAX_BLOCKSIZE", layout::MAX_BLOCKSIZE)?;
    m.add("BLOCK36_VALUES", layout::BLOCK36_VALUES)?;
    m.add("BLOCK36_BYTES", layout::BLOCK36_BYTES)?;
    m.add_function(wrap_pyfunction!(simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(matmul_isa, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_sources, m)?)?;
    m.add_function(wrap_pyfunction!(_panic, m)?)?;
    #[cfg(unix)]
    crate::py_launch::register(m)?;
    Ok(())
}
