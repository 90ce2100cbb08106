"""The codec: every fast implementation equals the numpy oracle bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nybble
from nybble import _core, reference
from tests.conftest import Codec
from tests.strategies import blocksizes, float32_arrays

CODEBOOKS = ["nf4", "fp4", "int8"]
OUT_DTYPES = ["float32", "float16", "bfloat16"]


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, so -0.0 != 0.0 and the comparison is exact."""
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def assert_same_quantization(got: tuple, want: tuple) -> None:
    np.testing.assert_array_equal(bits(np.asarray(got[1])), bits(want[1]), err_msg="absmax")
    np.testing.assert_array_equal(np.asarray(got[0]), want[0], err_msg="codes")


# --- quantize ---------------------------------------------------------------------------


@pytest.mark.parametrize("codebook", CODEBOOKS)
@given(data=st.data(), blocksize=blocksizes)
def test_quantize_equals_oracle(
    fast_codec: Codec, codebook: str, blocksize: int, data: st.DataObject
) -> None:
    x = data.draw(float32_arrays(blocksize=blocksize))
    assert_same_quantization(
        fast_codec.quantize(x, blocksize, codebook), reference.quantize(x, blocksize, codebook)
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
@given(x=float32_arrays())
def test_quantize_other_input_dtypes_convert_first(
    fast_codec: Codec, dtype: str, x: np.ndarray
) -> None:
    """f16/bf16 are widened exactly, f64 rounded to f32, then quantized as f32."""
    if dtype == "float64":
        wide = x.astype(np.float64) * (1 + 2**-30)  # not exactly representable in f32
    else:
        target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
        with np.errstate(over="ignore"):
            wide = x.astype(target)
        wide[~np.isfinite(wide.astype(np.float32))] = 0
    with np.errstate(over="ignore"):
        as_f32 = wide.astype(np.float32)
    if not np.isfinite(as_f32).all():
        return  # f64 values just above the f32 range round to inf; tested in test_errors
    assert_same_quantization(
        fast_codec.quantize(wide, 64, "nf4"), reference.quantize(as_f32, 64, "nf4")
    )


@pytest.mark.parametrize("n", [0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 4095, 4097])
@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_quantize_edge_lengths(fast_codec: Codec, n: int, codebook: str) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    assert_same_quantization(
        fast_codec.quantize(x, 64, codebook), reference.quantize(x, 64, codebook)
    )


def test_large_tensor_uses_threads_and_still_matches(fast_codec: Codec) -> None:
    """Above the parallel threshold the work is split in tasks; the result is the same."""
    x = np.random.default_rng(1).standard_normal(3 * 2**18 + 77).astype(np.float32)
    x[123_457::100_003] *= 1e-40  # tiny values inside some blocks
    assert_same_quantization(fast_codec.quantize(x, 64, "nf4"), reference.quantize(x, 64, "nf4"))


def test_exact_midpoints_take_the_lower_code(codec: Codec) -> None:
    # Block absmax 1 (a power of two), so v == x exactly.
    mids = reference.NF4_MIDPOINTS
    x = np.concatenate([[1.0], mids, -mids, np.nextafter(mids, np.float32(2))]).astype(np.float32)
    codes, absmax = codec.quantize(x, 64, "nf4")
    got = reference.unpack_nibbles(np.asarray(codes), x.size)
    assert absmax[0] == 1.0
    np.testing.assert_array_equal(got[1:16], np.arange(15))
    np.testing.assert_array_equal(got[31:46], np.arange(1, 16))


def test_zero_block_is_code_7_and_absmax_0(codec: Codec) -> None:
    x = np.zeros(130, np.float32)
    x[64:128] = -0.0
    codes, absmax = codec.quantize(x, 64, "nf4")
    np.testing.assert_array_equal(np.asarray(absmax), [0, 0, 0])
    np.testing.assert_array_equal(np.asarray(codes), np.full(65, 0x77, np.uint8))
    out = codec.dequantize(np.asarray(codes), np.asarray(absmax), 130, 64, "nf4", "float32")
    np.testing.assert_array_equal(bits(out), np.zeros(130, np.uint32))  # +0.0, no NaN


def test_tiny_block_keeps_its_information(codec: Codec) -> None:
    """absmax < 2^-128: 1/absmax overflows, so the block is normalised by division."""
    unit = np.array([1.0, -1.0, 0.5, -0.25, 0.1, 0.0, 0.7, -0.6], np.float32)
    x = (unit * np.float32(2.0**-140)).astype(np.float32)
    codes, absmax = codec.quantize(x, 64, "nf4")
    got = reference.unpack_nibbles(np.asarray(codes), x.size)
    assert absmax[0] == np.float32(2.0**-140)
    np.testing.assert_array_equal(got, reference.encode(unit, "nf4"))
    assert len(set(got.tolist())) > 2


def test_partial_last_block_scales_over_real_elements_only(codec: Codec) -> None:
    x = np.concatenate([np.full(64, 8.0), [0.5, -0.25, 0.125]]).astype(np.float32)
    codes, absmax = codec.quantize(x, 64, "nf4")
    np.testing.assert_array_equal(np.asarray(absmax), [8.0, 0.5])
    codes = np.asarray(codes)
    assert codes.size == 34
    assert codes[-1] >> 4 == 7  # the padding nibble of the odd length holds code 7


# --- dequantize -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("codebook", ["nf4", "fp4"])
def test_dequantize_all_256_code_bytes(fast_codec: Codec, dtype: str, codebook: str) -> None:
    """Exhaustive over every byte value, under scales that stress rounding and range."""
    scales = np.array([0.0, 1.0, 0.02, 3.0e38, 2.0**-140, 1e-30, 65504.0, 7.3], np.float32)
    nblocks = 4 * scales.size
    codes = np.tile(np.arange(256, dtype=np.uint8), nblocks // 8)  # 32 bytes (one block) each
    absmax = np.repeat(scales, 4)
    n = nblocks * 64
    got = fast_codec.dequantize(codes, absmax, n, 64, codebook, dtype)
    with np.errstate(over="ignore"):  # 3e38 overflows f16 to inf, in both implementations
        want = reference.dequantize(codes, absmax, n, 64, codebook).astype(
            nybble.formats.numpy_dtype(dtype)
        )
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(want))


@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_dequantize_int8_all_codes(fast_codec: Codec, dtype: str) -> None:
    codes = np.tile(np.arange(256, dtype=np.uint8), 3)
    absmax = np.array([1.0, 0.37, 5e-39] * 4, np.float32)[: -(-codes.size // 64)]
    got = fast_codec.dequantize(codes, absmax, codes.size, 64, "int8", dtype)
    want = reference.dequantize(codes, absmax, codes.size, 64, "int8").astype(
        nybble.formats.numpy_dtype(dtype)
    )
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(want))


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("dtype", OUT_DTYPES)
@given(data=st.data(), blocksize=blocksizes)
def test_dequantize_equals_oracle(
    fast_codec: Codec, codebook: str, dtype: str, blocksize: int, data: st.DataObject
) -> None:
    x = data.draw(float32_arrays(blocksize=blocksize))
    codes, absmax = reference.quantize(x, blocksize, codebook)
    got = fast_codec.dequantize(codes, absmax, x.size, blocksize, codebook, dtype)
    want = reference.dequantize(codes, absmax, x.size, blocksize, codebook)
    with np.errstate(over="ignore"):
        want = want.astype(nybble.formats.numpy_dtype(dtype))
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(want))


def test_rust_codebooks_equal_the_oracle() -> None:
    for name in CODEBOOKS:
        got = np.array(_core.codebook_values(name), np.float32)
        np.testing.assert_array_equal(bits(got), bits(reference.codebook_values(name)))


# --- shapes, strides, the tensor object -------------------------------------------------


def test_any_shape_and_strides_quantize_in_row_major_order() -> None:
    x = np.random.default_rng(5).standard_normal((37, 53)).astype(np.float32)
    q = nybble.quantize(x.T)  # a non-contiguous view
    codes, absmax = reference.quantize(np.ascontiguousarray(x.T).ravel())
    assert q.shape == (53, 37)
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.absmax, absmax)
    assert q.dequantize().shape == (53, 37)


def test_python_lists_and_scalars_quantize() -> None:
    q = nybble.quantize([[0.5, -1.0], [0.25, 2.0]])
    assert q.shape == (2, 2)
    assert nybble.quantize(np.float32(3.0)).shape == ()


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 2)])
def test_empty_tensors(shape: tuple[int, ...]) -> None:
    q = nybble.quantize(np.zeros(shape, np.float32))
    assert q.shape == shape and q.codes.size == 0 and q.absmax.size == 0
    for dtype in OUT_DTYPES:
        out = q.dequantize(dtype)
        assert out.shape == shape and out.dtype == nybble.formats.numpy_dtype(dtype)
    assert q.to_blocks().size == 0
    assert nybble.NF4Tensor.from_blocks(q.to_blocks(), shape).shape == shape


def test_dequantize_dtypes_and_function_form() -> None:
    x = np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32)
    q = nybble.quantize(x)
    assert nybble.dequantize(q, dtype=np.float16).dtype == np.float16
    assert q.dequantize(ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(q.dequantize("float32"), nybble.dequantize(q))


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000])
def test_blocks36_round_trip(n: int) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    q = nybble.quantize(x)
    buf = q.to_blocks()
    assert buf.dtype == np.uint8 and buf.size == -(-n // 64) * 36
    np.testing.assert_array_equal(buf, reference.to_blocks(q.codes, q.absmax, n))
    back = nybble.NF4Tensor.from_blocks(buf, (n,))
    np.testing.assert_array_equal(back.codes, q.codes)
    np.testing.assert_array_equal(back.absmax, q.absmax)
    assert nybble.NF4Tensor.from_blocks(bytes(buf), n).shape == (n,)


def test_blocks36_layout_is_absmax_then_codes() -> None:
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    q = nybble.quantize(x)
    buf = q.to_blocks()
    assert buf[:4].view("<f4")[0] == np.float32(3.0)
    np.testing.assert_array_equal(buf[4:], q.codes)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_either_byte_order_gives_the_same_tensor(dtype: str) -> None:
    """A big-endian array is read for its values, not for its bytes."""
    x = np.random.default_rng(7).standard_normal((8, 96)).astype(dtype)
    swapped = x.astype(x.dtype.newbyteorder(">"))
    assert not swapped.dtype.isnative
    a, b = nybble.quantize(x), nybble.quantize(swapped)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.absmax, b.absmax)
    assert nybble.quantize(np.full(64, 0.5, ">f2")).dequantize()[0] == 0.5
