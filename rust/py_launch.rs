//! The binding of the kernel launches (`cuda_launch`), unix only: `KernelLaunch`, a prepared
//! launch that the Python package's hot GPU calls give a stream and the values that change, and
//! `GemvCall`, the fused GEMV's call as a decode loop makes it (`nybble.cuda.nf4_matmul` with a
//! prepared weight), from the arrays to the driver with no Python between.
//!
//! `GemvCall` reads CuPy's arrays through their attributes (`dtype`, `shape`, `strides`,
//! `data.ptr`, `data.device_id`) and takes a call only when each is what the launch was made for
//! by a checked call of the Python package (`GemvWeight`); anything else returns None, and the
//! caller takes the checked path, which says what is wrong. The same checks made in Python cost
//! about 3 microseconds of a call's host time on the GPU machine, as much as the driver's launch.

use std::ffi::c_ulong;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple, PyType};

use crate::cuda_launch::{self, LaunchError};

/// A prepared kernel launch through the CUDA driver (`cuda_launch`): the Python package's hot
/// GPU calls give it the stream and the values that change; the GIL is released around the
/// driver's call.
#[pyclass(module = "nybble._core", name = "KernelLaunch", frozen)]
pub struct KernelLaunch(cuda_launch::KernelLaunch);

fn launch_error(e: LaunchError) -> PyErr {
    match e {
        LaunchError::Arguments(_) => PyValueError::new_err(e.to_string()),
        LaunchError::Unavailable(_) | LaunchError::Driver(..) => {
            PyRuntimeError::new_err(e.to_string())
        }
    }
}

/// A grid as Python gives it: blocks along x (an int), or a tuple of 1 to 3 of them (x, y, z),
/// as CuPy takes a kernel's grid. An int is converted as before tuples were taken (the same
/// OverflowError or TypeError for one that is no u32).
fn grid(value: &Bound<'_, PyAny>) -> PyResult<[u32; 3]> {
    let Ok(tuple) = value.cast::<PyTuple>() else {
        return Ok([value.extract()?, 1, 1]);
    };
    let dims: Vec<u32> = tuple.extract()?;
    match dims.as_slice() {
        [x] => Ok([*x, 1, 1]),
        [x, y] => Ok([*x, *y, 1]),
        [x, y, z] => Ok([*x, *y, *z]),
        _ => Err(PyValueError::new_err(format!(
            "grid: expected an int or a tuple of 1 to 3 ints, got a tuple of {}",
            dims.len()
        ))),
    }
}

impl KernelLaunch {
    /// Launches with the GIL released around the driver's call.
    fn call(
        &self,
        py: Python<'_>,
        stream: usize,
        values: &[u64],
        grid: Option<[u32; 3]>,
    ) -> PyResult<()> {
        let launch = &self.0;
        py.detach(|| launch.launch(stream, values, grid))
            .map_err(launch_error)
    }
}

#[pymethods]
impl KernelLaunch {
    /// RuntimeError where the driver library cannot be loaded, ValueError for arguments that
    /// make no launch. `grid`: blocks along x, or a tuple of 1 to 3 (x, y, z).
    #[new]
    fn new(
        function: usize,
        grid: &Bound<'_, PyAny>,
        block: u32,
        shared_mem: u32,
        slots: Vec<u64>,
        varying: Vec<usize>,
        programmatic: bool,
    ) -> PyResult<Self> {
        let launch = cuda_launch::KernelLaunch::new(
            function,
            self::grid(grid)?,
            block,
            shared_mem,
            slots,
            varying,
            programmatic,
        )
        .map_err(PyValueError::new_err)?;
        cuda_launch::programmatic_available().map_err(launch_error)?;
        Ok(KernelLaunch(launch))
    }

    /// Whether a launch has succeeded: the later ones are programmatic where this launch is.
    #[getter]
    fn primed(&self) -> bool {
        self.0.primed()
    }

    /// Whether the driver launches programmatically (it has cuLaunchKernelEx, CUDA 12 and
    /// later); RuntimeError where the driver library cannot be loaded.
    #[staticmethod]
    fn programmatic_available() -> PyResult<bool> {
        cuda_launch::programmatic_available().map_err(launch_error)
    }

    /// Sets the varying parameters to `values` (addresses or raw 8-byte values) and launches
    /// on `stream` (a CUstream handle) over `grid` blocks (an int, or a tuple of 1 to 3 for x,
    /// y and z; default: the launch's).
    #[pyo3(signature = (stream, *values, grid=None))]
    fn __call__(
        &self,
        py: Python<'_>,
        stream: usize,
        values: &Bound<'_, PyTuple>,
        grid: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let given: Vec<u64> = values.extract()?;
        let grid = grid.map(self::grid).transpose()?;
        self.call(py, stream, &given, grid)
    }
}

/// Token counts a GEMV launch takes at most (`nybble.cuda.GEMV_MAX_TOKENS`: `add` refuses more).
const MAX_TOKENS: usize = 8;

/// Outputs allocated ahead are for the stream, the thread and the generation they were made
/// in; `GemvCall.forget_outputs_ahead` starts a new generation (before a graph capture, whose
/// stream may have a handle that an earlier stream had and must own every output it writes).
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The launch for one token dtype and count, and the outputs allocated ahead for its calls
/// without `out` (a list of ((stream, thread, generation), array), shared with the Python
/// function that fills it).
struct Entry {
    launch: Py<KernelLaunch>,
    ahead: Py<PyList>,
}

/// The fused GEMV's call for one weight, y[m, rows] = x[m, cols] @ W.T with 16-bit tokens: the
/// launches its checked calls prepared, by token dtype and count. See the module's comment.
#[pyclass(module = "nybble._core", name = "GemvCall", frozen)]
pub struct GemvCall {
    /// What the launches' arguments point at (the weight's arrays), held alive with this call.
    _keep: Py<PyAny>,
    array_type: Py<PyType>,
    current_stream: Py<PyAny>,
    allocate_ahead: Py<PyAny>,
    dtypes: [Py<PyAny>; 2],
    device: i64,
    rows: usize,
    cols: usize,
    /// By dtype (the index in `dtypes`) and token count - 1.
    entries: [[OnceLock<Entry>; MAX_TOKENS]; 2],
}

/// A tuple of two non-negative integers, else None.
fn pair(value: &Bound<'_, PyAny>) -> Option<(usize, usize)> {
    let tuple = value.cast::<PyTuple>().ok()?;
    if tuple.len() != 2 {
        return None;
    }
    let first = tuple.get_borrowed_item(0).ok()?.extract().ok()?;
    let second = tuple.get_borrowed_item(1).ok()?.extract().ok()?;
    Some((first, second))
}

/// Whether two dtypes are one: the same object (CuPy hands out numpy's), else equal.
fn same_dtype(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> bool {
    a.is(b) || a.eq(b).unwrap_or(false)
}

impl GemvCall {
    /// The entry of token dtype `which` (an index in `dtypes`) and `m` tokens; None past them.
    fn slot(&self, which: usize, m: usize) -> Option<&OnceLock<Entry>> {
        self.entries.get(which)?.get(m.checked_sub(1)?)
    }

    /// The address of `a` (an array of the right type, dtype and shape) where its rows are
    /// `row_bytes` apart and contiguous, it starts on 16 bytes, and it lives on the weight's
    /// device; else None.
    fn address(&self, a: &Bound<'_, PyAny>, row_bytes: usize) -> PyResult<Option<u64>> {
        let py = a.py();
        if pair(&a.getattr(intern!(py, "strides"))?) != Some((row_bytes, 2)) {
            return Ok(None);
        }
        let data = a.getattr(intern!(py, "data"))?;
        let at: u64 = data.getattr(intern!(py, "ptr"))?.extract()?;
        let device: i64 = data.getattr(intern!(py, "device_id"))?.extract()?;
        Ok((at.is_multiple_of(16) && device == self.device).then_some(at))
    }
}

#[pymethods]
impl GemvCall {
    /// A weight's GEMV call over `rows` x `cols` on `device`: `keep` holds what its launches
    /// point at (the weight's arrays), `array_type` is the array class taken (cupy.ndarray),
    /// `current_stream` returns the stream to launch on (an object with `ptr` and
    /// `is_capturing()`), `allocate_ahead(ahead, stream, made_for, shape, dtype)` allocates the
    /// next call's output after a launch, `dtypes` are the two 16-bit token dtypes.
    #[new]
    #[allow(clippy::too_many_arguments)] // one per fact the call checks against
    fn new(
        keep: Py<PyAny>,
        array_type: Py<PyType>,
        current_stream: Py<PyAny>,
        allocate_ahead: Py<PyAny>,
        dtypes: (Py<PyAny>, Py<PyAny>),
        device: i64,
        rows: usize,
        cols: usize,
    ) -> Self {
        GemvCall {
            _keep: keep,
            array_type,
            current_stream,
            allocate_ahead,
            dtypes: [dtypes.0, dtypes.1],
            device,
            rows,
            cols,
            entries: std::array::from_fn(|_| std::array::from_fn(|_| OnceLock::new())),
        }
    }

    /// Calls for `m` tokens of `dtypes[which]` launch `launch` (x's address, then y's);
    /// outputs are allocated ahead into `ahead`. The first registration of a kind stays.
    fn add(
        &self,
        which: usize,
        m: usize,
        launch: Py<KernelLaunch>,
        ahead: Py<PyList>,
    ) -> PyResult<()> {
        let slot = self.slot(which, m).ok_or_else(|| {
            PyValueError::new_err(format!(
                "expected a dtype index below 2 and 1 <= m <= {MAX_TOKENS}, got {which} and {m}"
            ))
        })?;
        // A second registration (a twin prepared by another thread at once, of the same
        // kernel and arguments) changes nothing: the first one stays.
        let _ = slot.set(Entry { launch, ahead });
        Ok(())
    }

    /// No output allocated before this call is handed out after it.
    #[staticmethod]
    fn forget_outputs_ahead() {
        GENERATION.fetch_add(1, Ordering::Relaxed);
    }

    /// Launches x @ W.T into `out`, or without `out` into the output the previous call of this
    /// thread on this stream allocated ahead (allocating the next one once the kernel is
    /// queued, so the allocation runs beside it), and returns that output; None (nothing
    /// launched) when the call is not one this weight's checked calls prepared: x a C-contiguous
    /// [m, cols] array of a registered dtype and count, `out` None or a C-contiguous [m, rows]
    /// array of x's dtype, both 16-byte aligned on the weight's device.
    #[pyo3(signature = (x, out=None))]
    fn __call__<'py>(
        &self,
        x: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = x.py();
        let array_type = self.array_type.bind(py);
        if !x.get_type().is(array_type) {
            return Ok(None);
        }
        let dtype = x.getattr(intern!(py, "dtype"))?;
        let Some(which) = self
            .dtypes
            .iter()
            .position(|d| same_dtype(&dtype, d.bind(py)))
        else {
            return Ok(None);
        };
        let Some((m, cols)) = pair(&x.getattr(intern!(py, "shape"))?) else {
            return Ok(None);
        };
        let entry = self.slot(which, m).and_then(OnceLock::get);
        let (Some(entry), true) = (entry, cols == self.cols) else {
            return Ok(None);
        };
        let row_bytes = self.cols.saturating_mul(2);
        let Some(at_x) = self.address(x, row_bytes)? else {
            return Ok(None);
        };
        let stream = self.current_stream.bind(py).call0()?;
        let at_stream: usize = stream.getattr(intern!(py, "ptr"))?.extract()?;
        let launch = entry.launch.get();
        if let Some(out) = out {
            let fits = out.get_type().is(array_type)
                && same_dtype(&out.getattr(intern!(py, "dtype"))?, &dtype)
                && pair(&out.getattr(intern!(py, "shape"))?) == Some((m, self.rows));
            let Some(at_y) = (if fits {
                self.address(out, self.rows.saturating_mul(2))?
            } else {
                None
            }) else {
                return Ok(None);
            };
            launch.call(py, at_stream, &[at_x, at_y], None)?;
            return Ok(Some(out.clone()));
        }
        // SAFETY: PyThread_get_thread_ident only reads the calling thread's identity (what
        // `threading.get_ident` returns); the GIL is held.
        let thread = unsafe { pyo3::ffi::PyThread_get_thread_ident() };
        let made_for = (at_stream, thread, GENERATION.load(Ordering::Relaxed));
        let ahead = entry.ahead.bind(py);
        // The last one waiting, taken off the list with no Python run between (under the GIL,
        // no other thread takes it meanwhile).
        let waiting = match ahead.len().checked_sub(1) {
            Some(last) => {
                let item = ahead.get_item(last)?;
                ahead.del_item(last)?;
                Some(item)
            }
            None => None,
        };
        let ready = waiting.and_then(|item| {
            let (key, y): ((usize, c_ulong, u64), Bound<'py, PyAny>) = item.extract().ok()?;
            (key == made_for).then_some(y)
        });
        let shape = (m, self.rows);
        // None, or memory of another stream (dropped: back to its pool): one allocated now.
        let y = match ready {
            Some(y) => y,
            None => array_type.call1((shape, &dtype))?,
        };
        let at_y: u64 = y
            .getattr(intern!(py, "data"))?
            .getattr(intern!(py, "ptr"))?
            .extract()?;
        launch.call(py, at_stream, &[at_x, at_y], None)?;
        self.allocate_ahead
            .bind(py)
            .call1((ahead, stream, made_for, shape, dtype))?;
        Ok(Some(y))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KernelLaunch>()?;
    m.add_class::<GemvCall>()?;
    Ok(())
}
