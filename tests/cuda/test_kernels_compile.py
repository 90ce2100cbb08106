"""Every CUDA source shipped in the extension compiles with NVRTC for sm_80 and sm_90, with
the options the one compile path (backends/cuda/kernels.compile_options) gives it, and defines
every kernel the launchers name, with the parameter widths they pass: the library's
(kernels/nf4.cu, backends/cuda) and the trainer's (kernels/train.cu and kernels/attention.cu,
train/_cuda.py, whose flash launch sizes are the module's `flash_facts`). NVRTC needs no GPU
and no driver, so this runs in CI (from the `nvidia-cuda-nvrtc-cu12` wheel); it is skipped only
where that wheel is absent."""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nybble import _core, formats, reference
from nybble.backends.cuda import kernels, launch
from nybble.train import _cuda
from tests import ROOT


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
#: Each shipped file's own options (None: the library's), as its loader hands them to
#: kernels.module.
FILE_OPTIONS: dict[str, tuple[str, ...] | None] = {
    kernels.KERNEL_FILE: None,
    _cuda.KERNEL_FILE: _cuda.COMPILE_OPTIONS,
    _cuda.FLASH_FILE: _cuda.FLASH_COMPILE_OPTIONS,
}


def file_options(name: str, arch: str) -> list[str]:
    """The NVRTC options the library compiles the shipped source `name` with for `arch`: the
    one compile path's (kernels.compile_options)."""
    if name not in FILE_OPTIONS:
        raise AssertionError(f"{name}: no loader compiles it")
    return kernels.compile_options(arch.removeprefix("sm_"), options=FILE_OPTIONS[name])


def test_the_extension_ships_the_kernels() -> None:
    """The shipped sources are the files their loaders name, each with its compile options."""
    assert set(SOURCES) == {kernels.KERNEL_FILE, _cuda.KERNEL_FILE, _cuda.FLASH_FILE}
    assert all(name.endswith((".cu", ".cuh")) for name in SOURCES)
    on_disk = ROOT / "kernels"
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
        # CPU. (The trainer's files keep the -ftz=true CuPy's compile gave them.)
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


#: The flash kernels' dynamic shared memory before it moved into attention.cu (train/_cuda.py's
#: formula then), by kernel and head dim: the facts must keep it.
FLASH_SHARED_BEFORE = {
    ("forward", 64): 18464,
    ("dq", 64): 36896,
    ("dkdv", 64): 37920,
    ("forward", 128): 34848,
    ("dq", 128): 69664,
    ("dkdv", 128): 70688,
}


def facts_in(ptx: str, symbol: str) -> tuple[int, ...]:
    """A module's facts array `symbol` (long longs), decoded from its initializer in the PTX."""
    match = re.search(rf"\.global \.align 8 \.b8 {symbol}\[(\d+)\] = \{{([^}}]*)\}}", ptx)
    assert match is not None, f"{symbol} is not a module variable"
    size = int(match.group(1))
    raw = bytes(int(b) for b in match.group(2).split(",")).ljust(size, b"\0")
    return tuple(int.from_bytes(raw[i : i + 8], "little") for i in range(0, size, 8))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_flash_module_defines_its_launch_sizes(arch: str) -> None:
    """The host reads the flash kernels' launch sizes back from their module (FlashFacts, in
    the order of attention.cu's `flash_facts`); a recording works them out from the source
    text (kernels.source_facts), and gets the same; the sizes are those the kernels had when
    train/_cuda.py wrote them down."""
    compiled = facts_in(file_ptx(_cuda.FLASH_FILE, arch), _cuda.FLASH_FACTS_SYMBOL)
    assert len(compiled) == len(_cuda.FlashFacts._fields)
    defines = [o[2:] for o in _cuda.FLASH_COMPILE_OPTIONS if o.startswith("-D")]
    text = SOURCES[_cuda.FLASH_FILE]
    assert kernels.source_facts(text, _cuda.FLASH_FACTS_SYMBOL, defines) == compiled
    facts = _cuda.FlashFacts(*compiled)
    assert (facts.threads, facts.block, facts.delta_threads) == (128, 64, 256)
    assert (facts.dkdv_rows_64, facts.dkdv_rows_128) == tuple(_cuda.FLASH_DKDV_ROWS.values())
    for (kind, d), before in FLASH_SHARED_BEFORE.items():
        assert facts.shared(kind, d) == before, (kind, d)
    assert max(FLASH_SHARED_BEFORE.values()) <= 227 * 1024  # an sm_80 / sm_90 block's most
    with pytest.raises(ValueError, match="unknown flash kernel"):
        facts.shared("backward", 64)


def test_the_source_facts_take_integers_defines_and_arithmetic_only() -> None:
    text = (
        "#define A 3  // three\n#ifndef B\n#define B 5\n#endif\n"
        'extern "C" __device__ long long f[] = {\n  A,  // a\n  B * (A + 1) - 7 / 2,\n  -A,\n};\n'
    )
    assert kernels.source_facts(text, "f") == (3, 17, -3)
    assert kernels.source_facts(text, "f", ["B=2"]) == (3, 5, -3)
    for bad in ("sizeof(int)", "C", "A << 1", "A ? 1 : 2", "2.5"):
        with pytest.raises(ValueError, match="cannot work out"):
            kernels.source_facts(text.replace("-A,", f"{bad},"), "f")
    with pytest.raises(ValueError, match="no facts array"):
        kernels.source_facts(text, "g")


class _Recorder:
    def alloc(self, nbytes: int) -> int:
        return 0

    def free(self, key: int) -> None:
        pass


def trainer_launch_arguments(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple]]:
    """Every kernel train/_cuda.py launches, with the arguments it passes, from its own host
    code run on the recording backend (standing in for the GPU's, its modules launching
    nothing): row kernels of both dtypes, with and without starts, and the flash kernels of
    both head dims."""
    import ml_dtypes

    from nybble.backends.record import RecordingBackend
    from nybble.backends.record import arrays as record_arrays

    backend = RecordingBackend.gpu(_Recorder())
    xp = backend.xp
    launched: list[tuple[str, tuple]] = []

    def function(self: Any, name: str, dynamic_shared: int = 0) -> Any:
        return lambda grid, block, args, shared_mem=0: launched.append((name, tuple(args)))

    monkeypatch.setattr(record_arrays._KernelModule, "function", function)
    _cuda._module_facts.cache_clear()
    with backend.standing_in():
        for dtype in (np.float32, ml_dtypes.bfloat16):
            for starts in (None, xp.empty((2, 6), np.int32)):
                s, dp = xp.empty((2, 12, 6), dtype), xp.empty((2, 12, 6), dtype)
                lse, delta = xp.empty((2, 12), np.float32), xp.empty((2, 12), np.float32)
                _cuda.FusedSoftmax().forward(s, lse, 0, 2, 4, 0.5, starts)
                _cuda.FusedSoftmax().backward(s, dp, lse, delta, 0, 2, None, 0.5, starts)
            gate, up = xp.empty((3, 8), dtype), xp.empty((3, 8), dtype)
            _cuda.FusedGate().forward(gate, up)
            _cuda.FusedGate().backward(xp.empty((3, 8), dtype), gate, up)
            x, w = xp.empty((3, 8), dtype), xp.empty((8,), np.float32)
            y, rstd = _cuda.FusedNorm().forward(x, w, 1e-5)
            _cuda.FusedNorm().backward(y, x, rstd, w, False)
            heads = xp.empty((2, 5, 4, 16), dtype)
            cos, sin = xp.empty((5, 8), dtype), xp.empty((5, 8), dtype)
            _, rstd = _cuda.FusedHeads().forward(heads, w[:16], 1e-5, cos, sin, 2)
            _cuda.FusedHeads().backward(heads, heads, rstd, w[:16], cos, sin, False)
        for d in _cuda.FLASH_HEAD_DIMS:
            q = xp.empty((2, 1, 70, 4, d), ml_dtypes.bfloat16)
            k, v = (
                xp.empty((2, 1, 70, d), ml_dtypes.bfloat16),
                xp.empty((2, 1, 70, d), ml_dtypes.bfloat16),
            )
            for starts in (None, xp.empty((2, 70), np.int32)):
                o, lse = _cuda._flash_forward(q, k, v, 0.1, 16, starts)
                do = xp.empty(o.shape, o.dtype)
                _cuda._flash_backward(do, q, k, v, o, lse, 0.1, None, starts)
    _cuda._module_facts.cache_clear()
    return launched


def entry_params(entry: str) -> list[str]:
    """The PTX parameter types of a kernel (its `.entry` text): u64, u32, f32, ..."""
    head = entry.split(")", 1)[0]
    return re.findall(r"\.param \.(\w+) ", head)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_trainer_launch_passes_the_kernels_parameter_widths(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch slot holds an argument's bytes, of which the driver reads the kernel
    parameter's width: so every argument the trainer passes is an array (an 8-byte address)
    or a numpy scalar of exactly the parameter's width and kind (float or integer), in the
    kernel's order."""
    launched = trainer_launch_arguments(monkeypatch)
    names = {name for name, _ in launched}
    assert names == set(_cuda.KERNEL_NAMES) | set(_cuda.FLASH_KERNEL_NAMES)
    entries = {**file_entries(_cuda.KERNEL_FILE, arch), **file_entries(_cuda.FLASH_FILE, arch)}
    for name, args in launched:
        params = entry_params(entries[name])
        assert len(params) == len(args), (name, params, args)
        for i, (param, a) in enumerate(zip(params, args, strict=True)):
            width = int(param[1:]) // 8
            if isinstance(a, np.generic):
                kind = "f" if a.dtype.kind == "f" else "i"
                assert kernels.slot(a) < 2 ** (8 * a.dtype.itemsize), (name, i)
                got = (kind, a.dtype.itemsize)
            else:  # an array: its address
                got = ("i", 8)
            assert got == ("f" if param.startswith("f") else "i", width), (name, i, param, a)
