"""The compiled kernels: `kernels/nf4.cu`, compiled on first use and kept for the life of the
process, one module per device.

NVRTC is called directly (through CuPy's binding) rather than through `cupy.RawModule`,
because CuPy appends `-ftz=true` to every RawModule compile: flushing subnormals to zero would
break bit-exactness with the CPU codec (tiny blocks, subnormal products). It compiles to the
device's machine code (CUBIN), not PTX: a newer NVRTC writes PTX that an older driver rejects
(seen with CUDA 13 on an H100: CUDA_ERROR_INVALID_IMAGE).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import _core

#: The source file (embedded in the extension by build.rs; `_core.kernel_sources()`).
KERNEL_FILE = "nf4.cu"
#: NVRTC options besides the architecture; the CI check compiles with the same. NVRTC's
#: defaults keep IEEE semantics: no flush to zero, IEEE division and square root.
OPTIONS = ("-std=c++17",)

_modules: dict[int, Any] = {}
_functions: dict[tuple[int, str], Any] = {}


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


def compile_cubin(arch: str, source_text: str | None = None, defines: Sequence[str] = ()) -> bytes:
    """Machine code of the kernels (or of `source_text`) for compute capability `arch` (e.g.
    "90"), with extra `-D` `defines` such as "GEMV_ROWS=2" (benchmarks/gemv_tune.py)."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source_text or source(), KERNEL_FILE, [], [])
    options = [*OPTIONS, f"--gpu-architecture=sm_{arch}", *(f"-D{d}" for d in defines)]
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"{KERNEL_FILE} does not compile: {e}\n{log}") from None
        return bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


#: CUDA's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_MAX_DYNAMIC_SHARED = 8


def allow_dynamic_shared(kernel: Any, nbytes: int) -> None:
    """Lets `kernel` (a cupy.cuda.function.Function) use `nbytes` of dynamic shared memory;
    beyond 48 KiB a kernel must ask for it."""
    from cupy.cuda import driver

    driver.funcSetAttribute(kernel.ptr, _MAX_DYNAMIC_SHARED, nbytes)


def resident_blocks(kernel: Any, threads: int, dynamic_shared: int) -> int:
    """How many blocks of `kernel` (`threads` threads, `dynamic_shared` bytes of dynamic shared
    memory) the GPU holds at once: its multiprocessors times the blocks each holds."""
    import cupy
    from cupy.cuda import driver

    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, threads, dynamic_shared)
    return max(1, int(per_sm)) * int(cupy.cuda.Device().attributes["MultiProcessorCount"])


def function(name: str, dynamic_shared: int = 0) -> Any:
    """The kernel `name` on the current device, compiling the module the first time; with
    `dynamic_shared` bytes of dynamic shared memory allowed."""
    import cupy
    from cupy.cuda import function as cuda_function

    device = int(cupy.cuda.runtime.getDevice())
    key = (device, name)
    if key not in _functions:
        if device not in _modules:
            module = cuda_function.Module()
            module.load(compile_cubin(cupy.cuda.Device(device).compute_capability))
            _modules[device] = module
        kernel = _modules[device].get_function(name)
        if dynamic_shared:
            allow_dynamic_shared(kernel, dynamic_shared)
        _functions[key] = kernel
    return _functions[key]
