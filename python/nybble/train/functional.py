"""The parts of the decoder, each a forward and a hand-written backward over an array
namespace `xp` (numpy on the CPU, CuPy on the GPU): embedding, RMSNorm, rotary positions,
causal grouped-query attention, the SwiGLU MLP's gate, and the LM head with cross-entropy.
docs/training.md ("The math") states every formula; the numerics follow HF's Llama.

Dtypes: activations come in the compute dtype (float32 on the CPU, bfloat16 on the GPU, or
float64 for gradient checks) and go out in it; reductions, normalisation and softmax run in
float32 (float64 for float64 inputs), as HF's RMSNorm and softmax do. Weight gradients come out
in that accumulation dtype.

Attention never holds the whole [T, T] score matrix: queries go in chunks of positions whose
scores fit `chunk_elements`, and backward recomputes each chunk's probabilities from the
saved log-sum-exp (as flash attention does). On the GPU the softmax of a chunk and its
gradient run as one fused kernel each (train/_cuda.py); elsewhere the same math in `xp`. For
bfloat16 heads of 64 or 128 on the GPU, the whole attention runs in flash-attention kernels
instead (train/_cuda.py: no chunks, the scores never in memory), offered by the softmax
object (`flash_forward` / `flash_backward`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import numpy as np
from numpy.typing import DTypeLike

from .. import backends
from ..backends import Array
from .config import TransformerConfig

#: The largest number of attention scores of one chunk (per chunk: 2 buffers of this many
#: elements in backward, 1 in forward).
ATTENTION_CHUNK_ELEMENTS = 1 << 25
#: The largest number of logits of one chunk of the LM head.
HEAD_CHUNK_ELEMENTS = 1 << 25
#: Targets equal to this are ignored by the loss (HF's and torch's ignore_index).
IGNORE_INDEX = -100


def accumulate_dtype(dtype: DTypeLike) -> type[np.float32 | np.float64]:
    """float64 for float64 activations, float32 for every other."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


# --- embedding ----------------------------------------------------------------------------


def embedding_forward(weight: Array, ids: Array, dtype: DTypeLike) -> Array:
    """weight[ids] in `dtype`: ids [...] -> [..., hidden]."""
    return weight[ids].astype(dtype, copy=False)


def embedding_backward(xp: ModuleType, grad: Array, ids: Array, vocab_size: int) -> Array:
    """dL/dweight [vocab, hidden] for grad [N, hidden] of the rows ids [N]: the rows of each
    token summed. A one-hot product over the distinct tokens keeps the sum in a fixed order
    (an atomic scatter would not be deterministic on the GPU)."""
    acc = accumulate_dtype(grad.dtype)
    out = xp.zeros((vocab_size, grad.shape[-1]), acc)
    step = 4096
    for start in range(0, int(ids.shape[0]), step):
        chunk = ids[start : start + step]
        tokens, inverse = xp.unique(chunk, return_inverse=True)
        onehot = (xp.arange(tokens.shape[0])[:, None] == inverse.reshape(1, -1)).astype(acc)
        out[tokens] += onehot @ grad[start : start + step].astype(acc, copy=False)
    return out


# --- RMSNorm --------------------------------------------------------------------------------


def rms_norm_forward(xp: ModuleType, x: Array, weight: Array, eps: float) -> tuple[Array, Array]:
    """y = weight * x / sqrt(mean(x²) + eps) over the last axis, in float32 (HF's LlamaRMSNorm);
    returns y in x's dtype and 1/sqrt(mean(x²) + eps) [..., 1] for backward."""
    acc = accumulate_dtype(x.dtype)
    xf = x.astype(acc)
    rstd = xf * xf
    rstd = rstd.mean(axis=-1, keepdims=True)
    rstd += eps
    rstd = 1.0 / xp.sqrt(rstd)
    xf *= rstd
    xf *= weight.astype(acc, copy=False)
    return xf.astype(x.dtype, copy=False), rstd


def rms_norm_backward(
    xp: ModuleType, dy: Array, x: Array, rstd: Array, weight: Array, weight_grad: bool
) -> tuple[Array, Array | None]:
    """(dL/dx in dy's dtype, dL/dweight or None). With x̂ = x·rstd and g = dy·weight:
    dx = rstd·(g - x̂·mean(g·x̂)), dweight = Σ_rows dy·x̂."""
    acc = accumulate_dtype(x.dtype)
    xhat = x.astype(acc) * rstd
    g = dy.astype(acc)
    dw = None
    if weight_grad:
        dw = (g * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    g *= weight.astype(acc, copy=False)
    dot = (g * xhat).mean(axis=-1, keepdims=True)
    xhat *= dot
    g -= xhat
    g *= rstd
    return g.astype(dy.dtype, copy=False), dw


class NormKernels:
    """RMSNorm forward and backward as the model calls them, in `xp` (the GPU's fused kernels,
    train/_cuda.py, replace them for bfloat16 and float32)."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp

    def forward(self, x: Array, weight: Array, eps: float) -> tuple[Array, Array]:
        return rms_norm_forward(self.xp, x, weight, eps)

    def backward(
        self, dy: Array, x: Array, rstd: Array, weight: Array, weight_grad: bool
    ) -> tuple[Array, Array | None]:
        return rms_norm_backward(self.xp, dy, x, rstd, weight, weight_grad)


# --- rotary positions -----------------------------------------------------------------------


def rope_inverse_frequencies(config: TransformerConfig) -> np.ndarray:
    """inv_freq [head_dim/2] in float32, as HF computes it (default, linear and llama3)."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    rope = config.rope_scaling
    if rope.rope_type == "linear":
        inv_freq = (inv_freq / np.float32(rope.factor)).astype(np.float32)
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_tables(config: TransformerConfig, length: int, xp: ModuleType = np) -> tuple[Array, Array]:
    """cos, sin [length, head_dim] (float32, host) for positions 0..length-1: the angles
    position·inv_freq computed in float32, the two halves of the head sharing them (HF's
    `cat(freqs, freqs)`). Packed batches take the rows of their tokens' positions. `xp`: the
    namespace of the model's host arrays (numpy; a recording's, whose arrays hold no values)."""
    inv_freq = xp.asarray(rope_inverse_frequencies(config))
    freqs = xp.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = xp.concatenate([freqs, freqs], axis=-1)
    return xp.cos(angles).astype(np.float32), xp.sin(angles).astype(np.float32)


def rope_forward(x: Array, cos: Array, sin: Array) -> Array:
    """x·cos + rotate_half(x)·sin for x [B, T, heads, D] and tables [T, D] (or [B, T, D], a
    position per token), where rotate_half(x) = cat(-x₂, x₁) (HF's convention: the halves of
    the head are the pairs)."""
    half = x.shape[-1] // 2
    c, s = cos[..., None, :], sin[..., None, :]
    y = x * c
    y[..., :half] -= x[..., half:] * s[..., :half]
    y[..., half:] += x[..., :half] * s[..., half:]
    return y


def rope_backward(dy: Array, cos: Array, sin: Array) -> Array:
    """The transpose of rope_forward: dy·cos + rotate_halfᵀ(dy·sin), rotate_halfᵀ(z) =
    cat(z₂, -z₁)."""
    half = dy.shape[-1] // 2
    c, s = cos[..., None, :], sin[..., None, :]
    dx = dy * c
    dx[..., :half] += dy[..., half:] * s[..., half:]
    dx[..., half:] -= dy[..., :half] * s[..., :half]
    return dx


class HeadKernels:
    """The query or key heads from their projection to attention's layout, and back: the
    optional per-head RMSNorm (Qwen3's q_norm / k_norm), rotary positions, and the move from
    [B, T, heads, D] to [B, kv_heads, T, group, D] (keys: group 1), in `xp`."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp

    def forward(
        self,
        x: Array,
        weight: Array | None,
        eps: float,
        cos: Array,
        sin: Array,
        group: int,
    ) -> tuple[Array, Array | None]:
        """(rope(norm(x)) in attention's layout, the norm's rstd [B, T, heads, 1] or None)."""
        rstd = None
        if weight is not None:
            x, rstd = rms_norm_forward(self.xp, x, weight, eps)
        b, t, heads, d = x.shape
        y = rope_forward(x, cos, sin).reshape(b, t, heads // group, group, d)
        return self.xp.ascontiguousarray(y.transpose(0, 2, 1, 3, 4)), rstd

    def backward(
        self,
        dy: Array,
        x: Array | None,
        rstd: Array | None,
        weight: Array | None,
        cos: Array,
        sin: Array,
        weight_grad: bool,
    ) -> tuple[Array, Array | None]:
        """dy [B, T, heads, D] (the gradient of the rotated heads, in that layout) -> (dL/dx,
        the norm weight's gradient or None); x and rstd are the projection's output and the
        norm's rstd (None without a norm)."""
        d = rope_backward(dy, cos, sin)
        if weight is None:
            return d, None
        assert x is not None and rstd is not None  # saved by a forward with the norm
        return rms_norm_backward(self.xp, d, x, rstd, weight, weight_grad)


# --- causal attention ------------------------------------------------------------------------


class SoftmaxKernels:
    """The causal softmax of a chunk of scores and its gradient, in `xp`. Scores `s` are
    [batch, rows, keys] (rows: `group` query heads per position, positions from `t0`);
    `lse` and `delta` are [batch, positions · group], of which the chunk covers
    [t0·group, t0·group + rows). `starts` [batch, positions] (packed sequences), where given,
    is the first position of each position's sample: no row sees a key before it.

    A softmax object may also offer the whole attention (the GPU's, train/_cuda.py):
    `flash_forward(q, k, v, scale, window, starts)` and `flash_backward(do, q, k, v, out, lse,
    scale, window, starts)` with attention_forward's and attention_backward's arguments and
    results, or None where they do not apply; the xp statement offers neither."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp

    def _mask(
        self,
        rows: int,
        keys: int,
        t0: int,
        group: int,
        window: int | None,
        starts: Array | None,
        dtype: DTypeLike,
    ) -> Array:
        """[rows, keys] ([batch, rows, keys] with `starts`): 0 where row may see the key, -inf
        where it may not (a later position, one beyond the sliding window, one of another
        sample). Added before exp, so masked entries are exactly 0."""
        xp = self.xp
        pos = t0 + xp.arange(rows) // group
        key = xp.arange(keys)
        invalid = key[None, :] > pos[:, None]
        if window is not None:
            invalid |= key[None, :] <= pos[:, None] - window
        if starts is not None:
            first = starts[:, pos]  # [batch, rows]
            invalid = invalid[None] | (key[None, None, :] < first[:, :, None])
        return xp.where(invalid, -np.inf, 0.0).astype(dtype)

    def forward(
        self,
        s: Array,
        lse: Array,
        t0: int,
        group: int,
        window: int | None,
        scale: float,
        starts: Array | None = None,
    ) -> None:
        """s ← softmax(scale·s) over the keys each row may see; lse ← its log-sum-exp."""
        xp = self.xp
        rows, keys = s.shape[-2:]
        acc = accumulate_dtype(s.dtype)
        sf = s.astype(acc) * scale
        sf += self._mask(rows, keys, t0, group, window, starts, acc)
        m = sf.max(axis=-1, keepdims=True)
        sf -= m
        xp.exp(sf, out=sf)
        total = sf.sum(axis=-1, keepdims=True)
        sf /= total
        s[...] = sf.astype(s.dtype, copy=False)
        start = t0 * group
        lse[:, start : start + rows] = (m + xp.log(total))[..., 0].reshape(lse.shape[0], rows)

    def backward(
        self,
        s: Array,
        dp: Array,
        lse: Array,
        delta: Array,
        t0: int,
        group: int,
        window: int | None,
        scale: float,
        starts: Array | None = None,
    ) -> None:
        """s ← P = exp(scale·s - lse) (0 where masked), dp ← dS = P·(dp - delta)·scale."""
        xp = self.xp
        rows, keys = s.shape[-2:]
        acc = accumulate_dtype(s.dtype)
        start = t0 * group
        lse_c = lse[:, start : start + rows].reshape(s.shape[0], rows, 1)
        delta_c = delta[:, start : start + rows].reshape(s.shape[0], rows, 1)
        p = s.astype(acc) * scale
        p += self._mask(rows, keys, t0, group, window, starts, acc)
        p -= lse_c
        xp.exp(p, out=p)
        ds = dp.astype(acc) - delta_c
        ds *= p
        ds *= scale
        s[...] = p.astype(s.dtype, copy=False)
        dp[...] = ds.astype(dp.dtype, copy=False)


def attention_chunks(
    batch: int, positions: int, group: int, chunk_elements: int
) -> list[tuple[int, int]]:
    """Position ranges [t0, t1) whose scores (batch·(t1-t0)·group rows x up to `positions`
    keys) fit `chunk_elements`; at least one position per chunk."""
    per_position = max(1, batch * group * positions)
    step = max(1, min(positions, chunk_elements // per_position))
    return [(t0, min(t0 + step, positions)) for t0 in range(0, positions, step)]


def score_starts(xp: ModuleType, starts: Array | None, kv_heads: int) -> Array | None:
    """A batch's sample starts [B, T] for the scores' batches [B·kv_heads, T] (int32)."""
    if starts is None:
        return None
    return xp.ascontiguousarray(xp.repeat(starts.astype(np.int32, copy=False), kv_heads, axis=0))


def attention_forward(
    xp: ModuleType,
    q: Array,
    k: Array,
    v: Array,
    scale: float,
    window: int | None,
    softmax: SoftmaxKernels,
    chunk_elements: int = ATTENTION_CHUNK_ELEMENTS,
    starts: Array | None = None,
) -> tuple[Array, Array]:
    """Causal attention. q [B, kv_heads, T, group, D] (query head h = kv·group + i, HF's
    repeat_kv order), k, v [B, kv_heads, T, D], all C-contiguous; `starts` [B, T] (packed
    sequences: each position's sample begins there, and no query sees a key before it) or
    None. Returns the output [B, T, kv_heads, group, D] (the layout o_proj reads) and the
    log-sum-exp of every row [B·kv_heads, T·group] (float32). A softmax object that offers
    the whole attention (`flash_forward`) computes it where it applies."""
    flash = getattr(softmax, "flash_forward", None)
    if flash is not None:
        done = flash(q, k, v, scale, window, starts)
        if done is not None:
            return done
    b, kv, t, group, d = q.shape
    nb = b * kv
    qb, kb, vb = q.reshape(nb, t, group, d), k.reshape(nb, t, d), v.reshape(nb, t, d)
    bmm = backends.of(q).batched_matmul
    out = xp.empty((b, t, kv, group, d), q.dtype)
    lse = xp.empty((nb, t * group), accumulate_dtype(q.dtype))
    head_starts = score_starts(xp, starts, kv)
    for t0, t1 in attention_chunks(nb, t, group, chunk_elements):
        rows = (t1 - t0) * group
        qc = qb[:, t0:t1].reshape(nb, rows, d)
        s = bmm(qc, kb[:, :t1].transpose(0, 2, 1))
        softmax.forward(s, lse, t0, group, window, scale, head_starts)
        oc = bmm(s, vb[:, :t1])
        out[:, t0:t1] = oc.reshape(b, kv, t1 - t0, group, d).transpose(0, 2, 1, 3, 4)
    return out, lse


def attention_backward(
    xp: ModuleType,
    do: Array,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    scale: float,
    window: int | None,
    softmax: SoftmaxKernels,
    chunk_elements: int = ATTENTION_CHUNK_ELEMENTS,
    starts: Array | None = None,
) -> tuple[Array, Array, Array]:
    """Gradients of attention_forward for do [B, T, kv_heads, group, D]: dq in the same layout
    as do, dk and dv [B, T, kv_heads, D], all in do's dtype. Per chunk, with P recomputed
    from lse: dP = dO·Vᵀ, dS = P·(dP - rowsum(dO·O))·scale, dQ = dS·K, dK += dSᵀ·Q,
    dV += Pᵀ·dO (the key/value gradients summed over the group in float32). A softmax object
    that offers the whole attention (`flash_backward`) computes it where it applies."""
    flash = getattr(softmax, "flash_backward", None)
    if flash is not None:
        done = flash(do, q, k, v, out, lse, scale, window, starts)
        if done is not None:
            return done
    b, kv, t, group, d = q.shape
    nb = b * kv
    acc = accumulate_dtype(do.dtype)
    delta = (do.astype(acc) * out.astype(acc)).sum(axis=-1)  # [B, T, kv, group]
    delta = xp.ascontiguousarray(delta.transpose(0, 2, 1, 3)).reshape(nb, t * group)
    dob = xp.ascontiguousarray(do.transpose(0, 2, 1, 3, 4)).reshape(nb, t, group, d)
    qb, kb, vb = q.reshape(nb, t, group, d), k.reshape(nb, t, d), v.reshape(nb, t, d)
    bmm = backends.of(q).batched_matmul
    dq = xp.empty((b, t, kv, group, d), do.dtype)
    dk = xp.zeros((nb, t, d), acc)
    dv = xp.zeros((nb, t, d), acc)
    head_starts = score_starts(xp, starts, kv)
    for t0, t1 in attention_chunks(nb, t, group, chunk_elements):
        rows = (t1 - t0) * group
        qc = qb[:, t0:t1].reshape(nb, rows, d)
        doc = dob[:, t0:t1].reshape(nb, rows, d)
        s = bmm(qc, kb[:, :t1].transpose(0, 2, 1))
        dp = bmm(doc, vb[:, :t1].transpose(0, 2, 1))
        softmax.backward(s, dp, lse, delta, t0, group, window, scale, head_starts)
        dv[:, :t1] += bmm(s.transpose(0, 2, 1), doc).astype(acc, copy=False)
        dk[:, :t1] += bmm(dp.transpose(0, 2, 1), qc).astype(acc, copy=False)
        dqc = bmm(dp, kb[:, :t1])
        dq[:, t0:t1] = dqc.reshape(b, kv, t1 - t0, group, d).transpose(0, 2, 1, 3, 4)
    # C order: the projections' backward reads them as [B·T, kv_heads·D] without a copy
    dk_out = dk.reshape(b, kv, t, d).transpose(0, 2, 1, 3).astype(do.dtype, order="C")
    dv_out = dv.reshape(b, kv, t, d).transpose(0, 2, 1, 3).astype(do.dtype, order="C")
    return dq, dk_out, dv_out


def attention_with_cache(
    xp: ModuleType, q: Array, k: Array, v: Array, start: int, scale: float, window: int | None
) -> Array:
    """Causal attention of new queries against a key/value cache (inference): q
    [B, kv_heads, n, group, D] at positions start..start+n-1, k and v [B, kv_heads, L, D] for
    positions 0..L-1 (L = start + n, the new ones included). The same math as
    attention_forward (scores in the compute dtype, softmax in float32, probabilities rounded
    to the compute dtype before the product with v). Returns [B, n, kv_heads, group, D]."""
    b, kv, n, group, d = q.shape
    length = int(k.shape[2])
    nb = b * kv
    bmm = backends.of(q).batched_matmul
    acc = accumulate_dtype(q.dtype)
    qb = xp.ascontiguousarray(q).reshape(nb, n * group, d)
    kb = xp.ascontiguousarray(k).reshape(nb, length, d)
    vb = xp.ascontiguousarray(v).reshape(nb, length, d)
    sf = bmm(qb, kb.transpose(0, 2, 1)).astype(acc) * scale
    pos = start + xp.arange(n * group) // group
    key = xp.arange(length)
    invalid = key[None, :] > pos[:, None]
    if window is not None:
        invalid |= key[None, :] <= pos[:, None] - window
    sf += xp.where(invalid, -np.inf, 0.0).astype(acc)
    sf -= sf.max(axis=-1, keepdims=True)
    xp.exp(sf, out=sf)
    sf /= sf.sum(axis=-1, keepdims=True)
    out = bmm(sf.astype(q.dtype), vb)
    return out.reshape(b, kv, n, group, d).transpose(0, 2, 1, 3, 4)


def attention_at(
    xp: ModuleType, q: Array, k: Array, v: Array, position: Array, scale: float, window: int | None
) -> Array:
    """attention_with_cache for one new position held on the device (`position`, int32 [1]),
    over the whole cache (k, v [B, kv_heads, capacity, D]; keys after the position masked),
    so that every shape is fixed: a decode step that can be captured in a CUDA graph and
    replayed for each next position. q [B, kv_heads, 1, group, D]; the same math and result
    as attention_with_cache."""
    b, kv, n, group, d = q.shape
    capacity = int(k.shape[2])
    nb = b * kv
    bmm = backends.of(q).batched_matmul
    acc = accumulate_dtype(q.dtype)
    qb = q.reshape(nb, n * group, d)
    sf = bmm(qb, k.reshape(nb, capacity, d).transpose(0, 2, 1)).astype(acc) * scale
    key = xp.arange(capacity, dtype=np.int32)[None, :]
    invalid = key > position[:, None]
    if window is not None:
        invalid |= key <= position[:, None] - window
    sf += xp.where(invalid, -np.inf, 0.0).astype(acc)
    sf -= sf.max(axis=-1, keepdims=True)
    xp.exp(sf, out=sf)
    sf /= sf.sum(axis=-1, keepdims=True)
    out = bmm(sf.astype(q.dtype), v.reshape(nb, capacity, d))
    return out.reshape(b, kv, n, group, d).transpose(0, 2, 1, 3, 4)


# --- SwiGLU ---------------------------------------------------------------------------------


class GateKernels:
    """silu(gate)·up and its gradient, in `xp` (float32 math, results in the input dtype)."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp

    def _sigmoid(self, gf: Array) -> Array:
        # 0.5·(1 + tanh(g/2)): the logistic function without exp's overflow for large -g.
        s = self.xp.tanh(gf * 0.5)
        s += 1
        s *= 0.5
        return s

    def forward(self, gate: Array, up: Array) -> Array:
        acc = accumulate_dtype(gate.dtype)
        gf = gate.astype(acc)
        a = self._sigmoid(gf)
        a *= gf
        a *= up.astype(acc, copy=False)
        return a.astype(gate.dtype, copy=False)

    def backward(self, da: Array, gate: Array, up: Array) -> tuple[Array, Array]:
        """(dgate, dup): dup = da·silu(g), dgate = da·up·sig(g)·(1 + g·(1 - sig(g)))."""
        acc = accumulate_dtype(gate.dtype)
        gf = gate.astype(acc)
        sig = self._sigmoid(gf)
        daf = da.astype(acc)
        dup = daf * sig
        dup *= gf
        dgate = 1 - sig
        dgate *= gf
        dgate += 1
        dgate *= sig
        dgate *= daf
        dgate *= up.astype(acc, copy=False)
        return dgate.astype(da.dtype, copy=False), dup.astype(da.dtype, copy=False)


# --- LM head and cross-entropy ---------------------------------------------------------------


def head_chunks(rows: int, vocab: int, chunk_elements: int) -> list[tuple[int, int]]:
    step = max(1, min(rows, chunk_elements // max(1, vocab)))
    return [(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]


def head_cross_entropy(
    xp: ModuleType,
    h: Array,
    head_weight: Array,
    targets: Array,
    count: int,
    matmul: Callable[[Array, Array], Array],
    grad: bool,
    weight_grad: bool = False,
    chunk_elements: int = HEAD_CHUNK_ELEMENTS,
) -> tuple[Array, Array | None, Array | None]:
    """Mean cross-entropy of logits = h·Wᵀ (h [N, hidden], W [vocab, hidden]) against targets
    [N] (a negative target is ignored; `count` is the number of the others), computed a chunk
    of rows at a time so the [N, vocab] logits never exist whole. The logits are rounded to
    h's dtype and the log-softmax runs in float32 (HF's `logits.float()`).

    With `grad`, also dL/dh (h's dtype) and, with `weight_grad`, dL/dW (float32): the
    gradient of the logits, (softmax - onehot)/count, is formed chunk by chunk and multiplied
    out at once. Returns (loss as a 0-d device array, dh, dW)."""
    acc = accumulate_dtype(h.dtype)
    n = int(h.shape[0])
    vocab = int(head_weight.shape[0])
    total = xp.zeros((), np.float64)
    dh = xp.empty_like(h) if grad else None
    dw = xp.zeros(head_weight.shape, acc) if grad and weight_grad else None
    inv_count = 1.0 / max(count, 1)
    for r0, r1 in head_chunks(n, vocab, chunk_elements):
        rows = xp.arange(r1 - r0)
        hc = h[r0:r1]
        tc = targets[r0:r1]
        valid = tc >= 0
        safe = xp.where(valid, tc, 0)
        logits = matmul(hc, head_weight.T)
        lf = logits.astype(acc)
        del logits
        m = lf.max(axis=-1, keepdims=True)
        lf -= m
        picked = lf[rows, safe]
        xp.exp(lf, out=lf)
        sums = lf.sum(axis=-1)
        losses = xp.log(sums) - picked
        total += (losses * valid).sum(dtype=np.float64)
        if not grad:
            continue
        weight = valid.astype(acc) * inv_count  # [rows]
        lf *= (weight / sums)[:, None]
        lf[rows, safe] -= weight
        dlogits = lf.astype(h.dtype, copy=False)
        del lf
        assert dh is not None
        dh[r0:r1] = matmul(dlogits, head_weight)
        if dw is not None:
            dw += matmul(dlogits.T, hc).astype(acc, copy=False)
    loss = total * inv_count
    return loss, dh, dw


__all__ = [
    "ATTENTION_CHUNK_ELEMENTS",
    "HEAD_CHUNK_ELEMENTS",
    "IGNORE_INDEX",
    "GateKernels",
    "HeadKernels",
    "NormKernels",
    "SoftmaxKernels",
    "accumulate_dtype",
    "attention_at",
    "attention_backward",
    "attention_chunks",
    "attention_forward",
    "attention_with_cache",
    "embedding_backward",
    "embedding_forward",
    "head_cross_entropy",
    "rms_norm_backward",
    "rms_norm_forward",
    "rope_backward",
    "rope_forward",
    "rope_inverse_frequencies",
    "rope_tables",
    "score_starts",
]
