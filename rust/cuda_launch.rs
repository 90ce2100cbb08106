//! Kernel launches through the CUDA driver library, loaded at run time (`libcuda.so.1`; nothing
//! links against CUDA). The Python package compiles and loads its kernels with CuPy and prepares
//! each launch once; a launch made here costs the driver's call and little else, where the same
//! call through ctypes spends 1-2.6 microseconds more of the host's time (H100 hosts; see
//! benchmarks/results/history-2026-11.md, "Where the GPU path stood (2026-11-27, fifth
//! round)"). The GIL is released around the driver's call, as CuPy's and ctypes' launches do,
//! so a call never holds it while the driver blocks on a full queue.
//!
//! The caller vouches for what the driver gets: a loaded function of its context, parameters
//! matching the kernel's, a stream of the same context. Nothing here reads device memory.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// A kernel's parameters at most (the tensor-core GEMV's take 14).
pub const MAX_PARAMS: usize = 16;

/// Why a launch was not made: no driver, arguments that do not fit the launch, or the
/// CUresult of a failed driver call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchError {
    Unavailable(String),
    Arguments(String),
    /// The CUresult and its name.
    Driver(i32, String),
}

impl std::fmt::Display for LaunchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LaunchError::Unavailable(why) => write!(f, "the CUDA driver is unavailable: {why}"),
            LaunchError::Arguments(why) => f.write_str(why),
            LaunchError::Driver(code, name) => {
                write!(f, "the kernel launch failed: CUresult {code} ({name})")
            }
        }
    }
}

type LaunchKernel = unsafe extern "C" fn(
    function: *mut c_void,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> c_int;

type LaunchKernelEx = unsafe extern "C" fn(
    config: *const LaunchConfig,
    function: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> c_int;

/// CUlaunchAttribute: an id, padding, a 64-byte value (a union holding pointers: 8-aligned).
#[repr(C, align(8))]
struct LaunchAttribute {
    id: c_int,
    pad: [u8; 4],
    value: [u8; 64],
}

/// CUlaunchConfig (CUDA 12).
#[repr(C)]
struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_mem: c_uint,
    stream: *mut c_void,
    attrs: *mut LaunchAttribute,
    num_attrs: c_uint,
}

/// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
const PROGRAMMATIC: c_int = 6;

type GetErrorName = unsafe extern "C" fn(status: c_int, name: *mut *const c_char) -> c_int;

struct Driver {
    launch: LaunchKernel,
    /// None before CUDA 12.
    launch_ex: Option<LaunchKernelEx>,
    error_name: Option<GetErrorName>,
}

impl Driver {
    /// "CUDA_ERROR_..." for a CUresult, where the driver knows it.
    fn error_name(&self, status: c_int) -> Option<String> {
        let get = self.error_name?;
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static NUL-terminated string, or fails.
        let found = unsafe { get(status, &mut name) };
        if found != 0 || name.is_null() {
            return None;
        }
        // SAFETY: non-null, static and NUL-terminated (above).
        Some(
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned(),
        )
    }
}

fn driver() -> Result<&'static Driver, LaunchError> {
    static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();
    DRIVER
        .get_or_init(load_driver)
        .as_ref()
        .map_err(|why| LaunchError::Unavailable(why.clone()))
}

fn load_driver() -> Result<Driver, String> {
    // SAFETY: dlopen and dlsym take NUL-terminated names; the library stays loaded (never
    // closed), so the function pointers stay valid; the symbols have the CUDA driver API's
    // signatures that the types above spell out.
    unsafe {
        let handle = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if handle.is_null() {
            return Err(dl_error("libcuda.so.1"));
        }
        let launch = libc::dlsym(handle, c"cuLaunchKernel".as_ptr());
        if launch.is_null() {
            return Err(dl_error("cuLaunchKernel"));
        }
        let launch_ex = libc::dlsym(handle, c"cuLaunchKernelEx".as_ptr());
        let error_name = libc::dlsym(handle, c"cuGetErrorName".as_ptr());
        Ok(Driver {
            launch: std::mem::transmute::<*mut c_void, LaunchKernel>(launch),
            launch_ex: (!launch_ex.is_null())
                .then(|| std::mem::transmute::<*mut c_void, LaunchKernelEx>(launch_ex)),
            error_name: (!error_name.is_null())
                .then(|| std::mem::transmute::<*mut c_void, GetErrorName>(error_name)),
        })
    }
}

fn dl_error(what: &str) -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        return format!("{what} not found");
    }
    // SAFETY: non-null, NUL-terminated (above).
    let text = unsafe { CStr::from_ptr(message as *const c_char) };
    text.to_string_lossy().into_owned()
}

/// Whether programmatic launches are possible: the driver has cuLaunchKernelEx.
pub fn programmatic_available() -> Result<bool, LaunchError> {
    Ok(driver()?.launch_ex.is_some())
}

/// One kernel's launch, prepared: its parameters' values held in 8-byte slots (a parameter of
/// 4 bytes in the slot's low bytes, little-endian as the driver reads it), some of them given
/// by each call. A call copies the slots and changes only its copy, so calls from several
/// threads never see each other's values.
pub struct KernelLaunch {
    function: usize,
    /// Blocks along x, y and z.
    grid: [u32; 3],
    block: u32,
    shared_mem: u32,
    slots: [u64; MAX_PARAMS],
    count: usize,
    /// The slots a call sets, in the order of its values.
    varying: Vec<usize>,
    /// Programmatic once primed: the first launch that succeeds is plain, so that it runs after
    /// whatever wrote the kernel's constant inputs (see
    /// `nybble.backends.cuda.kernels.PreparedLaunch`).
    programmatic: bool,
    primed: AtomicBool,
}

impl KernelLaunch {
    /// A launch of `function` (a CUfunction) over a grid of `grid` blocks (x, y, z) of `block`
    /// threads with `shared_mem` bytes of dynamic shared memory; `slots` hold the parameters'
    /// values, `varying` the indices of those each call sets.
    pub fn new(
        function: usize,
        grid: [u32; 3],
        block: u32,
        shared_mem: u32,
        slots: Vec<u64>,
        varying: Vec<usize>,
        programmatic: bool,
    ) -> Result<KernelLaunch, String> {
        if function == 0 {
            return Err("function: a null CUfunction".into());
        }
        if grid.contains(&0) || block == 0 {
            return Err(format!(
                "grid and block must be positive, got {grid:?} and {block}"
            ));
        }
        let mut held = [0u64; MAX_PARAMS];
        if slots.len() > MAX_PARAMS {
            return Err(format!(
                "a kernel of at most {MAX_PARAMS} parameters, got {}",
                slots.len()
            ));
        }
        for (slot, &value) in held.iter_mut().zip(&slots) {
            *slot = value;
        }
        if let Some(bad) = varying.iter().find(|&&i| i >= slots.len()) {
            return Err(format!(
                "varying: parameter {bad} of a kernel of {} parameters",
                slots.len()
            ));
        }
        Ok(KernelLaunch {
            function,
            grid,
            block,
            shared_mem,
            slots: held,
            count: slots.len(),
            varying,
            programmatic,
            primed: AtomicBool::new(false),
        })
    }

    /// Whether a launch has succeeded, so that the next one is programmatic (if this launch is).
    pub fn primed(&self) -> bool {
        self.primed.load(Ordering::Relaxed)
    }

    /// How many values a call sets.
    pub fn varying(&self) -> usize {
        self.varying.len()
    }

    /// Sets the varying parameters to `values` (as many as `varying`, else an error and no
    /// launch) and launches on `stream` (a CUstream handle; 0 the legacy default stream) over
    /// a grid of `grid` blocks (x, y, z; None: the launch's own).
    pub fn launch(
        &self,
        stream: usize,
        values: &[u64],
        grid: Option<[u32; 3]>,
    ) -> Result<(), LaunchError> {
        if values.len() != self.varying.len() {
            return Err(LaunchError::Arguments(format!(
                "a call sets {} values, got {}",
                self.varying.len(),
                values.len()
            )));
        }
        let grid = grid.unwrap_or(self.grid);
        if grid.contains(&0) {
            return Err(LaunchError::Arguments(format!(
                "grid must be positive, got {grid:?}"
            )));
        }
        let driver = driver()?;
        let mut slots = self.slots;
        for (&index, &value) in self.varying.iter().zip(values) {
            if let Some(slot) = slots.get_mut(index) {
                *slot = value;
            }
        }
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_PARAMS];
        for (param, slot) in params.iter_mut().zip(slots.iter_mut()).take(self.count) {
            *param = (slot as *mut u64).cast::<c_void>();
        }
        let function = self.function as *mut c_void;
        let stream = stream as *mut c_void;
        let programmatic = self.programmatic && self.primed.load(Ordering::Relaxed);
        let status = match driver.launch_ex.filter(|_| programmatic) {
            Some(launch_ex) => {
                let mut attribute = LaunchAttribute {
                    id: PROGRAMMATIC,
                    pad: [0; 4],
                    value: [0; 64],
                };
                attribute.value[0] = 1; // programmaticStreamSerializationAllowed
                let config = LaunchConfig {
                    grid,
                    block: [self.block, 1, 1],
                    shared_mem: self.shared_mem,
                    stream,
                    attrs: &mut attribute,
                    num_attrs: 1,
                };
                // SAFETY: config, attribute and params live through the call; the caller
                // vouches for the function, the stream and the parameters (module docs).
                unsafe { launch_ex(&config, function, params.as_mut_ptr(), std::ptr::null_mut()) }
            }
            None => {
                // SAFETY: as above.
                unsafe {
                    (driver.launch)(
                        function,
                        grid[0],
                        grid[1],
                        grid[2],
                        self.block,
                        1,
                        1,
                        self.shared_mem,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                }
            }
        };
        if status != 0 {
            let name = driver
                .error_name(status)
                .unwrap_or_else(|| "unknown".into());
            return Err(LaunchError::Driver(status, name));
        }
        self.primed.store(true, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_launches_are_refused_before_the_driver() {
        let one = [1, 1, 1];
        assert!(KernelLaunch::new(0, one, 1, 0, vec![], vec![], false).is_err());
        assert!(KernelLaunch::new(1, [0, 1, 1], 1, 0, vec![], vec![], false).is_err());
        assert!(KernelLaunch::new(1, [2, 0, 1], 1, 0, vec![], vec![], false).is_err());
        assert!(KernelLaunch::new(1, [2, 3, 0], 1, 0, vec![], vec![], false).is_err());
        assert!(KernelLaunch::new(1, one, 0, 0, vec![], vec![], false).is_err());
        assert!(KernelLaunch::new(1, one, 1, 0, vec![0; MAX_PARAMS + 1], vec![], false).is_err());
        assert!(KernelLaunch::new(1, one, 1, 0, vec![0; 3], vec![3], false).is_err());
        let ok = KernelLaunch::new(1, [4, 2, 1], 1, 0, vec![0; 3], vec![0, 2], false).unwrap();
        assert_eq!(ok.varying(), 2);
        assert!(matches!(
            ok.launch(0, &[1], None),
            Err(LaunchError::Arguments(_))
        ));
        for grid in [[0, 1, 1], [1, 0, 1], [1, 1, 0]] {
            assert!(matches!(
                ok.launch(0, &[1, 2], Some(grid)),
                Err(LaunchError::Arguments(_))
            ));
        }
    }
}
