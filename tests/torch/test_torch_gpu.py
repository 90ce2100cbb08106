"""nybble.torch on CUDA (marked `gpu`: skipped without a GPU and CuPy, or without a CUDA
build of torch): the operators against the CPU's (dequantize and quantize bit for bit, the
products within their dtype's rounding) through the fused GEMV (up to 8 tokens) and the
dequantize + cuBLAS path, the 16-bit route (`nybble.torch._fastpath`) against the backend
route and Linear4bit's direct call against the op, opcheck on CUDA, launches on torch's
current stream (a side stream too) with temporaries from torch's allocator (CuPy's pool
does not grow), capture in a CUDA graph and replay, torch.compile, a PEFT QLoRA step on a
tiny Llama, and, where bitsandbytes is importable, parity with its Linear4bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import nybble

torch = pytest.importorskip("torch")
nt = pytest.importorskip("nybble.torch")
cp = pytest.importorskip("cupy")
ops = torch.ops.nybble

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch"),
    pytest.mark.filterwarnings(
        "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
    ),
]

CUDA = "cuda"
OUT, IN, R = 384, 512, 16


def weight_args(dq: bool, device: str = CUDA, shape: tuple[int, int] = (OUT, IN)) -> tuple:
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    q = nybble.quantize(w, double_quant=dq)

    def t(a: Any) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    if q.nested is None:
        args = (t(q.codes), t(q.absmax), None, 0.0)
    else:
        args = (t(q.codes), t(q.nested.codes), t(q.nested.absmax2), q.nested.offset)
    return (*args, list(shape), 64, "nf4"), q


def on(device: str, args: tuple) -> tuple:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOKENS = [1, 3, 8, 9, 64]  # the fused GEMV takes up to 8 tokens, cuBLAS the rest


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_and_quantize_equal_the_cpu_bit_for_bit(dq: bool, dtype: Any) -> None:
    w, _ = weight_args(dq)
    got = ops.dequantize(*w, dtype)
    want = ops.dequantize(*on("cpu", w), dtype)
    assert got.is_cuda and torch.equal(got.cpu(), want)
    x = torch.randn(7, 131, dtype=dtype) * 3
    codes, absmax = ops.quantize(x.to(CUDA), 64, "nf4")
    want_codes, want_absmax = ops.quantize(x, 64, "nf4")
    assert torch.equal(codes.cpu(), want_codes) and torch.equal(absmax.cpu(), want_absmax)


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", TOKENS)
def test_products_match_the_dequantized_weight(dq: bool, dtype: Any, m: int) -> None:
    w, q = weight_args(dq)
    wd = torch.from_numpy(q.dequantize("float32")).to(CUDA).double()
    x = torch.randn(m, IN, dtype=dtype, device=CUDA)
    g = torch.randn(m, OUT, dtype=dtype, device=CUDA)
    y, gx = ops.matmul(x, *w), ops.matmul_t(g, *w)
    assert y.dtype == dtype and gx.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = float((x.double() @ wd.T).abs().max())
    torch.testing.assert_close(y.double(), x.double() @ wd.T, rtol=tol, atol=tol * scale)
    scale = float((g.double() @ wd).abs().max())
    torch.testing.assert_close(gx.double(), g.double() @ wd, rtol=tol, atol=tol * scale)


#: opcheck compares eager calls with traced ones: cuBLAS may reduce in another order from one
#: call to the next (split-K), so the products agree to their rounding, not bit for bit.
TOL = {"atol": 1e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_on_cuda(dq: bool, dtype: Any) -> None:
    w, _ = weight_args(dq)
    for m in (2, 20):
        x = torch.randn(m, IN, dtype=dtype, device=CUDA, requires_grad=True)
        torch.library.opcheck(ops.matmul.default, (x, *w), **TOL)
        torch.library.opcheck(
            ops.matmul_t.default, (torch.randn(m, OUT, dtype=dtype, device=CUDA), *w), **TOL
        )
        keep = torch.nn.functional.dropout(torch.ones(m, IN, dtype=dtype, device=CUDA), 0.1)
        a = torch.randn(R, IN, device=CUDA, requires_grad=True)
        b = torch.randn(OUT, R, device=CUDA, requires_grad=True)
        bias = torch.randn(OUT, dtype=dtype, device=CUDA)
        torch.library.opcheck(ops.qlora_linear.default, (x, keep, *w, a, b, 2.0, bias), **TOL)
        dy = torch.randn(m, OUT, dtype=dtype, device=CUDA)
        args = (dy, x.detach(), keep, *w, a.detach(), b.detach(), 2.0)
        torch.library.opcheck(ops.qlora_linear_backward.default, args, **TOL)
    torch.library.opcheck(ops.dequantize.default, (*w, dtype))
    torch.library.opcheck(
        ops.quantize.default, (torch.randn(5, 200, dtype=dtype, device=CUDA), 64, "nf4")
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [4, 300])
def test_qlora_linear_matches_torch(dtype: Any, m: int) -> None:
    w, q = weight_args(True)
    wd = torch.from_numpy(q.dequantize("float32")).to(CUDA)
    x = torch.randn(m, IN, device=CUDA, dtype=dtype, requires_grad=True)
    keep = torch.nn.functional.dropout(torch.ones(m, IN, device=CUDA, dtype=dtype), 0.2)
    a = (torch.randn(R, IN, device=CUDA) * 0.05).requires_grad_()
    b = (torch.randn(OUT, R, device=CUDA) * 0.05).requires_grad_()
    y = ops.qlora_linear(x, keep, *w, a, b, 2.0, None)
    twins = [t.detach().float().clone().requires_grad_() for t in (x, a, b)]
    want = twins[0] @ wd.T + 2.0 * ((twins[0] * keep.float()) @ twins[1].T) @ twins[2].T
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(
        y.float(), want, rtol=tol, atol=tol * float(want.detach().abs().max())
    )
    dy = torch.randn_like(want)
    y.backward(dy.to(dtype))
    want.backward(dy)
    for got, ref in zip((x, a, b), twins, strict=True):
        scale = float(ref.grad.abs().max())
        torch.testing.assert_close(got.grad.float(), ref.grad, rtol=tol, atol=tol * scale)


def backend_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops on the backend route (CuPy views, the backend's launches and cuBLAS)."""
    from nybble.torch import _fastpath

    monkeypatch.setattr(_fastpath, "_unavailable", True)
    monkeypatch.setattr(_fastpath, "eager", lambda x: False)


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_the_16bit_route_equals_the_backend_route(
    dq: bool, dtype: Any, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast route's products (the same kernels, torch's GEMMs for cuBLAS through CuPy)
    against the backend route: the GEMV and the dequantized weight bit for bit, the rest
    to the rounding of the activations' dtype."""
    from nybble.torch import _fastpath

    w, _ = weight_args(dq)
    assert _fastpath.prepared(nt._ops.weight("matmul", *w)) is not None
    gen = torch.Generator(device=CUDA).manual_seed(m)
    x = torch.randn(m, IN, dtype=dtype, device=CUDA, generator=gen, requires_grad=True)
    g = torch.randn(m, OUT, dtype=dtype, device=CUDA, generator=gen)
    keep = torch.nn.functional.dropout(torch.ones(m, IN, dtype=dtype, device=CUDA), 0.1)
    a = (torch.randn(R, IN, device=CUDA, generator=gen) * 0.05).requires_grad_()
    b = (torch.randn(OUT, R, device=CUDA, generator=gen) * 0.05).requires_grad_()
    bias = torch.randn(OUT, dtype=dtype, device=CUDA, generator=gen)

    def run() -> list[Any]:
        y = ops.qlora_linear(x, keep, *w, a, b, 2.0, bias)
        grads = torch.autograd.grad(y, (x, a, b), g)
        with torch.no_grad():
            plain = [ops.matmul(x, *w), ops.matmul_t(g, *w), ops.dequantize(*w, dtype)]
        return [*plain, y.detach(), *grads]

    fast = run()
    with monkeypatch.context() as patch:
        backend_route(patch)
        slow = run()
    assert torch.equal(fast[2], slow[2])  # the dequantize kernel
    if m <= 8:
        assert torch.equal(fast[0], slow[0])  # the fused GEMV
    for got, want in zip(fast, slow, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2 * scale)


def test_linear4bit_calls_its_kernels_directly_where_autograd_does_not_follow() -> None:
    """Without autograd to follow, a 16-bit CUDA call of Linear4bit skips the op's dispatch:
    the same values as the op; with x requiring grad it goes through `_fastpath.Matmul`."""
    _, q = weight_args(True)
    layer = nt.Linear4bit.from_nf4(q, bias=torch.randn(OUT), device=CUDA)
    for m in (1, 3, 40):
        x = torch.randn(2, m, IN, device=CUDA, dtype=torch.bfloat16)
        with torch.no_grad():
            got = layer(x)
            want = ops.matmul(x, *layer.weight_args()) + layer.bias.to(x.dtype)
        assert got.shape == (2, m, OUT) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        xg = x.clone().requires_grad_()
        y = layer(xg)
        assert y.grad_fn is not None
        torch.testing.assert_close(y.detach(), want, rtol=1e-2, atol=1e-2)
    assert layer._kept().fast is not False


@pytest.mark.parametrize("m", [1, 40])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_the_eager_autograd_route_equals_the_ops_bit_for_bit(
    m: int, dropout: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PEFT QLoRA layer (and a Linear4bit under autograd) through `_fastpath.QLoraLinear` /
    `Matmul` against the same calls through nybble's ops: y and every gradient equal."""
    peft = pytest.importorskip("peft")
    from nybble.torch import _fastpath

    _, q = weight_args(True)
    gen = torch.Generator().manual_seed(m)
    bias = torch.randn(OUT, generator=gen)
    base = nt.Linear4bit.from_nf4(q, bias=bias, device=CUDA, compute_dtype=torch.bfloat16)
    plain = nt.Linear4bit.from_nf4(q, device=CUDA, compute_dtype=torch.bfloat16)
    config = nt.register_lora(
        peft.LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=dropout, target_modules=["0"])
    )
    model = peft.get_peft_model(torch.nn.Sequential(base), config)
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.05)
    base.bias.requires_grad_(True)  # PEFT freezes it: its gradient is checked too
    x0 = torch.randn(2, m, IN, generator=gen).to(CUDA)
    dy = torch.randn(2, m, OUT, generator=gen).to(CUDA)

    def run() -> list[Any]:
        torch.manual_seed(3)  # the same dropout mask
        x = x0.clone().requires_grad_()
        y = model(x)
        z = plain(x.bfloat16())
        torch.autograd.backward((y, z), (dy, dy.bfloat16()))
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        out = [y.detach(), z.detach(), x.grad, a.grad, b.grad, base.bias.grad]
        a.grad = b.grad = base.bias.grad = None
        return out

    calls = []
    apply = _fastpath.QLoraLinear.apply
    monkeypatch.setattr(_fastpath.QLoraLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    eager = run()
    assert calls  # the function route ran
    monkeypatch.setattr(_fastpath, "eager", lambda x: False)
    through_ops = run()
    assert len(calls) == 1
    for got, want in zip(eager, through_ops, strict=True):
        assert got is not None and torch.equal(got, want)


def test_autocast_to_another_dtype_leaves_the_products_in_the_activations_dtype() -> None:
    w, _ = weight_args(True)
    x = torch.randn(20, IN, device=CUDA, dtype=torch.bfloat16)
    a = torch.randn(R, IN, device=CUDA) * 0.05
    b = torch.randn(OUT, R, device=CUDA) * 0.05
    want = ops.qlora_linear(x, None, *w, a, b, 2.0, None)
    with torch.autocast("cuda", dtype=torch.float16):
        got = ops.qlora_linear(x, None, *w, a, b, 2.0, None)
    assert got.dtype == torch.bfloat16  # not recast to float16 inside the op
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_runs_on_torchs_current_stream_with_torchs_memory() -> None:
    """On a side stream the launches follow torch's stream order, and repeated calls take
    no memory from CuPy's own pool (temporaries come from torch's caching allocator)."""
    _, q = weight_args(True)
    layer = nt.Linear4bit.from_nf4(q, device=CUDA)
    x = torch.randn(300, IN, device=CUDA, dtype=torch.bfloat16)
    want = layer(x)
    pool = cp.get_default_memory_pool()
    before = pool.total_bytes()
    want_small = layer(x[:2])  # the fused GEMV: its own rounding, not cuBLAS'
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):
            got = layer(x)
            small = layer(x[:2])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(small, want_small)
    assert pool.total_bytes() == before


@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.filterwarnings("ignore:The AccumulateGrad node's stream does not match:UserWarning")
def test_cuda_graph_capture_and_replay(dq: bool) -> None:
    """A decode-sized forward (fused GEMV) and a training-sized forward and backward of the
    fused QLoRA operator, captured by torch.cuda.graph after a warm-up and replayed over new
    inputs: equal to eager. Nothing inside may wait for the device."""
    _, q = weight_args(dq)
    layer = nt.Linear4bit.from_nf4(q, bias=torch.randn(OUT), device=CUDA)
    a = (torch.randn(R, IN, device=CUDA) * 0.05).requires_grad_()
    b = (torch.randn(OUT, R, device=CUDA) * 0.05).requires_grad_()
    small = torch.randn(1, IN, device=CUDA, dtype=torch.bfloat16)
    big = torch.randn(256, IN, device=CUDA, dtype=torch.bfloat16, requires_grad=True)

    def work() -> tuple[Any, ...]:
        y1 = layer(small)
        y2 = ops.qlora_linear(big, None, *layer.weight_args(), a, b, 2.0, layer.bias)
        ga, gb, gx = torch.autograd.grad(y2.float().sum(), (a, b, big))
        return y1, y2, ga, gb, gx

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = work()
    for _ in range(2):
        small.copy_(torch.randn_like(small))
        with torch.no_grad():
            big.copy_(torch.randn_like(big))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, work(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


# torch warns of an empty CUDA graph under reduce-overhead here (a partition of the compiled
# graph with no kernel of its own, seen with torch 2.11); the outputs are checked against
# eager over new inputs each call.
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
def test_compile_on_cuda() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        nt.Linear4bit(IN, OUT, double_quant=True), torch.nn.GELU(), nt.Linear4bit(OUT, IN)
    ).to(CUDA)
    for m in (2, 100):
        x = torch.randn(m, IN, device=CUDA, dtype=torch.bfloat16)
        want = model(x)
        got = torch.compile(model, fullgraph=True)(x)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    # reduce-overhead: CUDA graphs (cudagraph trees) replayed over new inputs each call
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(1, IN, device=CUDA, dtype=torch.bfloat16)
            got = compiled(x).clone()
            torch.testing.assert_close(got, model(x), rtol=1e-2, atol=1e-2)


def test_a_peft_qlora_step_on_a_tiny_llama(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        quantization_config=nt.NybbleConfig(double_quant=True, compute_dtype=torch.bfloat16),
        dtype=torch.bfloat16,
        device_map=CUDA,
    )
    assert all(m.weight.is_cuda for m in model.modules() if isinstance(m, nt.Linear4bit))
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, nt.register_lora(lora))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 1000, (2, 64), device=CUDA)
    losses = []
    for _ in range(6):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        out = model.generate(ids[:1, :8], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 16)


def test_parity_with_bitsandbytes_linear4bit() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    linear = torch.nn.Linear(IN, OUT, dtype=torch.bfloat16)
    theirs = bnb.nn.Linear4bit(
        IN, OUT, compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4"
    )
    theirs.load_state_dict(linear.state_dict())
    theirs = theirs.to(CUDA)
    x = torch.randn(5, IN, device=CUDA, dtype=torch.bfloat16)
    with torch.no_grad():
        want = theirs(x)
        want_small = theirs(x[:1])
    deq = bnb.functional.dequantize_4bit(theirs.weight.data, theirs.weight.quant_state)
    ours = nt.Linear4bit.from_bnb(theirs)
    assert ours.weight.is_cuda
    assert torch.equal(ours.dequantize(torch.bfloat16), deq.to(torch.bfloat16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(ours(x[:1]), want_small, rtol=2e-2, atol=2e-2)
    # nybble's own quantization of the same weight, against bitsandbytes' CUDA codes: equal
    # but for the cases docs/bitsandbytes.md lists (none on normal data at this size).
    mine = nt.Linear4bit.from_linear(linear.to(CUDA), double_quant=True)
    same = mine.state_dict()["weight"] == theirs.state_dict()["weight"]
    assert float(same.float().mean()) >= 1 - 1e-4
