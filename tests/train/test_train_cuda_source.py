"""The trainer's GPU modules compile the CUDA files the extension ships (kernels/train.cu and
kernels/attention.cu, `_core.kernel_sources()`) through the library's one compile path
(backends/cuda/kernels.py: `kernels.module`, NVRTC to CUBIN) with their own options, the
flush to zero that CuPy's compile used to add named among them: read from what train/_cuda.py
hands that path through the GPU's backend (`CudaBackend.kernel_module`), under a stand-in for
CuPy (no GPU, no compiler)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import pytest

from nybble import _core
from nybble.backends.cuda import CudaBackend, kernels
from nybble.train import _cuda
from tests import ROOT

KERNELS = ROOT / "kernels"


class Module:
    """kernels.KernelModule as the trainer's modules are made: what it was given, the names
    asked of it."""

    made: ClassVar[list[Module]] = []

    def __init__(
        self,
        device: int,
        defines: tuple[str, ...] = (),
        source_text: str | None = None,
        file: str = kernels.KERNEL_FILE,
        options: tuple[str, ...] | None = None,
    ) -> None:
        self.device, self.defines, self.file, self.options = device, defines, file, options
        self.code = source_text or kernels.source(file)
        self.names: list[tuple[str, int]] = []
        Module.made.append(self)

    def function(self, name: str, dynamic_shared: int = 0) -> Any:
        self.names.append((name, dynamic_shared))
        return types.SimpleNamespace(name=name)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[CudaBackend]:
    """The GPU's backend (made directly: `backends.cuda.backend()` asks for CuPy) over a
    stand-in for CuPy, its modules `Module`s."""
    runtime = types.SimpleNamespace(getDevice=lambda: 0)
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(kernels, "KernelModule", Module)
    monkeypatch.setattr(kernels, "_modules", {})
    Module.made.clear()
    _cuda._module_facts.cache_clear()
    yield CudaBackend()
    _cuda._module_facts.cache_clear()


def test_the_row_kernels_compile_the_shipped_train_cu(fake_cupy: CudaBackend) -> None:
    _cuda._kernel(fake_cupy, "softmax_forward", np.float32)
    _cuda._kernel(fake_cupy, "rms_backward", ml_dtypes.bfloat16)
    (module,) = Module.made
    assert module.file == "train.cu" and module.device == 0 and module.defines == ()
    assert module.code == _core.kernel_sources()["train.cu"] == (KERNELS / "train.cu").read_text()
    assert module.options == _cuda.COMPILE_OPTIONS == ("-std=c++17", "--fmad=false", "-ftz=true")
    assert module.names == [("softmax_forward_f32", 0), ("rms_backward_bf16", 0)]


def test_the_flash_kernels_compile_the_shipped_attention_cu(fake_cupy: CudaBackend) -> None:
    _cuda._flash_kernel(fake_cupy, "flash_forward_d128", 34848)
    _cuda._flash_kernel(fake_cupy, "flash_delta", 0)
    (module,) = Module.made
    text = _core.kernel_sources()["attention.cu"]
    assert module.file == "attention.cu"
    assert module.code == text == (KERNELS / "attention.cu").read_text()
    assert module.options == _cuda.FLASH_COMPILE_OPTIONS
    assert "-DFLASH_DKDV_ROWS_64=64" in module.options and "-std=c++17" in module.options
    assert module.options[-1] == "-ftz=true"  # last, as CuPy added it: NVRTC takes the last
    assert module.names == [("flash_forward_d128", 34848), ("flash_delta", 0)]


def test_the_trainer_options_are_the_ones_cupy_compiled_with() -> None:
    """The options the CI check and the GPU compile with: the trainer's, then the
    architecture; the library's file keeps its own (no flush to zero, the host's -D)."""
    assert kernels.compile_options("90", options=_cuda.COMPILE_OPTIONS) == [
        "-std=c++17",
        "--fmad=false",
        "-ftz=true",
        "--gpu-architecture=sm_90",
    ]
    flash = kernels.compile_options("80", options=_cuda.FLASH_COMPILE_OPTIONS)
    assert flash == [*_cuda.FLASH_COMPILE_OPTIONS, "--gpu-architecture=sm_80"]
    library = kernels.compile_options("90")
    assert "-ftz=true" not in library and f"-D{kernels.HOST_DEFINES[0]}" in library


def test_one_compile_path_gives_nvrtc_the_file_and_its_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kernels.compile_cubin (every module's compile) hands NVRTC the named file's text,
    under its name, with the options asked for."""
    seen: dict[str, Any] = {}

    class Nvrtc:
        NVRTCError = RuntimeError

        @staticmethod
        def createProgram(text: str, name: str, headers: Any, includes: Any) -> str:
            seen.update(text=text, name=name)
            return "program"

        @staticmethod
        def compileProgram(program: str, options: list[str]) -> None:
            seen["options"] = options

        @staticmethod
        def getCUBIN(program: str) -> bytes:
            return b"cubin"

        @staticmethod
        def destroyProgram(program: str) -> None:
            seen["destroyed"] = program

    monkeypatch.setattr(kernels, "_nvrtc", lambda: Nvrtc)
    cubin = kernels.compile_cubin("90", file="attention.cu", options=_cuda.FLASH_COMPILE_OPTIONS)
    assert cubin == b"cubin" and seen["destroyed"] == "program"
    assert seen["name"] == "attention.cu" and seen["text"] == _cuda.source("attention.cu")
    assert seen["options"] == [*_cuda.FLASH_COMPILE_OPTIONS, "--gpu-architecture=sm_90"]


def test_the_trainer_source_honours_the_kernels_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train/_cuda.source is the library's look-up: NYBBLE_KERNELS_DIR names the folder
    whose files are compiled instead of the shipped ones (kernel work without a rebuild)."""
    (tmp_path / "attention.cu").write_text("// a copy being worked on\n")
    monkeypatch.setenv("NYBBLE_KERNELS_DIR", str(tmp_path))
    assert _cuda.source("attention.cu") == "// a copy being worked on\n"
    assert kernels.source("attention.cu") == "// a copy being worked on\n"
    monkeypatch.delenv("NYBBLE_KERNELS_DIR")
    assert _cuda.source("attention.cu") == _core.kernel_sources()["attention.cu"]


def test_no_cuda_source_is_left_in_the_python() -> None:
    assert _cuda.__file__ is not None
    text = Path(_cuda.__file__).read_text()
    for marker in ("__global__", "__device__", 'extern "C"', "#define"):
        assert marker not in text, marker
