"""nybble's torch operators (nybble.torch._ops) on the CPU: torch.library.opcheck for each op
(schema, autograd registration, fake implementation, AOT dispatch with dynamic shapes), their
values against nybble's own numpy API bit for bit or within float32 summation, gradients by
gradcheck in float64 and float32, the errors for bad arguments, that no product holds the
whole weight dequantized, and torch.compile(fullgraph=True) of a module that uses them.
The CUDA twins of these tests are in tests/torch/test_torch_gpu.py."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import nybble

torch = pytest.importorskip("torch")
nt = pytest.importorskip("nybble.torch")
ops = torch.ops.nybble

# opcheck's AOT test reads .grad of non-leaf tensors it makes itself (torch's warning, not ours)
pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)

OUT, IN, R = 40, 96, 8


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)  # each test's random tensors the same on every run


def weight_args(double_quant: bool = False, seed: int = 0, shape: Any = (OUT, IN)) -> tuple:
    """A random weight's op arguments and its NF4Tensor."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    q = nybble.quantize(w, double_quant=double_quant)
    codes = torch.from_numpy(q.codes.copy())
    if q.nested is None:
        args = (codes, torch.from_numpy(np.asarray(q.absmax).copy()), None, 0.0)
    else:
        n = q.nested
        args = (
            codes,
            torch.from_numpy(n.codes.copy()),
            torch.from_numpy(n.absmax2.copy()),
            n.offset,
        )
    return (*args, list(shape), 64, "nf4"), q


def dense(q: nybble.NF4Tensor) -> Any:
    return torch.from_numpy(q.dequantize("float32"))


def bits(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


# --- opcheck ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_matmul_and_matmul_t(dq: bool, dtype: Any) -> None:
    w, _ = weight_args(dq)
    x = torch.randn(3, 5, IN, dtype=dtype, requires_grad=True)
    torch.library.opcheck(ops.matmul.default, (x, *w))
    g = torch.randn(7, OUT, dtype=dtype)
    torch.library.opcheck(ops.matmul_t.default, (g, *w))


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_opcheck_dequantize(dq: bool, dtype: Any) -> None:
    w, _ = weight_args(dq)
    torch.library.opcheck(ops.dequantize.default, (*w, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 33), (64,), (3, 128)])
def test_opcheck_quantize(dtype: Any, shape: tuple[int, ...]) -> None:
    torch.library.opcheck(ops.quantize.default, (torch.randn(shape, dtype=dtype), 64, "nf4"))


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("with_keep", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_qlora_linear(dq: bool, with_keep: bool, with_bias: bool) -> None:
    w, _ = weight_args(dq)
    x = torch.randn(2, 3, IN, requires_grad=True)
    keep = torch.nn.functional.dropout(torch.ones(2, 3, IN), 0.25) if with_keep else None
    a = torch.randn(R, IN, requires_grad=True)
    b = torch.randn(OUT, R, requires_grad=True)
    bias = torch.randn(OUT, requires_grad=True) if with_bias else None
    torch.library.opcheck(ops.qlora_linear.default, (x, keep, *w, a, b, 0.5, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_opcheck_qlora_linear_backward(dtype: Any) -> None:
    w, _ = weight_args(True)
    x = torch.randn(4, IN, dtype=dtype)
    keep = torch.nn.functional.dropout(torch.ones(4, IN, dtype=dtype), 0.5)
    args = (torch.randn(4, OUT, dtype=dtype), x, keep, *w, torch.randn(R, IN), torch.randn(OUT, R))
    torch.library.opcheck(ops.qlora_linear_backward.default, (*args, 2.0))


# --- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 7 * 33])
def test_quantize_is_nybbles_codec_bit_for_bit(dtype: Any, n: int) -> None:
    x = torch.randn(n, dtype=dtype) * 3
    codes, absmax = ops.quantize(x, 64, "nf4")
    host = x.float().numpy() if dtype == torch.bfloat16 else x.numpy()
    if dtype == torch.bfloat16:
        host = host.astype(ml_dtypes.bfloat16)
    q = nybble.quantize(host)
    np.testing.assert_array_equal(codes.numpy(), q.codes)
    np.testing.assert_array_equal(bits(absmax.numpy()), bits(q.absmax))


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_nybbles_bit_for_bit(dq: bool, dtype: Any) -> None:
    w, q = weight_args(dq)
    got = ops.dequantize(*w, dtype)
    name = str(dtype).removeprefix("torch.")
    want = q.dequantize(name)
    assert got.dtype == dtype and tuple(got.shape) == (OUT, IN)
    host = got.view(torch.int16).numpy() if dtype == torch.bfloat16 else got.numpy()
    np.testing.assert_array_equal(bits(host), bits(want))


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_products(dq: bool, dtype: Any) -> None:
    """x @ Wᵀ and g @ W in x's dtype: float32 sums on the CPU (rounded once for 16-bit
    activations), float64 over exact float32 weights."""
    w, q = weight_args(dq)
    wd = dense(q).double()
    x = torch.randn(2, 5, IN, dtype=dtype)
    g = torch.randn(4, OUT, dtype=dtype)
    y, gx = ops.matmul(x, *w), ops.matmul_t(g, *w)
    assert y.dtype == dtype and tuple(y.shape) == (2, 5, OUT)
    assert gx.dtype == dtype and tuple(gx.shape) == (4, IN)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
    torch.testing.assert_close(y.double(), x.double() @ wd.T, rtol=tol, atol=tol)
    torch.testing.assert_close(gx.double(), g.double() @ wd, rtol=tol, atol=tol)


def test_matmul_takes_strided_activations_without_changing_them() -> None:
    w, q = weight_args()
    x = torch.randn(IN, 6).T  # a transposed view
    before = x.clone()
    torch.testing.assert_close(ops.matmul(x, *w), x @ dense(q).T, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before)


def _qlora_reference(x: Any, keep: Any, wd: Any, a: Any, b: Any, s: float, bias: Any) -> Any:
    xd = x if keep is None else x * keep
    y = x @ wd.T + s * (xd @ a.T) @ b.T
    return y if bias is None else y + bias


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("with_keep", [False, True])
def test_qlora_linear_forward_and_backward_values(dq: bool, with_keep: bool) -> None:
    w, q = weight_args(dq)
    wd = dense(q)
    x = torch.randn(3, 4, IN, requires_grad=True)
    keep = torch.nn.functional.dropout(torch.ones(3, 4, IN), 0.3) if with_keep else None
    a = torch.randn(R, IN, requires_grad=True)
    b = torch.randn(OUT, R, requires_grad=True)
    bias = torch.randn(OUT, requires_grad=True)
    y = ops.qlora_linear(x, keep, *w, a, b, 0.75, bias)
    leaves = (x, a, b, bias)
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    want = _qlora_reference(twins[0], keep, wd, twins[1], twins[2], 0.75, twins[3])
    # float32 sums in another order than torch's: within float32's rounding of the terms'
    # size (an output can cancel to far below it)
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * scale)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    for got, ref in zip(leaves, twins, strict=True):
        scale = float(ref.grad.abs().max())
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-5, atol=1e-5 * scale)


def test_lora_gradients_keep_the_parameters_dtype() -> None:
    """bfloat16 activations with float32 adapters (PEFT's layout): dA, dB in float32, dx in
    bfloat16."""
    w, _ = weight_args()
    x = torch.randn(5, IN, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(R, IN, requires_grad=True)
    b = torch.randn(OUT, R, requires_grad=True)
    ops.qlora_linear(x, None, *w, a, b, 2.0, None).float().sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    # bfloat16 adapters too (gradients in bfloat16)
    a16 = a.detach().bfloat16().requires_grad_()
    b16 = b.detach().bfloat16().requires_grad_()
    ops.qlora_linear(x.detach(), None, *w, a16, b16, 2.0, None).float().sum().backward()
    assert a16.grad.dtype == torch.bfloat16 and b16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a16.grad.float(), a.grad, rtol=2e-2, atol=2e-2 * a.grad.abs().max())


# --- gradcheck -------------------------------------------------------------------------------


@pytest.mark.parametrize("dq", [False, True])
def test_gradcheck_float64(dq: bool) -> None:
    w, _ = weight_args(dq, shape=(24, 64))
    f64 = torch.float64
    x = torch.randn(2, 3, 64, dtype=f64, requires_grad=True)
    a = torch.randn(4, 64, dtype=f64, requires_grad=True)
    b = torch.randn(24, 4, dtype=f64, requires_grad=True)
    bias = torch.randn(24, dtype=f64, requires_grad=True)
    keep = torch.nn.functional.dropout(torch.ones(2, 3, 64, dtype=f64), 0.4)

    def qlora(x: Any, a: Any, b: Any, bias: Any) -> Any:
        return ops.qlora_linear(x, keep, *w, a, b, 0.5, bias)

    assert torch.autograd.gradcheck(qlora, (x, a, b, bias))
    assert torch.autograd.gradcheck(lambda x: ops.matmul(x, *w), (x,))


@pytest.mark.filterwarnings("ignore:Input #. requires gradient and is not a double:UserWarning")
def test_gradcheck_float32_and_the_layer() -> None:
    """float32 by finite differences with float32's tolerance (the products are linear in
    each argument, so the differences are exact up to rounding), for the op and for a
    Linear4bit."""
    w, _ = weight_args(True, shape=(24, 64))
    x = torch.randn(3, 64, requires_grad=True)
    a = torch.randn(4, 64, requires_grad=True)
    b = torch.randn(24, 4, requires_grad=True)
    tol = {"eps": 1e-2, "atol": 2e-2, "rtol": 2e-2}

    def qlora(x: Any, a: Any, b: Any) -> Any:
        return ops.qlora_linear(x, None, *w, a, b, 0.5, None)

    assert torch.autograd.gradcheck(qlora, (x, a, b), **tol)
    layer = nt.Linear4bit(64, 24, double_quant=True)
    assert torch.autograd.gradcheck(layer, (x,), **tol)
    assert torch.autograd.gradcheck(layer, (x.detach().double().requires_grad_(),))


# --- no whole weight ---------------------------------------------------------------------------


def test_products_never_dequantize_the_whole_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """In float32 and 16-bit, forward and backward run the Rust core's tiled products: the
    backend's whole-tensor dequantize is never called."""
    from nybble.backends import cpu

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the whole weight was dequantized")

    w, _ = weight_args(True)
    layer = nt.Linear4bit(IN, OUT, double_quant=True)
    monkeypatch.setattr(cpu.CpuBackend, "dequantize", refuse)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, IN, dtype=dtype, requires_grad=True)
        a = torch.randn(R, IN, requires_grad=True)
        b = torch.randn(OUT, R, requires_grad=True)
        ops.qlora_linear(x, None, *w, a, b, 1.0, None).float().sum().backward()
        layer(x).float().sum().backward()


# --- errors ----------------------------------------------------------------------------------


def _error(call: Any) -> str:
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


def test_bad_arguments_are_named() -> None:
    w, _ = weight_args()
    codes, absmax, absmax2, offset, shape, bs, cb = w
    x = torch.randn(2, IN)
    assert "x must be float32/float16/bfloat16/float64, got int64" in _error(
        lambda: ops.matmul(torch.zeros(2, IN, dtype=torch.int64), *w)
    )
    assert f"x must have shape [..., {IN}], got [2, 7]" in _error(
        lambda: ops.matmul(torch.randn(2, 7), *w)
    )
    assert "grad must have shape" in _error(lambda: ops.matmul_t(torch.randn(2, IN), *w))
    assert "codes must be uint8" in _error(
        lambda: ops.matmul(x, codes.float(), absmax, absmax2, offset, shape, bs, cb)
    )
    assert "absmax must be float32 [60]" in _error(
        lambda: ops.matmul(x, codes, absmax[:-1], absmax2, offset, shape, bs, cb)
    )
    assert "absmax must be uint8" in _error(
        lambda: ops.matmul(x, codes, absmax, torch.ones(1), 1.0, shape, bs, cb)
    )
    assert "blocksize" in _error(lambda: ops.matmul(x, codes, absmax, None, 0.0, shape, 48, cb))
    assert "codebook must be one of nf4, fp4" in _error(
        lambda: ops.matmul(x, codes, absmax, None, 0.0, shape, bs, "int8")
    )
    assert "shape must be [out_features, in_features]" in _error(
        lambda: ops.matmul(x, codes, absmax, None, 0.0, [OUT * IN], bs, cb)
    )
    assert "x is on meta, the weight on cpu" in _error(
        lambda: ops.matmul(torch.randn(2, IN, device="meta"), *w)
    )
    a, b = torch.randn(R, IN), torch.randn(OUT, R)
    assert f"lora_b must be [{OUT}, {R}]" in _error(
        lambda: ops.qlora_linear(x, None, *w, a, b.T, 1.0, None)
    )
    assert "keep must have x's shape" in _error(
        lambda: ops.qlora_linear(x, torch.ones(3, IN), *w, a, b, 1.0, None)
    )
    assert "bias must be [40]" in _error(
        lambda: ops.qlora_linear(x, None, *w, a, b, 1.0, torch.ones(3))
    )
    assert "dtype must be float32/float16/bfloat16" in _error(
        lambda: ops.dequantize(*w, torch.float64)
    )


def test_non_finite_weights_are_refused_when_quantized() -> None:
    x = torch.randn(4, 64)
    x[2, 5] = float("nan")
    with pytest.raises(nybble.NonFiniteError) as e:
        ops.quantize(x, 64, "nf4")
    assert e.value.index == 2 * 64 + 5


# --- torch.compile ---------------------------------------------------------------------------


def test_compile_fullgraph_inductor() -> None:
    """A module of Linear4bit layers (plain and double-quantized scales) compiles as one graph
    with the default backend (inductor); forward and backward equal eager."""

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nt.Linear4bit(64, 96, double_quant=True)
            self.down = nt.Linear4bit(96, 64, bias=False)

        def forward(self, x: Any) -> Any:
            return self.down(torch.nn.functional.silu(self.up(x)))

    torch.manual_seed(0)
    model = Mlp()
    x = torch.randn(4, 64, requires_grad=True)
    eager = model(x)
    eager.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    compiled = torch.compile(model, fullgraph=True)
    got = compiled(x)
    got.sum().backward()
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, grad, rtol=1e-6, atol=1e-6)
