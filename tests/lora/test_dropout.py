"""LoRA dropout masks (nybble.lora.dropout): values, rate, independence between draws and
seeds, determinism from (seed, draw), the layer's draw count as the whole state, and (marked
`gpu`) the same mask on the GPU as on the CPU."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from nybble import LoraConfig, LoraLinear
from nybble.lora.dropout import keep_mask


@pytest.mark.parametrize("p", [0.05, 0.25, 0.5, 0.9])
def test_values_and_rate(p: float) -> None:
    n = 200_000
    m = keep_mask(np, (n,), p, seed=7, draw=0, dtype=np.float32)
    assert set(np.unique(m)) == {0.0, np.float32(1.0 / (1.0 - p))}
    kept = float((m > 0).mean())
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)  # five standard deviations


def test_draws_and_seeds_are_independent_and_reproducible() -> None:
    shape = (300, 400)
    base = keep_mask(np, shape, 0.3, seed=1, draw=0, dtype=np.float32) > 0
    np.testing.assert_array_equal(base, keep_mask(np, shape, 0.3, 1, 0, np.float32) > 0)
    agree = 0.7**2 + 0.3**2  # two independent masks agree this often
    for seed, draw in [(1, 1), (1, 2), (2, 0), (1 << 40, 0), (1, 10**9)]:
        other = keep_mask(np, shape, 0.3, seed=seed, draw=draw, dtype=np.float32) > 0
        assert abs(float((base == other).mean()) - agree) < 0.01, (seed, draw)
    flat = base.ravel().astype(np.float64)
    assert abs(np.corrcoef(flat[:-1], flat[1:])[0, 1]) < 0.01  # neighbours uncorrelated


def test_dtypes_and_shapes() -> None:
    m = keep_mask(np, (3, 5, 7), 0.5, 0, 0, ml_dtypes.bfloat16)
    assert m.shape == (3, 5, 7) and m.dtype == ml_dtypes.bfloat16
    assert keep_mask(np, (0, 4), 0.5, 0, 0, np.float32).shape == (0, 4)
    with pytest.raises(ValueError, match="2\\^32"):
        keep_mask(np, (1 << 16, 1 << 16), 0.5, 0, 0, np.float32)


def test_the_layer_draws_once_per_training_forward_and_not_in_eval() -> None:
    w = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    layer = LoraLinear(w, LoraConfig(r=2, dropout=0.5), name="q_proj")
    x = np.ones((4, 16), np.float32)
    layer.lora_b[...] = 1.0
    y0 = layer.forward(x)
    y1 = layer.forward(x)
    assert layer.dropout_draws == 2 and not np.array_equal(y0, y1)
    layer.dropout_draws = 0  # the count is the stream's whole state
    np.testing.assert_array_equal(layer.forward(x), y0)
    layer.train(False)
    layer.forward(x)
    assert layer.dropout_draws == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_the_gpu_draws_the_cpu_mask(dtype: type) -> None:
    import cupy

    for seed, draw in [(0, 0), (12345, 7), (1 << 50, 3)]:
        cpu = keep_mask(np, (257, 130), 0.2, seed, draw, dtype)
        gpu = keep_mask(cupy, (257, 130), 0.2, seed, draw, dtype)
        np.testing.assert_array_equal(cupy.asnumpy(gpu), cpu)
