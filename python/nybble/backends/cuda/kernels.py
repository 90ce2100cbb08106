"""The compiled kernels: every file of `kernels/` (the library's nf4.cu, the trainer's train.cu
and attention.cu) compiled here on first use and kept for the life of the process, one module
per device, file, options and set of `-D` overrides (tuning builds), with the launch geometry a
module defines (`LaunchFacts` for nf4.cu, read back from the module itself); and the one way
a kernel is launched: the Rust core's launcher (`_core.KernelLaunch`), given device pointers
and a stream (`Kernel`, `PreparedLaunch`).

NVRTC is called directly (through CuPy's binding) rather than through CuPy's own compile,
because CuPy appends `-ftz=true` to every compile of a raw module: flushing subnormals to zero would
break bit-exactness with the CPU codec (tiny blocks, subnormal products). A file whose kernels
were written against that flush (the trainer's) names `-ftz=true` in its own options. It
compiles to the device's machine code (CUBIN), not PTX: a newer NVRTC writes PTX that an older
driver rejects (seen with CUDA 13 on an H100: CUDA_ERROR_INVALID_IMAGE).
"""

from __future__ import annotations

import ast
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ... import _core

#: The library's source file (embedded in the extension by build.rs; `_core.kernel_sources()`).
KERNEL_FILE = "nf4.cu"
#: NVRTC options of the library's file besides the architecture; the CI check compiles with
#: the same. NVRTC's defaults keep IEEE semantics: no flush to zero, IEEE division and square
#: root.
OPTIONS = ("-std=c++17",)
#: The module variable holding the launch facts (kernels/nf4.cu, at its end).
FACTS_SYMBOL = "launch_facts"
#: Tokens the fused GEMV takes in one launch (more go through dequantize + cuBLAS, which is
#: faster beyond 8 on an H100: benchmarks/gpu_codec.py measures the crossover). The kernels
#: are compiled with it (-DTC_TOKENS): this is its one definition.
GEMV_MAX_TOKENS = 8
#: The definitions every compile of the library's file passes: the facts the host owns.
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


def source(file: str = KERNEL_FILE) -> str:
    """The CUDA source `file` of kernels/ shipped in the extension, or with
    `NYBBLE_KERNELS_DIR` set, the file in that directory (for kernel work without rebuilding
    the extension): what every module here compiles."""
    directory = os.environ.get("NYBBLE_KERNELS_DIR")
    if directory:
        return (Path(directory) / file).read_text()
    return _core.kernel_sources()[file]


def _nvrtc() -> Any:
    try:
        from cupy_backends.cuda.libs import nvrtc  # type: ignore[import-not-found,import-untyped]
    except ImportError:  # older CuPy layouts
        from cupy.cuda import nvrtc
    return nvrtc


def compile_options(
    arch: str, defines: Sequence[str] = (), options: Sequence[str] | None = None
) -> list[str]:
    """NVRTC options for compute capability `arch` (e.g. "90") with `-D` `defines` such as
    "TC_STAGES=4": the library's file's (OPTIONS, HOST_DEFINES) unless a file's own `options`
    are given (the trainer's, train/_cuda.py); the CI compile check uses the same."""
    if options is None:
        options, defines = OPTIONS, (*HOST_DEFINES, *defines)
    return [*options, f"--gpu-architecture=sm_{arch}", *(f"-D{d}" for d in defines)]


def compile_cubin(
    arch: str,
    defines: Sequence[str] = (),
    source_text: str | None = None,
    file: str = KERNEL_FILE,
    options: Sequence[str] | None = None,
) -> bytes:
    """Machine code of kernels/`file` (or of `source_text`) for compute capability `arch`,
    compiled with `compile_options(arch, defines, options)`."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source_text or source(file), file, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, compile_options(arch, defines, options))
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"{file} does not compile: {e}\n{log}") from None
        return bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


def source_facts(text: str, symbol: str, defines: Sequence[str] = ()) -> tuple[int, ...]:
    """The values of the facts array `symbol` of a kernel source (`extern "C" __device__ long
    long symbol[] = {...};`), worked out from the text without a compiler, for a recording
    (backends/record), which compiles nothing; a device reads them back from the compiled
    module (`KernelModule.read_facts`). The initializer may use integer literals, the file's
    `#define NAME <integer>` lines and the `-D` `defines` ("NAME=VALUE", which win over the
    file's), `+ - * /` (C's integer division) and parentheses; anything else is a ValueError.
    The CI compile check compares the result with the compiled module's initializer."""
    values: dict[str, int] = {}
    for found in re.finditer(r"^[ \t]*#define[ \t]+(\w+)[ \t]+(\d+)[ \t]*(?://.*)?$", text, re.M):
        values[found.group(1)] = int(found.group(2))
    for define in defines:
        name, _, value = define.partition("=")
        values[name] = int(value or "1")
    body = re.search(rf"\b{re.escape(symbol)}\s*\[\s*\]\s*=\s*\{{(.*?)\}};", text, re.S)
    if body is None:
        raise ValueError(f"no facts array {symbol!r} in the source")
    text = re.sub(r"//[^\n]*", "", body.group(1))
    return tuple(_fact(e.strip(), values) for e in text.split(",") if e.strip())


def _fact(expression: str, values: dict[str, int]) -> int:
    unknown = f"a fact the host cannot work out from the source: {expression!r}"

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name) and node.id in values:
            return values[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp):
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, ast.Div) and b:
                quotient = abs(a) // abs(b)  # C rounds toward zero
                return quotient if (a < 0) == (b < 0) else -quotient
        raise ValueError(unknown)

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(
            f"a fact the host cannot work out from the source: {expression!r}"
        ) from None
    return value(tree.body)


def _programmatic_available() -> bool:
    """Whether the driver launches programmatically (cuLaunchKernelEx, CUDA 12), asked of the
    core's launcher."""
    launch = getattr(_core, "KernelLaunch", None)
    if launch is None:
        return False
    try:
        return bool(launch.programmatic_available())
    except RuntimeError:  # no driver library to load
        return False


class KernelModule:
    """The kernels of one file of kernels/ compiled for one device (with its options and
    optional `-D` overrides): functions by name, launched through the core's launcher
    (`Kernel`), and the launch facts the module defines (`facts` for the library's file;
    `read_facts` for any)."""

    #: The library's launch facts (nf4.cu's `launch_facts`; set for that file only).
    facts: LaunchFacts

    def __init__(
        self,
        device: int,
        defines: tuple[str, ...] = (),
        source_text: str | None = None,
        file: str = KERNEL_FILE,
        options: tuple[str, ...] | None = None,
    ):
        import cupy
        from cupy.cuda import function as cuda_function

        self.device = device
        self.defines = defines
        self.file = file
        self.options = options
        with cupy.cuda.Device(device) as dev:
            self._module = cuda_function.Module()
            self._module.load(
                compile_cubin(dev.compute_capability, defines, source_text, file, options)
            )
            if file == KERNEL_FILE:
                self.facts = LaunchFacts(*self.read_facts(FACTS_SYMBOL, len(fields(LaunchFacts))))
            self.multiprocessors = int(dev.attributes["MultiProcessorCount"])
            #: Whether kernels may launch programmatically (sm_90 and a driver with
            #: cuLaunchKernelEx; see PreparedLaunch).
            self.programmatic = int(dev.compute_capability) >= 90 and _programmatic_available()
        self._functions: dict[tuple[str, int], Kernel] = {}

    def read_facts(self, symbol: str, count: int) -> tuple[int, ...]:
        """The first `count` values of the module's facts array `symbol` (long longs)."""
        from cupy.cuda import runtime

        host = np.zeros(count, np.int64)
        address = int(self._module.get_global_var(symbol))  # cuModuleGetGlobal
        at = int(host.__array_interface__["data"][0])
        runtime.memcpy(at, address, host.nbytes, _DEVICE_TO_HOST)
        return tuple(int(v) for v in host)

    def function(self, name: str, dynamic_shared: int = 0) -> Kernel:
        """The kernel `name`, allowed `dynamic_shared` bytes of dynamic shared memory (beyond
        48 KiB a kernel must ask for it)."""
        key = (name, dynamic_shared)
        kernel = self._functions.get(key)
        if kernel is None:
            from cupy.cuda import driver

            function = self._module.get_function(name)
            if dynamic_shared:
                driver.funcSetAttribute(function.ptr, _MAX_DYNAMIC_SHARED, dynamic_shared)
            kernel = self._functions[key] = Kernel(function)
        return kernel

    def resident_blocks(self, kernel: Any, threads: int, dynamic_shared: int) -> int:
        """How many blocks of `kernel` the GPU holds at once: multiprocessors times the blocks
        each holds."""
        from cupy.cuda import driver

        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.ptr, threads, dynamic_shared
        )
        return max(1, int(per_sm)) * self.multiprocessors


#: The kernels' scalar argument types (numpy scalars a launcher passes), each with the unsigned
#: type of its width: a launch slot holds its bytes.
_UNSIGNED: dict[type, type[np.unsignedinteger[Any]]] = {
    np.int64: np.uint64,
    np.int32: np.uint32,
    np.uint32: np.uint32,
    np.uint64: np.uint64,
    np.float32: np.uint32,
}


#: The integer scalar types' bytes as an unsigned integer: the value masked to its width (the
#: two's complement of a negative one), as `view` of the unsigned type gives it, ~7x faster (a
#: launch converts its arguments on every call).
_INTEGER_MASKS: dict[type, int] = {
    t: (1 << 8 * np.dtype(t).itemsize) - 1 for t in _UNSIGNED if t is not np.float32
}


def slot(a: Any) -> int:
    """A kernel argument as a slot of the core's launcher: a CuPy array's device address, or a
    numpy scalar's bytes as an integer (the driver reads as many of the slot's low bytes as
    the kernel parameter has: the scalar's type must be the parameter's)."""
    kind = type(a)
    mask = _INTEGER_MASKS.get(kind)
    if mask is not None:
        return int(a) & mask
    if kind is np.float32:
        return int(a.view(np.uint32))
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    if ptr is None:
        names = ", ".join(t.__name__ for t in _UNSIGNED)
        raise TypeError(
            f"a kernel argument is a CuPy array or a numpy scalar ({names}), got {type(a).__name__}"
        )
    return int(ptr)


def _as_slot(value: int | float, kind: type | None) -> int:
    """A new value for a slot first made from an argument of numpy type `kind` (None: an
    array, whose slot takes an address)."""
    if kind is None:
        return int(value)
    return int(np.array(value, kind).view(_UNSIGNED[kind]))


def core_launch(
    function: int,
    grid: int | tuple[int, ...],
    block: int,
    shared_mem: int,
    slots: list[int],
    varying: Sequence[int],
    programmatic: bool = False,
) -> Any:
    """The core's prepared launch (`_core.KernelLaunch`): every kernel launch nybble makes is
    one. RuntimeError where the core has none (a build without dlopen) or the driver library
    does not load."""
    launch = getattr(_core, "KernelLaunch", None)
    if launch is None:
        raise RuntimeError(
            "nybble launches its kernels through its core's launcher (_core.KernelLaunch), "
            "which this build of the core lacks (it needs dlopen)"
        )
    return launch(function, grid, block, shared_mem, slots, list(varying), programmatic)


def _threads(block: int | Sequence[int]) -> int:
    """Threads of a 1-D block given as an int or a tuple (x,) / (x, 1) / (x, 1, 1)."""
    if isinstance(block, int):
        return block
    x, *rest = (int(n) for n in block)
    if any(n != 1 for n in rest) or len(rest) > 2:
        raise ValueError(f"block: the core launches 1-D blocks, got {tuple(block)}")
    return x


def _grid(grid: int | Sequence[int]) -> int | tuple[int, ...]:
    return int(grid) if isinstance(grid, (int, np.integer)) else tuple(int(n) for n in grid)


class Kernel:
    """One kernel of a loaded module: `ptr` (its CUfunction) and a launch through the core's
    launcher called as CuPy's kernels are, `kernel(grid, block, args, shared_mem=0,
    stream=None)`: the grid an int or a tuple of up to 3, the block 1-D, the arguments CuPy
    arrays (their address) or numpy scalars of the kernel's parameter types (their bytes), on
    `stream` (a handle; default CuPy's current stream, the capturing one inside a graph
    capture). Launches are plain (never programmatic). Prepared launches (`PreparedLaunch`)
    take `ptr`."""

    def __init__(self, function: Any) -> None:
        self.function = function  # CuPy's object for the handle, held with its module
        self.ptr = int(function.ptr)
        #: The core's launches by (threads, dynamic shared memory, arguments), every slot
        #: set by each call.
        self._launches: dict[tuple[int, int, int], Any] = {}
        self._current_stream: Callable[[], Any] | None = None  # CuPy's, on the first call

    def __call__(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any],
        shared_mem: int = 0,
        stream: int | None = None,
    ) -> None:
        values = [slot(a) for a in args]
        threads = block if type(block) is int else _threads(block)
        key = (threads, int(shared_mem), len(values))
        launch = self._launches.get(key)
        if launch is None:
            every = range(len(values))
            launch = core_launch(self.ptr, 1, threads, key[1], [0] * len(values), every)
            launch = self._launches.setdefault(key, launch)
        if stream is None:
            if self._current_stream is None:
                from cupy.cuda import get_current_stream

                self._current_stream = get_current_stream
            stream = self._current_stream().ptr
        launch(stream, *values, grid=grid if type(grid) is int else _grid(grid))


class PreparedLaunch:
    """A kernel launch whose arguments are made into the core launcher's slots once: a call
    changes only the arguments that vary and calls the driver from the core with no Python
    between (`_core.KernelLaunch`), without CuPy's per-call argument processing, which costs
    about 10 us of host time, as much as a 1-token GEMV runs. Arguments: CuPy arrays (passed
    as their address, kept alive here) or numpy scalars of the kernel's parameter types."""

    def __init__(
        self,
        kernel: Any,
        grid: int,
        block: int,
        args: Sequence[Any],
        shared_mem: int = 0,
        programmatic: bool = False,
    ) -> None:
        from cupy.cuda import get_current_stream

        self.kernel = kernel
        self.grid, self.block, self.shared_mem = grid, block, shared_mem
        # A programmatic launch (sm_90) may start while the stream's previous kernel still runs,
        # once that kernel allows it (griddepcontrol.launch_dependents); the kernel must wait
        # (griddepcontrol.wait) before it reads anything an earlier kernel may have written but
        # its constant inputs. A launch's first call is plain (the core counts it), so that it
        # runs after whatever wrote those inputs (a weight quantized just before its first
        # GEMV, say); later calls rely on nothing writing them again.
        self.programmatic = programmatic
        # Held from a call's first change to its launch, so that threads sharing this launch
        # never launch with each other's arguments.
        self._lock = threading.Lock()
        self._current_stream = get_current_stream
        self._function = int(kernel.ptr)
        self._kinds: list[type | None] = [t if t in _UNSIGNED else None for t in map(type, args)]
        self._values = [slot(a) for a in args]
        self._arrays = [a for a, kind in zip(args, self._kinds, strict=True) if kind is None]
        self._launch: Any = None  # the core's, made by the first call

    def __call__(
        self, *changes: tuple[int, int | float], grid: int | None = None, stream: int | None = None
    ) -> None:
        """Launches on `stream` (a handle; default CuPy's current stream, the capturing one
        inside a graph capture), after setting each (argument index, address or scalar) of
        `changes`; the changes stay for the calls that follow."""
        with self._lock:
            values = self._values
            for index, value in changes:
                values[index] = _as_slot(value, self._kinds[index])
            if self._launch is None:
                self._launch = self._core(range(len(values)))
            self._launch(
                self._current_stream().ptr if stream is None else stream,
                *values,
                grid=self.grid if grid is None else grid,
            )

    def _core(self, varying: Sequence[int]) -> Any:
        return core_launch(
            self._function,
            self.grid,
            self.block,
            self.shared_mem,
            list(self._values),
            varying,
            self.programmatic,
        )

    def call_setting(self, varying: Sequence[int]) -> Callable[..., None]:
        """This launch as a call `(stream, *values, grid=None)` that sets the arguments at
        `varying` to the values (addresses, or the raw bytes of the parameters' types as
        integers) and launches on the stream (a handle), over `grid` blocks if given: a launch
        of the Rust core (`_core.KernelLaunch`, the driver called with no Python between). It
        starts plainly the first time (see `__init__`), apart from this object's own calls,
        so a caller launches through one of them only (else its captures may take plain
        launches for programmatic ones). The caller keeps the arrays of the fixed arguments
        alive as long as it may call."""
        return self._core(varying)  # type: ignore[no-any-return]


_modules: dict[tuple[int, str, tuple[str, ...] | None, tuple[str, ...]], KernelModule] = {}


def module(
    defines: Sequence[str] = (),
    device: int | None = None,
    file: str = KERNEL_FILE,
    options: Sequence[str] | None = None,
) -> KernelModule:
    """The kernels of kernels/`file` (default: the library's) on `device` (default: the
    current one), compiled with its `options` (default: the library's) and `defines` the first
    time."""
    if device is None:
        import cupy

        device = int(cupy.cuda.runtime.getDevice())
    key = (device, file, None if options is None else tuple(options), tuple(defines))
    found = _modules.get(key)
    if found is None:
        found = _modules[key] = KernelModule(device, key[3], file=file, options=key[2])
    return found
