"""LoRA / QLoRA / DoRA layers on the GPU (CuPy): the same results as on the CPU and as the
float64 oracle, in float32 and in bfloat16 compute. Marked `gpu`: skipped without CUDA."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from nybble import LoraConfig, LoraLinear, QLoraLinear, reference

pytestmark = pytest.mark.gpu


def f64(a: Any) -> np.ndarray:
    import cupy

    return np.asarray(cupy.asnumpy(a) if not isinstance(a, np.ndarray) else a, dtype=np.float64)


def rel_err(got: Any, want: Any) -> float:
    got, want = f64(got), f64(want)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def make(kind: str, dora: bool, seed: int = 0) -> tuple[Any, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((192, 128)) * 0.05).astype(np.float32)
    cfg = LoraConfig(r=8, alpha=16, use_dora=dora, seed=seed)
    layer: Any = (
        QLoraLinear(w, cfg, bias=rng.standard_normal(192))
        if kind == "qlora"
        else LoraLinear(w, cfg, bias=rng.standard_normal(192))
    )
    layer.set_lora_b(rng.standard_normal((192, 8)) * 0.05)
    if dora:
        layer.set_lora_magnitude(layer.lora_magnitude * rng.uniform(0.8, 1.2, 192))
    return layer, (layer.dequantize_weight() if kind == "qlora" else w)


@pytest.mark.parametrize("kind", ["lora", "qlora"])
@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_gpu_forward_backward_equal_the_oracle(
    kind: str, dora: bool, dtype: str, tol: float
) -> None:
    import cupy

    layer, w = make(kind, dora)
    layer.eval().cuda()
    assert layer.device == "cuda"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 9, 128)).astype(np.float32)
    gy = rng.standard_normal((4, 9, 192)).astype(np.float32)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    xg = cupy.asarray(x.astype(np_dtype))
    y = layer.forward(xg)
    assert isinstance(y, cupy.ndarray) and y.shape == (4, 9, 192)
    m = None if layer.lora_magnitude is None else f64(layer.lora_magnitude)
    args = (f64(w), f64(layer.lora_a), f64(layer.lora_b), layer.scaling)
    x2 = f64(x.astype(np_dtype)).reshape(-1, 128)
    want = reference.lora_forward(x2, *args, f64(layer.bias), m)
    assert rel_err(y.reshape(-1, 192), want) < tol
    gx = layer.backward(cupy.asarray(gy.astype(np_dtype)))
    gy2 = f64(gy.astype(np_dtype)).reshape(-1, 192)
    gx_want, ga, gb, gm = reference.lora_backward(gy2, x2, *args, m)
    assert rel_err(gx.reshape(-1, 128), gx_want) < tol
    assert rel_err(layer.grad_a, ga) < tol and rel_err(layer.grad_b, gb) < tol
    if dora:
        assert rel_err(layer.grad_magnitude, gm) < tol


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_cuda_and_cpu_round_trip_give_the_same_layer(kind: str) -> None:
    import cupy

    layer, _ = make(kind, dora=False)
    x = np.random.default_rng(2).standard_normal((5, 128)).astype(np.float32)
    y_cpu = layer.eval().forward(x)
    y_gpu = cupy.asnumpy(layer.cuda().forward(cupy.asarray(x)))
    assert rel_err(y_gpu, y_cpu) < 1e-5
    with pytest.raises(ValueError, match="on the CPU but the layer is on cuda"):
        layer.forward(x)
    layer.cpu()
    assert layer.device == "cpu"
    np.testing.assert_allclose(layer.forward(x), y_cpu, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dora", [False, True])
def test_gpu_merge_unmerge(dora: bool) -> None:
    import cupy

    layer, w = make("lora", dora)
    layer.eval().cuda()
    x = cupy.asarray(np.random.default_rng(3).standard_normal((3, 128)).astype(np.float32))
    y = layer.forward(x)
    layer.merge()
    assert rel_err(layer.forward(x), y) < 1e-5
    m = None if not dora else f64(layer.lora_magnitude)
    merged = reference.lora_merge(f64(w), f64(layer.lora_a), f64(layer.lora_b), layer.scaling, m)
    assert rel_err(layer.weight, merged) < 1e-5
    layer.unmerge()
    assert rel_err(layer.weight, w) < 1e-5
