"""The GPU codec against the CPU one, bit for bit: shapes and strides, double quantization,
the 36-byte and bitsandbytes layouts, torch inputs, device moves, and the launchers' argument
checks. (tests/codec/test_codec.py runs its differential tests over the `cuda` backend too.)"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nybble
from nybble import bnb
from nybble.tensor import NestedAbsmax
from tests import FIXTURES
from tests.strategies import blocksizes, float32_arrays

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
cuda = pytest.importorskip("nybble.cuda")
from nybble.backends.cuda import launch  # noqa: E402

OUT_DTYPES = ["float32", "float16", "bfloat16"]
CPU_FIXTURE = FIXTURES / "bnb_cpu.npz"


def bits(a: Any) -> np.ndarray:
    a = cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def assert_same_tensor(got: nybble.NF4Tensor, want: nybble.NF4Tensor) -> None:
    """Codes, scales (nested ones too) and metadata equal bit for bit."""
    got = got.cpu()
    assert (got.shape, got.blocksize, got.codebook) == (want.shape, want.blocksize, want.codebook)
    assert got.orig_dtype == want.orig_dtype
    np.testing.assert_array_equal(got.codes, want.codes)
    if want.nested is None:
        assert got.nested is None
        np.testing.assert_array_equal(bits(got.absmax), bits(want.absmax))
    else:
        assert got.nested is not None
        np.testing.assert_array_equal(got.nested.codes, want.nested.codes)
        np.testing.assert_array_equal(bits(got.nested.absmax2), bits(want.nested.absmax2))
        assert np.float32(got.nested.offset) == np.float32(want.nested.offset)


def normal(shape: Any, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --- quantize -------------------------------------------------------------------------------


@given(
    data=st.data(),
    blocksize=blocksizes,
    codebook=st.sampled_from(["nf4", "fp4", "int8"]),
    double_quant=st.booleans(),
)
def test_quantize_equals_cpu_with_double_quant(
    data: st.DataObject, blocksize: int, codebook: str, double_quant: bool
) -> None:
    x = data.draw(float32_arrays(blocksize=blocksize))
    want = nybble.quantize(x, blocksize, double_quant, codebook)
    got = nybble.quantize(cp.asarray(x), blocksize, double_quant, codebook)
    assert got.device == "cuda" and isinstance(got.codes, cp.ndarray)
    assert_same_tensor(got, want)
    for dtype in OUT_DTYPES:
        with np.errstate(over="ignore"):
            expected = want.dequantize(dtype)
        np.testing.assert_array_equal(bits(got.dequantize(dtype)), bits(expected))


def test_double_quant_over_many_nested_blocks() -> None:
    """1000 blocks of varied scale: four nested blocks, the last partial."""
    x = normal((1000, 64)) * np.exp(normal((1000, 1), 1)).astype(np.float32)
    want = nybble.quantize(x, double_quant=True)
    got = nybble.quantize(cp.asarray(x), double_quant=True)
    assert_same_tensor(got, want)
    np.testing.assert_array_equal(bits(got.absmax), bits(want.absmax))  # decoded on the GPU
    assert isinstance(got.absmax, cp.ndarray)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_16_bit_and_float64_inputs(dtype: str) -> None:
    target = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64}
    x = normal((33, 65), 3).astype(target[dtype])
    got = nybble.quantize(cp.asarray(x))
    assert_same_tensor(got, nybble.quantize(x))
    assert got.orig_dtype == ("float32" if dtype == "float64" else dtype)


def test_any_strides_and_unaligned_starts() -> None:
    x = normal((37, 53), 4)
    assert_same_tensor(nybble.quantize(cp.asarray(x).T), nybble.quantize(x.T))
    flat = cp.asarray(normal(1001, 5))
    for offset in (1, 3, 5):  # 4, 12, 20 bytes past an allocation: not 16-byte aligned
        view = flat[offset:]
        assert view.data.ptr % 16
        assert_same_tensor(nybble.quantize(view), nybble.quantize(cp.asnumpy(view)))
    assert_same_tensor(nybble.quantize(flat[::3]), nybble.quantize(cp.asnumpy(flat)[::3]))


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0, 2)])
def test_empty_tensors(shape: tuple[int, ...]) -> None:
    q = nybble.quantize(cp.zeros(shape, cp.float32), double_quant=True)
    assert q.shape == shape and q.codes.size == 0 and q.device == "cuda"
    for dtype in OUT_DTYPES:
        out = q.dequantize(dtype)
        assert isinstance(out, cp.ndarray) and out.shape == shape


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("index", [0, 5, 64, 999, 2**20 + 3])
def test_non_finite_input_names_the_first_flat_index(bad: float, index: int) -> None:
    x = cp.ones(2**21, cp.float32)
    x[index] = bad
    x[-1] = cp.nan
    x[2**20 + 100] = cp.inf
    with pytest.raises(nybble.NonFiniteError) as e:
        nybble.quantize(x)
    assert e.value.index == index


def test_the_finite_check_reports_each_call_on_its_own() -> None:
    """quantize's device counter is left clean by every read: a finite input after a bad one
    passes, a second bad one names its own index, and an unchecked launch (the one a graph
    capture makes) never reaches the counter."""
    good = cp.asarray(np.ones(4096, ml_dtypes.bfloat16))
    for index in (100, 7, 4000):
        x = cp.ones(4096, cp.float32)
        x[index] = cp.nan
        with pytest.raises(nybble.NonFiniteError) as e:
            nybble.quantize(x)
        assert e.value.index == index
        nybble.quantize(good)  # no stale index
    bad = cp.full(256, cp.inf, cp.float32)
    launch.quantize(bad, 64, "nf4", check_finite=False)
    nybble.quantize(cp.ones(256, cp.float32))


def test_quantize_from_several_threads_reports_each_threads_own_index() -> None:
    """Threads quantizing at once (each its own counter; launches that share an argument
    buffer take turns) get their own results and their own errors."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(3)
    inputs = [cp.asarray(rng.standard_normal(64 * 1024).astype(np.float32)) for _ in range(8)]
    for i in range(0, 8, 2):
        inputs[i][1000 * i + 1] = cp.nan
    want = [None if i % 2 == 0 else nybble.quantize(x).cpu() for i, x in enumerate(inputs)]

    def run(i: int) -> Any:
        results = []
        for _ in range(20):
            try:
                results.append(nybble.quantize(inputs[i]))
            except nybble.NonFiniteError as e:
                results.append(e.index)
        cp.cuda.get_current_stream().synchronize()
        return results

    with ThreadPoolExecutor(8) as pool:
        found = list(pool.map(run, range(8)))
    for i, results in enumerate(found):
        for got in results:
            if i % 2 == 0:
                assert got == 1000 * i + 1
            else:
                assert_same_tensor(got, want[i])


def test_float64_beyond_float32_range_is_an_error() -> None:
    with pytest.raises(nybble.NonFiniteError) as e:
        nybble.quantize(cp.asarray([1.0, 1e300]))
    assert e.value.index == 1


def test_unsupported_input_dtype() -> None:
    with pytest.raises(ValueError, match=r"dtype int32; expected one of float32"):
        nybble.quantize(cp.ones(8, cp.int32))


# --- dequantize from the other layouts -----------------------------------------------------


def exhaustive_bytes(codebook: str) -> nybble.NF4Tensor:
    """Every byte value under scales that stress rounding and range (cf. test_codec)."""
    scales = np.array([0.0, 1.0, 0.02, 3.0e38, 2.0**-140, 1e-30, 65504.0, 7.3], np.float32)
    codes = np.tile(np.arange(256, dtype=np.uint8), scales.size * 4 // 8)
    return nybble.NF4Tensor(codes, np.repeat(scales, 4), (scales.size * 4 * 64,), 64, codebook)


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("codebook", ["nf4", "fp4"])
def test_blocks36_and_bnb_layouts_all_256_bytes(dtype: str, codebook: str) -> None:
    q = exhaustive_bytes(codebook)
    with np.errstate(over="ignore"):
        want = bits(q.dequantize(dtype))
    # The layout carries no codebook (to_blocks is NF4's): FP4 codes make the same bytes.
    as_nf4 = nybble.NF4Tensor(q.codes, q.absmax, q.shape, 64, "nf4")
    got = cuda.dequantize_blocks(cp.asarray(as_nf4.to_blocks()), q.shape, dtype, codebook)
    np.testing.assert_array_equal(bits(got), want)
    got = cuda.dequantize_bnb(
        cp.asarray(bnb.swap_nibbles(q.codes)), cp.asarray(q.absmax), q.shape, dtype, 64, codebook
    )
    np.testing.assert_array_equal(bits(got), want)
    np.testing.assert_array_equal(bits(q.cuda().dequantize(dtype)), want)


@pytest.mark.parametrize("n", [0, 1, 31, 33, 63, 64, 65, 127, 1000, 4097])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_blocks36_any_length(n: int, dtype: str) -> None:
    q = nybble.quantize(normal(n, n))
    got = cuda.dequantize_blocks(cp.asarray(q.to_blocks()), (n,), dtype)
    np.testing.assert_array_equal(bits(got), bits(q.dequantize(dtype)))


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", [(7,), (33, 65), (300, 64)])
@pytest.mark.parametrize("blocksize", [32, 64, 256])
def test_bnb_layout_with_and_without_double_quant(
    double_quant: bool, shape: tuple[int, ...], blocksize: int
) -> None:
    q = nybble.quantize(normal(shape, 6), blocksize, double_quant)
    packed = cp.asarray(bnb.swap_nibbles(q.codes).reshape(-1, 1))  # bitsandbytes' [n/2, 1]
    scales: Any = q.nested if q.nested is not None else cp.asarray(q.absmax)
    for dtype in OUT_DTYPES:
        got = cuda.dequantize_bnb(packed, scales, shape, dtype, blocksize)
        np.testing.assert_array_equal(bits(got), bits(q.dequantize(dtype)))


@pytest.mark.parametrize("dq", [0, 1])
def test_bnb_layout_from_a_bitsandbytes_state_dict(dq: int) -> None:
    """A Linear4bit state written by bitsandbytes, dequantized in place on the GPU."""
    fixture = np.load(CPU_FIXTURE)
    prefix = f"state_dq{dq}/"
    state = {k[len(prefix) :]: fixture[k] for k in fixture.files if k.startswith(prefix)}
    q = bnb.import_state(state)  # for the metadata and the nested offset
    scales: Any = cp.asarray(state["weight.absmax"])
    if dq:
        scales = NestedAbsmax(
            cp.asarray(state["weight.absmax"]),
            cp.asarray(state["weight.nested_absmax"]),
            q.nested.offset,
        )
    got = cuda.dequantize_bnb(cp.asarray(state["weight"]), scales, q.shape, "bfloat16")
    want = state["dequantized_bf16_bits"].view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bits(got), bits(want))


# --- devices and interop ---------------------------------------------------------------------


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("codebook", ["nf4", "fp4", "int8"])
def test_cpu_cuda_round_trip(double_quant: bool, codebook: str) -> None:
    x = normal((300, 70), 8).astype(ml_dtypes.bfloat16)
    q = nybble.quantize(x, 128, double_quant, codebook)
    g = q.cuda()
    assert g.device == "cuda" and g.cuda() is g and q.cpu() is q
    assert isinstance(g.codes, cp.ndarray) and g.nbytes == q.nbytes and g.orig_dtype == "bfloat16"
    if double_quant:
        assert isinstance(g.nested.codes, cp.ndarray) and isinstance(g.nested.absmax2, cp.ndarray)
    back = g.cpu()
    assert back.device == "cpu" and isinstance(back.codes, np.ndarray)
    assert_same_tensor(back, q)
    assert "device='cuda'" in repr(g)


def test_torch_tensors_are_read_without_a_copy() -> None:
    torch = pytest.importorskip("torch")
    x = normal((64, 96), 9)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        t = torch.from_numpy(x).to(dtype).cuda().requires_grad_(True)
        view = cuda.as_cupy(t)
        assert view.data.ptr == t.data_ptr() and view.shape == (64, 96)
        host = t.detach().float().cpu().numpy().astype(view.dtype)  # exact: same values
        assert_same_tensor(nybble.quantize(t), nybble.quantize(host))
        transposed = cuda.as_cupy(t.T)
        assert transposed.data.ptr == t.data_ptr() and transposed.shape == (96, 64)
        assert_same_tensor(nybble.quantize(t.T), nybble.quantize(np.ascontiguousarray(host.T)))
    assert cuda.as_cupy(torch.empty((0, 4), device="cuda")).shape == (0, 4)
    # On another torch stream than CuPy's the view goes through DLPack, which orders the two.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.from_numpy(x).cuda() * 2
        view = cuda.as_cupy(t)
        assert view.data.ptr == t.data_ptr()
        np.testing.assert_array_equal(cp.asnumpy(view), x * 2)


def test_dlpack_and_cuda_array_interface_inputs() -> None:
    x = cp.asarray(normal(256, 10))

    class Interface:
        __cuda_array_interface__ = x.__cuda_array_interface__

    class DLPack:
        def __dlpack__(self, **kwargs: Any) -> Any:
            return x.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> Any:
            return x.__dlpack_device__()

    for wrapped in (Interface(), DLPack()):
        assert cuda.as_cupy(wrapped).data.ptr == x.data.ptr
        assert_same_tensor(nybble.quantize(wrapped), nybble.quantize(cp.asnumpy(x)))
    with pytest.raises(ValueError, match="expected a CUDA array"):
        cuda.as_cupy(np.ones(3))


# --- the launchers check before they launch ---------------------------------------------------


@pytest.mark.parametrize("codebook", ["nf4", "int8"])
def test_dequantize_after_the_first_call_checks_out_as_the_first_did(codebook: str) -> None:
    """A tensor's later dequantize calls take a path checked once; they still refuse every
    `out` the first call refuses, and equal the checked path bit for bit."""
    q = nybble.quantize(cp.asarray(normal((96, 128), 5)), codebook=codebook)
    want = {d: q.cpu().dequantize(d) for d in OUT_DTYPES}
    for dtype in OUT_DTYPES:
        for _ in range(2):  # the first call prepares, the second takes the fast path
            np.testing.assert_array_equal(bits(q.dequantize(dtype)), bits(want[dtype]))
            out = cp.empty((96, 128), want[dtype].dtype)
            assert q.dequantize(dtype, out) is out
            np.testing.assert_array_equal(bits(out), bits(want[dtype]))
            flat = cp.empty(96 * 128, want[dtype].dtype)  # any shape of the same size
            assert q.dequantize(dtype, flat) is flat
            # the tensor keeps the path it takes first; dtypes given otherwise than by name
            # take the checked one
            assert q._dequantize_call is not None
            by_type = q.dequantize(want[dtype].dtype)
            np.testing.assert_array_equal(bits(by_type), bits(want[dtype]))
    for name in ("int8", "float64", "bf16"):
        with pytest.raises(ValueError, match="dtype must be one of"):
            q.dequantize(name)
    bad_outs = [
        cp.empty((96, 128), cp.float16),  # another dtype than asked for
        cp.empty((96, 127), cp.float32),
        cp.empty((128, 96), cp.float32).T,  # not C-contiguous
        cp.empty(96 * 128 + 1, cp.float32)[1:],  # not 16-byte aligned
        np.empty((96, 128), np.float32),
    ]
    for out in bad_outs:
        with pytest.raises(ValueError, match="out"):
            q.dequantize("float32", out)
    empty = nybble.quantize(cp.empty((0, 64), cp.float32))
    for _ in range(2):
        assert empty.dequantize("bfloat16").shape == (0, 64)


def test_launchers_reject_bad_arguments() -> None:
    n = 256
    codes = cp.zeros(n // 2, cp.uint8)
    absmax = cp.ones(n // 64, cp.float32)
    out = cp.empty(n, cp.float32)
    ok = dict(codebook="nf4", layout="split", blocksize=64, total=n, start=0)

    def dequant4(**changes: Any) -> None:
        args = dict(codes=codes, absmax=absmax, nested=None, out=out, **ok)
        args.update(changes)
        launch.dequantize(**args)

    dequant4()  # the baseline is accepted
    cases: list[tuple[dict[str, Any], str]] = [
        ({"codes": codes.astype(cp.int8)}, "codes: expected dtype uint8, got int8"),
        ({"codes": cp.zeros(n, cp.uint8)[::2]}, "codes: expected a C-contiguous"),
        ({"codes": cp.zeros(n // 2 + 1, cp.uint8)[1:]}, "codes: expected a 16-byte aligned"),
        ({"codes": codes[:-16]}, r"codes: expected 128 elements, got 112"),
        ({"codes": codes.get()}, "codes: expected a CuPy array, got ndarray"),
        ({"absmax": absmax[:-1]}, "absmax: expected 4 elements, got 3"),
        ({"absmax": absmax.astype(cp.float16)}, "absmax: expected dtype float32"),
        ({"out": out.astype(cp.int32)}, "out: expected dtype float32 or float16 or bfloat16"),
        ({"out": cp.empty(2 * n, cp.float32)[::2]}, "out: expected a C-contiguous"),
        ({"start": 16, "out": out[:128]}, "start must be a multiple of 32"),
        ({"start": 192}, r"elements \[192, 448\) of 256"),
        ({"blocksize": 48}, "blocksize must be a power of two"),
        ({"codebook": "int8"}, "codes: expected 256 elements, got 128"),
        ({"codebook": "nf3"}, "codebook: expected one of nf4, fp4, int8, dynamic8"),
        ({"codebook": "int8", "layout": "high_first"}, "holds 4-bit codes, not int8"),
        ({"layout": "blocks36"}, "blocks of 64 and carries its own scales"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            dequant4(**changes)
    with pytest.raises(ValueError, match="x: expected dtype float32 or float16 or bfloat16"):
        launch.quantize(cp.ones(64, cp.float64), 64, "nf4")
    with pytest.raises(ValueError, match="x: expected a C-contiguous array"):
        launch.quantize(cp.ones((32, 2), cp.float32).T, 64, "nf4")
    square = cp.arange(64 * 64, dtype=cp.float32).reshape(64, 64)  # any shape, in flat order
    whole, flat = launch.quantize(square, 64, "nf4"), launch.quantize(square.reshape(-1), 64, "nf4")
    for got, want in zip(whole, flat, strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))
    with pytest.raises(ValueError, match=r"nested\.codes: expected 4 elements"):
        nested = NestedAbsmax(cp.zeros(5, cp.uint8), cp.ones(1, cp.float32), 0.0)
        launch.dequantize(codes, None, nested, "nf4", "split", 64, n, 0, out)
    cp.cuda.Device().synchronize()  # nothing bad reached the GPU


def test_public_functions_reject_bad_arguments() -> None:
    q = nybble.quantize(normal((64, 64), 11))
    with pytest.raises(ValueError, match="buf: expected 72 elements, got 70"):
        cuda.dequantize_blocks(cp.zeros(70, cp.uint8), (128,))
    with pytest.raises(ValueError, match="on the CPU"):
        cuda.nf4_matmul(cp.ones((2, 64), cp.float32), q)
    with pytest.raises(ValueError, match="dtype must be one of"):
        q.cuda().dequantize("int8")


def test_float64_input_keeps_float32_subnormals() -> None:
    """f64 values that round to f32 subnormals: rounded as numpy rounds them, not flushed to
    zero (CuPy's astype would flush them)."""
    tiny = np.float64(np.finfo(np.float32).smallest_subnormal)
    x = np.array([3 * tiny, 1e-40 * (1 + 2**-30), -7e-42, 0.0] * 16, np.float64)
    np.testing.assert_array_equal(
        cp.asnumpy(launch.narrow_f64(cp.asarray(x))), x.astype(np.float32)
    )
    assert_same_tensor(nybble.quantize(cp.asarray(x)), nybble.quantize(x))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_pair_rounds_as_numpy_does(dtype: str) -> None:
    """A LoRA layer's A and B in a 16-bit dtype, in one launch: rounded to nearest even as
    numpy / ml_dtypes round them, overflow to inf, subnormals kept (CuPy's astype flushes
    them), NaN kept NaN; odd sizes and empty arrays; arrays it does not take (strided, not
    float32) give None, and the backend's astype_pair then casts them itself."""
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    rng = np.random.default_rng(4)
    a = (rng.standard_normal((37, 129)) * 3).astype(np.float32)
    b = rng.standard_normal((129, 5)).astype(np.float32)
    tiny = np.finfo(np.float32).smallest_subnormal
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 3 * tiny, 65504 * 1.01, 1e-8, 2**-24 * 1.5]
    a.flat[: len(special)] = special
    b.flat[-3:] = [2**-25, -1e-30, 1 + 2**-9]
    pair = launch.narrow_pair(cp.asarray(a), cp.asarray(b), dtype)
    assert pair is not None
    for got, want in zip(pair, (a, b), strict=True):
        with np.errstate(over="ignore"):  # 65504 * 1.01 overflows float16: inf, as wanted
            expected = want.astype(np_dtype)
        host = cp.asnumpy(got)
        assert host.shape == want.shape and host.dtype == np_dtype
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(host.astype(np.float32)), nan)
        np.testing.assert_array_equal(host.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])
    empty = cp.zeros((0, 4), cp.float32)
    pair = launch.narrow_pair(empty, cp.asarray(b), dtype)
    assert pair is not None and pair[0].shape == (0, 4)
    got_b = pair[1]
    np.testing.assert_array_equal(
        cp.asnumpy(got_b).view(np.uint16), b.astype(np_dtype).view(np.uint16)
    )
    strided = cp.asarray(a)[:, ::2]
    assert launch.narrow_pair(strided, cp.asarray(b), dtype) is None
    assert launch.narrow_pair(cp.asarray(a, cp.float64), cp.asarray(b), dtype) is None
    assert launch.narrow_pair(cp.asarray(a), cp.asarray(b), "float32") is None
    from nybble.backends.cuda import backend

    pair = backend().astype_pair(strided, cp.asarray(b), np_dtype)
    np.testing.assert_array_equal(
        cp.asnumpy(pair[0]).astype(np.float32),
        cp.asnumpy(strided.astype(np_dtype)).astype(np.float32),
    )


def test_double_quant_of_subnormal_scales() -> None:
    """Scales and their differences from the mean in the subnormal range: the same nested
    codes, decoded scales and values as the CPU (CuPy's arithmetic would flush them to 0)."""
    rng = np.random.default_rng(3)
    x = (rng.uniform(0.5, 1.5, 64 * 512) * 1e-39).astype(np.float32)
    x[::7] *= -1
    got = nybble.quantize(cp.asarray(x), double_quant=True)
    want = nybble.quantize(x, double_quant=True)
    assert_same_tensor(got, want)
    assert got.nested is not None and want.nested is not None
    np.testing.assert_array_equal(bits(got.absmax), bits(want.absmax))
    np.testing.assert_array_equal(bits(got.dequantize()), bits(want.dequantize()))
