//! The Python binding (`nybble._core`): converts arrays, releases the GIL around the work,
//! and maps core errors to Python exceptions. No logic of its own lives here.

use half::slice::HalfBitsSliceExt;
use half::{bf16, f16};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::codebook::Format;
use crate::error::Error;
use crate::{codec, layout};

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        PyValueError::new_err(e.to_string())
    }
}

fn parse_format(name: &str) -> PyResult<Format> {
    Format::parse(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "codebook must be 'nf4', 'fp4' or 'int8', got {name:?}"
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
                other => {
                    return Err(PyValueError::new_err(format!(
                        "uint16 input needs bits16='float16' or 'bfloat16', got {other:?}"
                    )))
                }
            }
        }
    }?;
    Ok(into_pair(py, q))
}

/// Dequantizes `n` values to `dtype` ("float32", or "float16"/"bfloat16" returned as uint16 bits).
#[pyfunction]
fn dequantize<'py>(
    py: Python<'py>,
    codes: PyReadonlyArray1<'py, u8>,
    absmax: PyReadonlyArray1<'py, f32>,
    n: usize,
    blocksize: usize,
    codebook: &str,
    dtype: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let format = parse_format(codebook)?;
    let (c, a) = (slice(&codes, "codes")?, slice(&absmax, "absmax")?);
    Ok(match dtype {
        "float32" => {
            let mut out = vec![0f32; n];
            py.detach(|| codec::dequantize_into(c, a, blocksize, format, &mut out))?;
            out.into_pyarray(py).into_any()
        }
        "float16" | "bfloat16" => {
            // Written through a 16-bit float view of a uint16 buffer (zeroed lazily by the OS).
            let mut out = vec![0u16; n];
            if dtype == "float16" {
                let o: &mut [f16] = out.reinterpret_cast_mut();
                py.detach(|| codec::dequantize_into(c, a, blocksize, format, o))?;
            } else {
                let o: &mut [bf16] = out.reinterpret_cast_mut();
                py.detach(|| codec::dequantize_into(c, a, blocksize, format, o))?;
            }
            out.into_pyarray(py).into_any()
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "dtype must be 'float32', 'float16' or 'bfloat16', got {other:?}"
            )))
        }
    })
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

/// The value table of a format, indexed by code.
#[pyfunction]
fn codebook_values(codebook: &str) -> PyResult<Vec<f32>> {
    Ok(parse_format(codebook)?.values())
}

/// The instruction set the kernels use on this CPU ("avx2" or "scalar").
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
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(to_blocks36, m)?)?;
    m.add_function(wrap_pyfunction!(from_blocks36, m)?)?;
    m.add_function(wrap_pyfunction!(codebook_values, m)?)?;
    m.add_function(wrap_pyfunction!(simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(_panic, m)?)?;
    Ok(())
}
