"""Every CUDA source shipped in the extension compiles with NVRTC for sm_80 and sm_90, with
the options its loader compiles it with, and defines every kernel the launchers name: the
library's (kernels/nf4.cu, backends/cuda) and the trainer's (kernels/train.cu and
kernels/attention.cu, train/_cuda.py). NVRTC needs no GPU and no driver, so this runs in CI
(from the `nvidia-cuda-nvrtc-cu12` wheel); it is skipped only where that wheel is absent."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import functools
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from nybble import _core, formats, reference
from nybble.backends.cuda import kernels, launch
from nybble.train import _cuda


def _nvidia_dir() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / "cuda_nvrtc" / "lib" / "libnvrtc.so.12").exists():
            return Path(location)
    return None


NVIDIA = _nvidia_dir()
pytestmark = pytest.mark.skipif(NVIDIA is None, reason="needs the nvidia-cuda-nvrtc-cu12 wheel")


def _nvrtc() -> ctypes.CDLL:
    assert NVIDIA is not None
    lib = ctypes.CDLL(str(NVIDIA / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"))
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def compile_ptx(
    source: str,
    name: str,
    arch: str,
    defines: tuple[str, ...] = (),
    host: bool = True,
    options: list[str] | None = None,
) -> str:
    """PTX of `source`, compiled with the options the library uses (with the definitions the
    host passes unless not `host`; or `options` as given), or an AssertionError carrying the
    compiler's log."""
    nvrtc = _nvrtc()
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    assert rc == 0, nvrtc.nvrtcGetErrorString(rc)
    if options is None:
        options = kernels.compile_options(arch.removeprefix("sm_"), defines)
    if not host:
        options = [o for o in options if o.removeprefix("-D") not in kernels.HOST_DEFINES]
    include = NVIDIA / "cuda_runtime" / "include" if NVIDIA else None
    if include is not None and include.is_dir():  # cuda_fp16.h / cuda_bf16.h, should one need them
        options.append(f"-I{include}")
    argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
    try:
        rc = nvrtc.nvrtcCompileProgram(prog, len(options), argv)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert rc == 0, f"{name} ({arch}): {nvrtc.nvrtcGetErrorString(rc)!r}\n{log.value.decode()}"
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        assert nvrtc.nvrtcGetPTX(prog, ptx) == 0
        return ptx.value.decode()
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


SOURCES = _core.kernel_sources()
#: CuPy's RawModule, which compiles the trainer's modules, adds this to the options it is given.
CUPY_RAW_MODULE_OPTIONS = ("-ftz=true",)


def file_options(name: str, arch: str) -> list[str]:
    """The NVRTC options the library compiles the shipped source `name` with for `arch`."""
    target = f"--gpu-architecture={arch}"
    if name == kernels.KERNEL_FILE:
        return kernels.compile_options(arch.removeprefix("sm_"))
    if name == _cuda.KERNEL_FILE:
        return [*_cuda.COMPILE_OPTIONS, *CUPY_RAW_MODULE_OPTIONS, target]
    if name == _cuda.FLASH_FILE:
        return [*_cuda.FLASH_COMPILE_OPTIONS, *CUPY_RAW_MODULE_OPTIONS, target]
    raise AssertionError(f"{name}: no loader compiles it")


def test_the_extension_ships_the_kernels() -> None:
    """The shipped sources are the files their loaders name, each with its compile options."""
    assert set(SOURCES) == {kernels.KERNEL_FILE, _cuda.KERNEL_FILE, _cuda.FLASH_FILE}
    assert all(name.endswith((".cu", ".cuh")) for name in SOURCES)
    on_disk = Path(__file__).resolve().parent.parent / "kernels"
    for name, text in SOURCES.items():
        assert (on_disk / name).read_text() == text, f"the embedded {name} is stale: rebuild"


@functools.cache
def file_ptx(name: str, arch: str) -> str:
    """The shipped source `name` compiled for `arch` with its loader's options, once per run:
    several tests read it."""
    return compile_ptx(SOURCES[name], name, arch, options=file_options(name, arch))


def module_ptx(arch: str) -> str:
    """The library's kernel module (nf4.cu) compiled for `arch` with the host's definitions."""
    return file_ptx(kernels.KERNEL_FILE, arch)


def file_entries(name: str, arch: str) -> dict[str, str]:
    """The kernels of `name` for `arch` by name, each its PTX from its `.entry` to the next."""
    return {e.split("(", 1)[0]: e for e in re.split(r"\.entry ", file_ptx(name, arch))[1:]}


def module_entries(arch: str) -> dict[str, str]:
    return file_entries(kernels.KERNEL_FILE, arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", sorted(n for n in SOURCES if n.endswith(".cu")))
def test_kernel_source_compiles(name: str, arch: str) -> None:
    ptx = file_ptx(name, arch)
    assert ".entry" in ptx
    # No local-memory arrays: a register array indexed at run time would land there.
    assert ".local" not in ptx, "a kernel spills an array to local memory"
    if name == kernels.KERNEL_FILE:
        # IEEE arithmetic throughout: flushing subnormals would break bit-exactness with the
        # CPU. (The trainer's modules are compiled by CuPy's RawModule, with -ftz=true.)
        assert ".ftz" not in ptx, "flush-to-zero arithmetic in the kernels"


def trainer_launches() -> tuple[set[str], set[str]]:
    """The kernel names train/_cuda.py launches, read from its calls: `_kernel(name, dtype)`
    (the row module, a kernel per dtype suffix), `_flash_launch(kind, d, ...)` (the flash
    module, a kernel per head dim) and `_flash_kernel(device, name, shared)`."""
    assert _cuda.__file__ is not None
    tree = ast.parse(Path(_cuda.__file__).read_text())
    rows: set[str] = set()
    flash: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        literal = [str(a.value) for a in node.args if isinstance(a, ast.Constant)]
        if node.func.id == "_kernel" and literal:
            rows |= {f"{literal[0]}_{s}" for s in _cuda.SUFFIX.values()}
        elif node.func.id == "_flash_launch" and literal:
            flash |= {f"flash_{literal[0]}_d{d}" for d in _cuda.FLASH_HEAD_DIMS}
        elif node.func.id == "_flash_kernel" and literal:
            flash.add(literal[0])
    return rows, flash


def test_the_trainer_launches_are_read() -> None:
    rows, flash = trainer_launches()
    assert {"softmax_forward_bf16", "heads_backward_f32", "gate_backward_bf16"} <= rows
    assert {"flash_forward_d64", "flash_dkdv_d128", "flash_delta"} <= flash
    assert rows <= set(_cuda.KERNEL_NAMES) and flash <= set(_cuda.FLASH_KERNEL_NAMES)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_trainer_kernel_is_defined(arch: str) -> None:
    rows, flash = trainer_launches()
    assert rows | set(_cuda.KERNEL_NAMES) <= set(file_entries(_cuda.KERNEL_FILE, arch))
    assert flash | set(_cuda.FLASH_KERNEL_NAMES) <= set(file_entries(_cuda.FLASH_FILE, arch))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_launched_kernel_is_defined(arch: str) -> None:
    assert set(launch.kernel_names()) <= set(module_entries(arch))


def launch_facts(ptx: str) -> kernels.LaunchFacts:
    """The module's `launch_facts`, decoded from its initializer in the PTX."""
    match = re.search(
        rf"\.global \.align 8 \.b8 {kernels.FACTS_SYMBOL}\[(\d+)\] = \{{([^}}]*)\}}", ptx
    )
    assert match is not None, "launch_facts is not a module variable"
    size = int(match.group(1))
    assert size == 8 * len(dataclasses.fields(kernels.LaunchFacts))
    raw = bytes(int(b) for b in match.group(2).split(",")).ljust(size, b"\0")  # PTX may omit
    # trailing zeros
    return kernels.LaunchFacts(
        *(int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8))
    )


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_module_defines_its_launch_facts(arch: str) -> None:
    """The host reads the launch geometry back from the module: every field, consistent."""
    facts = launch_facts(module_ptx(arch))
    assert facts.threads % 32 == 0 and facts.tc_threads % 32 == 0
    for dtype in ("float32", "float16", "bfloat16"):
        assert facts.dequant_per_block(dtype) % facts.threads == 0
        assert facts.quant_per_block(dtype) % facts.threads == 0
    assert facts.tc_shared_g32 > 256 * 256 and facts.tc_shared_g64 > facts.tc_shared_g32
    assert facts.gemv_tokens >= 1 and facts.tc_rows == 16


@pytest.mark.parametrize("codebook", ["nf4", "fp4"])
def test_the_encoding_tables_give_the_reference_codes(codebook: str) -> None:
    """The quantize kernels' bucket rule (bucket_code in the kernel source: bucket
    floor(v * 32) + 33 masked to the table, then codes[b][v > thr[b]]) over the host's tables
    of the module's size gives the reference codes: at every threshold and bucket edge, the
    floats beside them, past +-1 by the roundings a quantize allows, and at random."""
    facts = launch_facts(module_ptx("sm_90"))
    buckets = facts.quant_buckets
    thr = launch._host_table("thresholds", codebook, buckets)
    codes = launch._host_table("codes", codebook, buckets)
    assert thr.size == buckets and codes.size == 2 * buckets
    marks = np.concatenate(
        [formats.thresholds(codebook), np.arange(-33, 34) / 32, [0.0, -0.0]]
    ).astype(np.float32)
    rng = np.random.default_rng(0)
    v = np.concatenate(
        [
            marks,
            np.nextafter(marks, np.float32(np.inf)),
            np.nextafter(marks, np.float32(-np.inf)),
            rng.uniform(-1, 1, 100_000).astype(np.float32),
        ]
    )
    v = v[np.abs(v) <= np.float32(1 + 2**-23)]  # x * (1 / absmax) passes 1 by a rounding at most
    magnitude = np.abs(v) if codebook == "fp4" else v
    b = (np.floor(magnitude.astype(np.float64) * 32).astype(np.int64) + 33) & (buckets - 1)
    got = codes[2 * b + (magnitude > thr[b])]
    if codebook == "fp4":
        got = got | np.where(v < 0, 0b1000, 0).astype(np.uint8)
    np.testing.assert_array_equal(got, reference.encode(v, codebook))


def test_the_host_owns_the_gemv_token_count() -> None:
    """The kernels do not compile without the definition the host passes (-DTC_TOKENS), so
    GEMV_MAX_TOKENS has one definition; a tuning build compiles with other parameters."""
    source = SOURCES[kernels.KERNEL_FILE]
    with pytest.raises(AssertionError, match="TC_TOKENS comes from the launcher"):
        compile_ptx(source, kernels.KERNEL_FILE, "sm_90", host=False)
    default = launch_facts(module_ptx("sm_90"))
    ptx = compile_ptx(source, kernels.KERNEL_FILE, "sm_90", ("TC_STAGES=4", "TC_WARPS=4"))
    tuned = launch_facts(ptx)
    assert ".entry gemv_tc_bf16_g64" in ptx and tuned.tc_threads == 128
    assert tuned.tc_shared_g64 > default.tc_shared_g64  # one more stage in shared memory


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_tensor_core_gemv_launches_as_clusters_of_one_block_on_sm90(arch: str) -> None:
    """A placement choice (kernels/nf4.cu, GEMV_TC): on an H100 the 14336 x 4096 GEMV ran 7%
    faster launched as clusters of one block. sm_80 has no clusters."""
    heads = {name: body.split("{", 1)[0] for name, body in module_entries(arch).items()}
    gemv = [n for n in heads if n.startswith("gemv_tc_")]
    assert len(gemv) == 8
    for name, head in heads.items():
        clustered = ".reqnctapercluster 1, 1, 1" in head
        assert clustered == (arch == "sm_90" and name in gemv), name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_only_the_tensor_core_gemv_waits_for_the_kernel_before_it(arch: str) -> None:
    """Launched programmatically (sm_90), a kernel must wait for the one before it
    (griddepcontrol.wait) before it reads the tokens: the tensor-core GEMV does, and no other
    kernel is launched that way. sm_80 has no programmatic launches."""
    for name, body in module_entries(arch).items():
        waits = "griddepcontrol.wait" in body
        assert waits == (arch == "sm_90" and name.startswith("gemv_tc_")), name


def test_a_compile_error_fails() -> None:
    with pytest.raises(AssertionError, match="undefined_identifier"):
        compile_ptx(
            'extern "C" __global__ void k() { undefined_identifier = 1; }', "bad.cu", "sm_90"
        )
