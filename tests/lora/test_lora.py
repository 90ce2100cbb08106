"""LoRA / QLoRA / DoRA layers against the float64 oracle (nybble.reference)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nybble
from nybble import LoraConfig, LoraLinear, QLoraLinear, reference


def f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def assert_close(got: Any, want: Any, rtol: float = 2e-5) -> None:
    """float32 results against float64: error relative to the result's scale."""
    got, want = f64(got), f64(want)
    assert got.shape == want.shape
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    err = float(np.abs(got - want).max(initial=0.0))
    assert err <= rtol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


@st.composite
def layer_cases(draw: st.DrawFn) -> dict[str, Any]:
    out_f = draw(st.integers(1, 48))
    in_f = draw(st.integers(1, 48))
    r = draw(st.integers(1, min(in_f, out_f)))
    lead = draw(st.sampled_from([(), (1,), (3,), (2, 5), (1, 1, 4)]))
    return {
        "out": out_f,
        "in": in_f,
        "r": r,
        "lead": lead,
        "alpha": draw(st.sampled_from([1.0, 8.0, 16.0, 0.5])),
        "rslora": draw(st.booleans()),
        "dora": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def make_layer(
    case: dict[str, Any], quantized: bool = False, dropout: float = 0.0
) -> tuple[Any, np.ndarray]:
    rng = np.random.default_rng(case["seed"])
    w = rng.standard_normal((case["out"], case["in"])).astype(np.float32)
    cfg = LoraConfig(
        r=case["r"],
        alpha=case["alpha"],
        use_rslora=case["rslora"],
        use_dora=case["dora"],
        dropout=dropout,
        seed=case["seed"],
    )
    bias = rng.standard_normal(case["out"]) if case["bias"] else None
    layer: Any = QLoraLinear(w, cfg, bias=bias) if quantized else LoraLinear(w, cfg, bias=bias)
    layer.set_lora_b(rng.standard_normal((case["out"], case["r"])) * 0.3)
    if case["dora"]:
        layer.set_lora_magnitude(layer.lora_magnitude * rng.uniform(0.5, 1.5, case["out"]))
    w_math = layer.dequantize_weight() if quantized else w
    return layer, w_math


def oracle(layer: Any, w: np.ndarray, x: np.ndarray, keep: Any = None) -> np.ndarray:
    m = None if layer.lora_magnitude is None else f64(layer.lora_magnitude)
    b = None if layer.bias is None else f64(layer.bias)
    x2 = f64(x).reshape(-1, layer.in_features)
    k = None if keep is None else f64(keep)
    y = reference.lora_forward(
        x2, f64(w), f64(layer.lora_a), f64(layer.lora_b), layer.scaling, b, m, k
    )
    return y.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
@given(case=layer_cases())
def test_forward_and_backward_equal_the_oracle(quantized: bool, case: dict[str, Any]) -> None:
    layer, w = make_layer(case, quantized)
    rng = np.random.default_rng(case["seed"] + 1)
    x = rng.standard_normal((*case["lead"], case["in"])).astype(np.float32)
    y = layer.forward(x)
    assert y.shape == (*case["lead"], case["out"]) and y.dtype == np.float32
    assert_close(y, oracle(layer, w, x))
    gy = rng.standard_normal(y.shape).astype(np.float32)
    gx = layer.backward(gy)
    m = None if layer.lora_magnitude is None else f64(layer.lora_magnitude)
    want = reference.lora_backward(
        f64(gy).reshape(-1, case["out"]),
        f64(x).reshape(-1, case["in"]),
        f64(w),
        f64(layer.lora_a),
        f64(layer.lora_b),
        layer.scaling,
        m,
    )
    assert gx.shape == x.shape
    assert_close(gx.reshape(-1, case["in"]), want[0], 5e-5)
    assert_close(layer.grad_a, want[1], 5e-5)
    assert_close(layer.grad_b, want[2], 5e-5)
    if case["dora"]:
        assert_close(layer.grad_magnitude, want[3], 5e-5)


@pytest.mark.parametrize("dora", [False, True])
def test_dropout_applies_to_the_lora_branch_in_training_only(dora: bool) -> None:
    case = dict(
        out=20, **{"in": 24}, r=4, lead=(6,), alpha=8.0, rslora=False, dora=dora, bias=True, seed=3
    )
    layer, w = make_layer(case, dropout=0.5)
    x = np.random.default_rng(0).standard_normal((6, 24)).astype(np.float32)
    y = layer.forward(x)
    keep = layer._calls.cache["keep"]
    assert keep is not None and set(np.unique(keep)) <= {0.0, 2.0} and 0 < keep.mean() < 2
    assert_close(y, oracle(layer, w, x, keep))
    gy = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    gx = layer.backward(gy)
    m = None if layer.lora_magnitude is None else f64(layer.lora_magnitude)
    want = reference.lora_backward(
        f64(gy), f64(x), f64(w), f64(layer.lora_a), f64(layer.lora_b), layer.scaling, m, f64(keep)
    )
    assert_close(gx, want[0], 5e-5)
    assert_close(layer.grad_a, want[1], 5e-5)
    layer.eval()
    assert_close(layer.forward(x), oracle(layer, w, x))


def test_oracle_backward_matches_finite_differences() -> None:
    """The oracle's gradients (which the layers are tested against) are right."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 5)), rng.standard_normal((4, 5))
    a, b, m = rng.standard_normal((2, 5)), rng.standard_normal((4, 2)), rng.uniform(0.5, 2, 4)
    keep = (rng.random((3, 5)) > 0.3) / 0.7
    gy = rng.standard_normal((3, 4))
    for mag in (None, m):

        def loss(x_: np.ndarray, a_: np.ndarray, b_: np.ndarray, m_: Any) -> float:
            y = reference.lora_forward(x_, w, a_, b_, 0.7, None, m_, keep)
            return float((y * gy).sum())

        gx, ga, gb, gm = reference.lora_backward(gy, x, w, a, b, 0.7, mag, keep)
        for arr, grad, which in ((x, gx, 0), (a, ga, 1), (b, gb, 2)) + (
            ((m, gm, 3),) if mag is not None else ()
        ):
            num = np.zeros_like(arr)
            for i in np.ndindex(arr.shape):
                args = [x, a, b, mag]
                for sign in (1, -1):
                    bumped = arr.copy()
                    bumped[i] += sign * 1e-6
                    args[which] = bumped
                    num[i] += sign * loss(*args) / 2e-6
            if which in (1, 2) and mag is not None:
                continue  # DoRA's norm is detached: A and B gradients exclude it by design
            np.testing.assert_allclose(grad, num, rtol=1e-5, atol=1e-6)


def test_layer_backward_matches_finite_differences() -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    layer = LoraLinear(w, LoraConfig(r=2, alpha=4))
    layer.set_lora_b(rng.standard_normal((6, 2)))
    x = rng.standard_normal((2, 5)).astype(np.float32)
    gy = rng.standard_normal((2, 6)).astype(np.float32)
    layer.forward(x)
    gx = layer.backward(gy)
    eps = 1e-2
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        num = ((layer.forward(xp) - layer.forward(xm)) * gy).sum() / (2 * eps)
        assert abs(num - gx[i]) <= 1e-2 * (1 + abs(gx[i]))


def test_fresh_adapter_changes_nothing_and_disabled_is_plain_w() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 12)).astype(np.float32)
    x = rng.standard_normal((5, 12)).astype(np.float32)
    plain = f64(x) @ f64(w).T
    for dora in (False, True):
        layer = LoraLinear(w, LoraConfig(r=4, alpha=8, use_dora=dora))
        assert not layer.lora_b.any()  # B = 0
        assert_close(layer.forward(x), plain)
        layer.set_lora_b(rng.standard_normal((16, 4)))
        assert np.abs(layer.forward(x) - plain).max() > 1e-3
        layer.disable()
        assert_close(layer.forward(x), plain)
        layer.backward(np.ones((5, 16), np.float32))
        assert layer.grad_a is None and layer.grad_b is None
        layer.enable()
        assert np.abs(layer.forward(x) - plain).max() > 1e-3


def test_batch_forward_equals_per_row_forward() -> None:
    rng = np.random.default_rng(1)
    layer = LoraLinear(rng.standard_normal((10, 7)), LoraConfig(r=3, alpha=6, use_dora=True))
    layer.set_lora_b(rng.standard_normal((10, 3)))
    x = rng.standard_normal((4, 3, 7)).astype(np.float32)
    y = layer.forward(x)
    for i in np.ndindex(x.shape[:-1]):
        np.testing.assert_allclose(y[i], layer.forward(x[i]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dora", [False, True])
def test_merge_unmerge_round_trip(dora: bool) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((32, 24)).astype(np.float32)
    layer = LoraLinear(w, LoraConfig(r=4, alpha=8, use_dora=dora))
    layer.set_lora_b(rng.standard_normal((32, 4)))
    x = rng.standard_normal((6, 24)).astype(np.float32)
    y = layer.forward(x)
    layer.merge()
    assert layer.merged
    m = None if not dora else f64(layer.lora_magnitude)
    assert_close(
        layer.weight,
        reference.lora_merge(f64(w), f64(layer.lora_a), f64(layer.lora_b), layer.scaling, m),
    )
    assert_close(layer.forward(x), y)  # merged forward = unmerged forward
    with pytest.raises(ValueError, match="already merged"):
        layer.merge()
    layer.unmerge()
    np.testing.assert_allclose(layer.weight, w, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not merged"):
        layer.unmerge()


def test_merge_refuses_non_finite_results_and_leaves_w_unchanged() -> None:
    w = np.full((4, 4), 3e38, np.float32)
    layer = LoraLinear(w, LoraConfig(r=1, alpha=1))
    layer.set_lora_a(np.ones((1, 4)))
    layer.set_lora_b(np.full((4, 1), 1e38))
    with pytest.raises(ValueError, match="non-finite"):
        layer.merge()
    assert not layer.merged
    np.testing.assert_array_equal(layer.weight, w)


def test_merged_weight_and_fan_in_fan_out() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 6)).astype(np.float32)  # [out, in]
    plain = LoraLinear(w, LoraConfig(r=2, alpha=2, seed=5))
    transposed = LoraLinear(w.T, LoraConfig(r=2, alpha=2, seed=5, fan_in_fan_out=True))
    b = rng.standard_normal((8, 2))
    plain.set_lora_b(b)
    transposed.set_lora_b(b)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_allclose(plain.forward(x), transposed.forward(x), rtol=1e-6, atol=1e-6)
    merged = plain.merged_weight()
    assert_close(merged, f64(w) + plain.scaling * f64(b) @ f64(plain.lora_a))
    np.testing.assert_allclose(transposed.merged_weight(), merged.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(plain.weight, w)  # merged_weight changes nothing
    assert plain.merged_weight("bfloat16").dtype.name == "bfloat16"


def test_qlora_forward_equals_lora_forward_on_the_dequantized_weight() -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((300, 70)).astype(np.float32)
    cfg = LoraConfig(r=8, alpha=16, seed=1)
    q = QLoraLinear(w, cfg, double_quant=True)
    dense = LoraLinear(q.dequantize_weight(), cfg)
    b = rng.standard_normal((300, 8)) * 0.1
    q.set_lora_b(b)
    dense.set_lora_b(b)
    x = rng.standard_normal((9, 70)).astype(np.float32)
    np.testing.assert_allclose(q.forward(x), dense.forward(x), rtol=2e-5, atol=2e-5)
    gy = rng.standard_normal((9, 300)).astype(np.float32)
    np.testing.assert_allclose(q.backward(gy), dense.backward(gy), rtol=2e-5, atol=2e-4)
    np.testing.assert_allclose(q.grad_a, dense.grad_a, rtol=2e-5, atol=2e-4)
    assert q.memory_saved_bytes() == 4 * w.size - q.qweight.nbytes > 0.8 * 4 * w.size
    assert_close(q.merged_weight(), f64(q.dequantize_weight()) + q.scaling * b @ f64(q.lora_a))
    with pytest.raises(ValueError, match="merged_weight"):
        q.merge()


def test_qlora_accepts_an_nf4_tensor_and_dora() -> None:
    rng = np.random.default_rng(5)
    qw = nybble.quantize(rng.standard_normal((40, 32)).astype(np.float32))
    layer = QLoraLinear(qw, LoraConfig(r=4, alpha=4, use_dora=True))
    norms = np.linalg.norm(f64(qw.dequantize()), axis=1)
    assert_close(layer.lora_magnitude, norms)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    assert_close(layer.forward(x), f64(x) @ f64(qw.dequantize()).T)


def test_init_is_seeded_kaiming_uniform_and_b_zero() -> None:
    w = np.zeros((64, 100), np.float32)
    a1 = LoraLinear(w, LoraConfig(r=8, seed=1), name="l").lora_a
    a2 = LoraLinear(w, LoraConfig(r=8, seed=1), name="l").lora_a
    a3 = LoraLinear(w, LoraConfig(r=8, seed=2), name="l").lora_a
    np.testing.assert_array_equal(a1, a2)
    assert not np.array_equal(a1, a3)
    assert np.abs(a1).max() <= 1 / np.sqrt(100) and np.abs(a1).max() > 0.09
    g = LoraLinear(w, LoraConfig(r=8, init="gaussian"), name="l").lora_a
    assert abs(float(g.std()) - 1 / 8) < 0.02


def test_counts_and_scaling() -> None:
    layer = LoraLinear(np.zeros((30, 20), np.float32), LoraConfig(r=4, alpha=16), bias=np.zeros(30))
    assert layer.scaling == 4.0
    assert layer.trainable_params == 4 * (20 + 30)
    assert layer.total_params == 30 * 20 + 30 + 200
    assert layer.compression_ratio == pytest.approx(600 / 200)
    assert LoraConfig(r=16, alpha=8, use_rslora=True).scaling == pytest.approx(2.0)
    dora = LoraLinear(np.ones((30, 20), np.float32), LoraConfig(r=4, use_dora=True))
    assert dora.trainable_params == 4 * 50 + 30


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"r": 0}, "r must be"),
        ({"r": 2.5}, "r must be"),
        ({"alpha": 0}, "alpha must be"),
        ({"alpha": -1.0}, "alpha must be"),
        ({"dropout": 1.0}, "dropout must be"),
        ({"dropout": -0.1}, "dropout must be"),
        ({"init": "xavier"}, "init must be"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LoraConfig(**kwargs).validate()


def test_config_needs_targets_where_one_is_needed() -> None:
    with pytest.raises(ValueError, match="target_modules is empty"):
        LoraConfig(target_modules=()).validate(need_targets=True)
    LoraConfig(target_modules=()).validate()


def test_layer_input_errors() -> None:
    layer = LoraLinear(np.ones((8, 6), np.float32), LoraConfig(r=2))
    with pytest.raises(ValueError, match="exceeds min"):
        LoraLinear(np.ones((8, 6), np.float32), LoraConfig(r=7))
    with pytest.raises(ValueError, match=r"shape \[\.\.\., 6\]"):
        layer.forward(np.ones((3, 5), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        layer.forward(np.array([[1, 2, 3, np.nan, 5, 6]], np.float32))
    with pytest.raises(ValueError, match="dtype int64"):
        layer.forward(np.ones((2, 6), np.int64))
    with pytest.raises(ValueError, match=r"backward\(\) needs a forward"):
        LoraLinear(np.ones((8, 6), np.float32), LoraConfig(r=2)).backward(np.ones((1, 8)))
    layer.forward(np.ones((2, 6), np.float32))
    with pytest.raises(ValueError, match="grad_y must have shape"):
        layer.backward(np.ones((3, 8), np.float32))
    with pytest.raises(ValueError, match=r"lora_A must have shape \(2, 6\)"):
        layer.set_lora_a(np.ones((6, 2)))
    with pytest.raises(ValueError, match=r"lora_B must have shape \(8, 2\)"):
        layer.set_lora_b(np.ones((2, 8)))
    with pytest.raises(ValueError, match="non-finite"):
        layer.set_lora_b(np.full((8, 2), np.inf))
    with pytest.raises(ValueError, match="must be 2-D"):
        LoraLinear(np.ones(8, np.float32), LoraConfig(r=1))
    with pytest.raises(ValueError, match="bias must have shape"):
        LoraLinear(np.ones((8, 6), np.float32), LoraConfig(r=1), bias=np.ones(6))
    with pytest.raises(ValueError, match="no DoRA magnitude"):
        layer.set_lora_magnitude(np.ones(8))


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_layers_return_the_dtype_they_are_given(quantized: bool, dtype: str) -> None:
    """16-bit in, 16-bit out (products in float32, rounded once); float64 is computed and
    returned as float32; gradients of the parameters are float32."""
    import ml_dtypes

    case = {
        "out": 12,
        "in": 10,
        "r": 2,
        "alpha": 4.0,
        "rslora": False,
        "dora": True,
        "bias": True,
        "seed": 3,
    }
    layer, _ = make_layer(case, quantized)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x32 = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    x = x32.astype(np_dtype)
    y = layer.forward(x)
    want_dtype = np.float32 if dtype == "float64" else np_dtype
    assert y.dtype == want_dtype
    y32 = layer.forward(x.astype(np.float32))
    np.testing.assert_array_equal(y, y32.astype(want_dtype))  # rounded once, at the end
    gx = layer.backward(np.ones(y.shape, np_dtype))
    assert gx.dtype == want_dtype and layer.grad_a.dtype == np.float32


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_zero_tokens(quantized: bool, lead: tuple[int, ...]) -> None:
    case = {
        "out": 32,
        "in": 24,
        "r": 4,
        "alpha": 8.0,
        "rslora": False,
        "dora": True,
        "bias": True,
        "seed": 1,
    }
    layer, _ = make_layer(case, quantized)
    for enabled in (True, False):
        layer.enable() if enabled else layer.disable()
        y = layer.forward(np.ones((*lead, 24), np.float32))
        assert y.shape == (*lead, 32)
        assert layer.backward(np.ones((*lead, 32), np.float32)).shape == (*lead, 24)


def test_threads_sharing_a_layer_get_their_own_gradients() -> None:
    """Each thread's backward pairs with its own forward and fills its own gradients."""
    import threading

    case = {
        "out": 16,
        "in": 12,
        "r": 2,
        "alpha": 4.0,
        "rslora": False,
        "dora": False,
        "bias": False,
        "seed": 4,
    }
    layer, _ = make_layer(case)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((3, 12)).astype(np.float32) for _ in range(4)]
    want = []
    for x in inputs:
        layer.forward(x)
        layer.backward(np.ones((3, 16), np.float32))
        want.append((layer.grad_a.copy(), layer.grad_b.copy()))
    wrong: list[int] = []

    def work(k: int) -> None:
        for _ in range(200):
            layer.forward(inputs[k])
            layer.backward(np.ones((3, 16), np.float32))
            if not (
                np.array_equal(layer.grad_a, want[k][0])
                and np.array_equal(layer.grad_b, want[k][1])
            ):
                wrong.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


# A LoRA and a QLoRA layer's forward and backward at sizes that reach every path of the core's
# dense products (thin rank-r products, tiles with edges, more than one depth block), printed
# as a digest of their bytes.
_ISA_SCRIPT = """
import hashlib, sys
import numpy as np
from nybble import LoraConfig, LoraLinear, QLoraLinear, _core
rng = np.random.default_rng(3)
w = rng.standard_normal((300, 520)).astype(np.float32)
x = rng.standard_normal((70, 520)).astype(np.float32)
dy = rng.standard_normal((70, 300)).astype(np.float32)
digest = hashlib.sha256()
for layer in (LoraLinear(w, LoraConfig(r=16)), QLoraLinear(w, LoraConfig(r=16))):
    layer.set_lora_b(rng.standard_normal((300, 16)) * 0.1)
    for a in (layer.forward(x), layer.backward(dy), layer.grad_a, layer.grad_b):
        digest.update(np.ascontiguousarray(a).tobytes())
print(_core.matmul_isa(), digest.hexdigest())
"""


def _run_at(isa: str) -> tuple[str, str]:
    import os
    import subprocess
    import sys

    env = {**os.environ, "NYBBLE_CPU_ISA": isa}
    out = subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    ran, digest = out.stdout.split()
    return ran, digest


def test_the_cpu_isa_switch_caps_the_products_and_every_isa_gives_the_same_bits() -> None:
    """NYBBLE_CPU_ISA caps the dense products' instruction set (read once per process); the
    x86 tiles (AVX-512, AVX2, scalar) are bit-exact twins, so the layers' results are the
    same bytes whichever runs."""
    best, want = _run_at("")
    assert best == nybble._core.matmul_isa()
    assert best in ("avx512", "avx2", "neon", "scalar")
    assert _run_at("scalar")[0] == "scalar"
    assert _run_at("no-such-isa")[0] == best  # unknown names leave the CPU's own
    if best == "avx512":
        assert _run_at("avx2") == ("avx2", want)
    if best in ("avx512", "avx2"):  # NEON runs the gemm crate's kernels, not a twin
        assert _run_at("scalar") == ("scalar", want)
