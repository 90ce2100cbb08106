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
    with pytest.raises(ValueError, match="x is on cpu but the layer is on cuda"):
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


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_a_non_finite_input_surfaces_at_check_and_at_the_optimizer(kind: str) -> None:
    """On the GPU forward and backward do not wait on the device: a NaN input is found there
    and raised by check(), and in training by AdamW.step (its gradients are NaN too)."""
    import cupy

    from nybble import AdamW, NonFiniteError

    layer, _ = make(kind, dora=False)
    layer.cuda()
    x = cupy.ones((4, 128), cupy.float32)
    x[2, 5] = cupy.nan
    y = layer.forward(x)  # no error yet: nothing waited for the device
    layer.backward(cupy.ones_like(y))
    with pytest.raises(NonFiniteError) as e:
        layer.check()
    # found through x's product with A (no second pass over x): the first element of its row
    assert (e.value.what, e.value.index) == ("x", 2 * 128)
    layer.check()  # reported once
    layer.disable()  # no LoRA branch: x itself is scanned, and the index is exact
    layer.forward(x)
    with pytest.raises(NonFiniteError) as e:
        layer.check()
    assert e.value.index == 2 * 128 + 5
    layer.enable()
    opt = AdamW(layer.parameters(), lr=1e-3)
    before = cupy.asnumpy(layer.lora_a).copy()
    layer.forward(x)
    layer.backward(cupy.ones_like(y))
    with pytest.raises(NonFiniteError):
        opt.step(layer.gradients())
    np.testing.assert_array_equal(cupy.asnumpy(layer.lora_a), before)  # nothing was applied


class _PeakMemory:
    """Bytes CuPy allocates at most while the context is open, over what it held on entry."""

    def __enter__(self) -> _PeakMemory:
        import cupy

        outer = self

        class Hook(cupy.cuda.MemoryHook):
            name = "peak"

            def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):  # type: ignore[no-untyped-def]
                outer.now += mem_size
                outer.peak = max(outer.peak, outer.now)

            def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):  # type: ignore[no-untyped-def]
                outer.now -= mem_size

        self.now = self.peak = 0
        cupy.get_default_memory_pool().free_all_blocks()
        self._hook = Hook()
        self._hook.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.__exit__(*exc)


def test_dora_on_the_gpu_takes_row_norms_a_tile_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """DoRA's row norms of a quantized W equal the CPU's, and the extra memory they take is
    a tile, not the float32 weight."""
    import cupy

    from nybble.backends import cuda as cuda_backend

    rng = np.random.default_rng(5)
    rows, cols = 2048, 1024
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    layer = QLoraLinear(w, LoraConfig(r=8, alpha=16, use_dora=True))
    layer.set_lora_b(rng.standard_normal((rows, 8)) * 0.05)
    want = layer._row_norms()
    layer.cuda()
    tile = 64 * cols * 4
    monkeypatch.setattr(cuda_backend, "TILE_BYTES", tile)
    with _PeakMemory() as peak:
        got = layer._row_norms()
        cupy.cuda.Device().synchronize()
    assert rel_err(got, want) < 1e-5
    assert peak.peak <= 3 * tile + 4 * rows, (peak.peak, 4 * rows * cols)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_layers_return_the_dtype_they_are_given(dtype: str) -> None:
    """16-bit in, 16-bit out, as on the CPU; the gradients of A and B are float32."""
    import cupy

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    for kind in ("lora", "qlora"):
        layer, _ = make(kind, dora=True)
        layer.cuda()
        x = cupy.asarray(np.ones((3, 128), np_dtype))
        y = layer.forward(x)
        gx = layer.backward(cupy.ones_like(y))
        assert y.dtype == x.dtype and gx.dtype == x.dtype
        assert layer.grad_a.dtype == np.float32 and layer.grad_b.dtype == np.float32


@pytest.mark.parametrize("kind", ["lora", "qlora"])
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_gpu_dropout_is_inverted_dropout_on_the_lora_branch(
    kind: str, dtype: str, tol: float
) -> None:
    """Training-mode dropout on the GPU (mask drawn on the device, in the input's dtype):
    y = x Wᵀ + s·(x ⊙ keep) Aᵀ Bᵀ with keep 1/(1-p) or 0, and A's gradient through the same
    mask; in eval mode no mask."""
    import cupy

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    rng = np.random.default_rng(8)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    p = 0.25
    cfg = LoraConfig(r=4, alpha=8, dropout=p)
    layer = (LoraLinear if kind == "lora" else QLoraLinear)(w, cfg).cuda()
    layer.lora_b[...] = cupy.asarray(rng.standard_normal((32, 4)).astype(np.float32))
    x = cupy.asarray(rng.standard_normal((16, 64)).astype(np_dtype))
    y = layer.forward(x)
    assert y.dtype == np.dtype(np_dtype)
    keep = f64(layer._calls.cache["keep"])
    assert set(np.unique(keep)) == {0.0, float(np.array(1.0 / (1.0 - p)).astype(np_dtype))}
    assert 0.5 < float((keep > 0).mean()) < 0.95
    gy = rng.standard_normal((16, 32))
    layer.backward(cupy.asarray(gy.astype(np_dtype)))

    base = f64(layer.dequantize_weight()) if kind == "qlora" else w.astype(np.float64)
    a, b, xs = f64(layer.lora_a), f64(layer.lora_b), f64(x)
    want = xs @ base.T + layer.scaling * (xs * keep) @ a.T @ b.T
    np.testing.assert_allclose(f64(y), want, atol=tol * np.abs(want).max())
    grad_a = layer.scaling * (gy @ b).T @ (xs * keep)
    got_a = f64(layer.gradients()["lora_A.weight"])
    np.testing.assert_allclose(got_a, grad_a, atol=tol * np.abs(grad_a).max())

    layer.training = False
    xs_eval = layer.forward(x)
    want_eval = xs @ base.T + layer.scaling * xs @ a.T @ b.T
    np.testing.assert_allclose(f64(xs_eval), want_eval, atol=tol * np.abs(want_eval).max())
