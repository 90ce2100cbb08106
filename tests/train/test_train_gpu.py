"""The trainer on the GPU (CuPy), marked `gpu`: the fused softmax, SwiGLU, RMSNorm and head
(norm + rotary) kernels against the same math in CuPy (float32 and bfloat16), the per-step
casts of the adapters, the GPU model against the CPU one (float32 close,
bfloat16 within its rounding), determinism, exact resumption from a checkpoint, gradient
checkpointing, and NaN inputs refused. The convergence contracts and the gradient checks run
on the GPU from tests/train/test_train_contracts.py and tests/train/test_train_gradients.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from nybble import LoraConfig
from nybble.train import Trainer, TransformerConfig, corpus_batch
from nybble.train import functional as F

pytestmark = pytest.mark.gpu

DTYPES = {"float32": (np.float32, 1e-5), "bfloat16": (ml_dtypes.bfloat16, 2e-2)}


def cupy() -> Any:
    import cupy

    return cupy


def host(a: Any) -> np.ndarray:
    return np.asarray(cupy().asnumpy(a), dtype=np.float64)


def close(got: Any, want: Any, tol: float) -> None:
    g, w = host(got), host(want)
    scale = max(float(np.abs(w).max()), 1e-30)
    assert float(np.abs(g - w).max()) <= tol * scale


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("t0", [0, 6])
def test_fused_softmax_equals_the_cupy_math(dtype: str, window: int | None, t0: int) -> None:
    from nybble.train import _cuda

    cp = cupy()
    np_dtype, tol = DTYPES[dtype]
    batch, group, positions = 3, 2, 16
    rows, keys = 5 * group, t0 + 5  # a chunk of 5 positions from t0
    rng = np.random.default_rng(0)
    s = rng.standard_normal((batch, rows, keys)) * 3
    dp = rng.standard_normal((batch, rows, keys))
    delta = rng.standard_normal((batch, positions * group)).astype(np.float32)
    fused, plain = _cuda.FusedSoftmax(), F.SoftmaxKernels(cp)
    results = []
    for kernels in (fused, plain):
        sd = cp.asarray(s.astype(np_dtype))
        lse = cp.zeros((batch, positions * group), cp.float32)
        kernels.forward(sd, lse, t0, group, window, 0.3)
        p = sd.copy()
        sb, dpb = cp.asarray(s.astype(np_dtype)), cp.asarray(dp.astype(np_dtype))
        kernels.backward(sb, dpb, lse, cp.asarray(delta), t0, group, window, 0.3)
        results.append((p, lse, sb, dpb))
    for got, want in zip(results[0], results[1], strict=True):
        close(got, want, tol)
    p = host(results[0][0])
    assert np.allclose(p.sum(-1), 1, atol=tol * 4)
    pos = t0 + np.arange(rows) // group
    assert np.all(p[:, np.arange(keys)[None, :] > pos[:, None]] == 0)  # causal


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("window", [None, 3])
def test_fused_softmax_keeps_packed_samples_apart(dtype: str, window: int | None) -> None:
    """With sample starts the fused kernels equal the cupy math, and no row sees a key of an
    earlier sample."""
    from nybble.train import _cuda

    cp = cupy()
    np_dtype, tol = DTYPES[dtype]
    batch, group, positions, t0 = 4, 2, 12, 4
    rows, keys = 6 * group, t0 + 6
    rng = np.random.default_rng(5)
    s = rng.standard_normal((batch, rows, keys)) * 3
    dp = rng.standard_normal((batch, rows, keys))
    delta = rng.standard_normal((batch, positions * group)).astype(np.float32)
    starts = np.zeros((batch, positions), np.int32)
    starts[:, 3:7] = 3
    starts[:, 7:] = 7
    starts[1] = 0  # one batch of a single sample
    fused, plain = _cuda.FusedSoftmax(), F.SoftmaxKernels(cp)
    results = []
    for kernels in (fused, plain):
        sd = cp.asarray(s.astype(np_dtype))
        lse = cp.zeros((batch, positions * group), cp.float32)
        kernels.forward(sd, lse, t0, group, window, 0.3, cp.asarray(starts))
        p = sd.copy()
        sb, dpb = cp.asarray(s.astype(np_dtype)), cp.asarray(dp.astype(np_dtype))
        kernels.backward(
            sb, dpb, lse, cp.asarray(delta), t0, group, window, 0.3, cp.asarray(starts)
        )
        results.append((p, lse, sb, dpb))
    for got, want in zip(results[0], results[1], strict=True):
        close(got, want, tol)
    p = host(results[0][0])
    pos = t0 + np.arange(rows) // group
    first = starts[:, pos]  # [batch, rows]
    assert np.all(p[np.arange(keys)[None, None, :] < first[:, :, None]] == 0)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_fused_heads_take_a_position_per_token(dtype: str) -> None:
    from nybble.train import _cuda

    cp = cupy()
    np_dtype, tol = DTYPES[dtype]
    b, t, heads, d = 2, 9, 4, 32
    cfg = dataclasses.replace(TransformerConfig.tiny(), head_dim=d)
    cos_t, sin_t = F.rope_tables(cfg, t)
    positions = np.array([[0, 1, 2, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    cos, sin = (cp.asarray(a[positions].astype(np_dtype)) for a in (cos_t, sin_t))
    rng = np.random.default_rng(4)
    x = cp.asarray((rng.standard_normal((b, t, heads, d)) * 2).astype(np_dtype))
    dy = cp.asarray(rng.standard_normal((b, t, heads, d)).astype(np_dtype))
    w = cp.asarray(rng.standard_normal(d).astype(np.float32))
    fused, plain = _cuda.FusedHeads(), F.HeadKernels(cp)
    out, _ = fused.forward(x, w, 1e-6, cos, sin, 2)
    out0, rstd0 = plain.forward(x, w, 1e-6, cos, sin, 2)
    close(out, out0, tol)
    dx, _ = fused.backward(dy, x, rstd0, w, cos, sin, False)
    dx0, _ = plain.backward(dy, x, rstd0, w, cos, sin, False)
    close(dx, dx0, tol)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_fused_gate_equals_the_cupy_math(dtype: str) -> None:
    from nybble.train import _cuda

    cp = cupy()
    np_dtype, tol = DTYPES[dtype]
    rng = np.random.default_rng(1)
    g, u, da = (cp.asarray((rng.standard_normal((37, 53)) * 4).astype(np_dtype)) for _ in "gud")
    plain = F.GateKernels(cp)
    close(_cuda.FusedGate().forward(g, u), plain.forward(g, u), tol)
    want = plain.backward(da, g, u)
    got = _cuda.FusedGate().backward(da, g.copy(), u.copy())
    for a, b in zip(got, want, strict=True):
        close(a, b, tol)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("width", [64, 200, 1024])
def test_fused_rms_norm_equals_the_cupy_math(dtype: str, width: int) -> None:
    from nybble.train import _cuda

    cp = cupy()
    np_dtype, tol = DTYPES[dtype]
    rng = np.random.default_rng(2)
    x, dy = (cp.asarray((rng.standard_normal((2, 7, width)) * 3).astype(np_dtype)) for _ in "xd")
    w = cp.asarray(rng.standard_normal(width).astype(np.float32))
    fused, plain = _cuda.FusedNorm(), F.NormKernels(cp)
    y, rstd = fused.forward(x, w, 1e-6)
    y0, rstd0 = plain.forward(x, w, 1e-6)
    assert y.dtype == y0.dtype and rstd.shape == rstd0.shape
    close(y, y0, tol)
    close(rstd, rstd0, 1e-6)
    dx, dw = fused.backward(dy, x, rstd, w, False)
    dx0, _ = plain.backward(dy, x, rstd0, w, False)
    assert dw is None and dx.dtype == dx0.dtype
    close(dx, dx0, tol)
    # a trainable weight's gradient goes to the xp statement, and matches it
    dx1, dw1 = fused.backward(dy, x, rstd0, w, True)
    dx2, dw2 = plain.backward(dy, x, rstd0, w, True)
    close(dx1, dx2, 0)
    close(dw1, dw2, 0)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("group", [1, 2])
def test_fused_heads_equal_the_cupy_math(dtype: str, norm: bool, group: int) -> None:
    from nybble.train import _cuda

    cp = cupy()
    np_dtype, tol = DTYPES[dtype]
    b, t, heads, d = 2, 9, 4, 64
    cfg = dataclasses.replace(TransformerConfig.tiny(), head_dim=d)
    cos, sin = (cp.asarray(a.astype(np_dtype)) for a in F.rope_tables(cfg, t))
    rng = np.random.default_rng(3)
    x = cp.asarray((rng.standard_normal((b, t, heads, d)) * 2).astype(np_dtype))
    dy = cp.asarray(rng.standard_normal((b, t, heads, d)).astype(np_dtype))
    w = cp.asarray(rng.standard_normal(d).astype(np.float32)) if norm else None
    fused, plain = _cuda.FusedHeads(), F.HeadKernels(cp)
    out, rstd = fused.forward(x, w, 1e-6, cos, sin, group)
    out0, rstd0 = plain.forward(x, w, 1e-6, cos, sin, group)
    assert out.shape == out0.shape == (b, heads // group, t, group, d) and out.flags.c_contiguous
    close(out, out0, tol)
    assert (rstd is None) == (rstd0 is None) == (not norm)
    dx, _ = fused.backward(dy, x if norm else None, rstd0, w, cos, sin, False)
    dx0, _ = plain.backward(dy, x if norm else None, rstd0, w, cos, sin, False)
    assert dx.shape == dx0.shape and dx.dtype == dx0.dtype
    close(dx, dx0, tol)
    if dtype == "float32" and not norm:  # no sums: the same operations, bit for bit
        assert bool((out == out0).all()) and bool((dx == dx0).all())


def test_adapter_casts_are_used_for_one_step_only() -> None:
    """The model casts every adapter's A and B once per step; after the step no layer keeps a
    cast (a forward outside the trainer casts its own, current parameters)."""
    t = Trainer(
        TransformerConfig.tiny(),
        LoraConfig(r=4, alpha=8, target_modules="all-linear"),
        device="cuda",
        lr=0.05,
    )
    train(t, 2)
    assert all(p.casts is None for p in t.model.lora_projections.values())
    assert all(layer._casts is None for layer in t.lora_layers().values())
    layer = next(iter(t.lora_layers().values()))
    x = cupy().asarray(np.ones((3, layer.in_features), ml_dtypes.bfloat16))
    want = layer.forward(x)
    stale = (layer.lora_a.astype(x.dtype) * 0, layer.lora_b.astype(x.dtype) * 0)
    layer.use_casts(stale)
    assert not bool((layer.forward(x) == want).all())  # the casts are what forward uses
    layer.set_lora_a(layer.lora_a)  # setting a parameter drops them
    assert bool((layer.forward(x) == want).all())


def train(t: Trainer, n: int, start: int = 0) -> list[float]:
    return [t.train_batch(*corpus_batch(i, 4, 32)) for i in range(start, start + n)]


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_gpu_float32_follows_the_cpu(quant: str | None) -> None:
    lora = LoraConfig(r=8, alpha=16, target_modules="all-linear")
    cpu = train(Trainer(TransformerConfig.tiny(), lora, lr=0.01, quant=quant), 10)
    gpu = Trainer(TransformerConfig.tiny(), lora, lr=0.01, quant=quant, device="cuda")
    assert gpu.compute_dtype == "bfloat16"
    gpu32 = Trainer(
        TransformerConfig.tiny(), lora, lr=0.01, quant=quant, device="cuda", compute_dtype="float32"
    )
    np.testing.assert_allclose(train(gpu32, 10), cpu, rtol=1e-4)
    np.testing.assert_allclose(train(gpu, 10), cpu, rtol=2e-2)


def test_gpu_runs_are_deterministic_and_resume_exactly(tmp_path: Path) -> None:
    lora = LoraConfig(r=8, alpha=16, dropout=0.1, target_modules="all-linear")

    def make() -> Trainer:
        return Trainer(TransformerConfig.tiny(), lora, lr=0.01, quant="nf4", device="cuda")

    a = make()
    first = train(a, 5)
    a.save_checkpoint(tmp_path / "c.safetensors")
    rest = train(a, 5, 5)
    b = make()
    assert train(b, 5) == first
    c = make()
    c.load_checkpoint(tmp_path / "c.safetensors")
    assert train(c, 5, 5) == rest


def test_gpu_gradient_checkpointing_and_fused_kernels_match() -> None:
    cfg = TransformerConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
        qk_norm=True,
        tie_word_embeddings=True,
        model_type="qwen3",
    )
    lora = LoraConfig(r=8, alpha=16, target_modules="all-linear")
    plain = train(Trainer(cfg, lora, lr=0.01, quant="nf4", device="cuda"), 4)
    ckpt = Trainer(cfg, lora, lr=0.01, quant="nf4", device="cuda", gradient_checkpointing=True)
    assert train(ckpt, 4) == plain
    unfused = Trainer(cfg, lora, lr=0.01, quant="nf4", device="cuda")
    unfused.model.use_fused_kernels(False)
    np.testing.assert_allclose(train(unfused, 4), plain, rtol=2e-2)


def test_gpu_attention_chunks_agree() -> None:
    """Many small chunks of queries give the one-chunk result (float32)."""
    lora = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    one = Trainer(TransformerConfig.tiny(), lora, device="cuda", compute_dtype="float32")
    many = Trainer(TransformerConfig.tiny(), lora, device="cuda", compute_dtype="float32")
    many.model.attention_chunk_elements = 200
    many.model.head_chunk_elements = 600
    np.testing.assert_allclose(train(many, 3), train(one, 3), rtol=1e-5)


def test_gpu_non_finite_weights_are_refused() -> None:
    from nybble.errors import NonFiniteError

    t = Trainer(TransformerConfig.tiny(), LoraConfig(r=4, alpha=8), device="cuda")
    layer = next(iter(t.lora_layers().values()))
    layer.lora_a[0, 0] = np.nan
    with pytest.raises(NonFiniteError):
        train(t, 1)
    assert t.step == 0


def test_gpu_packed_rows_and_cache_decoding_follow_the_cpu(tmp_path: Path) -> None:
    """A packed batch's loss and a trained step, and a greedy generation from a pretrained
    checkpoint, on the GPU (float32) as on the CPU; bfloat16 close."""
    from tests.pretrained_fixtures import write_model

    write_model(tmp_path / "m")
    lora = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 200, (2, 24))
    starts = np.zeros((2, 24), np.int64)
    starts[:, 10:] = 10
    starts[1, 17:] = 17
    losses = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
        t = Trainer.from_pretrained(
            tmp_path / "m", lora, quant="nf4", device=device, compute_dtype=dtype, lr=1e-2
        )
        first = t.train_batch(ids[:, :-1], ids[:, 1:], starts[:, :-1])
        after = t.loss(ids[:, :-1], ids[:, 1:], starts[:, :-1])
        frozen = Trainer.from_pretrained(
            tmp_path / "m", None, quant="nf4", device=device, frozen=True, compute_dtype=dtype
        )
        gen = frozen.generate(ids[0, :6].tolist(), max_new_tokens=12).ids
        losses[(device, dtype)] = (first, after, gen)
    cpu, gpu, bf16 = (
        losses[("cpu", "float32")],
        losses[("cuda", "float32")],
        losses[("cuda", "bfloat16")],
    )
    assert gpu[0] == pytest.approx(cpu[0], rel=1e-5) and gpu[1] == pytest.approx(cpu[1], rel=1e-4)
    assert gpu[2] == cpu[2]
    assert bf16[0] == pytest.approx(cpu[0], rel=2e-2) and bf16[1] == pytest.approx(cpu[1], rel=2e-2)


def test_gpu_generation_replays_a_graph_with_the_eager_tokens(tmp_path: Path) -> None:
    """The decode step captured in a CUDA graph gives the tokens of the eager step, with and
    without an adapter, greedy and sampled."""
    from nybble.train.generate import generate
    from tests.pretrained_fixtures import write_model

    write_model(tmp_path / "m")
    lora = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    frozen = Trainer.from_pretrained(tmp_path / "m", None, quant="nf4", device="cuda", frozen=True)
    tuned = Trainer.from_pretrained(tmp_path / "m", lora, quant="nf4", device="cuda", lr=1e-2)
    ids = np.random.default_rng(1).integers(0, 200, (1, 17))
    for _ in range(3):
        tuned.train_batch(ids[:, :-1], ids[:, 1:])
    prompt = ids[0, :9].tolist()
    for t in (frozen, tuned):
        for temperature in (0.0, 0.9):
            eager = generate(t.model, prompt, 20, temperature, 0.95, seed=4, graph=False)
            replayed = generate(t.model, prompt, 20, temperature, 0.95, seed=4)
            assert replayed.graph, replayed.graph_error
            assert replayed.ids == eager.ids
