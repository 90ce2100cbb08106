"""Every backward of the trainer's parts against finite differences, in float64, on the CPU
and (marked `gpu`) on CuPy arrays: embedding, RMSNorm, rotary positions, causal grouped-query
attention (chunked, with and without a sliding window), SwiGLU, the LM head with
cross-entropy, a whole decoder with every weight trainable (with and without gradient
checkpointing, qk-norm, tied embeddings), and the LoRA / QLoRA gradients inside the model
against the dense model's weight gradient. A naive statement of HF Llama's forward checks the
model's loss itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from nybble import LoraConfig
from nybble.backends import Backend, get
from nybble.train import DecoderLM, TransformerConfig
from nybble.train import functional as F


class Device:
    """The arrays of one device: `put` moves a host array there, `host` brings one back."""

    def __init__(self, name: str) -> None:
        self.backend: Backend = get(name)
        self.xp = self.backend.xp
        self.softmax = F.SoftmaxKernels(self.xp)
        self.gate = F.GateKernels(self.xp)

    def put(self, a: Any) -> Any:
        return self.backend.from_host(np.asarray(a))

    def host(self, a: Any) -> np.ndarray:
        return np.asarray(self.backend.to_host(a))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def dev(request: pytest.FixtureRequest) -> Device:
    return Device(request.param)


def numeric_grad(
    f: Callable[[], float], x: Any, points: int = 12, seed: int = 0, eps: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """Central differences of f at `points` random flat indices of x (a C-contiguous array of
    either device, changed in place and restored); returns (indices, derivatives)."""
    rng = np.random.default_rng(seed)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=min(points, flat.size), replace=False)
    out = np.empty(len(idx))
    for j, i in enumerate(idx):
        old = float(flat[i])
        flat[i] = old + eps
        up = f()
        flat[i] = old - eps
        down = f()
        flat[i] = old
        out[j] = (up - down) / (2 * eps)
    return idx, out


def check(analytic: Any, f: Callable[[], float], x: Any, rtol: float = 1e-6) -> None:
    idx, numeric = numeric_grad(f, x)
    host = analytic.get() if hasattr(analytic, "get") else analytic
    got = np.asarray(host).reshape(-1)[idx]
    scale = max(np.abs(numeric).max(), 1e-12)
    assert np.abs(got - numeric).max() <= rtol * scale + 1e-10, (got, numeric)


def rand(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape) * scale


def test_embedding_backward(dev: Device) -> None:
    w = dev.put(rand((11, 5), 0))
    ids = dev.put(np.array([3, 7, 3, 0, 10, 3]))
    r = dev.put(rand((6, 5), 1))

    def loss() -> float:
        return float((F.embedding_forward(w, ids, np.float64) * r).sum())

    grad = F.embedding_backward(dev.xp, r, ids, 11)
    check(grad, loss, w)
    assert np.all(dev.host(grad)[[1, 2, 4, 5, 6, 8, 9]] == 0)


@pytest.mark.parametrize("shape", [(7, 6), (2, 3, 4, 8)])
def test_rms_norm_backward(dev: Device, shape: tuple[int, ...]) -> None:
    x = dev.put(rand(shape, 0))
    w = dev.put(rand(shape[-1:], 1) + 1)
    r = dev.put(rand(shape, 2))

    def loss() -> float:
        return float((F.rms_norm_forward(dev.xp, x, w, 1e-6)[0] * r).sum())

    _, rstd = F.rms_norm_forward(dev.xp, x, w, 1e-6)
    dx, dw = F.rms_norm_backward(dev.xp, r, x, rstd, w, True)
    check(dx, loss, x)
    assert dw is not None
    check(dw, loss, w)


def test_rms_norm_forward_is_hf_llama_rmsnorm(dev: Device) -> None:
    x = rand((4, 16), 0).astype(np.float32)
    w = (rand((16,), 1) + 1).astype(np.float32)
    y, _ = F.rms_norm_forward(dev.xp, dev.put(x), dev.put(w), 1e-5)
    want = w * (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5))
    np.testing.assert_allclose(dev.host(y), want, rtol=1e-6)
    assert y.dtype == np.float32


def test_rope_backward_and_convention(dev: Device) -> None:
    cfg = TransformerConfig.tiny().with_(head_dim=8)
    cos, sin = (dev.put(t.astype(np.float64)) for t in F.rope_tables(cfg, 5))
    host_x = rand((2, 5, 3, 8), 0)
    x = dev.put(host_x)
    r = dev.put(rand((2, 5, 3, 8), 1))

    def loss() -> float:
        return float((F.rope_forward(x, cos, sin) * r).sum())

    check(F.rope_backward(r, cos, sin), loss, x)
    # HF's rotate_half: cat(-x2, x1); the first and second halves of the head are the pairs.
    c, s = dev.host(cos), dev.host(sin)
    rotated = np.concatenate([-host_x[..., 4:], host_x[..., :4]], axis=-1)
    want = host_x * c[:, None, :] + rotated * s[:, None, :]
    np.testing.assert_allclose(dev.host(F.rope_forward(x, cos, sin)), want, rtol=1e-12)
    inv = 1.0 / (10000.0 ** (np.arange(0, 8, 2) / 8))
    np.testing.assert_allclose(c[3, :4], np.cos(3 * inv), rtol=1e-6)


def test_llama3_rope_frequencies_follow_hf() -> None:
    from nybble.train import RopeScaling

    cfg = TransformerConfig.tiny().with_(
        head_dim=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_size=256,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
    )
    inv = F.rope_inverse_frequencies(cfg).astype(np.float64)
    base = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    wavelen = 2 * np.pi / base
    # high frequencies kept, low frequencies divided by the factor, the middle interpolated
    assert np.allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4], rtol=1e-6)
    assert np.allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8, rtol=1e-6)
    middle = (wavelen >= 2048) & (wavelen <= 8192)
    assert middle.any()
    assert np.all((inv[middle] <= base[middle]) & (inv[middle] >= base[middle] / 8))


def naive_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int | None
) -> np.ndarray:
    """HF eager attention: q [B, H, T, D], k, v [B, KV, T, D] repeated per group."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    t = q.shape[2]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    masked = j > i
    if window is not None:
        masked |= j <= i - window
    s = np.where(masked, -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ v


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("chunk_elements", [10**9, 40])
def test_attention_forward_and_backward(
    dev: Device, window: int | None, chunk_elements: int
) -> None:
    b, kv, group, t, d = 2, 2, 3, 7, 4
    scale = d**-0.5
    host_q, host_k, host_v = (
        rand((b, kv, t, group, d), 0),
        rand((b, kv, t, d), 1),
        rand((b, kv, t, d), 2),
    )
    q, k, v = dev.put(host_q), dev.put(host_k), dev.put(host_v)
    r = dev.put(rand((b, t, kv, group, d), 3))

    def run() -> tuple[Any, Any]:
        return F.attention_forward(dev.xp, q, k, v, scale, window, dev.softmax, chunk_elements)

    out, lse = run()
    assert len(F.attention_chunks(b * kv, t, group, chunk_elements)) == (
        1 if chunk_elements > 10**6 else 7
    )
    # heads in HF's order: head h = kv_head * group + i
    q_hf = host_q.transpose(0, 1, 3, 2, 4).reshape(b, kv * group, t, d)
    want = naive_attention(q_hf, host_k, host_v, scale, window)
    got = dev.host(out).reshape(b, t, kv * group, d).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)

    def loss() -> float:
        return float((run()[0] * r).sum())

    dq, dk, dv = F.attention_backward(
        dev.xp, r, q, k, v, out, lse, scale, window, dev.softmax, chunk_elements
    )
    assert dq.shape == r.shape and dk.shape == (b, t, kv, d)
    check(dq.transpose(0, 2, 1, 3, 4), loss, q)
    check(dk.transpose(0, 2, 1, 3), loss, k)
    check(dv.transpose(0, 2, 1, 3), loss, v)


def test_gate_backward(dev: Device) -> None:
    host_g = rand((5, 6), 0, 3.0)
    g, u, r = dev.put(host_g), dev.put(rand((5, 6), 1)), dev.put(rand((5, 6), 2))

    def loss() -> float:
        return float((dev.gate.forward(g, u) * r).sum())

    silu = host_g / (1 + np.exp(-host_g))
    want = silu * dev.host(u)
    np.testing.assert_allclose(dev.host(dev.gate.forward(g, u)), want, rtol=1e-12)
    dg, du = dev.gate.backward(r, g, u)
    check(dg, loss, g)
    check(du, loss, u)


@pytest.mark.parametrize("chunk_elements", [10**9, 25])
def test_head_cross_entropy(dev: Device, chunk_elements: int) -> None:
    n, hidden, vocab = 6, 5, 9
    host_h, host_w = rand((n, hidden), 0), rand((vocab, hidden), 1)
    h, w = dev.put(host_h), dev.put(host_w)
    host_targets = np.array([1, 8, -100, 0, 4, 4])
    targets = dev.put(host_targets)
    count = 5

    def mm(a: Any, b: Any) -> Any:
        return a @ b

    def loss() -> float:
        return float(
            F.head_cross_entropy(dev.xp, h, w, targets, count, mm, False, False, chunk_elements)[0]
        )

    logits = host_h @ host_w.T
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.mean([logp[i, t] for i, t in enumerate(host_targets) if t >= 0])
    value, dh, dw = F.head_cross_entropy(
        dev.xp, h, w, targets, count, mm, True, True, chunk_elements
    )
    assert float(value) == pytest.approx(want, rel=1e-12)
    check(dh, loss, h)
    check(dw, loss, w)
    assert np.all(dev.host(dh)[2] == 0)


def dense_model(dev: Device, cfg: TransformerConfig, **kwargs: Any) -> DecoderLM:
    return DecoderLM(cfg, dev.backend, compute_dtype="float64", seed=3, **kwargs)


def batch(cfg: TransformerConfig, b: int = 2, t: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    ids = rng.integers(0, cfg.vocab_size, (b, t))
    targets = rng.integers(0, cfg.vocab_size, (b, t))
    targets[0, 1] = -100
    return ids, targets


CONFIGS = {
    "tiny": TransformerConfig.tiny().with_(vocab_size=32, intermediate_size=48),
    "qwen3-like": TransformerConfig(
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        vocab_size=29,
        tie_word_embeddings=True,
        qk_norm=True,
        model_type="qwen3",
    ),
    "mistral-like": TransformerConfig(
        hidden_size=24,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
        vocab_size=31,
        sliding_window=3,
        model_type="mistral",
    ),
}


def randomize_norms(dev: Device, model: DecoderLM) -> None:
    """Norm weights away from 1, so their gradients matter."""
    rng = np.random.default_rng(9)
    for name, w in model.weights.items():
        if "norm" in name:
            w[...] = dev.put(1 + 0.3 * rng.standard_normal(w.shape))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_whole_model_gradients(dev: Device, name: str) -> None:
    cfg = CONFIGS[name]
    host_ids, host_targets = batch(cfg)
    ids, targets = dev.put(host_ids), dev.put(host_targets)
    count = int((host_targets >= 0).sum())
    model = dense_model(dev, cfg)
    randomize_norms(dev, model)

    def loss() -> float:
        return float(model.loss(ids, targets, count))

    value = model.forward_backward(ids, targets, count)
    assert float(value) == pytest.approx(loss(), rel=1e-12)
    grads = model.flat_gradients().copy()
    offset = 0
    for pname in model.trainable:
        view = model.views[pname]
        check(grads[offset : offset + view.size], loss, view, rtol=1e-5)
        offset += view.size
    # rel 1e-7: the model's rotary angles are float32, as HF computes them; the naive's float64
    want = naive_loss(model, host_ids, host_targets)
    assert float(value) == pytest.approx(want, rel=1e-7)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradient_checkpointing_gives_the_same_gradients(dev: Device, name: str) -> None:
    cfg = CONFIGS[name]
    host_ids, host_targets = batch(cfg)
    ids, targets = dev.put(host_ids), dev.put(host_targets)
    count = int((host_targets >= 0).sum())
    plain = dense_model(dev, cfg)
    ckpt = dense_model(dev, cfg, gradient_checkpointing=True)
    a = plain.forward_backward(ids, targets, count)
    b = ckpt.forward_backward(ids, targets, count)
    assert float(a) == float(b)
    np.testing.assert_array_equal(dev.host(plain.flat_gradients()), dev.host(ckpt.flat_gradients()))


def naive_loss(model: DecoderLM, ids: np.ndarray, targets: np.ndarray) -> float:
    """HF Llama's forward written out plainly from the model's weights (float64)."""
    cfg = model.config
    w = model.state_dict()
    eps = cfg.rms_norm_eps

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return weight * x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)

    def rope(x: np.ndarray) -> np.ndarray:  # x [B, H, T, D]
        d, t = x.shape[-1], x.shape[-2]
        inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2) / d))
        ang = np.arange(t)[:, None] * inv[None, :]
        ang = np.concatenate([ang, ang], -1)
        half = d // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * np.cos(ang) + rot * np.sin(ang)

    x = w["model.embed_tokens.weight"].astype(np.float64)[ids]
    b, t, _ = x.shape
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."

        def lin(name: str, a: np.ndarray, p: str = p) -> np.ndarray:
            return a @ w[p + name + ".weight"].astype(np.float64).T

        h = rms(x, w[p + "input_layernorm.weight"])
        q = lin("self_attn.q_proj", h).reshape(b, t, heads, d)
        k = lin("self_attn.k_proj", h).reshape(b, t, kv, d)
        v = lin("self_attn.v_proj", h).reshape(b, t, kv, d)
        if cfg.qk_norm:
            q = rms(q, w[p + "self_attn.q_norm.weight"])
            k = rms(k, w[p + "self_attn.k_norm.weight"])
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        o = naive_attention(rope(q), rope(k), v, d**-0.5, cfg.sliding_window)
        x = x + lin("self_attn.o_proj", o.transpose(0, 2, 1, 3).reshape(b, t, heads * d))
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        g, u = lin("mlp.gate_proj", h), lin("mlp.up_proj", h)
        x = x + lin("mlp.down_proj", g / (1 + np.exp(-g)) * u)
    x = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    logits = x @ head.astype(np.float64).T
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = [logp[bi, ti, max(targets[bi, ti], 0)] for bi in range(b) for ti in range(t)]
    keep = [targets[bi, ti] >= 0 for bi in range(b) for ti in range(t)]
    return float(-np.mean(np.array(picked)[np.array(keep)]))


@pytest.mark.parametrize("quant", [None, "nf4"])
@pytest.mark.parametrize("name", ["tiny", "qwen3-like"])
def test_lora_gradients_in_the_model(dev: Device, quant: str | None, name: str) -> None:
    """The LoRA model's gradients of A and B (float32 on both devices) equal what the chain
    rule gives from the float64 dense model's weight gradient at W + s·B·A: dB = s·dW·Aᵀ,
    dA = s·Bᵀ·dW."""
    cfg = CONFIGS[name]
    host_ids, host_targets = batch(cfg)
    ids, targets = dev.put(host_ids), dev.put(host_targets)
    count = int((host_targets >= 0).sum())
    lora = LoraConfig(r=3, alpha=6, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
    model = DecoderLM(cfg, dev.backend, lora=lora, quant=quant, seed=3)
    rng = np.random.default_rng(0)
    layers = {name: p.layer for name, p in model.lora_projections.items()}
    for layer in layers.values():
        layer.set_lora_b(rng.standard_normal(layer.lora_b.shape) * 0.2)
    lora_a = {m: dev.host(layer.lora_a).astype(np.float64) for m, layer in layers.items()}
    lora_b = {m: dev.host(layer.lora_b).astype(np.float64) for m, layer in layers.items()}
    dense = dense_model(dev, cfg)
    base = model.state_dict()
    for pname in dense.trainable:
        if pname.endswith("_proj.weight"):
            module = pname.removesuffix(".weight")
            w = base[pname].astype(np.float64)
            if module in layers:
                w = w + layers[module].scaling * lora_b[module] @ lora_a[module]
            dense.views[pname][...] = dev.put(w)
    lora_loss = model.forward_backward(ids, targets, count)
    dense_loss = dense.forward_backward(ids, targets, count)
    assert float(lora_loss) == pytest.approx(float(dense_loss), rel=1e-5)
    dense_grads = {k: dev.host(v) for k, v in dense.grads.items() if v is not None}
    got = dev.host(model.flat_gradients())
    offset = 0
    for pname, view in model.named_parameters().items():
        g = got[offset : offset + view.size].reshape(view.shape)
        offset += view.size
        module, _, part = pname.rpartition(".lora_")
        scaling = layers[module].scaling
        dw = dense_grads[f"{module}.weight"]
        want = (
            scaling * dw @ lora_a[module].T
            if part == "B.weight"
            else scaling * lora_b[module].T @ dw
        )
        np.testing.assert_allclose(g, want, rtol=2e-3, atol=2e-5 * np.abs(want).max())
