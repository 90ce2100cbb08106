"""The compiled kernels: `kernels/nf4.cu`, compiled on first use and kept for the life of the
process, one module per device and set of `-D` overrides (tuning builds), with the launch
geometry each module defines (`LaunchFacts`, read back from the module itself).

NVRTC is called directly (through CuPy's binding) rather than through `cupy.RawModule`,
because CuPy appends `-ftz=true` to every RawModule compile: flushing subnormals to zero would
break bit-exactness with the CPU codec (tiny blocks, subnormal products). It compiles to the
device's machine code (CUBIN), not PTX: a newer NVRTC writes PTX that an older driver rejects
(seen with CUDA 13 on an H100: CUDA_ERROR_INVALID_IMAGE).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ... import _core

#: The source file (embedded in the extension by build.rs; `_core.kernel_sources()`).
KERNEL_FILE = "nf4.cu"
#: NVRTC options besides the architecture; the CI check compiles with the same. NVRTC's
#: defaults keep IEEE semantics: no flush to zero, IEEE division and square root.
OPTIONS = ("-std=c++17",)
#: The module variable holding the launch facts (kernels/nf4.cu, at its end).
FACTS_SYMBOL = "launch_facts"
#: Tokens the fused GEMV takes in one launch (more go through dequantize + cuBLAS, which is
#: faster beyond 8 on an H100: benchmarks/gpu_codec.py measures the crossover). The kernels
#: are compiled with it (-DTC_TOKENS): this is its one definition.
GEMV_MAX_TOKENS = 8
#: The definitions every compile passes: the facts the host owns.
HOST_DEFINES = (f"TC_TOKENS={GEMV_MAX_TOKENS}",)
#: CUDA's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_MAX_DYNAMIC_SHARED = 8
#: cudaMemcpyDeviceToHost
_DEVICE_TO_HOST = 2


@dataclass(frozen=True)
class LaunchFacts:
    """The launch geometry a module's kernels were compiled with, in the order of the source's
    `launch_facts` array."""

    threads: int  # every codec kernel's block
    dequant_per_block_f32: int  # outputs per dequantize block, by output dtype
    dequant_per_block_f16: int
    dequant_per_block_bf16: int
    quant_per_block_f32: int  # inputs per quantize block, by input dtype
    quant_per_block_f16: int
    quant_per_block_bf16: int
    scan_per_block_f32: int  # inputs per non-finite scan block, by input dtype
    scan_per_block_f16: int
    scan_per_block_bf16: int
    quant_buckets: int  # entries of the NF4 / FP4 encoding tables (launch.bucket_tables)
    gemv_threads: int  # the float32 GEMV
    gemv_rows: int
    gemv_tokens: int
    tc_threads: int  # the tensor-core GEMV
    tc_rows: int
    tc_shared_g32: int  # its dynamic shared memory, groups of 32 / 64 elements
    tc_shared_g64: int

    def dequant_per_block(self, dtype: str) -> int:
        return int(getattr(self, f"dequant_per_block_{SUFFIX[dtype]}"))

    def quant_per_block(self, dtype: str) -> int:
        return int(getattr(self, f"quant_per_block_{SUFFIX[dtype]}"))

    def scan_per_block(self, dtype: str) -> int:
        return int(getattr(self, f"scan_per_block_{SUFFIX[dtype]}"))

    def tc_shared(self, group: int) -> int:
        return self.tc_shared_g64 if group == 64 else self.tc_shared_g32


#: Kernel name suffixes by element dtype.
SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def source() -> str:
    """The kernel source shipped in the extension, or with `NYBBLE_KERNELS_DIR` set, the file
    in that directory (for kernel work without rebuilding the extension)."""
    directory = os.environ.get("NYBBLE_KERNELS_DIR")
    if directory:
        return (Path(directory) / KERNEL_FILE).read_text()
    return _core.kernel_sources()[KERNEL_FILE]


def _nvrtc() -> Any:
    try:
        from cupy_backends.cuda.libs import nvrtc  # type: ignore[import-not-found,import-untyped]
    except ImportError:  # older CuPy layouts
        from cupy.cuda import nvrtc
    return nvrtc


def compile_options(arch: str, defines: Sequence[str] = ()) -> list[str]:
    """NVRTC options for compute capability `arch` (e.g. "90") with `-D` `defines` such as
    "TC_STAGES=4"; the CI compile check uses the same."""
    every = (*HOST_DEFINES, *defines)
    return [*OPTIONS, f"--gpu-architecture=sm_{arch}", *(f"-D{d}" for d in every)]


def compile_cubin(arch: str, defines: Sequence[str] = (), source_text: str | None = None) -> bytes:
    """Machine code of the kernels (or of `source_text`) for compute capability `arch`."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source_text or source(), KERNEL_FILE, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, compile_options(arch, defines))
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"{KERNEL_FILE} does not compile: {e}\n{log}") from None
        return bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


class KernelModule:
    """The kernels compiled for one device (with optional `-D` overrides): functions by name,
    and the launch facts the module defines."""

    def __init__(self, device: int, defines: tuple[str, ...] = (), source_text: str | None = None):
        import cupy
        from cupy.cuda import function as cuda_function

        self.device = device
        self.defines = defines
        with cupy.cuda.Device(device) as dev:
            self._module = cuda_function.Module()
            self._module.load(compile_cubin(dev.compute_capability, defines, source_text))
            self.facts = self._read_facts()
            self.multiprocessors = int(dev.attributes["MultiProcessorCount"])
            #: Whether kernels may launch programmatically (sm_90 and a driver with
            #: cuLaunchKernelEx; see PreparedLaunch).
            self.programmatic = (
                int(dev.compute_capability) >= 90 and _driver_launch_ex() is not None
            )
        self._functions: dict[tuple[str, int], Any] = {}

    def _read_facts(self) -> LaunchFacts:
        from cupy.cuda import runtime

        count = len(fields(LaunchFacts))
        host = (ctypes.c_longlong * count)()
        address = int(self._module.get_global_var(FACTS_SYMBOL))  # cuModuleGetGlobal
        runtime.memcpy(ctypes.addressof(host), address, ctypes.sizeof(host), _DEVICE_TO_HOST)
        return LaunchFacts(*(int(v) for v in host))

    def function(self, name: str, dynamic_shared: int = 0) -> Any:
        """The kernel `name`, allowed `dynamic_shared` bytes of dynamic shared memory (beyond
        48 KiB a kernel must ask for it)."""
        key = (name, dynamic_shared)
        kernel = self._functions.get(key)
        if kernel is None:
            from cupy.cuda import driver

            kernel = self._module.get_function(name)
            if dynamic_shared:
                driver.funcSetAttribute(kernel.ptr, _MAX_DYNAMIC_SHARED, dynamic_shared)
            self._functions[key] = kernel
        return kernel

    def resident_blocks(self, kernel: Any, threads: int, dynamic_shared: int) -> int:
        """How many blocks of `kernel` the GPU holds at once: multiprocessors times the blocks
        each holds."""
        from cupy.cuda import driver

        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.ptr, threads, dynamic_shared
        )
        return max(1, int(per_sm)) * self.multiprocessors


#: ctypes of the kernels' scalar arguments, by the numpy scalar type a launcher passes.
_SCALARS: dict[type, type[ctypes._SimpleCData[Any]]] = {
    np.int64: ctypes.c_int64,
    np.int32: ctypes.c_int32,
    np.uint32: ctypes.c_uint32,
    np.uint64: ctypes.c_uint64,
    np.float32: ctypes.c_float,
}


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding, and a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_byte * 64)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (CUDA 12)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PROGRAMMATIC = 6


@functools.cache
def _driver_launch_ex() -> Any:
    """cuLaunchKernelEx from the driver library (CuPy does not wrap it); None where the driver
    has none (before CUDA 12)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class PreparedLaunch:
    """A kernel launch whose argument buffer is built once: a call changes only the arguments
    that vary and calls cuLaunchKernel directly (cupy.cuda.driver.launchKernel), without
    CuPy's per-call argument processing, which costs about 10 us of host time, as much as a
    1-token GEMV runs. Arguments: CuPy arrays (passed as their address, kept alive here) or
    numpy scalars of the kernel's parameter types."""

    def __init__(
        self,
        kernel: Any,
        grid: int,
        block: int,
        args: Sequence[Any],
        shared_mem: int = 0,
        programmatic: bool = False,
    ) -> None:
        from cupy.cuda import driver, get_current_stream

        self.kernel = kernel
        self.grid, self.block, self.shared_mem = grid, block, shared_mem
        # Held from a call's first change to its launch, so that threads sharing this launch
        # never launch with each other's arguments.
        self._lock = threading.Lock()
        # Bound once: a call then makes no import or module look-up (a microsecond or two of
        # the host's time per launch, measured on the GPU machine).
        self._launch_kernel = driver.launchKernel
        self._current_stream = get_current_stream
        self._function = int(kernel.ptr)
        self._values: list[ctypes._SimpleCData[Any]] = []
        self._arrays: list[Any] = []  # what the buffer points at, held alive
        for a in args:
            if hasattr(a, "data") and hasattr(a.data, "ptr"):
                self._values.append(ctypes.c_void_p(a.data.ptr))
                self._arrays.append(a)
            else:
                self._values.append(_SCALARS[type(a)](a))
        self._params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(v) for v in self._values))
        self._params_address = ctypes.addressof(self._params)
        # A programmatic launch (sm_90) may start while the stream's previous kernel still runs,
        # once that kernel allows it (griddepcontrol.launch_dependents); the kernel must wait
        # (griddepcontrol.wait) before it reads anything an earlier kernel may have written but
        # its constant inputs. The first call launches plainly, so that it runs after whatever
        # wrote those inputs (a weight quantized just before its first GEMV, say); later calls
        # rely on nothing writing them again.
        self._config: _LaunchConfig | None = None
        self._primed = False
        if programmatic:
            attribute = _LaunchAttribute(id=_PROGRAMMATIC)
            attribute.value[0] = 1  # programmaticStreamSerializationAllowed
            self._attribute = attribute
            self._config = _LaunchConfig(
                (grid, 1, 1), (block, 1, 1), shared_mem, None, ctypes.pointer(attribute), 1
            )
            self._config_address = ctypes.addressof(self._config)
            self._launch_ex = _driver_launch_ex()

    def __call__(
        self, *changes: tuple[int, int | float], grid: int | None = None, stream: int | None = None
    ) -> None:
        """Launches on `stream` (a handle; default CuPy's current stream, the capturing one
        inside a graph capture), after setting each (argument index, address or scalar) of
        `changes`; the changes stay for the calls that follow."""
        values = self._values
        with self._lock:
            for index, value in changes:
                values[index].value = value
            config = self._config
            if config is not None and self._primed:
                config.stream = self._current_stream().ptr if stream is None else stream
                config.grid[0] = self.grid if grid is None else grid
                status = self._launch_ex(
                    self._config_address, self._function, self._params_address, None
                )
                if status:
                    raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {status}")
                return
            self._launch_kernel(
                self._function,
                self.grid if grid is None else grid,
                1,
                1,
                self.block,
                1,
                1,
                self.shared_mem,
                self._current_stream().ptr if stream is None else stream,
                self._params_address,
                0,
            )
            self._primed = True  # once a launch succeeded, as the core's launch counts

    def call_setting(self, varying: Sequence[int]) -> Callable[..., None]:
        """This launch as a call `(stream, *values, grid=None)` that sets the arguments at
        `varying` to the values (addresses, or integers of the parameters' types) and launches
        on the stream (a handle), over `grid` blocks if given: a launch of the Rust core
        (`_core.KernelLaunch`, the driver called with no Python between: 0.9-2.6 us less host
        time a call than this class on H100 hosts) where the driver library loads, else this
        launch. Either starts plainly the first time (see `__init__`); the core's launch counts
        its own first time, apart from this object's, so a caller launches through one of them
        only (else its captures may take plain launches for programmatic ones). The caller
        keeps the arrays of the fixed arguments alive as long as it may call."""
        native = getattr(_core, "KernelLaunch", None)  # absent where the OS has no dlopen
        if native is not None:
            slots = [int.from_bytes(bytes(v).ljust(8, b"\0"), "little") for v in self._values]
            try:
                return native(
                    self._function,
                    self.grid,
                    self.block,
                    self.shared_mem,
                    slots,
                    list(varying),
                    self._config is not None,
                )
            except RuntimeError:  # no driver library to load: the ctypes launch
                pass

        def call(stream: int, *values: int, grid: int | None = None) -> None:
            self(*zip(varying, values, strict=True), stream=stream, grid=grid)

        return call


_modules: dict[tuple[int, tuple[str, ...]], KernelModule] = {}


def module(defines: Sequence[str] = (), device: int | None = None) -> KernelModule:
    """The kernels on `device` (default: the current one), compiling them the first time."""
    if device is None:
        import cupy

        device = int(cupy.cuda.runtime.getDevice())
    key = (device, tuple(defines))
    found = _modules.get(key)
    if found is None:
        found = _modules[key] = KernelModule(device, key[1])
    return found
