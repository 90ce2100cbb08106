"""The trainer's GPU modules compile the CUDA files the extension ships (kernels/train.cu and
kernels/attention.cu, `_core.kernel_sources()`), with their options: read from what
train/_cuda.py hands CuPy's RawModule, under a stand-in for CuPy (no GPU, no compiler)."""

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
from nybble.train import _cuda

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


class RawModule:
    """CuPy's RawModule as the trainer calls it: what it was given, and the names asked of it."""

    made: ClassVar[list[RawModule]] = []

    def __init__(self, *, code: str, options: tuple[str, ...]) -> None:
        self.code = code
        self.options = options
        self.names: list[str] = []
        RawModule.made.append(self)

    def get_function(self, name: str) -> Any:
        self.names.append(name)
        return types.SimpleNamespace(name=name)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    runtime = types.SimpleNamespace(getDevice=lambda: 0)
    cp = types.SimpleNamespace(RawModule=RawModule, cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", cp)
    RawModule.made.clear()
    for cached in (_cuda._module, _cuda._flash_module, _cuda._flash_kernel):
        cached.cache_clear()
    yield
    for cached in (_cuda._module, _cuda._flash_module, _cuda._flash_kernel):
        cached.cache_clear()


def test_the_row_kernels_compile_the_shipped_train_cu(fake_cupy: None) -> None:
    _cuda._kernel("softmax_forward", np.float32)
    _cuda._kernel("rms_backward", ml_dtypes.bfloat16)
    (module,) = RawModule.made
    assert module.code == _core.kernel_sources()["train.cu"] == (KERNELS / "train.cu").read_text()
    assert module.options == _cuda.COMPILE_OPTIONS == ("-std=c++17", "--fmad=false")
    assert module.names == ["softmax_forward_f32", "rms_backward_bf16"]


def test_the_flash_kernels_compile_the_shipped_attention_cu(fake_cupy: None) -> None:
    _cuda._flash_kernel(0, "flash_forward_d128", 0)
    _cuda._flash_kernel(0, "flash_delta", 0)
    (module,) = RawModule.made
    text = _core.kernel_sources()["attention.cu"]
    assert module.code == text == (KERNELS / "attention.cu").read_text()
    assert module.options == _cuda.FLASH_COMPILE_OPTIONS
    assert "-DFLASH_DKDV_ROWS_64=64" in module.options and "-std=c++17" in module.options
    assert module.names == ["flash_forward_d128", "flash_delta"]


def test_no_cuda_source_is_left_in_the_python() -> None:
    assert _cuda.__file__ is not None
    text = Path(_cuda.__file__).read_text()
    for marker in ("__global__", "__device__", 'extern "C"', "#define"):
        assert marker not in text, marker
