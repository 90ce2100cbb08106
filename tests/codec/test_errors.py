"""Bad input gets a clear exception naming what was wrong; never an abort or a wrong answer."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import nybble
from nybble import _core


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("index", [0, 5, 64, 999])
def test_non_finite_input_names_the_first_flat_index(bad: float, index: int) -> None:
    x = np.ones((10, 100), np.float32)
    x.flat[index] = bad
    x.flat[-1] = np.nan
    with pytest.raises(nybble.NonFiniteError) as e:
        nybble.quantize(x)
    assert e.value.index == index and isinstance(e.value, ValueError)


def test_non_finite_index_found_in_large_threaded_input() -> None:
    x = np.ones(2**21, np.float32)
    x[2**20 + 3] = np.nan
    x[2**21 - 1] = np.inf
    with pytest.raises(nybble.NonFiniteError) as e:
        nybble.quantize(x)
    assert e.value.index == 2**20 + 3


def test_float64_beyond_float32_range_is_an_error() -> None:
    with pytest.raises(nybble.NonFiniteError) as e:
        nybble.quantize(np.array([1.0, 1e300]))
    assert e.value.index == 1


def test_non_finite_error_pickles_with_its_index() -> None:
    import pickle

    e = pickle.loads(pickle.dumps(nybble.NonFiniteError(7, "x")))
    assert (type(e), e.index, e.what) == (nybble.NonFiniteError, 7, "x")
    f = pickle.loads(pickle.dumps(nybble.FormatError("a.json", "bad", "r")))
    assert (f.source, f.problem, f.field) == ("a.json", "bad", "r")


@pytest.mark.parametrize("blocksize", [0, 16, 48, 63, 8192, -64, 64.0, True])
def test_bad_blocksize(blocksize: object) -> None:
    with pytest.raises(ValueError, match="blocksize must be a power of two from 32 to 4096"):
        nybble.quantize(np.ones(64, np.float32), blocksize=blocksize)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.complex64, np.bool_])
def test_unsupported_input_dtype(dtype: type) -> None:
    with pytest.raises(ValueError, match=r"dtype .* expected one of float32"):
        nybble.quantize(np.ones(8, dtype))


def test_unknown_codebook_and_output_dtype() -> None:
    with pytest.raises(ValueError, match="codebook must be one of"):
        nybble.quantize(np.ones(8, np.float32), codebook="nf3")
    q = nybble.quantize(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="dtype must be one of"):
        q.dequantize("int8")


@pytest.mark.parametrize("length", [0, 35, 37, 72])
def test_from_blocks_wrong_length(length: int) -> None:
    with pytest.raises(ValueError, match=r"expected 36, got " + str(length)):
        nybble.NF4Tensor.from_blocks(np.zeros(length, np.uint8), (64,))


def test_from_blocks_rejects_bad_scales_and_dtypes() -> None:
    buf = nybble.quantize(np.ones(64, np.float32)).to_blocks()
    buf[:4] = np.array([np.nan], "<f4").view(np.uint8)
    with pytest.raises(ValueError, match=r"(?i)block 0 .* absmax nan"):
        nybble.NF4Tensor.from_blocks(buf, (64,))
    with pytest.raises(ValueError, match="bytes"):
        nybble.NF4Tensor.from_blocks(np.zeros(9, np.float32), (64,))
    with pytest.raises(ValueError, match="shape"):
        nybble.NF4Tensor.from_blocks(buf, (-1, 64))


def test_to_blocks_needs_blocksize_64() -> None:
    with pytest.raises(ValueError, match="blocksize 128"):
        nybble.quantize(np.ones(128, np.float32), blocksize=128).to_blocks()


@pytest.mark.parametrize("codebook", ["fp4", "int8"])
def test_to_blocks_refuses_formats_the_layout_cannot_name(codebook: str) -> None:
    """The 36-byte layout has no codebook field: an FP4 tensor would come back as NF4."""
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    q = nybble.quantize(x, codebook=codebook)
    with pytest.raises(ValueError, match=codebook):
        q.to_blocks()
    if codebook == "fp4":  # FP4 bytes stored that way elsewhere are read with the codebook named
        buf = nybble.NF4Tensor(q.codes, q.absmax, q.shape).to_blocks()
        back = nybble.NF4Tensor.from_blocks(buf, q.shape, codebook="fp4")
        np.testing.assert_array_equal(back.dequantize(), q.dequantize())


def test_tensor_rejects_codes_that_do_not_match_the_shape() -> None:
    q = nybble.quantize(np.ones(100, np.float32))
    with pytest.raises(ValueError, match="expected a flat uint8 array of 50 bytes"):
        nybble.NF4Tensor(q.codes[:-1], q.absmax, (100,))
    with pytest.raises(ValueError, match="expected 2 float32 scales"):
        nybble.NF4Tensor(q.codes, q.absmax[:1], (100,))


def test_core_rejects_inconsistent_sizes_with_value_errors() -> None:
    """The binding checks sizes itself, so no Rust assertion can be reached from Python."""
    codes = np.zeros(32, np.uint8)
    with pytest.raises(ValueError, match="number of scales"):
        _core.dequantize_into(codes, np.zeros(2, np.float32), 64, "nf4", np.empty(64, np.float32))
    with pytest.raises(ValueError, match="bytes of codes"):
        _core.dequantize_into(codes, np.zeros(1, np.float32), 64, "nf4", np.empty(66, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.quantize(np.zeros(128, np.float32)[::2], 64, "nf4")
    with pytest.raises(ValueError, match="bits16"):
        _core.quantize(np.zeros(8, np.uint16), 64, "nf4")
    with pytest.raises(ValueError, match="bits16"):
        _core.dequantize_into(codes, np.zeros(1, np.float32), 64, "nf4", np.empty(64, np.uint16))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        _core.dequantize_into(
            codes, np.zeros(1, np.float32), 64, "nf4", np.empty(128, np.float32)[::2]
        )
    with pytest.raises(TypeError):
        _core.quantize(np.zeros(8, np.int64), 64, "nf4")  # type: ignore[arg-type]


def test_rust_panic_becomes_a_python_exception_not_an_abort() -> None:
    """Run in a child process: if a panic aborted, the child would die by a signal."""
    code = (
        "import nybble._core as c\n"
        "try:\n    c._panic('boom')\n"
        "except BaseException as e:\n    print(type(e).__name__, e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "PanicException boom" in r.stdout
