"""nybble.torch's CUDA route for 16-bit activations (`nybble.torch._fastpath`), as far as the
CPU can check it: the bodies of the ops (the order of their products, transposes, the dropout
mask, the scaling, the bias, the gradients' dtypes) run on CPU tensors over a stand-in for a
weight's launches that dequantizes and multiplies with torch, against float64 references;
every buffer the bodies take from `torch.empty` starts as NaN, so one they read before
writing shows. The kernel arguments as the core's launcher takes them. And `Linear4bit`'s
kept weight (`_kept`): the views `weight_args` makes equal the checked ones, it follows every
change of the layer's tensors, holds none of them alive, and leaves with pickling. The
launches themselves run in tests/torch/test_torch_gpu.py."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import pickle
import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nt = pytest.importorskip("nybble.torch")
fp = pytest.importorskip("nybble.torch._fastpath")

OUT, IN, R = 48, 64, 8


class StandIn:
    """A `FastWeight` on the CPU: W dense, the GEMV and the dequantize as torch products."""

    def __init__(self, dense: torch.Tensor, max_tokens: int = 8) -> None:
        self.dense = dense  # float32 [rows, cols]
        self.rows, self.cols = dense.shape
        self.index = -1
        self.device = torch.device("cpu")
        self.max_tokens = max_tokens
        self.calls: list[str] = []

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        self.calls.append("dequantize")
        return self.dense.to(dtype)

    def gemv(self, x: torch.Tensor, m: int, shape: Any) -> torch.Tensor:
        assert 1 <= m <= self.max_tokens and x.numel() == m * self.cols
        self.calls.append("gemv")
        y = x.reshape(m, self.cols).float() @ self.dense.T
        return y.to(x.dtype).reshape(shape)


class NanTorch:
    """torch as `_fastpath` sees it in these tests: `empty` hands out NaN-filled float
    buffers (torch itself is left alone: other modules, dynamo's tables, keep the real one)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> Any:
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN-filled buffers from `torch.empty` in `_fastpath`; the float32 GEMM from 16-bit
    operands (CUDA only in torch) is a float32 product of the widened operands."""
    monkeypatch.setattr(fp, "torch", NanTorch())
    monkeypatch.setattr(fp, "_MM_FLOAT", lambda a, b, dtype: (a.float() @ b.float()).to(dtype))


def dense() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)) * 0.1


def close(got: torch.Tensor, want: torch.Tensor, dtype: Any, compute: Any = None) -> None:
    """got has `dtype` and want's values to the rounding of `compute` (default: dtype)."""
    assert got.dtype == dtype and got.shape == want.shape
    tol = 2e-2 if (compute or dtype) in (torch.bfloat16, torch.float16) else 1e-5
    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_products_take_the_gemv_up_to_max_tokens_else_the_dequantized_weight(
    dtype: Any, m: int
) -> None:
    w = StandIn(dense())
    x = torch.randn(2, m, IN).to(dtype)
    x2 = x.reshape(-1, IN)
    y = fp._matmul(w, x, x2, True)
    close(y, x.double() @ w.dense.double().T, dtype)
    assert w.calls == (["gemv"] if 2 * m <= 8 else ["dequantize"])
    g = torch.randn(2, m, OUT).to(dtype)
    close(fp._matmul(w, g, g.reshape(-1, OUT), False), g.double() @ w.dense.double(), dtype)
    w.calls.clear()
    close(fp._linear(w, x), x.double() @ w.dense.double().T, dtype)
    assert w.calls == (["gemv"] if 2 * m <= 8 else ["dequantize"])
    one = torch.randn(IN).to(dtype)  # no leading dimensions
    assert fp._linear(w, one).shape == (OUT,)


def reference(x: Any, keep: Any, w: Any, a: Any, b: Any, s: float, bias: Any, dy: Any) -> Any:
    """y and (dx, dA, dB) in float64."""
    x, a, b = (t.detach().double().requires_grad_() for t in (x, a, b))
    xd = x if keep is None else x * keep.double()
    y = x @ w.double().T + s * (xd @ a.T) @ b.T
    if bias is not None:
        y = y + bias.double()
    grads = torch.autograd.grad(y, (x, a, b), dy.double())
    return y.detach(), grads


@pytest.mark.parametrize("m", [1, 5, 8, 9, 33])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize(
    ("dtype", "adapter", "bias_dtype"),
    [
        (torch.bfloat16, torch.float32, None),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float32, torch.float16),
        (torch.bfloat16, torch.float64, None),
        (torch.float16, torch.bfloat16, None),
    ],
)
def test_qlora_forward_and_backward_against_float64(
    m: int, dropout: bool, dtype: Any, adapter: Any, bias_dtype: Any
) -> None:
    gen = torch.Generator().manual_seed(m)
    w = StandIn(dense())
    x = torch.randn(m, 1, IN, generator=gen).to(dtype)
    keep = None
    if dropout:
        keep = (torch.rand(m, 1, IN, generator=gen) > 0.25).to(dtype) / 0.75
    a = (torch.randn(R, IN, generator=gen) * 0.1).to(adapter)
    b = (torch.randn(OUT, R, generator=gen) * 0.1).to(adapter)
    bias = None if bias_dtype is None else torch.randn(OUT, generator=gen).to(bias_dtype)
    s = 1.5
    dy = torch.randn(m, 1, OUT, generator=gen)
    want_y, (want_dx, want_da, want_db) = reference(x, keep, w.dense, a, b, s, bias, dy)

    y = fp._qlora_linear(w, x, x.reshape(-1, IN), keep, a, b, s, bias)
    close(y, want_y, dtype)
    assert w.calls == (["gemv"] if m <= 8 else ["dequantize"])
    # grad_y in float32 (an upstream cast's gradient): cast to x's dtype first
    dx, da, db = fp._qlora_linear_backward(
        w, dy, x, x.reshape(-1, IN), keep, a, b, s
    )  # fmt: skip
    close(dx, want_dx, dtype)
    close(da, want_da, adapter, dtype)  # each gradient in its adapter's dtype
    close(db, want_db, adapter, dtype)


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("alpha", [1.0, 0.5, 3.0])
def test_product_in_each_gradient_dtype(out: Any, alpha: float) -> None:
    a = torch.randn(7, 5).to(torch.bfloat16)
    b = torch.randn(5, 3).to(torch.bfloat16)
    got = fp._product(a, b, out, alpha)
    close(got, alpha * (a.double() @ b.double()), out, torch.bfloat16)


def test_kernel_arguments_as_the_core_takes_them() -> None:
    class Array:  # a CuPy array as the launcher sees it: its address
        class data:
            ptr = 0x7F00_0000_1000

    values = (Array(), np.int64(-3), np.int32(-1), np.uint32(7), np.float32(-0.375))
    slots = fp._slots(values)
    want = [
        int.from_bytes(bytes(c).ljust(8, b"\0"), "little")
        for c in (
            ctypes.c_void_p(Array.data.ptr),
            ctypes.c_int64(-3),
            ctypes.c_int32(-1),
            ctypes.c_uint32(7),
            ctypes.c_float(-0.375),
        )
    ]  # what kernels.PreparedLaunch.call_setting makes of its ctypes values
    assert slots == want
    assert all(0 <= v < 2**64 for v in slots)


def test_the_argument_positions_are_the_backends() -> None:
    from nybble.backends.cuda import launch

    assert fp._DEQUANT_OUT == launch.DequantizeWeight._OUT
    assert (fp._GEMV_X, fp._GEMV_Y) == (launch.GemvWeight._X, launch.GemvWeight._TC_Y)


def test_a_weights_launches_carry_the_kernels_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """FastWeight over stand-ins of the backend's prepared weight and of the core's launcher:
    the slots, grids and varying arguments of the dequantize and GEMV launches, and what a
    call gives them (torch's stream, the tensors' addresses; unaligned tokens copied)."""
    made: list[Any] = []

    class Launch:
        def __init__(self, *args: Any) -> None:
            self.function, self.grid, self.block, self.shared, self.slots = args[:5]
            self.varying, self.programmatic = args[5:]
            self.calls: list[Any] = []
            made.append(self)

        def __call__(self, stream: int, *values: int, grid: Any = None) -> None:
            self.calls.append((stream, values))

    class Array:  # a CuPy array, as the slots read it
        def __init__(self, ptr: int) -> None:
            self.data = SimpleNamespace(ptr=ptr)

    monkeypatch.setattr(fp._core, "KernelLaunch", Launch, raising=False)
    monkeypatch.setattr(fp, "_stream", lambda index: 0x5EED)
    codes, absmax, table = Array(0x1000), Array(0x2000), Array(0x3000)
    scales = (absmax, table, table, table, np.float32(0), np.int32(0))
    per_block = {"float32": 1024, "float16": 8192, "bfloat16": 8192}
    facts = SimpleNamespace(threads=256, tc_threads=256, dequant_per_block=per_block.__getitem__)
    functions: dict[str, Any] = {}

    def function(name: str, shared: int = 0) -> Any:
        return functions.setdefault(name, SimpleNamespace(ptr=0x100 + len(functions)))

    module = SimpleNamespace(facts=facts, function=function)
    gemv = SimpleNamespace(
        module=module,
        tc_names={"float16": "gemv_tc_f16_g64", "bfloat16": "gemv_tc_bf16_g64"},
        smem=99000,
        codes=codes,
        scales=scales,
        values=table,
        dims=(np.int32(OUT), np.int32(IN)),
        log2_bs=np.int32(6),
        programmatic=True,
        tc_blocks=lambda kernel: 7,
    )
    dequantize = SimpleNamespace(
        module=module, codes=codes, scales=scales, values=table, log2_bs=np.int32(6)
    )
    prepared = SimpleNamespace(dequantize=dequantize, gemv=lambda: gemv)
    cupy = SimpleNamespace(cuda=SimpleNamespace(Device=lambda index: contextlib.nullcontext()))
    fw = fp.FastWeight(None, prepared, (OUT, IN), 0, 8, cupy)
    assert fw.max_tokens == 8 and fw.gemv_weight is gemv
    fw.device = torch.device("cpu")  # where the stand-in's buffers go

    out = fw.dequantize(torch.bfloat16)
    d = made[-1]
    assert out.shape == (OUT, IN) and out.dtype == torch.bfloat16
    assert d.function == functions["dequant4_split_bf16"].ptr
    assert (d.grid, d.block, d.shared, d.programmatic) == (-(-OUT * IN // 8192), 256, 0, False)
    total = OUT * IN
    assert d.slots == [0x1000, 0x2000, 0x3000, 0x3000, 0x3000, 0, 0, 0x3000, 0, total, 6, 0x1000]
    assert d.varying == [11] and d.calls == [(0x5EED, (out.data_ptr(),))]
    fw.dequantize(torch.bfloat16)
    assert made[-1] is d and len(d.calls) == 2  # made once

    x = torch.zeros(3, IN, dtype=torch.float16)
    y = fw.gemv(x, 3, (3, OUT))
    g = made[-1]
    assert y.shape == (3, OUT) and y.dtype == torch.float16
    assert g.function == functions["gemv_tc_f16_g64"].ptr
    assert (g.grid, g.block, g.shared, g.programmatic) == (7, 256, 99000, True)
    assert g.slots == [
        0x1000, 0x1000, 0x2000, 0x3000, 0x3000, 0x3000, 0, 0, 0x3000, OUT, IN, 3, 6, 0x1000
    ]  # fmt: skip
    assert g.varying == [0, 13] and g.calls == [(0x5EED, (x.data_ptr(), y.data_ptr()))]
    unaligned = torch.zeros(3 * IN + 1, dtype=torch.float16)[1:].view(3, IN)
    fw.gemv(unaligned, 3, (3, OUT))
    sent = g.calls[-1][1][0]
    assert made[-1] is g and sent != unaligned.data_ptr() and sent % 16 == 0


def test_cpu_tensors_never_take_the_direct_call() -> None:
    x = torch.randn(2, IN, dtype=torch.bfloat16)
    assert not fp.eager(x)
    layer = nt.Linear4bit(IN, OUT, dtype=torch.bfloat16)
    assert layer._eager(x) is None
    assert layer._kept().fast is False  # the weight is on the CPU: no launches to make


# --- the autograd route of eager training steps ----------------------------------------------


@pytest.fixture
def inline_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_run` calls its body at once (the CPU has no device to enter)."""
    monkeypatch.setattr(fp, "_run", lambda index, dtype, body, *args: body(*args))


def leaves(*ts: Any) -> list[Any]:
    return [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in ts]


@pytest.mark.usefixtures("inline_run")
@pytest.mark.parametrize("m", [1, 9])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("bias_grad", [False, True])
@pytest.mark.parametrize("frozen", [None, "x", "a", "b"])
def test_qlora_function_gives_the_bodies_results_and_only_the_gradients_asked_for(
    m: int, dropout: bool, bias_grad: bool, frozen: Any
) -> None:
    """`QLoraLinear` returns the op bodies' y, and their dx, dA, dB (bit for bit: the same
    bodies), dbias as the op's backward makes it, None for what needs no gradient."""
    gen = torch.Generator().manual_seed(m)
    w = StandIn(dense())
    dtype = torch.bfloat16
    x = torch.randn(2, m, IN, generator=gen).to(dtype).requires_grad_(frozen != "x")
    keep = (torch.rand(2, m, IN, generator=gen) > 0.25).to(dtype) / 0.75 if dropout else None
    a = (torch.randn(R, IN, generator=gen) * 0.1).requires_grad_(frozen != "a")
    b = (torch.randn(OUT, R, generator=gen) * 0.1).requires_grad_(frozen != "b")
    bias = torch.randn(OUT, generator=gen).requires_grad_(bias_grad)
    dy = torch.randn(2, m, OUT, generator=gen).to(dtype)
    assert fp.fits(w, x, keep, a, b, bias)

    y = fp.QLoraLinear.apply(x, keep, a, b, bias, w, 1.5, ())
    want_y = fp._qlora_linear(w, x, x.reshape(-1, IN), keep, a, b, 1.5, bias)
    assert torch.equal(y, want_y)
    y.backward(dy)
    dx, da, db = fp._qlora_linear_backward(w, dy, x, x.reshape(-1, IN), keep, a, b, 1.5)
    for t, want in ((x, dx), (a, da), (b, db)):
        assert (t.grad is None) if not t.requires_grad else torch.equal(t.grad, want)
    if bias_grad:
        assert torch.equal(bias.grad, dy.reshape(-1, OUT).sum(0).to(bias.dtype))
    else:
        assert bias.grad is None


@pytest.mark.usefixtures("inline_run")
def test_matmul_function_gives_the_bodies_results() -> None:
    w = StandIn(dense())
    x = torch.randn(3, 5, IN).to(torch.float16).requires_grad_()
    dy = torch.randn(3, 5, OUT).to(torch.float16)
    y = fp.Matmul.apply(x, w, ())
    assert torch.equal(y, fp._matmul(w, x, x.reshape(-1, IN), True))
    y.backward(dy)
    assert torch.equal(x.grad, fp._matmul(w, dy, dy.reshape(-1, OUT), False))


@pytest.mark.usefixtures("inline_run")
def test_the_functions_under_gradient_checkpointing() -> None:
    """Recomputed in the backward (non-reentrant checkpointing), the same gradients."""
    from torch.utils.checkpoint import checkpoint

    w = StandIn(dense())
    x0 = torch.randn(4, IN).to(torch.bfloat16)
    a0, b0 = torch.randn(R, IN) * 0.1, torch.randn(OUT, R) * 0.1

    def block(x: Any, a: Any, b: Any) -> Any:
        h = fp.QLoraLinear.apply(x, None, a, b, None, w, 2.0, ())
        g = fp.Matmul.apply(x * 1.5, w, ())
        return h.float().square().sum() + g.float().square().sum()

    grads = []
    for ckpt in (False, True):
        x, a, b = leaves(x0.requires_grad_(), a0.requires_grad_(), b0.requires_grad_())
        loss = checkpoint(block, x, a, b, use_reentrant=False) if ckpt else block(x, a, b)
        loss.backward()
        grads.append([x.grad, a.grad, b.grad])
    for got, want in zip(*grads, strict=True):
        assert torch.equal(got, want)


def test_fits_refuses_what_the_op_must_check() -> None:
    """Each argument the op would refuse (or that the route does not take) fails `fits`, so
    that the op's checks name it."""
    w = StandIn(dense())
    x = torch.randn(3, IN).to(torch.bfloat16)
    a, b = torch.randn(R, IN), torch.randn(OUT, R)
    keep, bias = torch.ones_like(x), torch.randn(OUT)
    assert fp.fits(w, x, keep, a, b, bias) and fp.fits(w, x, None, a, b, None)
    bad = [
        (torch.randn(3, IN + 1).to(torch.bfloat16), keep, a, b, bias),  # x's width
        (x, keep, torch.randn(R, IN + 2), b, bias),  # A's width
        (x, keep, a, torch.randn(OUT + 1, R), bias),  # B's rows
        (x, keep, a, torch.randn(OUT, R + 1), bias),  # B's rank
        (x, keep, torch.randn(R, IN, 1), b, bias),  # A not 2-D
        (x, keep, a.to(torch.int32), b, bias),  # A not float
        (x, keep, a, b.to(torch.int64), bias),  # B not float
        (x, keep[:2], a, b, bias),  # the mask's shape
        (x, keep.to(torch.uint8), a, b, bias),  # the mask's dtype
        (x, keep, a, b, torch.randn(OUT + 1)),  # the bias's shape
        (x, keep, a, b, torch.randn(1, OUT)),  # the bias 2-D
    ]
    for args in bad:
        assert not fp.fits(w, *args)
    w.index = 0  # a weight on another device than the tensors
    assert not fp.fits(w, x, keep, a, b, bias)


@pytest.mark.usefixtures("inline_run")
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_peft_layer_takes_the_function_route_with_the_ops_arguments(
    dropout: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PEFT LoRA layer over a Linear4bit, with the route allowed on the CPU (`eager` true, the
    weight's launches a stand-in over its dequantized W): its y and gradients are the op's
    (the CPU's core; the stand-in multiplies with torch: equal to rounding), so the arguments
    reach the function in the op's order (x, mask, A, B, bias, scaling)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nt.Linear4bit(IN, OUT, bias=True, compute_dtype=torch.bfloat16)
    model = torch.nn.Sequential(base)
    config = nt.register_lora(
        peft.LoraConfig(r=R, lora_alpha=3 * R, lora_dropout=dropout, target_modules=["0"])
    )
    model = peft.get_peft_model(model, config)
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.1)
    x0 = torch.randn(2, 5, IN)
    dy = torch.randn(2, 5, OUT)

    def run() -> list[Any]:
        torch.manual_seed(1)  # the same dropout mask
        x = x0.clone().requires_grad_()
        y = model(x)
        y.backward(dy)
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        out = [y.detach(), x.grad, a.grad.clone(), b.grad.clone()]
        a.grad = b.grad = None
        return out

    want = run()
    stand_in = StandIn(base.dequantize(torch.float32))
    monkeypatch.setattr(fp, "eager", lambda x: True)
    monkeypatch.setattr(nt.Linear4bit, "_fast_weight", lambda self: stand_in)
    got = run()
    assert stand_in.calls  # the function route ran
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        scale = float(e.abs().max())
        torch.testing.assert_close(g.double(), e.double(), rtol=3e-2, atol=3e-2 * scale)


# --- Linear4bit's kept weight ----------------------------------------------------------------


def same_args(got: tuple, want: tuple) -> None:
    assert len(got) == len(want) == 7
    for g, e in zip(got, want, strict=True):
        if isinstance(e, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == e.dtype and g.shape == e.shape
            assert g.data_ptr() == e.data_ptr() and torch.equal(g, e)
        else:
            assert g == e


@pytest.mark.parametrize("dq", [False, True])
def test_weight_args_from_the_kept_weight_equal_the_checked_ones(dq: bool) -> None:
    layer = nt.Linear4bit(IN, OUT, double_quant=dq)
    first = layer.weight_args()
    assert layer.__dict__["_nybble_kept"].plain
    same_args(layer.weight_args(), layer._weight_args())
    same_args(first, layer._weight_args())
    x = torch.randn(3, IN)
    torch.testing.assert_close(
        layer(x), torch.ops.nybble.matmul(x, *layer._weight_args()) + layer.bias
    )


def test_the_kept_weight_follows_every_change_of_the_layers_tensors() -> None:
    torch.manual_seed(0)
    layer = nt.Linear4bit(IN, OUT, double_quant=True)
    kept = layer._kept()
    assert layer._kept() is kept
    layer.quantize_(torch.randn(OUT, IN))  # new tensors
    assert layer._kept() is not kept
    same_args(layer.weight_args(), layer._weight_args())
    kept = layer._kept()
    with torch.no_grad():  # the same parameter over other memory
        layer.weight.data = layer.weight.data.clone()
    assert layer._kept() is not kept
    same_args(layer.weight_args(), layer._weight_args())
    kept = layer._kept()
    layer.absmax = layer.absmax.clone()  # a buffer replaced
    assert layer._kept() is not kept
    same_args(layer.weight_args(), layer._weight_args())
    layer.to(torch.bfloat16)  # a module move or cast forgets it
    assert "_nybble_kept" not in layer.__dict__
    same_args(layer.weight_args(), layer._weight_args())
    layer.set_quant_storage(torch.bfloat16)  # codes seen through another dtype
    assert not layer._kept().plain
    same_args(layer.weight_args(), layer._weight_args())
    with torch.no_grad():  # a cast of the stored codes is still refused
        layer.weight.data = layer.weight.data.float()
    with pytest.raises(nt.StorageDtypeError):
        layer.weight_args()
    layer = nt.Linear4bit(IN, OUT).pack_()  # packed: read per call, nothing kept
    assert layer._kept() is None
    layer.unpack_()
    same_args(layer.weight_args(), layer._weight_args())


def test_the_kept_weight_holds_no_tensor_alive_and_is_not_pickled() -> None:
    layer = nt.Linear4bit(IN, OUT, double_quant=True)
    layer(torch.randn(2, IN))
    old = weakref.ref(layer.weight)
    old_scales = weakref.ref(layer.absmax)
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
    layer.absmax = layer.absmax.clone()
    gc.collect()
    assert old() is None and old_scales() is None
    layer(torch.randn(2, IN))
    assert "_nybble_kept" in layer.__dict__
    twin = copy.deepcopy(layer)
    assert "_nybble_kept" not in twin.__dict__
    loaded = pickle.loads(pickle.dumps(layer))
    assert "_nybble_kept" not in loaded.__dict__
    x = torch.randn(2, IN)
    torch.testing.assert_close(twin(x), layer(x))
    torch.testing.assert_close(loaded(x), layer(x))


def test_a_meta_placeholder_is_refused_and_never_kept() -> None:
    layer = nt.Linear4bit(IN, OUT, device="meta")
    with pytest.raises(ValueError, match="not loaded yet"):
        layer.weight_args()
    assert "_nybble_kept" not in layer.__dict__
