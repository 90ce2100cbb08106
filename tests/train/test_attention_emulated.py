"""The flash-attention kernels (kernels/attention.cu) run on the CPU (docs/testing.md): the
shipped file, unmodified, built with the system C++ compiler against the emulator of
tests/cuda_emulator/ (a block's threads as coroutines in a random order, barriers and warp
collectives checked, cp.async copies landing at random), and launched by train/_cuda.py's own
host code under a stand-in for the GPU's backend, through the library's launcher
(backends/cuda/kernels.Kernel: the argument slots a GPU gets) into a stand-in for the core's
that launches by name in the emulator. Forward, flash_delta, dQ and dK/dV against
functional.attention_forward/attention_backward in float64 numpy, for query blocks that end
inside a tile, groups of 1 and 4, heads of 64 and 128, sliding windows, packed rows (also
starts that decrease), batches of 2 and T = 1. Every array lies between guard bytes that must
stay as they were, and outputs start as NaN. No GPU; nothing is timed.

NYBBLE_KERNELS_DIR, where set, names the directory whose attention.cu is built instead of
kernels/ (kernel work; a mutated copy, to see that a missing barrier or an index off by one
fails here)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from nybble import _core
from nybble.backends.cuda import kernels
from nybble.train import _cuda
from nybble.train import functional as F
from tests import TESTS
from tests.train.attention_cases import sample_starts

BF16 = ml_dtypes.bfloat16
EMULATOR = TESTS / "cuda_emulator"
KERNELS = Path(os.environ.get("NYBBLE_KERNELS_DIR") or EMULATOR.parent.parent / "kernels")
GUARD = 4096  # bytes before and after every array
#: Dynamic shared memory a block gets without the opt-in to more (the device's default).
SHARED_DEFAULT = 48 * 1024

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the emulator's threads are Linux ucontexts"
)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The emulated kernels, built once with the -D options train/_cuda.py compiles them with."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler (c++ or g++) to build the CUDA emulator")
    library = tmp_path_factory.mktemp("cuda_emulator") / "attention_emulated.so"
    defines = [o for o in _cuda.FLASH_COMPILE_OPTIONS if o.startswith("-D")]
    command = [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Wno-unknown-pragmas"]
    command += [*defines, f"-I{KERNELS}", "-o", str(library), str(EMULATOR / "launch.cpp")]
    built = subprocess.run(command, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(command)}\n{built.stderr}"
    lib = ctypes.CDLL(str(library))
    lib.emu_launch.restype = ctypes.c_char_p
    lib.emu_launch.argtypes = [
        ctypes.c_char_p,  # kernel name
        ctypes.POINTER(ctypes.c_uint),  # grid
        ctypes.POINTER(ctypes.c_uint),  # block
        ctypes.c_size_t,  # dynamic shared memory
        ctypes.POINTER(ctypes.c_void_p),  # a pointer to each argument
        ctypes.POINTER(ctypes.c_void_p),  # the arrays cp.async may read ...
        ctypes.POINTER(ctypes.c_size_t),  # ... their bytes
        ctypes.c_int,
        ctypes.c_ulonglong,  # seed of the emulator's random orders
    ]
    return lib


def unwritten(dtype: np.dtype) -> Any:
    """What guards and fresh outputs hold: NaN, or an int that masks every key."""
    return np.nan if dtype.kind == "f" or dtype == BF16 else np.iinfo(dtype).max


class DeviceArray(np.ndarray):
    """A numpy array that gives its address as a CuPy array does (`data.ptr`): what the
    launcher passes for an array argument."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


class Device:
    """What train/_cuda.py's flash host code asks of the GPU's backend (`xp`, `kernel_module`),
    over numpy arrays, and the launcher of CuPy (its current stream): every array
    between guards (`empty` ones NaN); its flash module the emulator's build of the file
    (the launch facts read from the built library, kernels found by name); the launches made
    through the library's own launcher (`kernels.Kernel`, argument slots made as on the GPU)
    into a stand-in for the core's (`_core.KernelLaunch`) that hands the emulator each slot as
    the driver would, with the arguments of each launch kept by kernel name."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.seed = 0
        self.buffers: list[tuple[np.ndarray, int, int]] = []  # buffer, guard, array elements
        self.arrays: dict[int, np.ndarray] = {}  # by address
        self.launches: dict[str, tuple[Any, ...]] = {}
        self.names: list[tuple[str, int]] = []  # (kernel name, dynamic shared allowed) by handle
        runtime = types.SimpleNamespace(getDevice=lambda: 0)
        stream = types.SimpleNamespace(ptr=0)
        self.cupy = types.SimpleNamespace(
            cuda=types.SimpleNamespace(runtime=runtime, get_current_stream=lambda: stream),
            empty=lambda shape, dtype: self.array(shape, dtype),
            zeros=lambda shape, dtype: self.array(shape, dtype, 0),
            ascontiguousarray=lambda a: self.array(a.shape, a.dtype, a),
            float32=np.float32,
            int32=np.int32,
        )

    def array(self, shape: Any, dtype: Any, fill: Any = None) -> np.ndarray:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape))
        guard = GUARD // dtype.itemsize
        buffer = np.full(size + 2 * guard, unwritten(dtype), dtype)
        if fill is not None:
            buffer[guard : guard + size] = np.ravel(fill)
        self.buffers.append((buffer, guard, size))
        a = buffer[guard : guard + size].reshape(shape).view(DeviceArray)
        self.arrays[a.data.ptr] = a
        return a

    def guards_hold(self) -> bool:
        for buffer, guard, size in self.buffers:
            want = np.full(guard, unwritten(buffer.dtype), buffer.dtype).view(np.uint8)
            for part in (buffer[:guard], buffer[guard + size :]):
                if not np.array_equal(part.view(np.uint8), want):
                    return False
        return True

    @property
    def xp(self) -> Any:
        return self.cupy

    def compute_capability(self) -> int:
        return 80

    def kernel_module(self, file: str, options: tuple[str, ...]) -> Any:
        """train/_cuda.py's module of `file`: the emulator's build of attention.cu."""
        # the file built is the one shipped (tests/cuda/test_kernels_compile.py: the file itself)
        assert file == _cuda.FLASH_FILE
        assert options == _cuda.FLASH_COMPILE_OPTIONS  # the emulator's -D options
        return self  # its read_facts and function

    def read_facts(self, symbol: str, count: int) -> tuple[int, ...]:
        """The facts array as the built file defines it (the emulator's `__device__` is
        empty: a global of the library)."""
        return tuple((ctypes.c_longlong * count).in_dll(self.lib, symbol))

    def function(self, name: str, dynamic_shared: int = 0) -> kernels.Kernel:
        self.names.append((name, max(dynamic_shared, SHARED_DEFAULT)))
        return kernels.Kernel(types.SimpleNamespace(ptr=len(self.names)))  # a handle: 1, 2, ...

    def launch(
        self,
        function: int,
        grid: tuple[int, int, int],
        block: int,
        shared: int,
        slots: list[int],
    ) -> None:
        name, allowed = self.names[function - 1]
        # its shared memory within what the host allowed, as a device would refuse the launch
        assert shared <= allowed, (name, shared, allowed)
        # each argument in an 8-byte slot, little-endian: a 4-byte parameter reads the low
        # bytes, as the driver copies it
        held = (ctypes.c_uint64 * len(slots))(*slots)
        params = (ctypes.c_void_p * len(slots))(
            *(ctypes.addressof(held) + 8 * i for i in range(len(slots)))
        )
        arrays = [self.arrays[v] for v in slots if v in self.arrays]
        self.launches[name] = tuple(self.arrays.get(v, v) for v in slots)

        def dims(d: tuple[int, ...]) -> Any:
            return (ctypes.c_uint * 3)(*d)

        self.seed += 1
        error = self.lib.emu_launch(
            name.encode(),
            dims(grid),
            dims((block, 1, 1)),
            shared,
            params,
            (ctypes.c_void_p * len(arrays))(*(a.data.ptr for a in arrays)),
            (ctypes.c_size_t * len(arrays))(*(a.nbytes for a in arrays)),
            len(arrays),
            self.seed,
        )
        assert error is None, f"{name}: {error.decode()}"


class CoreLaunch:
    """`_core.KernelLaunch` for the emulator: its checks of a call (the count of values, a
    positive grid of up to 3 dimensions) and the launch by the kernel's handle."""

    device: Device

    def __init__(
        self,
        function: int,
        grid: int | tuple[int, ...],
        block: int,
        shared_mem: int,
        slots: list[int],
        varying: list[int],
        programmatic: bool,
    ) -> None:
        assert not programmatic  # the trainer's launches are plain
        assert all(0 <= s < 2**64 for s in slots) and all(0 <= i < len(slots) for i in varying)
        self.function, self.grid, self.block, self.shared = function, grid, block, shared_mem
        self.slots, self.varying = slots, varying

    def __call__(self, stream: int, *values: int, grid: Any = None) -> None:
        assert stream == 0  # CuPy's current stream
        assert len(values) == len(self.varying)
        slots = list(self.slots)
        for index, value in zip(self.varying, values, strict=True):
            assert 0 <= value < 2**64
            slots[index] = value
        dims = self.grid if grid is None else grid
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        assert 1 <= len(dims) <= 3 and all(type(n) is int and n > 0 for n in dims), dims
        full = (*dims, *(1,) * (3 - len(dims)))
        self.device.launch(self.function, full, self.block, self.shared, slots)  # type: ignore[arg-type]


@pytest.fixture
def device(emulator: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> Iterator[Device]:
    """The stand-in for the GPU's backend, whose modules are the emulator's, installed as
    train/_cuda.py's; the stand-in for CuPy (the launcher imports cupy inside its functions)
    and for the core's launcher installed; train/_cuda.py's cache of launch facts empty before
    and after."""
    dev = Device(emulator)
    monkeypatch.setitem(sys.modules, "cupy", dev.cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", dev.cupy.cuda)
    monkeypatch.setattr(_cuda, "_backend", lambda: dev)
    monkeypatch.setattr(CoreLaunch, "device", dev, raising=False)
    monkeypatch.setattr(_core, "KernelLaunch", CoreLaunch, raising=False)
    _cuda._module_facts.cache_clear()
    yield dev
    _cuda._module_facts.cache_clear()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """Largest error over the largest value (at least 1e-3: a gradient exactly 0 in float64,
    as with one key, is a few ulps of the others in bfloat16); inf where `got` has a NaN (an
    unwritten output, or garbage read)."""
    assert got.shape == want.shape
    err = np.abs(np.asarray(got, np.float64) - want)
    return float(np.where(np.isnan(err), np.inf, err).max() / max(np.abs(want).max(), 1e-3))


CASES = [
    # b, kv, t, group, d, window, starts
    pytest.param(2, 1, 100, 4, 64, None, None, id="b2-t100-g4-d64"),
    pytest.param(1, 2, 130, 1, 128, None, None, id="t130-g1-d128"),
    # the last query rows that see a dK/dV block's keys begin a query tile of their own
    pytest.param(1, 1, 100, 4, 128, 34, None, id="window34-g4-d128"),
    pytest.param(2, 1, 140, 1, 64, 30, "packed", id="packed-window-b2-d64"),
    pytest.param(2, 2, 70, 4, 64, None, "packed", id="packed-b2-kv2-g4"),
    pytest.param(2, 1, 100, 4, 128, None, "decreasing", id="decreasing-starts"),
    pytest.param(1, 1, 1, 4, 64, None, None, id="t1"),
]


@pytest.mark.parametrize(("b", "kv", "t", "group", "d", "window", "starts_kind"), CASES)
def test_the_flash_kernels_match_the_float64_attention(
    device: Device,
    b: int,
    kv: int,
    t: int,
    group: int,
    d: int,
    window: int | None,
    starts_kind: str | None,
) -> None:
    rng = np.random.default_rng(t * 31 + group * 7 + d)

    def given(shape: tuple[int, ...]) -> np.ndarray:
        return device.array(shape, BF16, rng.standard_normal(shape).astype(BF16))

    q, k, v = given((b, kv, t, group, d)), given((b, kv, t, d)), given((b, kv, t, d))
    do = given((b, t, kv, group, d))
    starts = None if starts_kind is None else sample_starts(rng, starts_kind, b, t)
    scale = d**-0.5

    out, lse = _cuda._flash_forward(q, k, v, scale, window, starts)
    dq, dk, dv = _cuda._flash_backward(do, q, k, v, out, lse, scale, window, starts)
    kernels = {f"flash_{kind}_d{d}" for kind in ("forward", "dq", "dkdv")} | {"flash_delta"}
    assert set(device.launches) == kernels
    assert device.guards_hold(), "a kernel wrote outside its arrays"

    q64, k64, v64, do64 = (np.asarray(a, np.float64) for a in (q, k, v, do))
    softmax = F.SoftmaxKernels(np)
    want_out, want_lse = F.attention_forward(
        np, q64, k64, v64, scale, window, softmax, starts=starts
    )
    # bfloat16 rounding of the outputs and of P and dS in the products (measured: at most
    # 4.4e-3); the log-sum-exp from float32 scores (1e-7)
    assert rel_err(out, want_out) <= 1e-2
    assert rel_err(lse, want_lse) <= 1e-4

    # flash_delta: rowsum(dO * O) of the kernel's own output; bad[b]: whether row b's starts
    # ever decrease
    _, _, delta, bad, *_ = device.launches["flash_delta"]
    want_delta = (do64 * np.asarray(out, np.float64)).sum(-1).transpose(0, 2, 1, 3)
    assert rel_err(delta, want_delta.reshape(b * kv, t * group)) <= 1e-5
    if starts is not None:
        np.testing.assert_array_equal(bad, (np.diff(starts, axis=1) < 0).any(axis=1))

    want_grads = F.attention_backward(
        np, do64, q64, k64, v64, want_out, want_lse, scale, window, softmax, starts=starts
    )
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), want_grads, strict=True):
        assert rel_err(got, want) <= 1e-2, name
