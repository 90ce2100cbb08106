"""Hypothesis over the codec's whole input space (docs/testing.md): dtypes (the floats nybble
reads and the ones it must refuse), both byte orders, strides (slices, negative steps,
transposes, Fortran order, unaligned and read-only buffers), shapes (0-d, empty dimensions, up
to rank 6), valid and invalid blocksizes and codebooks, values with NaN/inf at random places
and subnormals; through `nybble.quantize`, `NF4Tensor.dequantize` (with and without `out`),
`to_blocks` / `from_blocks` and the `NF4Tensor` constructor.

Each example is classified like a fuzz case (tests/fuzzing.py): a panic or an internal error
type fails it; an accepted input must give the oracle's (`nybble.reference`) codes and scales
bit for bit and dequantize to its values; a NonFiniteError must name the oracle's first bad
flat index; a refusal is only right where the oracle's rules refuse too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import nybble
from nybble import NF4Tensor, reference
from nybble.errors import NonFiniteError
from nybble.tensor import NestedAbsmax
from tests.fuzzing import ACCEPTED, ARGUMENT_ERRORS, outcome_class, problem_with, scaled_examples
from tests.strategies import EDGE_LENGTHS, float32_arrays

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float32), np.dtype(np.float16), BF16, np.dtype(np.float64)]
NOT_FLOATS = [np.dtype(t) for t in (np.int8, np.int32, np.int64, np.uint8, np.uint16, bool)]
NOT_FLOATS += [np.dtype(np.complex64), np.dtype(np.longdouble), np.dtype(object)]
GOOD_BLOCKSIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096]
BAD_BLOCKSIZES: list[Any] = [0, 1, 16, 31, 48, 96, 8192, -64, 64.0, True, "64", None, 2**64]
CODEBOOKS = ["nf4", "fp4", "int8"]
BAD_CODEBOOKS: list[Any] = ["NF4", "dynamic8", "", None, 4, "nf4 "]
OUTPUT_DTYPES = ["float32", "float16", "bfloat16"]
LAYOUTS = ["c", "c", "fortran", "transpose", "step", "negative", "unaligned", "swapped", "readonly"]

#: Outcome classes seen by the examples of this module, printed at its end.
OUTCOMES: Counter[str] = Counter()
EXAMPLES = settings(
    max_examples=scaled_examples(250),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    deadline=None,
)


@pytest.fixture(scope="module", autouse=True)
def _print_outcomes() -> Iterator[None]:
    yield
    width = max((len(k) for k in OUTCOMES), default=0)
    rows = "\n".join(f"  {k.ljust(width)}  {v}" for k, v in sorted(OUTCOMES.items()))
    print(f"\ncodec examples per outcome ({sum(OUTCOMES.values())} in all):\n{rows}")


def attempt(property_name: str, fn: Any) -> tuple[Any, BaseException | None]:
    """(result, None) or (None, error); fails on a panic or an internal error type."""
    try:
        result = fn()
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        OUTCOMES[f"{property_name}: {outcome_class(e)}"] += 1
        problem = problem_with(e, ARGUMENT_ERRORS)
        assert problem is None, problem
        return None, e
    OUTCOMES[f"{property_name}: {ACCEPTED}"] += 1
    return result, None


def known_bug(property_name: str, error: BaseException | None, label: str) -> None:
    """Counts a case as the known bug `label` (not as its outcome class)."""
    if error is not None:
        OUTCOMES[f"{property_name}: {outcome_class(error)}"] -= 1
    OUTCOMES[f"{property_name}: known bug: {label}"] += 1


# --- strategies -----------------------------------------------------------------------------------


shapes = st.one_of(
    st.sampled_from(EDGE_LENGTHS).map(lambda n: (n,)),
    hnp.array_shapes(min_dims=0, max_dims=6, min_side=0, max_side=3),
    st.tuples(st.integers(0, 40), st.integers(0, 40)),
)


@st.composite
def values(draw: st.DrawFn, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """A C-ordered array of `shape` and `dtype` with adversarial values (see strategies.py),
    sometimes NaN/inf at random places, and for float64 values beyond float32's range."""
    n = math.prod(shape)
    flat = draw(float32_arrays(n=n))
    if dtype.kind == "O":
        return np.zeros(shape, object)
    with np.errstate(all="ignore"):
        a = flat.astype(dtype)
    if n and dtype.kind in "fV" and draw(st.integers(0, 3)) == 0:
        for _ in range(draw(st.integers(1, 3))):
            index = draw(st.integers(0, n - 1))
            special = draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e39, -1e300, 6e4]))
            if dtype == np.float64 or not abs(special) < 1e39:
                with np.errstate(all="ignore"):
                    a[index] = special
    return a.reshape(shape)


def laid_out(a: np.ndarray, layout: str) -> np.ndarray:
    """An array equal to `a` (same logical values and shape) in another memory layout."""
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout == "transpose" and a.ndim >= 2:
        return np.ascontiguousarray(a.T).T
    if layout == "step":
        base = np.zeros((2 * a.size,), a.dtype)
        base[::2] = a.reshape(-1)
        return base[::2].reshape(a.shape)
    if layout == "negative" and a.ndim >= 1:
        return np.ascontiguousarray(a[::-1])[::-1]
    if layout == "unaligned" and a.dtype.itemsize > 1 and a.dtype.kind != "O":
        raw = np.zeros(a.nbytes + 1, np.uint8)
        view = raw[1:].view(a.dtype).reshape(a.shape)
        view[...] = a
        return view
    if layout == "swapped" and a.dtype.itemsize > 1 and a.dtype.kind != "O":
        return a.astype(a.dtype.newbyteorder("S"))
    if layout == "readonly":
        b = a.copy()
        b.flags.writeable = False
        return b
    return a


@st.composite
def quantize_inputs(draw: st.DrawFn) -> tuple[np.ndarray, Any, Any, bool, str]:
    dtype = draw(
        st.sampled_from(FLOATS) if draw(st.integers(0, 5)) else st.sampled_from(NOT_FLOATS)
    )
    shape = draw(shapes)
    a = draw(values(shape, dtype))
    layout = draw(st.sampled_from(LAYOUTS))
    blocksize = draw(
        st.sampled_from(GOOD_BLOCKSIZES)
        if draw(st.integers(0, 7))
        else st.sampled_from(BAD_BLOCKSIZES)
    )
    codebook = draw(
        st.sampled_from(CODEBOOKS) if draw(st.integers(0, 7)) else st.sampled_from(BAD_CODEBOOKS)
    )
    return laid_out(a, layout), blocksize, codebook, draw(st.booleans()), layout


# --- the oracle's rules ---------------------------------------------------------------------------


def valid_blocksize(blocksize: Any) -> bool:
    return (
        isinstance(blocksize, (int, np.integer))
        and not isinstance(blocksize, bool)
        and blocksize in GOOD_BLOCKSIZES
    )


def as_float32(x: np.ndarray) -> np.ndarray:
    """The logical values in C order, rounded to float32 (float64 first rounded, as
    docs/formats.md states)."""
    with np.errstate(all="ignore"):
        return np.asarray(x).astype(np.float32).reshape(-1)


def oracle_dequantize(
    codes: np.ndarray, absmax: np.ndarray, n: int, bs: int, cb: str, dtype: str
) -> np.ndarray:
    with np.errstate(all="ignore"):
        out = reference.dequantize(codes, absmax, n, bs, cb)
        return out.astype(BF16 if dtype == "bfloat16" else np.dtype(dtype))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# --- properties -----------------------------------------------------------------------------------


@EXAMPLES
@given(quantize_inputs(), st.sampled_from(OUTPUT_DTYPES))
def test_quantize_and_dequantize_agree_with_the_oracle(
    case: tuple[np.ndarray, Any, Any, bool, str], out_dtype: str
) -> None:
    x, blocksize, codebook, double_quant, _layout = case
    before = x.copy()
    q, error = attempt("quantize", lambda: nybble.quantize(x, blocksize, double_quant, codebook))
    assert same_bits(x, before), "quantize changed its input"
    valid = (
        x.dtype.newbyteorder("=") in FLOATS and valid_blocksize(blocksize) and codebook in CODEBOOKS
    )
    if not valid:
        assert error is not None, "accepted an input the format refuses"
        assert not isinstance(error, NonFiniteError)
        return
    x32 = as_float32(x)
    bad = reference.first_non_finite(x32)
    if bad is not None:
        assert isinstance(error, NonFiniteError), f"expected NonFiniteError({bad}), got {error!r}"
        assert error.index == bad
        return
    assert error is None, f"refused a valid input: {error!r}"
    codes, absmax = reference.quantize(x32, blocksize, codebook)
    assert q.shape == x.shape and q.blocksize == blocksize and q.codebook == codebook
    assert same_bits(q.codes, codes)
    if double_quant:
        nested_codes, absmax2, offset = reference.double_quantize(absmax)
        assert q.nested is not None
        assert same_bits(q.nested.codes, nested_codes) and same_bits(q.nested.absmax2, absmax2)
        assert np.float32(q.nested.offset) == offset
        absmax = reference.double_dequantize(nested_codes, absmax2, offset)
    assert same_bits(q.absmax, absmax)
    got, error = attempt("dequantize", lambda: q.dequantize(out_dtype))
    assert error is None, f"dequantize refused: {error!r}"
    want = oracle_dequantize(codes, absmax, x32.size, blocksize, codebook, out_dtype)
    assert same_bits(got.reshape(-1), want) and got.shape == x.shape


@st.composite
def out_arrays(draw: st.DrawFn, size: int, dtype: str) -> tuple[Any, bool]:
    """An `out` array for a dequantize of `size` values, and whether it is a valid one."""
    kind = draw(
        st.sampled_from(["good", "good", "dtype", "size", "strided", "readonly", "list", "fortran"])
    )
    want = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    if kind == "good":
        return np.empty(draw(st.sampled_from([(size,), (1, size)])), want), True
    if kind == "dtype":
        other = draw(
            st.sampled_from(
                [
                    t
                    for t in [np.float32, np.float64, np.float16, BF16, np.uint16]
                    if np.dtype(t) != want
                ]
            )
        )
        return np.empty(size, other), False
    if kind == "size":
        return np.empty(size + draw(st.sampled_from([-1, 1, 64])) if size else 1, want), False
    if kind == "strided":
        a = np.empty(2 * size, want)[::2]
        return a, a.flags.c_contiguous  # one element: contiguous all the same
    if kind == "readonly":
        a = np.empty(size, want)
        a.flags.writeable = False
        return a, False
    if kind == "fortran" and size % 2 == 0 and size:
        a = np.empty((2, size // 2), want, order="F")
        return a, a.flags.c_contiguous  # (2, 1) is both
    return [0.0] * size, False


@EXAMPLES
@given(st.data())
def test_dequantize_into_out(data: st.DataObject) -> None:
    n = data.draw(st.sampled_from(EDGE_LENGTHS))
    x = data.draw(float32_arrays(n=n))
    codebook = data.draw(st.sampled_from(CODEBOOKS))
    q = nybble.quantize(x, 32, data.draw(st.booleans()), codebook)
    dtype = data.draw(st.sampled_from(OUTPUT_DTYPES))
    out, valid = data.draw(out_arrays(n, dtype))
    got, error = attempt("dequantize(out=)", lambda: q.dequantize(dtype, out=out))
    if not valid:
        assert error is not None, "accepted an out= the contract refuses"
        return
    assert error is None, f"refused a valid out=: {error!r}"
    assert got is out
    codes, absmax = reference.quantize(x, 32, codebook)
    if q.nested is not None:
        absmax = reference.double_dequantize(*reference.double_quantize(absmax))
    assert same_bits(got.reshape(-1), oracle_dequantize(codes, absmax, n, 32, codebook, dtype))


@EXAMPLES
@given(quantize_inputs(), st.booleans())
def test_to_blocks_and_back(case: tuple[np.ndarray, Any, Any, bool, str], nf4: bool) -> None:
    x, blocksize, codebook, double_quant, _ = case
    if nf4:  # the layout's own format half of the time
        blocksize, codebook = 64, "nf4"
    try:
        q = nybble.quantize(x, blocksize, double_quant, codebook)
    except (ValueError, TypeError):
        return  # the inputs the previous property covers
    buf, error = attempt("to_blocks", q.to_blocks)
    if codebook != "nf4" or blocksize != 64:
        assert isinstance(error, ValueError), "the 36-byte layout holds NF4 in blocks of 64 only"
        return
    assert error is None, f"to_blocks refused: {error!r}"
    n = q.size
    assert same_bits(buf, reference.to_blocks(q.codes, q.absmax, n))
    back, error = attempt("from_blocks", lambda: NF4Tensor.from_blocks(buf, q.shape))
    assert error is None, f"from_blocks refused to_blocks' output: {error!r}"
    assert same_bits(back.codes, q.codes) and same_bits(back.absmax, q.absmax)
    assert back.shape == q.shape


BAD_SHAPES: list[Any] = [-1, (-1,), (2**62,), (2**31, 2**31), 2.0, (2.0,), "64", None, True, [[64]]]


@st.composite
def block_buffers(draw: st.DrawFn) -> tuple[Any, Any, Any, str]:
    """Buffers for from_blocks: right and wrong lengths, any scales (NaN, negative, inf,
    subnormal), in containers numpy reads and some it does not."""
    shape = draw(shapes) if draw(st.integers(0, 7)) else draw(st.sampled_from(BAD_SHAPES))
    try:
        n = math.prod(shape if isinstance(shape, (tuple, list)) else (shape,))
    except TypeError:
        n = 0
    nblocks = -(-n // 64) if isinstance(n, int) and 0 <= n < 10**6 else 1
    length = nblocks * 36 + draw(st.sampled_from([0, 0, 0, 0, 1, -1, 36, -36]))
    raw = bytearray(draw(st.binary(min_size=max(length, 0), max_size=max(length, 0))))
    for b in range(nblocks if len(raw) >= nblocks * 36 else 0):
        scale = draw(st.sampled_from([0.0, -0.0, 1.0, 1e-45, 3e38, -1.0, np.nan, np.inf, 0.5]))
        raw[b * 36 : b * 36 + 4] = np.float32(scale).tobytes()
    container = draw(
        st.sampled_from(
            ["numpy", "bytes", "bytearray", "memoryview", "int8", "uint16", "list", "2d", "strided"]
        )
    )
    arr = np.frombuffer(bytes(raw), np.uint8)
    buf: Any = {
        "numpy": arr,
        "bytes": bytes(raw),
        "bytearray": raw,
        "memoryview": memoryview(bytes(raw)),
        "int8": arr.view(np.int8),
        "uint16": arr[: len(arr) // 2 * 2].view(np.uint16),
        "list": list(raw),
        "2d": arr.reshape(1, -1),
        "strided": np.repeat(arr, 2)[::2],
    }[container]
    codebook = draw(st.sampled_from(["nf4", "nf4", "fp4", "int8", "NF4"]))
    return buf, shape, codebook, container


@EXAMPLES
@given(block_buffers())
def test_from_blocks_on_any_buffer(case: tuple[Any, Any, Any, str]) -> None:
    buf, shape, codebook, container = case
    q, error = attempt("from_blocks(any)", lambda: NF4Tensor.from_blocks(buf, shape, codebook))
    if error is not None:
        return
    if isinstance(buf, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(bytes(buf), np.uint8)
    else:
        raw = np.ascontiguousarray(np.asarray(buf)).reshape(-1).view(np.uint8)
    assert codebook in ("nf4", "fp4"), f"accepted codebook {codebook!r}"
    assert container not in ("uint16",), "accepted a buffer that is not bytes"
    n = q.size
    assert raw.size == -(-n // 64) * 36, "accepted a buffer of the wrong length"
    codes, absmax = reference.from_blocks(raw, n)
    # Finite, but not necessarily >= 0: to_blocks writes a double-quantized tensor's decoded
    # scales, and a zero block's decodes a little below zero; the layout must take it back.
    assert np.all(np.isfinite(absmax)), "accepted scales that are not finite"
    assert same_bits(q.codes, codes) and same_bits(q.absmax, absmax)
    got = q.dequantize()
    assert same_bits(got.reshape(-1), oracle_dequantize(codes, absmax, n, 64, codebook, "float32"))


@st.composite
def constructor_arguments(draw: st.DrawFn) -> dict[str, Any]:
    """NF4Tensor(codes, absmax, shape, blocksize, codebook, nested, orig_dtype) arguments made
    from a real tensor, then one or two of them spoiled (or not)."""
    n = draw(st.sampled_from(EDGE_LENGTHS[:14]))
    codebook = draw(st.sampled_from(CODEBOOKS))
    blocksize = draw(st.sampled_from([32, 64, 128]))
    dq = draw(st.booleans())
    q = nybble.quantize(draw(float32_arrays(n=n)), blocksize, dq, codebook)
    args: dict[str, Any] = dict(
        codes=q.codes.copy(),
        absmax=None if dq else q.absmax.copy(),
        shape=q.shape,
        blocksize=blocksize,
        codebook=codebook,
        nested=q.nested,
        orig_dtype="float32",
    )
    for key in draw(st.lists(st.sampled_from(list(args)), max_size=2, unique=True)):
        value = args[key]
        if key in ("codes", "absmax") and value is not None:
            args[key] = draw(spoiled_array(value))
        elif key == "nested" and value is not None:
            part = draw(st.sampled_from(["codes", "absmax2", "offset"]))
            if part == "offset":
                offset = draw(
                    st.sampled_from([np.nan, np.inf, -1.0, 1e308, 3.5e38, "1", None, 0.0])
                )
                args[key] = NestedAbsmax(value.codes, value.absmax2, offset)
            elif part == "codes":
                args[key] = NestedAbsmax(
                    draw(spoiled_array(value.codes)), value.absmax2, value.offset
                )
            else:
                args[key] = NestedAbsmax(
                    value.codes, draw(spoiled_array(value.absmax2)), value.offset
                )
        elif key == "shape":
            args[key] = draw(st.sampled_from([*BAD_SHAPES, (n + 1,), (n, 1), (1, n), ()]))
        elif key == "blocksize":
            args[key] = draw(st.sampled_from(GOOD_BLOCKSIZES + BAD_BLOCKSIZES))
        elif key == "codebook":
            args[key] = draw(st.sampled_from(CODEBOOKS + BAD_CODEBOOKS))
        elif key == "orig_dtype":
            args[key] = draw(
                st.sampled_from(["bfloat16", "float16", "float64", "int8", None, np.float16])
            )
        elif key == "absmax":
            args[key] = np.zeros(1, np.float32)
    return args


@st.composite
def spoiled_array(draw: st.DrawFn, a: np.ndarray) -> Any:
    kind = draw(
        st.sampled_from(
            ["dtype", "size", "2d", "list", "value", "value", "strided", "swapped", "same"]
        )
    )
    if kind == "dtype":
        with np.errstate(all="ignore"):
            return a.astype(
                draw(
                    st.sampled_from(
                        [np.float64, np.float16, np.int8, np.uint16, np.float32, np.uint8]
                    )
                )
            )
    if kind == "size":
        return np.concatenate([a, a[:1]]) if draw(st.booleans()) or not a.size else a[:-1]
    if kind == "2d":
        return a.reshape(1, -1)
    if kind == "list":
        return a.tolist()
    if kind == "value" and a.size:
        b = a.copy()
        index = draw(st.integers(0, a.size - 1))
        if b.dtype.kind == "f":
            value = draw(st.sampled_from([np.nan, np.inf, -np.inf, -1.0, -0.0, 1e-45, 3e38]))
            b.reshape(-1)[index] = value
        else:
            b.reshape(-1)[index] = draw(st.integers(0, 255))
        return b
    if kind == "strided":
        return np.repeat(a, 2)[::2]
    if kind == "swapped" and a.dtype.itemsize > 1:
        return a.astype(a.dtype.newbyteorder("S"))
    return a


def _constructor_valid(args: dict[str, Any]) -> tuple[bool, str]:
    """Whether the oracle's format rules take these arguments (and why not)."""
    shape, blocksize, codebook = args["shape"], args["blocksize"], args["codebook"]
    dims = shape if isinstance(shape, (tuple, list)) else (shape,)
    if not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        return False, "shape"
    n = math.prod(dims)
    if n >= 2**62 or not valid_blocksize(blocksize) or codebook not in CODEBOOKS:
        return False, "shape, blocksize or codebook"
    orig = args["orig_dtype"]
    try:
        orig_name = orig if isinstance(orig, str) else np.dtype(orig).name
    except TypeError:
        orig_name = None
    if orig_name not in OUTPUT_DTYPES:
        return False, "orig_dtype"
    codes = np.asarray(args["codes"])
    want_codes = -(-n // 2) if codebook != "int8" else n
    if codes.dtype != np.uint8 or codes.shape != (want_codes,):
        return False, "codes"
    nblocks = -(-n // blocksize)
    nested = args["nested"]
    if nested is None:
        absmax = np.asarray(args["absmax"])
        ok = absmax.dtype.newbyteorder("=") == np.float32 and absmax.shape == (nblocks,)
        if not ok or not np.all(np.isfinite(absmax) & (absmax >= 0)):
            return False, "absmax"
        return True, ""
    nc, a2, offset = np.asarray(nested.codes), np.asarray(nested.absmax2), nested.offset
    ok = nc.dtype == np.uint8 and nc.shape == (nblocks,)
    ok = ok and a2.dtype.newbyteorder("=") == np.float32 and a2.shape == (-(-nblocks // 256),)
    if not ok or not np.all(np.isfinite(a2) & (a2 >= 0)):
        return False, "nested"
    try:  # a number, or what float() reads as one
        offset = float(offset)
    except (TypeError, ValueError):
        return False, "nested offset"
    if not math.isfinite(offset):
        return False, "nested offset"
    if not abs(offset) <= float(np.finfo(np.float32).max):
        return False, "nested offset beyond float32"
    return True, ""


@EXAMPLES
@given(constructor_arguments())
def test_the_constructor_checks_what_it_is_given(args: dict[str, Any]) -> None:
    q, error = attempt("NF4Tensor(...)", lambda: NF4Tensor(**args))
    valid, why = _constructor_valid(args)
    if error is not None:
        return  # refusing is always allowed for a constructor; accepting is checked below
    assert valid, f"accepted arguments the format refuses ({why})"
    n = q.size
    if args["nested"] is not None:
        nested = args["nested"]
        with np.errstate(all="ignore"):
            absmax = reference.double_dequantize(
                np.asarray(nested.codes),
                np.asarray(nested.absmax2, np.float32),
                float(nested.offset),
            )
        assert np.all(np.isfinite(absmax)), "accepted nested scales that decode to inf/NaN"
    else:
        absmax = np.asarray(args["absmax"], np.float32)
    got, error = attempt("dequantize", q.dequantize)
    assert error is None, f"dequantize refused an accepted tensor: {error!r}"
    codes = np.asarray(args["codes"])
    assert same_bits(
        got.reshape(-1), oracle_dequantize(codes, absmax, n, q.blocksize, q.codebook, "float32")
    )


# --- bugs the suite found, fixed since: each stays a test ------------------------------------


def test_an_unaligned_array_is_quantized() -> None:
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    raw = np.zeros(x.nbytes + 1, np.uint8)
    unaligned = raw[1:].view(np.float32)
    unaligned[...] = x
    assert same_bits(nybble.quantize(unaligned).codes, nybble.quantize(x).codes)


def test_to_blocks_of_a_double_quantized_tensor_reads_back() -> None:
    x = np.zeros(148, np.float32)  # blocks [0, 0, 1]: the zero blocks decode below zero
    x[-1] = 1.0
    q = nybble.quantize(x, double_quant=True)
    assert np.any(q.absmax < 0)
    back = NF4Tensor.from_blocks(q.to_blocks(), q.shape)
    assert same_bits(back.dequantize(), q.dequantize())


def test_a_nested_offset_beyond_float32_is_refused_at_once() -> None:
    q = nybble.quantize(np.ones(64, np.float32), double_quant=True)
    assert q.nested is not None
    nested = NestedAbsmax(q.nested.codes, q.nested.absmax2, 1e308)
    with pytest.raises(ValueError):
        NF4Tensor(q.codes, None, q.shape, nested=nested)


@pytest.mark.parametrize("which", ["codes", "absmax"])
def test_a_strided_array_given_to_the_constructor_dequantizes(which: str) -> None:
    q = nybble.quantize(np.linspace(-1, 1, 256, dtype=np.float32))
    arrays = {"codes": q.codes, "absmax": q.absmax}
    arrays[which] = np.repeat(arrays[which], 2)[::2]
    t = NF4Tensor(arrays["codes"], arrays["absmax"], q.shape)
    assert same_bits(t.dequantize(), q.dequantize())
