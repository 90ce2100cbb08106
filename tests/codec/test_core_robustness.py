"""The Rust core's binding on every class of bad or edge input: each call ends in a result the
math says, or a Python exception of the proper type (ValueError for bad values and sizes,
TypeError for wrong types, NonFiniteError for NaN/inf, MemoryError for an output that cannot
be allocated), never a `pyo3_runtime.PanicException` (a BaseException) and never an abort.
Also: the format facts the core exports agree with the oracle's own statement of them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nybble import _core, reference
from nybble.errors import NonFiniteError

F32 = np.float32
CODEBOOKS = ["nf4", "fp4", "int8", "dynamic8"]


def _panic_type() -> type[BaseException]:
    try:
        _core._panic("probe")
    except BaseException as e:
        return type(e)
    raise AssertionError("_panic returned")


PANIC = _panic_type()


def test_the_panic_type_is_what_pyo3_raises() -> None:
    assert PANIC.__name__ == "PanicException"
    assert not issubclass(PANIC, Exception)


def outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException | None:
    """The exception `fn` raises (None when it returns); fails on a panic."""
    try:
        fn(*args, **kwargs)
    except BaseException as e:  # a panic is a BaseException
        assert not isinstance(e, PANIC), f"panic: {e}"
        return e
    return None


def raises(kind: type[BaseException], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    e = outcome(fn, *args, **kwargs)
    assert isinstance(e, kind), f"expected {kind.__name__}, got {e!r}"


def quantized(rows: int, cols: int, codebook: str = "nf4", blocksize: int = 64) -> Any:
    rng = np.random.default_rng(rows * 1000 + cols)
    w = rng.standard_normal((rows, cols)).astype(F32)
    codes, absmax = _core.quantize(w.reshape(-1), blocksize, codebook)
    return w, codes, absmax


def dequantized(codes: Any, absmax: Any, shape: tuple[int, int], codebook: str = "nf4") -> Any:
    out = np.empty(shape[0] * shape[1], F32)
    _core.dequantize_into(codes, absmax, 64, codebook, out)
    return out.reshape(shape)


# --- the format facts -----------------------------------------------------------------------


def test_format_facts_agree_with_the_oracle() -> None:
    thresholds = {
        "nf4": reference.NF4_MIDPOINTS,
        "fp4": reference.FP4_THRESHOLDS,
        "int8": np.zeros(0, F32),
        "dynamic8": reference.DYNAMIC_MIDPOINTS,
    }
    for name in CODEBOOKS:
        values = np.array(_core.codebook_values(name), F32)
        np.testing.assert_array_equal(values, reference.CODEBOOKS[name])
        got = np.array(_core.codebook_thresholds(name), F32)
        np.testing.assert_array_equal(got, thresholds[name])
        assert np.all(np.diff(got) > 0)
        assert _core.zero_code(name) == reference.ZERO_CODE[name]
        assert values[_core.zero_code(name)] == 0.0
        assert _core.code_bits(name) == reference.BITS[name]
        assert len(values) == 1 << _core.code_bits(name)
    codes = _core.fp4_magnitude_codes()
    assert all(type(c) is int for c in codes)
    np.testing.assert_array_equal(codes, reference.FP4_MAGNITUDE_CODES)
    assert np.all(np.diff(reference.FP4[codes]) > 0)


def test_layout_constants_agree_with_the_oracle() -> None:
    assert _core.NESTED_BLOCKSIZE == reference.NESTED_BLOCKSIZE
    assert _core.BLOCK36_VALUES == reference.BLOCK36_VALUES
    assert _core.BLOCK36_BYTES == 4 + _core.BLOCK36_VALUES // 2
    assert (_core.MIN_BLOCKSIZE, _core.MAX_BLOCKSIZE) == (32, 4096)
    x = np.ones(_core.BLOCK36_VALUES * 3 - 1, F32)
    codes, absmax = _core.quantize(x, _core.BLOCK36_VALUES, "nf4")
    assert len(_core.to_blocks36(codes, absmax, x.size, "nf4")) == 3 * _core.BLOCK36_BYTES
    for bs in (_core.MIN_BLOCKSIZE, _core.MAX_BLOCKSIZE):
        assert len(_core.quantize(x, bs, "nf4")[1]) == -(-x.size // bs)
    for bs in (_core.MIN_BLOCKSIZE // 2, _core.MAX_BLOCKSIZE * 2):
        raises(ValueError, _core.quantize, x, bs, "nf4")


@pytest.mark.parametrize("name", ["nf5", "NF4", "", "dynamic"])
def test_unknown_codebook_names_are_value_errors(name: str) -> None:
    codes, absmax = _core.quantize(np.ones(64, F32), 64, "nf4")
    for fn in (_core.codebook_values, _core.codebook_thresholds, _core.zero_code, _core.code_bits):
        raises(ValueError, fn, name)
    raises(ValueError, _core.quantize, np.ones(64, F32), 64, name)
    raises(ValueError, _core.dequantize_into, codes, absmax, 64, name, np.empty(64, F32))
    raises(ValueError, _core.to_blocks36, codes, absmax, 64, name)


# --- empty inputs: the math's answer --------------------------------------------------------


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_empty_arrays_quantize_and_dequantize_to_empty(codebook: str) -> None:
    for x in (np.zeros(0, F32), np.zeros(0, np.float64)):
        codes, absmax = _core.quantize(x, 64, codebook)
        assert (codes.size, absmax.size) == (0, 0)
        _core.dequantize_into(codes, absmax, 64, codebook, np.empty(0, F32))
    codes, absmax = _core.quantize(np.zeros(0, np.uint16), 64, codebook, "bfloat16")
    assert (codes.size, absmax.size) == (0, 0)


def test_empty_layouts_and_nested_scales() -> None:
    empty_codes, empty_absmax = np.zeros(0, np.uint8), np.zeros(0, F32)
    assert _core.to_blocks36(empty_codes, empty_absmax, 0, "nf4").size == 0
    codes, absmax = _core.from_blocks36(np.zeros(0, np.uint8), 0)
    assert (codes.size, absmax.size) == (0, 0)
    (codes, absmax2), offset = _core.double_quantize(empty_absmax)
    assert (codes.size, absmax2.size, offset) == (0, 0, 0.0)
    assert _core.double_dequantize(codes, absmax2, offset).size == 0


@pytest.mark.parametrize(("m", "k", "n"), [(0, 3, 4), (2, 0, 4), (2, 3, 0), (0, 0, 0), (0, 3, 0)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_with_empty_operands_follows_the_math(
    m: int, k: int, n: int, accumulate: bool
) -> None:
    a, b = np.ones((m, k), F32), np.ones((k, n), F32)
    out = np.full((m, n), 5.0, F32)
    _core.matmul(a, b, out, 2.0, accumulate)
    np.testing.assert_array_equal(out, 5.0 * accumulate + 2.0 * (a @ b))


@pytest.mark.parametrize("transpose", [True, False])
def test_qmatmul_over_zero_tokens_writes_nothing(transpose: bool) -> None:
    """A QLoRA forward (and backward) over zero tokens."""
    _, codes, absmax = quantized(32, 24)
    x = np.ones((0, 24 if transpose else 32), F32)
    out = np.empty((0, 32 if transpose else 24), F32)
    _core.qmatmul(x, codes, absmax, (32, 24), 64, "nf4", out, transpose)
    assert out.shape == (0, 32 if transpose else 24)


@pytest.mark.parametrize(("rows", "cols"), [(0, 24), (32, 0), (0, 0)])
@pytest.mark.parametrize("transpose", [True, False])
def test_qmatmul_with_an_empty_weight_is_an_empty_sum(
    rows: int, cols: int, transpose: bool
) -> None:
    codes, absmax = _core.quantize(np.zeros(0, F32), 64, "nf4")
    inner, outer = (cols, rows) if transpose else (rows, cols)
    x = np.ones((3, inner), F32)
    for accumulate in (False, True):
        out = np.full((3, outer), 5.0, F32)
        _core.qmatmul(x, codes, absmax, (rows, cols), 64, "nf4", out, transpose, 1.0, accumulate)
        np.testing.assert_array_equal(out, np.full((3, outer), 5.0 * accumulate, F32))


def test_dora_norms_of_empty_weights_and_adapters() -> None:
    w, codes, absmax = quantized(32, 24)
    e_codes, e_absmax = _core.quantize(np.zeros(0, F32), 64, "nf4")
    # Rank 0: the norms of W alone.
    want = np.linalg.norm(dequantized(codes, absmax, (32, 24)), axis=1)
    got = _core.dora_row_norms_quantized(
        codes, absmax, (32, 24), 64, "nf4", np.ones((32, 0), F32), np.ones((0, 24), F32), 1.0
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    got = _core.dora_row_norms_dense(w, np.ones((32, 0), F32), np.ones((0, 24), F32), 1.0)
    np.testing.assert_allclose(got, np.linalg.norm(w, axis=1), rtol=1e-6)
    # No rows: no norms. No columns: every norm is 0.
    for rows, cols in ((0, 24), (32, 0), (0, 0)):
        b, a = np.ones((rows, 4), F32), np.ones((4, cols), F32)
        got = _core.dora_row_norms_quantized(e_codes, e_absmax, (rows, cols), 64, "nf4", b, a, 1.0)
        np.testing.assert_array_equal(got, np.zeros(rows, F32))
        got = _core.dora_row_norms_dense(np.ones((rows, cols), F32), b, a, 1.0)
        np.testing.assert_array_equal(got, np.zeros(rows, F32))


def test_outputs_too_large_to_allocate_are_memory_errors() -> None:
    """2^60 rows of nothing: the inputs are empty, the norms would take 4 EiB."""
    e_codes, e_absmax = _core.quantize(np.zeros(0, F32), 64, "nf4")
    rows = 1 << 60
    b = np.lib.stride_tricks.as_strided(np.zeros(1, F32), (rows, 0), (0, 4))
    a = np.zeros((0, 0), F32)
    w = np.lib.stride_tricks.as_strided(np.zeros(1, F32), (rows, 0), (0, 4))
    raises(
        MemoryError,
        _core.dora_row_norms_quantized,
        e_codes,
        e_absmax,
        (rows, 0),
        64,
        "nf4",
        b,
        a,
        1.0,
    )
    raises(MemoryError, _core.dora_row_norms_dense, w, b, a, 1.0)


# --- sizes and shapes that do not fit ------------------------------------------------------


BAD_SIZES = [-1, -64, 2**64, 2**70, -(2**70)]
BAD_BLOCKSIZES = [0, 1, 3, 48, 8192, 2**63, *BAD_SIZES]


@pytest.mark.parametrize("blocksize", BAD_BLOCKSIZES)
def test_bad_blocksizes_are_value_errors(blocksize: int) -> None:
    _, codes, absmax = quantized(8, 8)
    raises(ValueError, _core.quantize, np.ones(10, F32), blocksize, "nf4")
    raises(ValueError, _core.dequantize_into, codes, absmax, blocksize, "nf4", np.empty(64, F32))
    x, out = np.ones((2, 8), F32), np.empty((2, 8), F32)
    raises(ValueError, _core.qmatmul, x, codes, absmax, (8, 8), blocksize, "nf4", out)
    b, a = np.ones((8, 2), F32), np.ones((2, 8), F32)
    raises(
        ValueError,
        _core.dora_row_norms_quantized,
        codes,
        absmax,
        (8, 8),
        blocksize,
        "nf4",
        b,
        a,
        1.0,
    )


@pytest.mark.parametrize("n", [*BAD_SIZES, 2**64 - 1, 2**63, 65, 129])
def test_bad_element_counts_of_the_block_layout_are_value_errors(n: int) -> None:
    codes, absmax = _core.quantize(np.ones(64, F32), 64, "nf4")
    raises(ValueError, _core.to_blocks36, codes, absmax, n, "nf4")
    raises(ValueError, _core.from_blocks36, np.zeros(36, np.uint8), n)


def test_integers_too_long_to_print_are_value_errors() -> None:
    """Python refuses str() of an int over 4300 digits; the message must not need it."""
    huge = 10**5000
    raises(ValueError, _core.from_blocks36, np.zeros(36, np.uint8), huge)
    raises(ValueError, _core.quantize, np.ones(64, F32), -huge, "nf4")
    c2, a2 = _core.double_quantize(np.ones(4, F32))[0]
    raises(ValueError, _core.double_dequantize, c2, a2, huge)


def test_the_block_layout_holds_4_bit_codes_only() -> None:
    for codebook in ("int8", "dynamic8"):
        raises(ValueError, _core.to_blocks36, np.zeros(1, np.uint8), np.ones(1, F32), 1, codebook)


def test_non_finite_scales_in_the_block_layout_are_value_errors() -> None:
    for bad in (np.nan, np.inf, -np.inf):
        buf = np.zeros(36, np.uint8)
        buf[:4] = np.array([bad], "<f4").view(np.uint8)
        raises(ValueError, _core.from_blocks36, buf, 64)
    # A finite negative scale is kept: a double-quantized zero block decodes a hair below 0.
    buf = np.zeros(36, np.uint8)
    buf[:4] = np.array([-5e-4], "<f4").view(np.uint8)
    assert _core.from_blocks36(buf, 64)[1][0] == np.float32(-5e-4)


@pytest.mark.parametrize(
    "shape",
    [(2**32, 2**32), (2**63, 2), (2**64 - 1, 2**64 - 1), (-1, 8), (8, 2**64), (9, 8), (8, 9)],
)
def test_weight_shapes_that_do_not_match_or_overflow_are_value_errors(
    shape: tuple[int, int],
) -> None:
    # Zero tokens whose shapes agree with the weight's where numpy can make them: only the
    # weight's own sizes are wrong. Empty codes: an element count that wraps to 0 would fit.
    rows, cols = (d if 0 <= d < 2**63 else 8 for d in shape)
    for n in (64, 0):
        codes, absmax = _core.quantize(np.ones(n, F32), 64, "nf4")
        x, out = np.ones((0, cols), F32), np.empty((0, rows), F32)
        raises(ValueError, _core.qmatmul, x, codes, absmax, shape, 64, "nf4", out)
        x, out = np.ones((0, rows), F32), np.empty((0, cols), F32)
        raises(ValueError, _core.qmatmul, x, codes, absmax, shape, 64, "nf4", out, False)
        b, a = np.ones((rows, 0), F32), np.ones((0, cols), F32)
        args = (codes, absmax, shape, 64, "nf4", b, a, 1.0)
        raises(ValueError, _core.dora_row_norms_quantized, *args)


def test_mismatched_operand_shapes_are_value_errors() -> None:
    w, codes, absmax = quantized(8, 16)
    q = (codes, absmax, (8, 16), 64, "nf4")
    raises(ValueError, _core.qmatmul, np.ones((2, 15), F32), *q, np.empty((2, 8), F32))
    raises(ValueError, _core.qmatmul, np.ones((2, 16), F32), *q, np.empty((2, 9), F32))
    for shape in ((8,), (8, 16, 1)):
        x, out = np.ones((2, 16), F32), np.empty((2, 8), F32)
        raises(ValueError, _core.qmatmul, x, codes, absmax, shape, 64, "nf4", out)
    raises(ValueError, _core.qmatmul, np.ones((2, 16), F32), *q, np.empty((3, 8), F32))
    raises(ValueError, _core.qmatmul, np.ones((2, 16), F32), *q, np.empty((2, 16), F32), False)
    raises(ValueError, _core.qmatmul, np.ones((0, 16), F32), *q, np.empty((0, 9), F32))
    raises(
        ValueError,
        _core.qmatmul,
        np.ones((2, 16), F32),
        codes[:-1],
        absmax,
        (8, 16),
        64,
        "nf4",
        np.empty((2, 8), F32),
    )
    raises(
        ValueError,
        _core.qmatmul,
        np.ones((2, 16), F32),
        codes,
        absmax[:-1],
        (8, 16),
        64,
        "nf4",
        np.empty((2, 8), F32),
    )
    raises(
        ValueError, _core.matmul, np.ones((2, 3), F32), np.ones((4, 5), F32), np.empty((2, 5), F32)
    )
    raises(
        ValueError, _core.matmul, np.ones((2, 3), F32), np.ones((3, 5), F32), np.empty((2, 4), F32)
    )
    raises(
        ValueError, _core.matmul, np.ones((0, 3), F32), np.ones((3, 5), F32), np.empty((1, 5), F32)
    )
    b, a = np.ones((8, 2), F32), np.ones((2, 16), F32)
    raises(ValueError, _core.dora_row_norms_dense, w, np.ones((7, 2), F32), a, 1.0)
    raises(ValueError, _core.dora_row_norms_dense, w, b, np.ones((3, 16), F32), 1.0)
    raises(ValueError, _core.dora_row_norms_dense, w, b, np.ones((2, 15), F32), 1.0)
    raises(ValueError, _core.dora_row_norms_quantized, *q, b, np.ones((2, 0), F32), 1.0)
    raises(ValueError, _core.dequantize_into, codes, absmax, 64, "nf4", np.empty(126, F32))
    raises(ValueError, _core.dequantize_into, codes, absmax[:1], 64, "nf4", np.empty(128, F32))
    raises(ValueError, _core.double_dequantize, np.zeros(257, np.uint8), np.ones(1, F32), 0.0)


# --- arrays of the wrong kind ---------------------------------------------------------------


def _unaligned(shape: tuple[int, ...]) -> Any:
    raw = np.zeros(int(np.prod(shape)) * 4 + 1, np.uint8)
    return raw[1:].view(F32).reshape(shape)


def test_wrong_dtypes_and_ranks_are_type_errors() -> None:
    ones = np.ones(64, F32)
    codes, absmax = _core.quantize(ones, 64, "nf4")
    for x in (
        np.ones(64, np.float16),
        np.ones(64, np.int64),
        np.ones(64, ">f4"),
        np.ones(64, ">f8"),
        np.ones((8, 8), F32),
        [1.0] * 64,
        np.ones(64, ml_dtypes.bfloat16),
    ):
        raises(TypeError, _core.quantize, x, 64, "nf4")
    raises(
        TypeError,
        _core.dequantize_into,
        codes.astype(np.int8),
        absmax,
        64,
        "nf4",
        np.empty(64, F32),
    )
    raises(
        TypeError,
        _core.dequantize_into,
        codes,
        absmax.astype(np.float64),
        64,
        "nf4",
        np.empty(64, F32),
    )
    raises(TypeError, _core.dequantize_into, codes, absmax, 64, "nf4", np.empty(64, np.float64))
    raises(TypeError, _core.matmul, np.ones((2, 2)), np.ones((2, 2), F32), np.empty((2, 2), F32))
    raises(TypeError, _core.matmul, np.ones(4, F32), np.ones((4, 1), F32), np.empty((1, 1), F32))
    raises(
        TypeError,
        _core.qmatmul,
        np.ones((1, 8), F32),
        codes,
        absmax,
        (8, 8),
        64.0,
        "nf4",
        np.empty((1, 8), F32),
    )
    raises(TypeError, _core.quantize, ones, "64", "nf4")
    raises(TypeError, _core.quantize, ones, 64, 4)
    raises(TypeError, _core.from_blocks36, np.zeros(36, np.uint8), 64.5)


def test_uint16_input_needs_its_float_format() -> None:
    bits = np.ones(64, np.float16).view(np.uint16)
    for bits16 in (None, "float32", "f16"):
        raises(ValueError, _core.quantize, bits, 64, "nf4", bits16)
    codes, absmax = _core.quantize(bits, 64, "nf4", "float16")
    raises(ValueError, _core.dequantize_into, codes, absmax, 64, "nf4", np.empty(64, np.uint16))


def test_non_contiguous_misaligned_and_fortran_arrays_are_refused_or_read_right() -> None:
    _, codes, absmax = quantized(8, 64)
    ones = np.ones(128, F32)
    raises(ValueError, _core.quantize, ones[::2], 64, "nf4")
    raises(ValueError, _core.quantize, _unaligned((64,)), 64, "nf4")
    raises(ValueError, _core.dequantize_into, codes, absmax, 64, "nf4", np.empty(1024, F32)[::2])
    raises(ValueError, _core.dequantize_into, codes, absmax, 64, "nf4", _unaligned((512,)))
    raises(ValueError, _core.dequantize_into, codes[::2], absmax, 64, "nf4", np.empty(512, F32))
    a = np.ones((4, 4), F32)
    # Outputs must be C-ordered: a Fortran-ordered one is refused, not written transposed.
    raises(ValueError, _core.matmul, a, a, np.empty((4, 4), F32, order="F"))
    raises(ValueError, _core.matmul, a, a, np.empty((4, 8), F32)[:, ::2])
    raises(ValueError, _core.matmul, a, a, _unaligned((4, 4)))
    raises(ValueError, _core.matmul, _unaligned((4, 4)), a, np.empty((4, 4), F32))
    raises(ValueError, _core.matmul, a[::-1], a, np.empty((4, 4), F32))
    # Readonly or aliased outputs: the array borrow checks say no.
    raises(TypeError, _core.matmul, a, a, np.broadcast_to(np.ones(4, F32), (4, 4)))
    raises(TypeError, _core.matmul, a, a, a)
    # Strided and broadcast inputs are read as they are.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 10), dtype=F32)
    for a_view, b_view in (
        (x[::2, ::3], x[:4, :5]),
        (x.T[:4, :3], x[:3, ::2]),
        (np.broadcast_to(x[0, :4], (3, 4)), np.asfortranarray(x[:4, :2])),
    ):
        out = np.empty((a_view.shape[0], b_view.shape[1]), F32)
        _core.matmul(a_view, b_view, out)
        np.testing.assert_allclose(out, a_view @ b_view, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e300, 2**1100])
def test_non_finite_or_unrepresentable_factors_are_value_errors(bad: float) -> None:
    w, codes, absmax = quantized(8, 8)
    x, out = np.ones((2, 8), F32), np.empty((2, 8), F32)
    raises(ValueError, _core.matmul, x, w.T.copy(), out, bad)
    raises(ValueError, _core.qmatmul, x, codes, absmax, (8, 8), 64, "nf4", out, True, bad)
    b, a = np.ones((8, 2), F32), np.ones((2, 8), F32)
    raises(ValueError, _core.dora_row_norms_dense, w, b, a, bad)
    raises(ValueError, _core.dora_row_norms_quantized, codes, absmax, (8, 8), 64, "nf4", b, a, bad)
    (c2, a2), _ = _core.double_quantize(absmax)
    raises(ValueError, _core.double_dequantize, c2, a2, bad)


# --- non-finite inputs: NonFiniteError with the index ---------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_non_finite_inputs_raise_non_finite_error_with_the_first_index(
    dtype: str, codebook: str
) -> None:
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    for n, bad_at in ((1, 0), (100, 70), (300_000, 299_999)):
        x = np.ones(n, np_dtype)
        x[bad_at] = np.nan
        if n > bad_at + 1:
            x[-1] = np.inf
        arg = x.view(np.uint16) if x.dtype.itemsize == 2 else x
        bits16 = dtype if x.dtype.itemsize == 2 else None
        e = outcome(_core.quantize, arg, 64, codebook, bits16)
        assert isinstance(e, NonFiniteError), repr(e)
        assert e.index == bad_at


def test_bad_scales_for_double_quantization_are_value_errors() -> None:
    for bad in (np.nan, np.inf, -1.0):
        raises(ValueError, _core.double_quantize, np.array([1.0, bad], F32))


# --- properties over shapes and sizes -------------------------------------------------------

DIMS = st.sampled_from([0, 1, 2, 3, 31, 32, 33, 64, 65, 130])


@given(m=DIMS, rows=DIMS, cols=DIMS, transpose=st.booleans(), codebook=st.sampled_from(CODEBOOKS))
def test_qmatmul_equals_a_product_with_the_dequantized_weight(
    m: int, rows: int, cols: int, transpose: bool, codebook: str
) -> None:
    rng = np.random.default_rng(m * 10_000 + rows * 100 + cols)
    w = rng.standard_normal(rows * cols).astype(F32)
    codes, absmax = _core.quantize(w, 32, codebook)
    flat = np.empty(rows * cols, F32)
    _core.dequantize_into(codes, absmax, 32, codebook, flat)
    dense = flat.reshape(rows, cols)
    op = dense.T if transpose else dense
    x = rng.standard_normal((m, op.shape[0])).astype(F32)
    out = np.full((m, op.shape[1]), np.nan, F32)
    _core.qmatmul(x, codes, absmax, (rows, cols), 32, codebook, out, transpose)
    np.testing.assert_allclose(out, x @ op, rtol=1e-4, atol=1e-4)


SIZES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 63, 64, 65, 2**32, 2**58, 2**63, 2**64 - 1, 2**64]),
)


@given(n=SIZES, blocksize=SIZES, rows=SIZES, cols=SIZES)
def test_any_integer_sizes_give_a_result_or_a_value_error(
    n: int, blocksize: int, rows: int, cols: int
) -> None:
    codes, absmax = _core.quantize(np.ones(64, F32), 64, "nf4")
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (_core.quantize, (np.ones(64, F32), blocksize, "nf4")),
        (_core.dequantize_into, (codes, absmax, blocksize, "nf4", np.empty(64, F32))),
        (_core.to_blocks36, (codes, absmax, n, "nf4")),
        (_core.from_blocks36, (np.zeros(36, np.uint8), n)),
        (
            _core.qmatmul,
            (
                np.ones((0, 8), F32),
                codes,
                absmax,
                (rows, cols),
                blocksize,
                "nf4",
                np.empty((0, 8), F32),
            ),
        ),
        (
            _core.dora_row_norms_quantized,
            (
                codes,
                absmax,
                (rows, cols),
                blocksize,
                "nf4",
                np.ones((8, 1), F32),
                np.ones((1, 8), F32),
                1.0,
            ),
        ),
    ]
    for fn, args in calls:
        e = outcome(fn, *args)
        assert e is None or isinstance(e, ValueError), repr(e)


# --- inputs written by another thread while the core reads them ------------------------------


def test_input_toggled_to_nan_during_quantize_gives_a_result_or_non_finite_error() -> None:
    """Python may write an array while the core reads it with the GIL released: the result
    may be either version of the data, but never a panic. A value can turn back to 1.0
    between the scan that finds a NaN and the scan that locates it; large blocks keep that
    window wide (the Rust tests pin the outcome: the block's start)."""
    n, blocksize = 1 << 19, 4096  # the parallel path; a call takes about a millisecond
    x = np.ones(n, F32)
    indices = [0, 64 * 1000 + 5, n - 1]
    stop = threading.Event()

    def toggle() -> None:
        while not stop.is_set():
            for i in indices:
                x[i] = np.nan
                x[i] = 1.0

    toggler = threading.Thread(target=toggle)
    toggler.start()
    results = errors = 0
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for codebook in ("nf4", "fp4"):  # the SIMD and the scalar block loops
                e = outcome(_core.quantize, x, blocksize, codebook)
                if e is None:
                    results += 1
                else:
                    assert isinstance(e, NonFiniteError), repr(e)
                    assert e.index in indices or e.index % blocksize == 0
                    errors += 1
    finally:
        stop.set()
        toggler.join()
    assert results + errors > 0


@pytest.mark.skipif(not hasattr(_core, "KernelLaunch"), reason="no dlopen on this OS")
@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0, 1, 32, 0, [], [], False), ValueError, "null CUfunction"),
        ((1, 0, 32, 0, [], [], False), ValueError, "grid and block must be positive"),
        ((1, 1, 0, 0, [], [], False), ValueError, "grid and block must be positive"),
        ((1, 1, 32, 0, [0] * 17, [], False), ValueError, "at most 16 parameters"),
        ((1, 1, 32, 0, [0, 0], [2], False), ValueError, "parameter 2 of a kernel of 2"),
        ((1, 1, 32, 0, [-1], [], False), OverflowError, "negative"),
        ((1, 2**32, 32, 0, [], [], False), OverflowError, "out of range"),
        (("f", 1, 32, 0, [], [], False), TypeError, "cannot be interpreted as an integer"),
    ],
)
def test_kernel_launches_refuse_arguments_that_make_no_launch(
    args: tuple[Any, ...], error: type[Exception], match: str
) -> None:
    """Checked before the driver is looked for, so the same errors with or without a GPU."""
    with pytest.raises(error, match=match):
        _core.KernelLaunch(*args)


@pytest.mark.skipif(not hasattr(_core, "KernelLaunch"), reason="no dlopen on this OS")
def test_kernel_launches_without_a_driver_are_runtime_errors() -> None:
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has the CUDA driver")
    with pytest.raises(RuntimeError, match=r"the CUDA driver is unavailable: .*libcuda"):
        _core.KernelLaunch(1, 1, 32, 0, [0, 0], [0], True)


class _Memory:
    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr, self.device_id = ptr, device_id


class _Array:
    """What the core's GEMV call reads of a CuPy array, with any values."""

    def __init__(self, dtype: Any, shape: Any, strides: Any, ptr: int = 0, device: int = 0) -> None:
        self.dtype, self.shape, self.strides = dtype, shape, strides
        self.data = _Memory(ptr, device)


@pytest.mark.skipif(not hasattr(_core, "GemvCall"), reason="no dlopen on this OS")
def test_gemv_calls_launch_nothing_they_were_not_prepared_for() -> None:
    """The core's GEMV call (nybble.cuda.nf4_matmul's first try) returns None, launching
    nothing, for any call its weight's checked calls did not prepare, whatever the arrays
    hold: the caller's checked path then takes it. Without a driver nothing is prepared, so
    here every call is of that kind; the GPU tests cover the prepared ones."""
    f16, bf16 = np.dtype("float16"), np.dtype(ml_dtypes.bfloat16)
    streams: list[int] = []

    def current_stream() -> Any:
        streams.append(1)
        return _Memory(0, 0)

    call = _core.GemvCall((), _Array, current_stream, lambda *a: None, (f16, bf16), 0, 32, 64)
    out = _Array(f16, (1, 32), (64, 2))
    shapes: list[Any] = [(1, 64), (8, 64), (0, 64), (9, 64), (-1, 64), (1, 63), (1, 64, 1)]
    shapes += [(64,), "1x64", None, (1.0, 64), (2**70, 64)]
    strides: list[Any] = [(128, 2), (-128, 2), (128, 4), None]
    for dtype in (f16, bf16, np.dtype("float32"), "float16", None):
        for shape in shapes:
            for stride in strides:
                x = _Array(dtype, shape, stride, ptr=2**40)
                assert call(x) is None
                assert call(x, out) is None
                assert call(x, object()) is None
    assert call(np.zeros((1, 64), f16)) is None  # not the array type it takes
    assert call(object()) is None
    assert not streams  # nothing got as far as the stream
    with pytest.raises(TypeError):
        call.add(0, 1, object(), [])  # type: ignore[arg-type]
