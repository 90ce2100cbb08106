"""The flash-attention kernels (train/_cuda.py, marked `gpu`): forward (output and
log-sum-exp) and backward (dQ, dK, dV) against a float64 statement of the math and against
the chunked path (cuBLAS products + the fused softmax), for query blocks that end inside a
tile, groups of 1, 4 and 7 query heads per key/value head, heads of 64 and 128, sliding
windows, packed rows (sample starts, also starts that decrease), batches of 2; bit-for-bit
repeatable; the shapes and dtypes the kernels do not take fall back to the chunked path; and
a model with 64-wide heads trains alike on both paths."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from nybble import LoraConfig
from nybble.train import Trainer, TransformerConfig
from nybble.train import functional as F
from tests.train.attention_cases import sample_starts

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16


def cupy() -> Any:
    import cupy

    return cupy


def host(a: Any) -> np.ndarray:
    return np.asarray(cupy().asnumpy(a), dtype=np.float64)


def reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    do: np.ndarray,
    scale: float,
    window: int | None,
    starts: np.ndarray | None,
) -> tuple[np.ndarray, ...]:
    """Float64 attention of the (rounded) inputs: out, lse, dq, dk, dv in the kernels'
    layouts."""
    b, kv, t, group, d = q.shape
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
    pos = np.arange(t)
    out = np.zeros((b, t, kv, group, d))
    lse = np.zeros((b * kv, t * group))
    dq = np.zeros_like(out)
    dk = np.zeros((b, t, kv, d))
    dv = np.zeros((b, t, kv, d))
    for n in range(b):
        lo = np.zeros(t, np.int64)
        if window is not None:
            lo = np.maximum(lo, pos - window + 1)
        if starts is not None:
            lo = np.maximum(lo, starts[n])
        seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= lo[:, None])
        for h in range(kv):
            for i in range(group):
                qh, kh, vh, doh = q[n, h, :, i], k[n, h], v[n, h], do[n, :, h, i]
                s = np.where(seen, qh @ kh.T * scale, -np.inf)
                m = s.max(1, keepdims=True)
                e = np.exp(s - m)
                total = e.sum(1, keepdims=True)
                p = e / total
                o = p @ vh
                out[n, :, h, i] = o
                lse[n * kv + h, np.arange(t) * group + i] = (m + np.log(total))[:, 0]
                ds = p * (doh @ vh.T - (doh * o).sum(1, keepdims=True)) * scale
                dq[n, :, h, i] = ds @ kh
                dk[n, :, h] += ds.T @ qh
                dv[n, :, h] += p.T @ doh
    return out, lse, dq, dk, dv


def rel_err(got: Any, want: np.ndarray) -> float:
    """Largest error over the largest value (at least 1e-3: a gradient that is exactly 0 in
    float64, as with one key, is a few ulps of the others in bfloat16)."""
    return float(np.abs(host(got) - want).max() / max(float(np.abs(want).max()), 1e-3))


CASES = [
    # b, kv, t, group, d, window, starts
    pytest.param(1, 2, 100, 4, 128, None, None, id="t100-g4-d128"),
    pytest.param(2, 2, 130, 1, 64, None, None, id="b2-t130-g1-d64"),
    pytest.param(1, 1, 77, 7, 128, None, None, id="t77-g7-d128"),
    pytest.param(2, 1, 93, 7, 64, None, None, id="b2-t93-g7-d64"),
    pytest.param(2, 2, 200, 4, 64, 37, None, id="window37-d64"),
    pytest.param(1, 2, 300, 4, 128, 100, None, id="window100-d128"),
    pytest.param(2, 1, 150, 4, 128, None, "packed", id="packed-d128"),
    pytest.param(2, 2, 190, 2, 64, 50, "packed", id="packed-window-d64"),
    pytest.param(2, 1, 160, 3, 64, None, "decreasing", id="decreasing-starts"),
    pytest.param(1, 1, 1, 4, 64, None, None, id="t1"),
    pytest.param(1, 8, 1024, 4, 128, None, None, id="llama-heads-t1024"),
]


@pytest.mark.parametrize(("b", "kv", "t", "group", "d", "window", "starts_kind"), CASES)
def test_flash_attention_matches_float64_and_the_chunked_path(
    b: int, kv: int, t: int, group: int, d: int, window: int | None, starts_kind: str | None
) -> None:
    from nybble.train import _cuda

    cp = cupy()
    rng = np.random.default_rng(t * 31 + group * 7 + d)
    q = rng.standard_normal((b, kv, t, group, d)).astype(BF16)
    k = rng.standard_normal((b, kv, t, d)).astype(BF16)
    v = rng.standard_normal((b, kv, t, d)).astype(BF16)
    do = rng.standard_normal((b, t, kv, group, d)).astype(BF16)
    starts = None
    if starts_kind is not None:
        starts = sample_starts(rng, starts_kind, b, t)
    scale = d**-0.5
    want = reference(q, k, v, do, scale, window, starts)
    qd, kd, vd, dod = (cp.asarray(a) for a in (q, k, v, do))
    sd = None if starts is None else cp.asarray(starts)
    assert _cuda.flash_applies(qd, kd, vd, sd)

    results = {}
    paths: list[tuple[str, Any, int]] = [
        ("flash", _cuda.FusedSoftmax(), F.ATTENTION_CHUNK_ELEMENTS),
        ("chunked", _cuda.FusedSoftmax(flash=False), 4096),  # several chunks
    ]
    for name, softmax, chunk in paths:
        out, lse = F.attention_forward(cp, qd, kd, vd, scale, window, softmax, chunk, sd)
        grads = F.attention_backward(
            cp, dod, qd, kd, vd, out, lse, scale, window, softmax, chunk, sd
        )
        results[name] = (out, lse, *grads)
    flash, chunked = results["flash"], results["chunked"]
    for got in flash:
        assert got.flags.c_contiguous
    assert flash[0].dtype == BF16 and flash[1].dtype == np.float32
    assert all(g.dtype == BF16 for g in flash[2:])
    names = ("out", "lse", "dq", "dk", "dv")
    for name, got, other, w in zip(names, flash, chunked, want, strict=True):
        assert tuple(got.shape) == tuple(other.shape) == w.shape, name
        err, err_chunked = rel_err(got, w), rel_err(other, w)
        # bfloat16 rounding of the outputs and of P and dS in the products; the flash
        # kernels keep the scores in float32, so they are no worse than the chunked path
        tol = 1e-4 if name == "lse" else 2e-2
        assert err <= tol, (name, err, err_chunked)
        assert err <= max(2 * err_chunked, tol / 4), (name, err, err_chunked)

    # the same launches give the same bits
    again: Any = _cuda.FusedSoftmax()
    out2, lse2 = F.attention_forward(cp, qd, kd, vd, scale, window, again, starts=sd)
    grads2 = F.attention_backward(cp, dod, qd, kd, vd, out2, lse2, scale, window, again, starts=sd)
    for a, c in zip(flash, (out2, lse2, *grads2), strict=True):
        assert cp.array_equal(a.view(cp.uint8), c.view(cp.uint8))


def test_flash_attention_falls_back_where_it_does_not_apply() -> None:
    """float32, heads of 32, non-contiguous or misaligned arrays: the chunked path."""
    from nybble.train import _cuda

    cp = cupy()
    rng = np.random.default_rng(3)
    fused: Any = _cuda.FusedSoftmax()

    def arrays(dtype: Any, d: int) -> tuple[Any, Any, Any]:
        return (
            cp.asarray(rng.standard_normal((1, 2, 40, 2, d)).astype(dtype)),
            cp.asarray(rng.standard_normal((1, 2, 40, d)).astype(dtype)),
            cp.asarray(rng.standard_normal((1, 2, 40, d)).astype(dtype)),
        )

    q, k, v = arrays(np.float32, 64)
    assert not _cuda.flash_applies(q, k, v)
    assert fused.flash_forward(q, k, v, 0.125, None) is None
    q, k, v = arrays(BF16, 32)
    assert not _cuda.flash_applies(q, k, v)
    q, k, v = arrays(BF16, 64)
    assert _cuda.flash_applies(q, k, v)
    assert not _cuda.flash_applies(q[:, :, ::2], k[:, :, ::2], v[:, :, ::2])
    assert not _cuda.FusedSoftmax(flash=False).flash_forward(q, k, v, 0.125, None)
    misaligned = cp.empty(q.size + 1, q.dtype)[1:].reshape(q.shape)
    misaligned[...] = q
    assert not _cuda.flash_applies(misaligned, k, v)
    out, lse = F.attention_forward(cp, misaligned, k, v, 0.125, None, fused)
    want, want_lse = F.attention_forward(cp, q, k, v, 0.125, None, fused)
    assert float(cp.abs(out.astype(cp.float32) - want.astype(cp.float32)).max()) < 0.05
    # the chunked path's log-sum-exp comes from scores rounded to bfloat16 (|lse| ~ 4 here)
    assert float(cp.abs(lse - want_lse).max()) < 2e-2


def test_a_model_with_flash_attention_trains_as_with_the_chunked_path() -> None:
    """64-wide heads in bfloat16 (the flash path), packed rows and a sliding window: the losses
    of a few steps follow the chunked path's within bfloat16's rounding."""
    from nybble.train import _cuda

    cfg = TransformerConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=256,
        sliding_window=48,
        model_type="mistral",
    )
    lora = LoraConfig(r=8, alpha=16, target_modules="all-linear")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (2, 97))
    starts = sample_starts(rng, "packed", 2, 96)

    def run(flash: bool) -> list[float]:
        t = Trainer(cfg, lora, lr=1e-2, quant="nf4", device="cuda", gradient_checkpointing=True)
        assert isinstance(t.model.softmax, _cuda.FusedSoftmax)
        t.model.softmax = _cuda.FusedSoftmax(flash=flash)
        return [t.train_batch(ids[:, :-1], ids[:, 1:], starts) for _ in range(4)]

    flash, chunked = run(True), run(False)
    np.testing.assert_allclose(flash, chunked, rtol=2e-2)
    assert flash[-1] < flash[0]
