//! The Python binding (`nybble._core`): converts arrays, releases the GIL around the work,
//! and maps core errors to Python exceptions. No logic of its own lives here.

use half::slice::HalfBitsSliceExt;
use half::{bf16, f16};
use numpy::{
    IntoPyArray, PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray1, PyReadwriteArray2,
};
use pyo3::exceptions::PyValueError;
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

fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{what} must be C-contiguous")))
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
    blocksize: usize,
    codebook: &str,
    bits16: Option<&str>,
) -> PyResult<Pair<'py>> {
    let format = parse_format(codebook)?;
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
    blocksize: usize,
    codebook: &str,
    mut out: FloatArrayMut<'py>,
    bits16: Option<&str>,
) -> PyResult<()> {
    let format = parse_format(codebook)?;
    let (c, a) = (slice(&codes, "codes")?, slice(&absmax, "absmax")?);
    let not_contiguous = || PyValueError::new_err("out must be C-contiguous");
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
    n: usize,
    codebook: &str,
) -> PyResult<Bound<'py, PyArray1<u8>>> {
    let pad = parse_format(codebook)?.zero_code();
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
    n: usize,
) -> PyResult<Pair<'py>> {
    let b = slice(&buf, "buf")?;
    let (codes, absmax) = py.detach(|| layout::from_blocks36(b, n))?;
    Ok(into_pair(py, codec::Quantized { codes, absmax }))
}

/// A read-only strided view of a 2-D array (strides in elements, non-negative).
fn mat_ref<'a>(a: &'a PyReadonlyArray2<'_, f32>, what: &str) -> PyResult<MatRef<'a>> {
    let v = a.as_array();
    let (rows, cols) = v.dim();
    let (rs, cs) = (v.strides()[0], v.strides()[1]);
    if rs < 0 || cs < 0 {
        return Err(PyValueError::new_err(format!(
            "{what} has negative strides"
        )));
    }
    let extent = if rows * cols == 0 {
        0
    } else {
        (rows - 1) * rs as usize + (cols - 1) * cs as usize + 1
    };
    // SAFETY: every element of the view lies in `[ptr, ptr + extent)`, all inside the one
    // buffer numpy allocated for the array's base, which stays borrowed for `'a`.
    let data = unsafe { std::slice::from_raw_parts(v.as_ptr(), extent) };
    Ok(MatRef {
        data,
        rows,
        cols,
        row_stride: rs,
        col_stride: cs,
        offset: 0,
    })
}

/// A writable C-contiguous 2-D array.
fn mat_mut<'a>(a: &'a mut PyReadwriteArray2<'_, f32>) -> PyResult<MatMut<'a>> {
    let (rows, cols) = a.as_array().dim();
    let data = a
        .as_slice_mut()
        .map_err(|_| PyValueError::new_err("out must be C-contiguous"))?;
    Ok(MatMut::row_major(data, rows, cols))
}

/// `out = alpha * a @ b` (or `out += ...` when `accumulate`), f32, any input strides.
#[pyfunction]
#[pyo3(signature = (a, b, out, alpha = 1.0, accumulate = false))]
fn matmul<'py>(
    py: Python<'py>,
    a: PyReadonlyArray2<'py, f32>,
    b: PyReadonlyArray2<'py, f32>,
    mut out: PyReadwriteArray2<'py, f32>,
    alpha: f32,
    accumulate: bool,
) -> PyResult<()> {
    let (a, b) = (mat_ref(&a, "a")?, mat_ref(&b, "b")?);
    let mut c = mat_mut(&mut out)?;
    py.detach(|| linalg::matmul(&mut c, a, b, alpha, accumulate))?;
    Ok(())
}

/// A quantized weight [rows, cols] as the core sees it.
fn quantized<'a>(
    codes: &'a PyReadonlyArray1<'_, u8>,
    absmax: &'a PyReadonlyArray1<'_, f32>,
    shape: (usize, usize),
    blocksize: usize,
    codebook: &str,
) -> PyResult<QuantizedMatrix<'a>> {
    Ok(QuantizedMatrix {
        codes: slice(codes, "codes")?,
        absmax: slice(absmax, "absmax")?,
        rows: shape.0,
        cols: shape.1,
        blocksize,
        format: parse_format(codebook)?,
    })
}

/// `out = alpha * x @ W^T` (or `x @ W` when `transpose` is false) for a quantized W of
/// `shape` [rows, cols], dequantized a few rows at a time.
#[pyfunction]
#[pyo3(signature = (x, codes, absmax, shape, blocksize, codebook, out, transpose = true, alpha = 1.0, accumulate = false))]
#[allow(clippy::too_many_arguments)]
fn qmatmul<'py>(
    py: Python<'py>,
    x: PyReadonlyArray2<'py, f32>,
    codes: PyReadonlyArray1<'py, u8>,
    absmax: PyReadonlyArray1<'py, f32>,
    shape: (usize, usize),
    blocksize: usize,
    codebook: &str,
    mut out: PyReadwriteArray2<'py, f32>,
    transpose: bool,
    alpha: f32,
    accumulate: bool,
) -> PyResult<()> {
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
    scale: f32,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
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
    shape: (usize, usize),
    blocksize: usize,
    codebook: &str,
    b: PyReadonlyArray2<'py, f32>,
    a: PyReadonlyArray2<'py, f32>,
    scale: f32,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
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
    offset: f32,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
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

/// The instruction set the kernels use on this CPU ("avx2", "neon" or "scalar").
#[pyfunction]
fn simd_level() -> &'static str {
    crate::simd::level().name()
}

/// Panics on purpose: the tests use it to prove a Rust panic reaches Python as an
/// exception, never as an abort.
#[pyfunction]
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
    m.add_function(wrap_pyfunction!(kernel_sources, m)?)?;
    m.add_function(wrap_pyfunction!(_panic, m)?)?;
    Ok(())
}
