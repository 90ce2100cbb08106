"""The named contracts of the codec (docs/contracts.md), one test each."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import nybble
from nybble import _core, reference
from tests.strategies import blocksizes, float32_arrays


def test_codebook_properties() -> None:
    for values in (reference.NF4, np.array(_core.codebook_values("nf4"), np.float32)):
        assert values.shape == (16,) and values.dtype == np.float32
        assert np.all(np.diff(values) > 0)
        assert (values[0], values[7], values[15]) == (-1.0, 0.0, 1.0)


def test_c_nf4_001_fidelity() -> None:
    """Every element within half the largest codebook gap of its normalised value; the mean
    absolute error of N(0, 1) data at blocksize 64 within bitsandbytes' own gate."""
    x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    q = nybble.quantize(x, blocksize=64)
    deq = q.dequantize()
    scale = np.repeat(q.absmax, 64)
    assert float(np.abs(x / scale - deq / scale).max()) < 0.16
    assert float(np.abs(x - deq).mean()) <= 0.0733


@given(x=float32_arrays(), blocksize=blocksizes)
def test_c_nf4_001_fidelity_on_any_input(x: np.ndarray, blocksize: int) -> None:
    q = nybble.quantize(x, blocksize=blocksize)
    deq = q.dequantize()
    scale = np.repeat(q.absmax, blocksize)[: x.size].astype(np.float64)
    err = np.abs(x.astype(np.float64) - deq.astype(np.float64))
    nonzero = scale > 0
    assert np.all(err[nonzero] / scale[nonzero] < 0.16)
    assert np.all(deq[~nonzero] == 0)


@given(n=st.integers(0, 10_000), blocksize=blocksizes)
def test_c_nf4_002_sizes(n: int, blocksize: int) -> None:
    q = nybble.quantize(np.ones(n, np.float32), blocksize=blocksize)
    nblocks = -(-n // blocksize)
    assert q.codes.nbytes == -(-n // 2)
    assert q.absmax.shape == (nblocks,) and q.absmax.dtype == np.float32
    assert q.nbytes == -(-n // 2) + 4 * nblocks
    if blocksize == 64:
        assert q.to_blocks().nbytes == nblocks * 36


def test_c_nf4_004_compression() -> None:
    """32 / 4.5 = 7.11x at blocksize 64. With double quantization the scales cost
    8/64 + 32/(64*256) = 0.127 bits per parameter (QLoRA §3), so 32 / 4.127 = 7.75x is the
    most any layout of those bits can give."""
    x = np.random.default_rng(1).standard_normal((4096, 4096)).astype(np.float32)
    plain = nybble.quantize(x)
    double = nybble.quantize(x, double_quant=True)
    assert x.nbytes / plain.nbytes >= 7.1
    assert 8 * double.nbytes / x.size < 4.128
    assert x.nbytes / double.nbytes >= 7.75


@given(x=float32_arrays(), blocksize=blocksizes, codebook=st.sampled_from(["nf4", "fp4", "int8"]))
def test_idempotence(x: np.ndarray, blocksize: int, codebook: str) -> None:
    """quantize(dequantize(q)) == q: every block of a quantized tensor holds a code of
    magnitude 1, so requantizing finds the same scale and, value by value, the same code."""
    x[np.abs(x) < 2.0**-120] = 0  # below this, products with absmax underflow to subnormals
    q = nybble.quantize(x, blocksize=blocksize, codebook=codebook)
    again = nybble.quantize(q.dequantize(), blocksize=blocksize, codebook=codebook)
    np.testing.assert_array_equal(again.absmax, q.absmax)
    if codebook == "fp4":
        # FP4 has two codes for zero (0 and the sign bit alone, 8); both decode to 0.0.
        np.testing.assert_array_equal(again.dequantize(), q.dequantize())
    else:
        np.testing.assert_array_equal(again.codes, q.codes)


def test_qwen3_4b_decoder_layer_is_under_60_mb() -> None:
    hidden, inter, heads, kv_heads, head_dim = 2560, 9728, 32, 8, 128
    shapes = {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    total = sum(nybble.quantize(np.ones(s, np.float32)).nbytes for s in shapes.values())
    assert total < 60e6, total
