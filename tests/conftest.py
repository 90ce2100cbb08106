"""Shared test setup: hypothesis profiles, the `gpu` marker, and the codec backends that
every differential test runs over (the numpy oracle, the Rust core, and CUDA where present)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import nybble
from nybble import reference

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _cuda_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


CUDA = _cuda_available()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass(frozen=True)
class Codec:
    """One implementation of quantize/dequantize with numpy in and out."""

    name: str
    quantize: Callable[..., tuple[np.ndarray, np.ndarray]]
    dequantize: Callable[..., np.ndarray]


def _reference_quantize(x: np.ndarray, blocksize: int, codebook: str) -> tuple[Any, Any]:
    return reference.quantize(np.asarray(x).astype(np.float32).ravel(), blocksize, codebook)


def _reference_dequantize(
    codes: Any, absmax: Any, n: int, blocksize: int, codebook: str, dtype: str
) -> Any:
    out = reference.dequantize(codes, absmax, n, blocksize, codebook)
    return out.astype(nybble.formats.numpy_dtype(dtype))


def _rust_quantize(x: np.ndarray, blocksize: int, codebook: str) -> tuple[Any, Any]:
    q = nybble.quantize(x, blocksize=blocksize, codebook=codebook)
    return q.codes, q.absmax


def _rust_dequantize(
    codes: Any, absmax: Any, n: int, blocksize: int, codebook: str, dtype: str
) -> Any:
    return nybble.NF4Tensor(codes, absmax, (n,), blocksize, codebook).dequantize(dtype)


def _cuda_quantize(x: np.ndarray, blocksize: int, codebook: str) -> tuple[Any, Any]:
    import cupy

    q = nybble.quantize(cupy.asarray(x), blocksize=blocksize, codebook=codebook).cpu()
    return q.codes, q.absmax


def _cuda_dequantize(
    codes: Any, absmax: Any, n: int, blocksize: int, codebook: str, dtype: str
) -> Any:
    import cupy

    q = nybble.NF4Tensor(codes, absmax, (n,), blocksize, codebook).cuda()
    return cupy.asnumpy(q.dequantize(dtype))


CODECS = [
    pytest.param(Codec("reference", _reference_quantize, _reference_dequantize), id="reference"),
    pytest.param(Codec("rust", _rust_quantize, _rust_dequantize), id="rust"),
    pytest.param(Codec("cuda", _cuda_quantize, _cuda_dequantize), id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=CODECS, scope="session")
def codec(request: Any) -> Codec:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(params=CODECS[1:], scope="session")
def fast_codec(request: Any) -> Codec:
    """The implementations that are checked against the oracle."""
    return request.param  # type: ignore[no-any-return]
