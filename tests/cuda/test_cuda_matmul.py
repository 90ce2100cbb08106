"""The 4-bit matmuls on the GPU (fused GEMV, nf4_matmul, nf4_matmul_t) against the float64
product of the exactly dequantized weight, within bounds that follow from the arithmetic."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nybble
from nybble.formats import Packed
from tests.strategies import blocksizes

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
cuda = pytest.importorskip("nybble.cuda")
from nybble.backends import cuda as cuda_backend  # noqa: E402
from nybble.backends.cuda import launch  # noqa: E402

DTYPES = ["float32", "float16", "bfloat16"]
#: Unit roundoff of each dtype (half an ulp of 1).
ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def weight(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-3, 3, (rows, 1)))
    return w.astype(np.float32)


def tokens(shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return cp.asarray(x.astype(nybble.formats.numpy_dtype(dtype)))


def assert_within_bound(got: Any, a: Any, b: np.ndarray, dtype: str) -> None:
    """got ≈ a @ b in float64, where a holds the inputs as given and b the exact dequantized
    weight. Allowed: the output's rounding, the weight's rounding to the compute dtype (the
    cuBLAS path) and float32 accumulation over k terms, each on the scale of |a| @ |b|,
    with a factor 2 to spare."""
    assert got.dtype == a.dtype
    a64 = cp.asnumpy(a).astype(np.float64)
    want = a64 @ b
    scale = np.abs(a64) @ np.abs(b)
    k = b.shape[0]
    u = ROUNDOFF[dtype]
    bound = 2 * (u * np.abs(want) + (u + (k + 3) * 2.0**-24) * scale) + 1e-30
    err = np.abs(cp.asnumpy(got).astype(np.float64) - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
    assert (err <= bound).all(), f"error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


def exact_weight(q: nybble.NF4Tensor) -> np.ndarray:
    return np.asarray(q.cpu().dequantize("float32"), np.float64)


# --- the fused GEMV ----------------------------------------------------------------------


@given(
    rows=st.integers(1, 70),
    chunks=st.integers(1, 12),
    m=st.integers(1, cuda.GEMV_MAX_TOKENS),
    dtype=st.sampled_from(DTYPES),
    blocksize=blocksizes,
    codebook=st.sampled_from(["nf4", "fp4"]),
    double_quant=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gemv_against_float64(
    rows: int,
    chunks: int,
    m: int,
    dtype: str,
    blocksize: int,
    codebook: str,
    double_quant: bool,
    seed: int,
) -> None:
    """Any row count, rows of 32k elements, blocks shorter or longer than a row."""
    cols = 32 * chunks
    q = nybble.quantize(cp.asarray(weight(rows, cols, seed)), blocksize, double_quant, codebook)
    x = tokens((m, cols), dtype, seed + 1)
    y = cuda.nf4_gemv(x, q)
    assert y.shape == (m, rows)
    assert_within_bound(y, x, exact_weight(q).T, dtype)


@given(
    rows=st.integers(1, 40),
    chunks=st.integers(1, 48),
    m=st.integers(1, cuda.GEMV_MAX_TOKENS),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    blocksize=blocksizes,
    codebook=st.sampled_from(["nf4", "fp4"]),
    seed=st.integers(0, 2**16),
)
def test_gemv_decodes_double_quantized_scales_as_the_decode_kernel(
    rows: int, chunks: int, m: int, dtype: str, blocksize: int, codebook: str, seed: int
) -> None:
    """The tensor-core GEMV decodes nested scales itself: its result is bit-identical to the
    GEMV of the same codes with the scales decoded first (up to 1,920 blocks, so stages cross
    the 256-block boundaries of absmax2 and rows start anywhere in a word of codes)."""
    cols = 32 * chunks
    q = nybble.quantize(cp.asarray(weight(rows, cols, seed)), blocksize, True, codebook)
    assert q.nested is not None
    scales = cp.empty(q.nested.codes.size, cp.float32)
    launch.decode_scales(q.nested, scales.size, scales)
    # Decoded scales of all-zero blocks can be a hair below zero, which the public constructor
    # refuses for plain scales: build the plain tensor as the library builds its own.
    plain = nybble.NF4Tensor._trusted(
        Packed(q.codes, scales, None, q.shape, blocksize, codebook), q.orig_dtype
    )
    x = tokens((m, cols), dtype, seed + 1)
    got, want = cuda.nf4_gemv(x, q), cuda.nf4_gemv(x, plain)
    assert cp.array_equal(got.view(cp.uint16), want.view(cp.uint16))


@given(
    rows=st.integers(1, 120),
    chunks=st.integers(1, 40),
    m=st.integers(1, cuda.GEMV_MAX_TOKENS),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    blocksize=blocksizes,
    double_quant=st.booleans(),
    blocks=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_gemv_blocks_taking_several_tiles_match_one_block_per_tile(
    rows: int,
    chunks: int,
    m: int,
    dtype: str,
    blocksize: int,
    double_quant: bool,
    blocks: int,
    seed: int,
) -> None:
    """A tensor-core GEMV block takes the tiles of 16 rows blockIdx.x, + gridDim.x, ... as one
    stream of stages: with 1-4 blocks for up to 8 tiles the result is bit-identical to one
    block per tile."""
    cols = 32 * chunks
    w = cp.asarray(weight(rows, cols, seed))
    x = tokens((m, cols), dtype, seed + 1)
    results = []
    for cap in (blocks, None):
        q = nybble.quantize(w, blocksize, double_quant)  # a weight of its own: a launch of its own
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                launch.GemvWeight,
                "tc_blocks",
                lambda self, kernel, cap=cap: min(self.tiles, cap or self.tiles),
            )
            results.append(cuda.nf4_gemv(x, q))
    assert cp.array_equal(results[0].view(cp.uint16), results[1].view(cp.uint16))


@pytest.mark.parametrize("double_quant", [False, True])
def test_gemv_of_more_tiles_than_the_gpu_holds_blocks_of(double_quant: bool) -> None:
    """Enough rows that the GPU's blocks take several tiles each (2-3 on an H100), rows ending
    in a partial stage."""
    rows, cols = 9001, 2112
    q = nybble.quantize(cp.asarray(weight(rows, cols, 3)), double_quant=double_quant)
    x = tokens((3, cols), "bfloat16", 4)
    assert_within_bound(cuda.nf4_gemv(x, q), x, exact_weight(q).T, "bfloat16")
    prepared = cuda_backend.backend().gemv_weight(q.packed)
    (made,) = prepared._launches.values()
    assert made.grid < -(-rows // prepared.module.facts.tc_rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1000, 4096), (64, 14336)])
def test_gemv_long_rows(dtype: str, shape: tuple[int, int]) -> None:
    q = nybble.quantize(cp.asarray(weight(*shape, seed=1)))
    x = tokens((shape[1],), dtype, 2)
    y = cuda.nf4_gemv(x, q)
    assert y.shape == (shape[0],)
    assert_within_bound(y, x, exact_weight(q).T, dtype)


def test_gemv_reuses_what_it_prepared_for_a_weight() -> None:
    """The checked launch arguments are kept per weight while it lives; every token dtype and
    count still gets its own kernel; a weight over arrays that had to be copied (not 16-byte
    aligned) is computed right but nothing is kept for it."""
    backend = cuda_backend.backend()
    q = nybble.quantize(cp.asarray(weight(48, 128, 20)))
    for dtype in DTYPES:
        for m in (1, 5):
            x = tokens((m, 128), dtype, m)
            assert_within_bound(cuda.nf4_gemv(x, q), x, exact_weight(q).T, dtype)
    assert id(q.packed) in backend._prepared
    assert backend.gemv_weight(q.packed) is backend.gemv_weight(q.packed)
    x = tokens((2, 128), "bfloat16", 3)
    shifted = cp.empty(q.codes.size + 1, cp.uint8)[1:]
    shifted[:] = q.codes
    odd = nybble.NF4Tensor(shifted, q.absmax, q.shape)
    assert_within_bound(cuda.nf4_gemv(x, odd), x, exact_weight(q).T, "bfloat16")
    assert id(odd.packed) not in backend._prepared
    as_fp4 = nybble.NF4Tensor(q.codes, q.absmax, q.shape, codebook="fp4")  # same codes, FP4
    assert_within_bound(cuda.nf4_gemv(x, as_fp4), x, exact_weight(as_fp4).T, "bfloat16")
    del q, as_fp4
    import gc

    gc.collect()
    assert len(backend._prepared) == 0  # nothing outlives its weight


def test_threads_sharing_a_weight_get_their_own_products() -> None:
    """Threads calling the GEMV of one weight at once (its prepared launches are shared: a
    call's arguments are set and launched in turn) each get the products of their own x."""
    from concurrent.futures import ThreadPoolExecutor

    q = nybble.quantize(cp.asarray(weight(256, 512, 30)))
    xs = [tokens((1 + i % 3, 512), "bfloat16", 40 + i) for i in range(8)]
    want = [cp.asnumpy(cuda.nf4_matmul(x, q)) for x in xs]

    def run(i: int) -> list[np.ndarray]:
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            out = cp.empty((xs[i].shape[0], 256), xs[i].dtype)
            got = []
            for k in range(50):
                y = cuda.nf4_matmul(xs[i], q, out=out if k % 2 else None)
                got.append(cp.asnumpy(y))  # waits for this stream only
            return got

    with ThreadPoolExecutor(8) as pool:
        found = list(pool.map(run, range(8)))
    for i, got in enumerate(found):
        for y in got:
            np.testing.assert_array_equal(y.view(np.uint16), want[i].view(np.uint16))


def test_allocating_gemv_calls_each_return_their_own_output() -> None:
    """A call without `out` returns an output allocated ahead by the call before it on the same
    stream: results kept across many calls, on two streams in turn and inside a stream's
    own context, are each the product of their own x, in memory no other result shares."""
    q = nybble.quantize(cp.asarray(weight(192, 256, 50)))
    xs = [tokens((1, 256), "bfloat16", 60 + i) for i in range(12)]
    other = cp.cuda.Stream(non_blocking=True)
    kept = []
    for i, x in enumerate(xs):
        if i % 4 == 3:
            with other:
                kept.append(cuda.nf4_matmul(x, q))
            other.synchronize()
        else:
            kept.append(cuda.nf4_matmul(x, q))
    cp.cuda.get_current_stream().synchronize()
    assert len({y.data.ptr for y in kept}) == len(kept)
    for y, x in zip(kept, xs, strict=True):
        assert_within_bound(y, x, exact_weight(q).T, "bfloat16")


def test_the_fast_path_launches_through_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path's launch is the Rust core's driver call, the one way nybble launches a
    kernel: it refuses a wrong count of values without launching; a build of the core
    without it launches nothing and says why."""
    from nybble import _core

    native = _core.KernelLaunch
    q = nybble.quantize(cp.asarray(weight(160, 256, 70)))
    x = tokens((2, 256), "float16", 71)
    want = cuda.nf4_matmul(x, q)
    fast = cuda_backend.backend().gemv_weight(q.packed)._fast[(x.dtype, x.shape)]
    assert isinstance(fast, native)
    with pytest.raises(ValueError, match="a call sets 2 values, got 1"):
        fast(cp.cuda.get_current_stream().ptr, x.data.ptr)
    again = [cuda.nf4_matmul(x, q) for _ in range(3)]
    for y in again:
        np.testing.assert_array_equal(cp.asnumpy(y).view("u2"), cp.asnumpy(want).view("u2"))
    monkeypatch.delattr(_core, "KernelLaunch")
    twin = nybble.NF4Tensor(q.codes.copy(), q.absmax.copy(), q.shape)  # prepared anew
    with pytest.raises(RuntimeError, match="core's launcher"):
        cuda.nf4_matmul(x, twin)


def test_the_decode_loops_call_takes_only_what_its_checked_calls_prepared() -> None:
    """`cuda.nf4_matmul`'s first try, the core's GEMV call, launches only for tokens and
    outputs like those a checked call prepared (bit-identical to it) and returns None, with
    nothing launched, for any other call; the public call then takes the checked path, which
    computes it or says what is wrong."""
    from nybble import _core

    q = nybble.quantize(cp.asarray(weight(96, 128, 80)))
    x = tokens((2, 128), "bfloat16", 81)
    want = cp.asnumpy(cuda.nf4_matmul(x, q)).view("u2")  # a checked call: prepares
    gemv = cuda_backend.backend().gemv_weight(q.packed)
    if gemv.fast is None:
        pytest.skip("the core launches nothing on this OS")
    assert q._gemv_call is gemv.fast  # what the next nf4_matmul tries first
    out = cp.empty((2, 96), x.dtype)
    assert gemv.fast(x, out) is out
    made = [gemv.fast(x) for _ in range(3)]
    assert len({y.data.ptr for y in made}) == 3
    for y in [out, *made]:
        np.testing.assert_array_equal(cp.asnumpy(y).view("u2"), want)
    wide = cp.zeros((2, 256), x.dtype)
    wide[:, :128] = x
    shifted = cp.empty(2 * 128 + 1, x.dtype)[1:].reshape(2, 128)  # 2 bytes past 16
    shifted[...] = x
    unprepared = [x.astype(cp.float16), x[:1], x.astype(cp.float32), x.reshape(1, 2, 128)]
    odd = [wide[:, :128], shifted]
    for bad in [*unprepared, *odd, cp.asnumpy(x), x.T.copy().T]:
        assert gemv.fast(bad) is None
        assert gemv.fast(bad, out) is None
    for taken in odd:  # the checked path computes what the fast one refused
        np.testing.assert_array_equal(cp.asnumpy(cuda.nf4_matmul(taken, q)).view("u2"), want)
    shifted_out = cp.empty(2 * 96 + 1, x.dtype)[1:].reshape(2, 96)
    assert gemv.fast(x, shifted_out) is None
    for call in (cuda.nf4_matmul, cuda.nf4_gemv):  # the product copied into it
        shifted_out.fill(0)
        assert call(x, q, out=shifted_out) is shifted_out
        np.testing.assert_array_equal(cp.asnumpy(shifted_out).view("u2"), want)
    wide_out = cp.empty((2, 192), x.dtype)[:, :96]
    wrongs = [wide_out, cp.empty((2, 96), cp.float16), cp.empty((1, 96), x.dtype)]
    for wrong in [*wrongs, cp.empty(192, x.dtype)]:
        assert gemv.fast(x, wrong) is None
        for call in (cuda.nf4_matmul, cuda.nf4_gemv):
            with pytest.raises(ValueError, match=r"^out: expected"):
                call(x, q, out=wrong)
    assert gemv.fast(x, np.empty((2, 96), np.float32)) is None
    launch = gemv._fast[(x.dtype, x.shape)]
    assert isinstance(launch, _core.KernelLaunch)
    for which, m in [(2, 1), (0, 0), (0, cuda.GEMV_MAX_TOKENS + 1)]:
        with pytest.raises(ValueError, match="dtype index below 2 and 1 <= m <= 8"):
            gemv.fast.add(which, m, launch, [])


# --- nf4_matmul / nf4_matmul_t -------------------------------------------------------------


@pytest.mark.parametrize("lead", [(), (1,), (8,), (9,), (3, 5), (300,)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_and_its_transpose(lead: tuple[int, ...], dtype: str) -> None:
    """Few tokens take the GEMV, more take cuBLAS; both directions, any leading shape."""
    q = nybble.quantize(cp.asarray(weight(96, 160, 3)), double_quant=True)
    w = exact_weight(q)
    x = tokens((*lead, 160), dtype, 4)
    y = cuda.nf4_matmul(x, q)
    assert isinstance(y, cp.ndarray) and y.shape == (*lead, 96)
    assert_within_bound(y, x, w.T, dtype)
    dy = tokens((*lead, 96), dtype, 5)
    dx = cuda.nf4_matmul_t(dy, q)
    assert dx.shape == (*lead, 160)
    assert_within_bound(dx, dy, w, dtype)


@pytest.mark.parametrize("codebook, cols", [("int8", 64), ("nf4", 100), ("fp4", 48)])
def test_weights_the_gemv_does_not_take_go_through_cublas(codebook: str, cols: int) -> None:
    assert not launch.gemv_supported(codebook, (40, cols))
    q = nybble.quantize(cp.asarray(weight(40, cols, 6)), 32, codebook=codebook)
    x = tokens((2, cols), "bfloat16", 7)
    assert_within_bound(cuda.nf4_matmul(x, q), x, exact_weight(q).T, "bfloat16")
    with pytest.raises(ValueError, match="the fused GEMV takes"):
        cuda.nf4_gemv(x, q)


def test_gemv_and_cublas_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    q = nybble.quantize(cp.asarray(weight(256, 512, 8)))
    x = tokens((4, 512), "float32", 9)
    fused = cp.asnumpy(cuda.nf4_matmul(x, q))
    monkeypatch.setattr(cuda_backend, "GEMV_MAX_TOKENS", 0)
    dense = cp.asnumpy(cuda.nf4_matmul(x, q))
    np.testing.assert_allclose(fused, dense, rtol=1e-5, atol=1e-5 * np.abs(dense).max())


def test_float32_weights_are_dequantized_in_row_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    rows, cols = 100, 96
    q = nybble.quantize(cp.asarray(weight(rows, cols, 10)), 64)
    monkeypatch.setattr(cuda_backend, "TILE_BYTES", 32 * cols * 4)
    assert cuda.row_tiles(q.packed, "float32") == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert cuda.row_tiles(q.packed, "bfloat16") == [(0, rows)]
    w = exact_weight(q)
    x = tokens((20, cols), "float32", 11)
    assert_within_bound(cuda.nf4_matmul(x, q), x, w.T, "float32")
    dy = tokens((20, rows), "float32", 12)
    assert_within_bound(cuda.nf4_matmul_t(dy, q), dy, w, "float32")


def test_torch_bfloat16_inputs() -> None:
    torch = pytest.importorskip("torch")
    q = nybble.quantize(cp.asarray(weight(64, 128, 13)))
    for m in (1, 16):
        x = np.random.default_rng(m).standard_normal((m, 128)).astype(ml_dtypes.bfloat16)
        t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda().requires_grad_(True)
        got = cuda.nf4_matmul(t, q)
        assert isinstance(got, cp.ndarray) and got.dtype == ml_dtypes.bfloat16
        want = cuda.nf4_matmul(cp.asarray(x), q)
        np.testing.assert_array_equal(
            cp.asnumpy(got).view(np.uint16), cp.asnumpy(want).view(np.uint16)
        )


def test_bad_matmul_arguments() -> None:
    q = nybble.quantize(cp.asarray(weight(64, 128, 14)))
    x = tokens((2, 128), "float32", 15)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 128\)"):
        cuda.nf4_matmul(x[:, :96], q)
    with pytest.raises(ValueError, match=r"dy: expected shape \(\.\.\., 64\)"):
        cuda.nf4_matmul_t(x, q)
    with pytest.raises(ValueError, match="on the CPU"):
        cuda.nf4_matmul(x, q.cpu())
    with pytest.raises(ValueError, match="int32"):
        cuda.nf4_matmul(x.astype(cp.int32), q)
    with pytest.raises(ValueError, match="expected a 2-D weight"):
        cuda.nf4_matmul(x, nybble.quantize(cp.ones(128, cp.float32)))
    m = cuda.GEMV_MAX_TOKENS + 1
    with pytest.raises(ValueError, match=rf"1 <= m <= {m - 1}, got \({m}, 128\)"):
        cuda.nf4_gemv(tokens((m, 128), "float32", 16), q)
    y = cp.empty((2, 64), cp.float16)
    checked = launch.GemvWeight(q.codes, q.absmax, None, "nf4", (64, 128), 64)
    with pytest.raises(ValueError, match="y: expected dtype float32, got float16"):
        checked(x, y)
    with pytest.raises(ValueError, match=r"y: expected shape \(2, 64\)"):
        checked(x, cp.empty((64, 2), cp.float32))
    cp.cuda.Device().synchronize()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("view", ["contiguous", "transposed", "prefix", "copied"])
def test_batched_matmul_against_float64(dtype: str, view: str) -> None:
    """The batched product attention uses, for the views it passes: transposed matrices,
    a prefix of the rows of each (`k[:, :t]`), and strides cuBLAS cannot take (copied)."""
    import cupy

    from nybble.backends import get

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((6, 9, 16)).astype(np_dtype)
    full = rng.standard_normal((6, 20, 16)).astype(np_dtype)
    b_host = {
        "contiguous": full[:, :16, :].copy(),
        "transposed": full.transpose(0, 2, 1)[:, :, :11],
        "prefix": full[:, :16, :11],
        "copied": full[:, ::-1, :].transpose(0, 2, 1)[:, :, ::2],
    }[view]
    b_dev = {
        "contiguous": cupy.asarray(full[:, :16, :].copy()),
        "transposed": cupy.asarray(full).transpose(0, 2, 1)[:, :, :11],
        "prefix": cupy.asarray(full)[:, :16, :11],
        "copied": cupy.asarray(full)[:, ::-1, :].transpose(0, 2, 1)[:, :, ::2],
    }[view]
    got = get("cuda").batched_matmul(cupy.asarray(a), b_dev)
    want = np.matmul(a.astype(np.float64), np.asarray(b_host, np.float64))
    assert got.dtype == np.dtype(np_dtype) and got.shape == want.shape
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    np.testing.assert_allclose(
        cupy.asnumpy(got).astype(np.float64), want, rtol=tol, atol=tol * np.abs(want).max()
    )


def test_batched_matmul_refuses_mixed_dtypes_and_bad_shapes() -> None:
    import cupy

    from nybble.backends.cuda import blas

    a = cupy.ones((2, 3, 4), cupy.float32)
    with pytest.raises(ValueError, match="one dtype"):
        blas.gemm_batched(a, cupy.ones((2, 4, 5), cupy.float16))
    with pytest.raises(ValueError, match="do not chain"):
        blas.gemm_batched(a, cupy.ones((2, 5, 5), cupy.float32))
    assert blas.gemm_batched(a, cupy.ones((2, 4, 0), cupy.float32)).shape == (2, 3, 0)
    assert float(blas.gemm_batched(a[:, :, :0], cupy.ones((2, 0, 5), cupy.float32)).sum()) == 0
