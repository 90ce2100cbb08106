"""One launch route (issue 40): every kernel nybble launches, the library's and the trainer's,
goes through the Rust core's launcher (`_core.KernelLaunch`) from backends/cuda/kernels.py
(`Kernel`, a call as CuPy's kernels take one; `PreparedLaunch`, the argument slots made once),
given device pointers and a stream. Checked without a GPU: the slots an argument becomes (the
bytes of its type: the driver reads the parameter's width of them), what the core's launcher
is given, and that no module of the package launches or compiles a kernel any other way."""

from __future__ import annotations

import ast
import sys
import types
from typing import Any, ClassVar

import numpy as np
import pytest

from nybble import _core
from nybble.backends.cuda import kernels
from tests import ROOT

PACKAGE = ROOT / "python" / "nybble"

#: Modules that may import ctypes, and why: none of them launches a kernel.
CTYPES_USERS = {
    "nybble/backends/cuda/blas.py": "cuBLAS, the library CuPy loaded, called during captures",
    "nybble/checkpoint/_output.py": "libc's fsync errors",
}
#: CuPy's other ways to compile or launch a kernel, and the driver's launch calls.
OTHER_ROUTES = {"RawModule", "RawKernel", "launchKernel", "cuLaunchKernel", "cuLaunchKernelEx"}


class Launch:
    """`_core.KernelLaunch` as the launcher calls it: what it was made with, each call."""

    made: ClassVar[list[Launch]] = []

    def __init__(
        self,
        function: int,
        grid: Any,
        block: int,
        shared_mem: int,
        slots: list[int],
        varying: list[int],
        programmatic: bool,
    ) -> None:
        self.made_with = (function, grid, block, shared_mem, list(slots), list(varying))
        self.programmatic = programmatic
        self.calls: list[tuple[int, tuple[int, ...], Any]] = []
        Launch.made.append(self)

    def __call__(self, stream: int, *values: int, grid: Any = None) -> None:
        self.calls.append((stream, values, grid))


@pytest.fixture
def core(monkeypatch: pytest.MonkeyPatch) -> type[Launch]:
    Launch.made.clear()
    monkeypatch.setattr(_core, "KernelLaunch", Launch, raising=False)
    stream = types.SimpleNamespace(ptr=0x5EED)
    cuda = types.SimpleNamespace(get_current_stream=lambda: stream)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    return Launch


def array(ptr: int) -> Any:
    """What the launcher reads of a CuPy array: its address."""
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr))


def test_an_argument_is_its_address_or_the_bytes_of_its_type() -> None:
    assert kernels.slot(array(0x7F00_0000_1000)) == 0x7F00_0000_1000
    assert kernels.slot(np.int32(-1)) == 0xFFFF_FFFF  # 4 bytes: the parameter's low half
    assert kernels.slot(np.int64(-1)) == 2**64 - 1
    assert kernels.slot(np.uint32(7)) == 7 and kernels.slot(np.uint64(0)) == 0  # a null pointer
    assert kernels.slot(np.float32(1.0)) == 0x3F80_0000
    for v in (np.int32(-(2**31)), np.int32(2**31 - 1), np.int64(-(2**63)), np.uint64(2**64 - 1)):
        assert kernels.slot(v) == int(v.view(np.dtype(v.dtype.str.replace("i", "u"))))
    assert kernels.slot(np.float32(-0.0)) == 0x8000_0000
    assert kernels.slot(np.float32(-0.5)) == int(np.float32(-0.5).view(np.uint32))
    for a in (np.int32(5), np.int64(-3), np.float32(0.1), np.uint32(9)):  # as the driver reads
        raw = kernels.slot(a).to_bytes(8, "little")[: a.dtype.itemsize]
        assert np.frombuffer(raw, a.dtype)[0] == a
    for wrong in (1, 0.5, np.float64(1.0), np.int16(1), np.zeros(2), None):
        with pytest.raises(TypeError, match="a kernel argument"):
            kernels.slot(wrong)


def test_a_kernel_launches_through_the_core_on_the_current_stream(core: type[Launch]) -> None:
    kernel = kernels.Kernel(types.SimpleNamespace(ptr=0xF00))
    assert kernel.ptr == 0xF00
    args = (array(0x1000), np.int32(3), np.float32(2.0), np.int64(-2), np.uint64(0))
    kernel((5, 2), (128,), args, shared_mem=4096)
    kernel(7, 128, args, shared_mem=4096, stream=0xABC)
    (launch,) = core.made  # one per block, shared memory and count of arguments
    function, grid, block, shared, slots, varying = launch.made_with
    assert (function, grid, block, shared) == (0xF00, 1, 128, 4096)  # the grid: each call's
    assert (slots, varying) == ([0] * 5, [0, 1, 2, 3, 4])  # every slot: each call's
    want = (0x1000, 3, 0x4000_0000, 2**64 - 2, 0)
    assert launch.calls == [(0x5EED, want, (5, 2)), (0xABC, want, 7)]
    assert not launch.programmatic  # as CuPy's kernels launched
    kernel((1,), (256, 1, 1), args)
    assert len(core.made) == 2 and core.made[1].made_with[2] == 256
    with pytest.raises(ValueError, match="1-D blocks"):
        kernel((1,), (32, 2), args)


def test_a_prepared_launch_sets_its_changes_in_their_types(core: type[Launch]) -> None:
    """The arguments made into slots once; a call's changes converted as the argument they
    replace (an address, or a scalar of its type); `call_setting` is a launch of the core of
    its own (counting its own first, plain launch)."""
    x = array(0x2000)
    prepared = kernels.PreparedLaunch(
        types.SimpleNamespace(ptr=0xBEE),
        9,
        64,
        (x, np.int64(0), np.int32(0), np.float32(0)),
        shared_mem=512,
        programmatic=True,
    )
    assert core.made == []  # nothing until a call
    prepared((0, 0x3000), (2, -1), (3, 1.5))
    prepared(grid=4, stream=0x77)
    (launch,) = core.made
    first = (0x3000, 0, 0xFFFF_FFFF, 0x3FC0_0000)
    assert launch.made_with == (0xBEE, 9, 64, 512, list(first), [0, 1, 2, 3])
    assert launch.programmatic
    assert launch.calls == [(0x5EED, first, 9), (0x77, first, 4)]  # changes stay
    call = prepared.call_setting((0, 1))
    assert isinstance(call, Launch) and call is not launch
    assert call.made_with == (0xBEE, 9, 64, 512, list(first), [0, 1]) and call.programmatic


def test_without_the_cores_launcher_nothing_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(_core, "KernelLaunch", raising=False)
    kernel = kernels.Kernel(types.SimpleNamespace(ptr=1))
    with pytest.raises(RuntimeError, match="core's launcher"):
        kernel(1, 32, (np.int32(0),), stream=0)


def _module_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The modules a file imports, and the names and attributes its code uses."""
    imported: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
            used |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Name):
            used.add(node.id)
    return imported, used


def test_no_module_launches_or_compiles_a_kernel_another_way() -> None:
    """The package's code (comments and strings aside) uses none of CuPy's other kernel
    routes (RawModule, RawKernel, launchKernel) nor the driver's launch calls itself; ctypes
    only where it calls no kernel (CTYPES_USERS, each with its reason)."""
    ctypes_users = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE.parent).as_posix()
        imported, used = _module_names(ast.parse(path.read_text(encoding="utf-8")))
        assert not used & OTHER_ROUTES, (name, used & OTHER_ROUTES)
        if "ctypes" in imported:
            ctypes_users.add(name)
    assert ctypes_users == set(CTYPES_USERS)


def test_the_launcher_itself_needs_no_ctypes() -> None:
    for module in ("kernels.py", "launch.py", "graph.py"):
        imported, _ = _module_names(
            ast.parse((PACKAGE / "backends" / "cuda" / module).read_text(encoding="utf-8"))
        )
        assert "ctypes" not in imported, module
