"""DecoderLM: a decoder-only language model with HF Llama's module names and math, written once
over the backend seam (nybble.backends: numpy + the Rust core on the CPU, CuPy on the GPU).
Its linear projections are LoRA / QLoRA layers (nybble.lora), frozen weights, or trainable
weights (full fine-tuning); every part's backward is written by hand (train/functional.py).

The trainable parameters live in one flat float32 buffer (`flat`), each parameter a view into
it, so the optimizer updates them all with a few whole-buffer operations and a checkpoint
stores them as one array; their gradients are gathered into `flat_gradients()` in the same
order. docs/training.md describes the model, its memory and the dtypes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .. import backends
from ..backends import Array, Backend
from ..formats import numpy_dtype
from ..lora.adapter import LoraAdapter
from ..lora.config import LoraConfig
from ..tensor import NF4Tensor
from . import functional as F
from .config import TransformerConfig
from .linear import (
    FrozenDense,
    FrozenQuantized,
    LoraProjection,
    Projection,
    TrainableDense,
    matmul,
)
from .weights import RandomWeights, WeightSource

#: Projections of a decoder layer by their short name, with their path below the layer.
PROJECTIONS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
#: Compute dtypes the model runs in (float64: the CPU gradient checks, without LoRA).
COMPUTE_DTYPES = ("float32", "bfloat16", "float64")


def layer_prefix(index: int) -> str:
    return f"model.layers.{index}"


@dataclass(frozen=True)  # without slots=True: see below
class _Saved:
    """What a decoder layer's backward needs from its forward. Its arrays are freed when the
    backward drops it, in the order of the fields (the order the GPU run frees them in, which
    the memory estimator records: Python clears `__slots__` sorted by name instead)."""

    x: Array
    rstd_in: Array
    q_raw: Array | None
    rstd_q: Array | None
    k_raw: Array | None
    rstd_k: Array | None
    q: Array
    k: Array
    v: Array
    attn: Array
    lse: Array
    h: Array
    rstd_post: Array
    gate: Array
    up: Array


@dataclass
class Positions:
    """Where a batch's tokens sit: the rotary tables of their positions ([T, D], or [B, T, D]
    when packed samples restart their positions) and, for packed batches, each token's sample
    start [B, T] (attention stays inside a sample), else None."""

    cos: Array
    sin: Array
    starts: Array | None = None


class DecoderLayer:
    """One block: RMSNorm → attention (rotary, GQA, causal) → residual → RMSNorm → SwiGLU MLP →
    residual. Its norm weights live in the model's `weights`; its projections here."""

    def __init__(self, model: DecoderLM, index: int, projections: dict[str, Projection]) -> None:
        self.model = model
        self.index = index
        self.prefix = layer_prefix(index)
        self.proj = projections

    def _w(self, name: str) -> Array:
        return self.model.weights[f"{self.prefix}.{name}.weight"]

    def _head_norms(self) -> tuple[Array | None, Array | None]:
        """The q_norm and k_norm weights (None, None without them)."""
        if not self.model.config.qk_norm:
            return None, None
        return self._w("self_attn.q_norm"), self._w("self_attn.k_norm")

    def project(self, short: str, x: Array) -> Array:
        """x Wᵀ (+ the projection's bias) for a projection by short name."""
        y = self.proj[short].forward(x)
        bias = self.model.weights.get(f"{self.prefix}.{PROJECTIONS[short]}.bias")
        if bias is not None:
            y += bias.astype(y.dtype, copy=False)
        return y

    def project_back(self, short: str, dy: Array) -> Array:
        """dL/dx of `project`, and the bias's gradient when it trains."""
        name = f"{self.prefix}.{PROJECTIONS[short]}.bias"
        if name in self.model.views:
            self.model.set_grad(name, dy.astype(self.model.param_dtype).sum(axis=0))
        return self.proj[short].backward(dy)

    def forward(self, x: Array, keep: bool, positions: Positions) -> tuple[Array, _Saved | None]:
        m = self.model
        cfg, xp = m.config, m.xp
        b, t, hidden = x.shape
        n = b * t
        heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        p = self.proj
        x2 = x.reshape(n, hidden)
        n1, rstd_in = m.norm.forward(x2, self._w("input_layernorm"), cfg.rms_norm_eps)
        q = self.project("q_proj", n1).reshape(b, t, heads, d)
        k = self.project("k_proj", n1).reshape(b, t, kv, d)
        v = self.project("v_proj", n1).reshape(b, t, kv, d)
        del n1
        cos, sin = positions.cos, positions.sin
        q_norm, k_norm = self._head_norms()
        qt, rstd_q = m.heads.forward(q, q_norm, cfg.rms_norm_eps, cos, sin, cfg.group_size)
        kt, rstd_k = m.heads.forward(k, k_norm, cfg.rms_norm_eps, cos, sin, 1)
        kt = kt.reshape(b, kv, t, d)
        vt = xp.ascontiguousarray(v.transpose(0, 2, 1, 3))
        # the projections' outputs: what the norms' backward needs (nothing without norms)
        q_raw, k_raw = (q, k) if cfg.qk_norm else (None, None)
        del q, k, v
        attn, lse = F.attention_forward(
            xp,
            qt,
            kt,
            vt,
            m.scale,
            cfg.sliding_window,
            m.softmax,
            m.attention_chunk_elements,
            positions.starts,
        )
        h = x2 + self.project("o_proj", attn.reshape(n, heads * d))
        y, rstd_post, gate, up = self.mlp(h)
        if not keep:
            for proj in p.values():
                proj.release()
            return y.reshape(b, t, hidden), None
        saved = _Saved(
            x2, rstd_in, q_raw, rstd_q, k_raw, rstd_k, qt, kt, vt, attn, lse, h, rstd_post, gate, up
        )
        return y.reshape(b, t, hidden), saved

    def mlp(self, h: Array) -> tuple[Array, Array, Array, Array]:
        """h + the SwiGLU MLP of h's post-attention norm (h [N, hidden]), and what its
        backward needs: (y, the norm's rstd, gate, up)."""
        m = self.model
        n2, rstd_post = m.norm.forward(
            h, self._w("post_attention_layernorm"), m.config.rms_norm_eps
        )
        gate = self.project("gate_proj", n2)
        up = self.project("up_proj", n2)
        del n2
        y = h + self.project("down_proj", m.gate.forward(gate, up))
        return y, rstd_post, gate, up

    def backward(self, dy: Array, s: _Saved, positions: Positions) -> Array:
        m = self.model
        cfg, xp = m.config, m.xp
        b, t, hidden = dy.shape
        n = b * t
        heads, kv, d, group = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.group_size,
        )
        p = self.proj
        dy2 = dy.reshape(n, hidden)
        # MLP
        da = self.project_back("down_proj", dy2)
        dgate, dup = m.gate.backward(da, s.gate, s.up)
        del da
        dn2 = self.project_back("gate_proj", dgate)
        dn2 += self.project_back("up_proj", dup)
        del dgate, dup
        dh, dw = m.norm.backward(
            dn2, s.h, s.rstd_post, self._w("post_attention_layernorm"), m.norms_trainable
        )
        m.set_grad(f"{self.prefix}.post_attention_layernorm.weight", dw)
        dh += dy2
        # attention
        do = self.project_back("o_proj", dh).reshape(b, t, kv, group, d)
        dq, dk, dv = F.attention_backward(
            xp,
            do,
            s.q,
            s.k,
            s.v,
            s.attn,
            s.lse,
            m.scale,
            cfg.sliding_window,
            m.softmax,
            m.attention_chunk_elements,
            positions.starts,
        )
        del do
        cos, sin = positions.cos, positions.sin
        q_norm, k_norm = self._head_norms()
        dq, dwq = m.heads.backward(
            dq.reshape(b, t, heads, d), s.q_raw, s.rstd_q, q_norm, cos, sin, m.norms_trainable
        )
        dk, dwk = m.heads.backward(dk, s.k_raw, s.rstd_k, k_norm, cos, sin, m.norms_trainable)
        if cfg.qk_norm:
            m.set_grad(f"{self.prefix}.self_attn.q_norm.weight", dwq)
            m.set_grad(f"{self.prefix}.self_attn.k_norm.weight", dwk)
        dn1 = self.project_back("q_proj", dq.reshape(n, heads * d))
        dn1 += self.project_back("k_proj", dk.reshape(n, kv * d))
        dn1 += self.project_back("v_proj", dv.reshape(n, kv * d))
        del dq, dk, dv
        dx, dw = m.norm.backward(dn1, s.x, s.rstd_in, self._w("input_layernorm"), m.norms_trainable)
        m.set_grad(f"{self.prefix}.input_layernorm.weight", dw)
        dx += dh
        m.collect_projection_grads(p.values())
        for proj in p.values():
            proj.release()
        return dx.reshape(b, t, hidden)

    def decode(self, x: Array, cache: LayerCache, start: int) -> Array:
        """The layer over new tokens x [B, n, hidden] at positions start..start+n-1, reading
        and extending its key/value cache (inference only: nothing is kept for backward)."""
        m = self.model
        cfg, xp = m.config, m.xp
        b, t, hidden = x.shape
        n = b * t
        heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x2 = x.reshape(n, hidden)
        n1, _ = m.norm.forward(x2, self._w("input_layernorm"), cfg.rms_norm_eps)
        q = self.project("q_proj", n1).reshape(b, t, heads, d)
        k = self.project("k_proj", n1).reshape(b, t, kv, d)
        v = self.project("v_proj", n1).reshape(b, t, kv, d)
        cos, sin = m.rope(int(cache.k.shape[2]))
        cos, sin = cos[start : start + t], sin[start : start + t]
        q_norm, k_norm = self._head_norms()
        qt, _ = m.heads.forward(q, q_norm, cfg.rms_norm_eps, cos, sin, cfg.group_size)
        kt, _ = m.heads.forward(k, k_norm, cfg.rms_norm_eps, cos, sin, 1)
        cache.k[:, :, start : start + t] = kt.reshape(b, kv, t, d)
        cache.v[:, :, start : start + t] = v.transpose(0, 2, 1, 3)
        attn = F.attention_with_cache(
            xp,
            qt,
            cache.k[:, :, : start + t],
            cache.v[:, :, : start + t],
            start,
            m.scale,
            cfg.sliding_window,
        )
        return self._decode_rest(x2, attn, (b, t, hidden))

    def decode_at(self, x: Array, cache: LayerCache, position: Array, rope: Positions) -> Array:
        """`decode` of one new token x [B, 1, hidden] at a position held on the device (int32
        [1]; `rope` its rotary rows): every shape fixed, nothing read back, so the step can be
        captured in a CUDA graph and replayed for the next position."""
        m = self.model
        cfg, xp = m.config, m.xp
        b, _, hidden = x.shape
        heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x2 = x.reshape(b, hidden)
        n1, _ = m.norm.forward(x2, self._w("input_layernorm"), cfg.rms_norm_eps)
        q = self.project("q_proj", n1).reshape(b, 1, heads, d)
        k = self.project("k_proj", n1).reshape(b, 1, kv, d)
        v = self.project("v_proj", n1).reshape(b, 1, kv, d)
        q_norm, k_norm = self._head_norms()
        qt, _ = m.heads.forward(q, q_norm, cfg.rms_norm_eps, rope.cos, rope.sin, cfg.group_size)
        kt, _ = m.heads.forward(k, k_norm, cfg.rms_norm_eps, rope.cos, rope.sin, 1)
        cache.k[:, :, position] = kt.reshape(b, kv, 1, d)
        cache.v[:, :, position] = v.transpose(0, 2, 1, 3)
        attn = F.attention_at(xp, qt, cache.k, cache.v, position, m.scale, cfg.sliding_window)
        return self._decode_rest(x2, attn, (b, 1, hidden))

    def _decode_rest(self, x2: Array, attn: Array, shape: tuple[int, ...]) -> Array:
        """The layer after attention (o_proj, residual, MLP) of a decode step, out in `shape`."""
        cfg = self.model.config
        h = x2 + self.project(
            "o_proj", attn.reshape(x2.shape[0], cfg.num_attention_heads * cfg.head_dim)
        )
        y, _, _, _ = self.mlp(h)
        for proj in self.proj.values():
            proj.release()
        return y.reshape(shape)


@dataclass(frozen=True, slots=True)
class _HeadSaved:
    """What the backward of the final norm and the LM head needs from the loss."""

    x: Array  # the norm's input [N, hidden]
    rstd: Array  # the norm's rstd
    dh: Array | None  # dL/d(the norm's output), in its dtype
    dw: Array | None  # dL/d(the head's weight), where it trains


@dataclass
class LayerCache:
    """One layer's keys (after rotary positions) and values [B, kv_heads, capacity, D]."""

    k: Array
    v: Array


class DecoderLM:
    """The model. `weights` holds every dense array by HF name (norms, embeddings, the head,
    trainable projection weights; frozen dense projections keep theirs); `layers[i].proj` the
    projections. With `lora`, the projections it targets are LoRA layers over frozen bases
    (NF4 with `quant="nf4"`) and only their A and B train; without, every weight trains."""

    def __init__(
        self,
        config: TransformerConfig,
        backend: Backend,
        *,
        lora: LoraConfig | None = None,
        quant: str | None = None,
        compute_dtype: str = "float32",
        seed: int = 0,
        gradient_checkpointing: bool = False,
        blocksize: int = 64,
        double_quant: bool = False,
        weights: WeightSource | None = None,
        frozen: bool = False,
    ) -> None:
        self.config = config.validate()
        self.backend = backend
        self.xp = backend.xp
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}"
            )
        if compute_dtype == "float64" and (lora is not None or quant is not None):
            raise ValueError("compute_dtype float64 (gradient checks) is for dense models only")
        if quant not in (None, "nf4"):
            raise ValueError(f"quant must be None or 'nf4', got {quant!r}")
        if frozen and lora is not None:
            raise ValueError("frozen (a model for inference) takes no LoRA config")
        if quant is not None and lora is None and not frozen:
            raise ValueError("quant='nf4' freezes the base in 4 bits: it needs a LoRA config")
        self.dtype = np.dtype(numpy_dtype(compute_dtype))
        self.param_dtype = np.dtype(np.float64 if compute_dtype == "float64" else np.float32)
        self.lora = lora
        self.quant = quant
        self.gradient_checkpointing = bool(gradient_checkpointing)
        self.scale = config.head_dim**-0.5
        self.attention_chunk_elements = F.ATTENTION_CHUNK_ELEMENTS
        self.head_chunk_elements = F.HEAD_CHUNK_ELEMENTS
        self.use_fused_kernels(backend.cuda_kernels)
        self.training = True
        #: every weight frozen, nothing trainable (inference: `next_logits`, `loss`)
        self.frozen = bool(frozen)
        #: full fine-tuning: every weight trains
        self.full = lora is None and not frozen
        self.norms_trainable = self.full
        self.adapter = LoraAdapter(lora) if lora is not None else None
        self.weights: dict[str, Array] = {}
        self.grads: dict[str, Array | None] = {}
        self._rope: dict[int, tuple[Array, Array]] = {}
        #: the namespace of the host arrays the weights came in (numpy, or a recording's)
        self._host_xp: ModuleType = np
        #: Trainable parameter names in the order of the flat buffer.
        self.trainable: list[str] = []
        self._dense_trainable: list[str] = []  # those that live in `weights` (not projections)
        source = weights if weights is not None else RandomWeights(seed, config.initializer_range)
        self._build(source, blocksize, double_quant)

    # --- construction ----------------------------------------------------------------------

    def _build(self, source: WeightSource, blocksize: int, double_quant: bool) -> None:
        """Every weight from `source`, asked for once each in HF's order (a random source
        draws them in that order, so both devices start the same)."""
        cfg = self.config
        full = self.full
        initial: dict[str, Array] = {}

        def dense(name: str, value: np.ndarray, trainable: bool) -> None:
            if trainable:
                initial[name] = value
                self.trainable.append(name)
                self._dense_trainable.append(name)
            else:
                self.weights[name] = self._to_device(value, self.dtype)

        def norm(name: str, size: int) -> None:
            value = source.vector(name, size, 1.0)
            if full:
                dense(name, value, True)
            else:
                self.weights[name] = self._to_device(value, self.param_dtype)

        embed = "model.embed_tokens.weight"
        dense(embed, source.matrix(embed, (cfg.vocab_size, cfg.hidden_size)), full)
        shapes = cfg.projection_shapes()
        self.layers: list[DecoderLayer] = []
        for i in range(cfg.num_hidden_layers):
            prefix = layer_prefix(i)
            norm(f"{prefix}.input_layernorm.weight", cfg.hidden_size)
            if cfg.qk_norm:
                norm(f"{prefix}.self_attn.q_norm.weight", cfg.head_dim)
                norm(f"{prefix}.self_attn.k_norm.weight", cfg.head_dim)
            norm(f"{prefix}.post_attention_layernorm.weight", cfg.hidden_size)
            projections: dict[str, Projection] = {}
            for short, path in PROJECTIONS.items():
                name = f"{prefix}.{path}"
                projections[short] = self._projection(
                    name, shapes[path], source, initial, blocksize, double_quant
                )
                if short in cfg.biases:
                    bias = source.vector(f"{name}.bias", shapes[path][0], 0.0)
                    dense(f"{name}.bias", bias, full)
            self.layers.append(DecoderLayer(self, i, projections))
        norm("model.norm.weight", cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            head = "lm_head.weight"
            dense(head, source.matrix(head, (cfg.vocab_size, cfg.hidden_size)), full)
        self._check_targets()
        self._make_flat(initial)

    def _check_targets(self) -> None:
        """ValueError for LoRA targets that name no projection of the model (a typo would
        otherwise train nothing, or not what was meant)."""
        if self.lora is None or self.adapter is None:
            return
        targets = self.lora.target_modules
        names = [f"{layer.prefix}.{path}" for layer in self.layers for path in PROJECTIONS.values()]
        unmatched = (
            [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
            if not isinstance(targets, str)
            else ([] if self.adapter.layers else [targets])
        )
        if unmatched or not self.adapter.layers:
            raise ValueError(
                f"LoRA target_modules {unmatched or targets!r} match no projection of the model "
                f"(its projections: {', '.join(PROJECTIONS)}, or all-linear)"
            )

    def _projection(
        self,
        name: str,
        shape: tuple[int, int],
        source: WeightSource,
        initial: dict[str, Array],
        blocksize: int,
        double_quant: bool,
    ) -> Projection:
        backend = self.backend
        weight = f"{name}.weight"
        if self.full:
            w = np.asarray(source.matrix(weight, shape), np.float32)
            initial[weight] = w
            self.trainable.append(weight)
            return TrainableDense(name, w, backend, self.dtype)  # weight: a view, once flat
        base: NF4Tensor | np.ndarray
        if self.quant is not None:
            base = source.quantized(weight, shape, blocksize, double_quant)
        else:
            base = source.matrix(weight, shape)
        if self.lora is not None and self.lora.targets(name):
            assert self.adapter is not None
            if not isinstance(base, NF4Tensor):
                base = backends.of(base).xp.asarray(base, np.float32)
            layer = self.adapter.add_layer(name, base)
            layer._to(backend)  # built on the host: its arrays to the model's device
            projection = LoraProjection(name, layer, self.dtype)
            for pname, value in projection.parameters().items():
                initial[pname] = backend.to_host(value)
                self.trainable.append(pname)
            return projection
        if isinstance(base, NF4Tensor):
            return FrozenQuantized(name, base._moved(backend), backend)
        return FrozenDense(name, self._to_device(base, self.dtype), backend)

    def _to_device(self, host: Array, dtype: DTypeLike) -> Array:
        """A host array on the model's device in `dtype`, made contiguous by the namespace of
        the host arrays (numpy's, or a recording's, whose host arrays hold no values)."""
        xp = backends.of(host).xp
        self._host_xp = xp
        return self.backend.from_host(xp.ascontiguousarray(host, dtype=dtype))

    def _make_flat(self, initial: dict[str, Array]) -> None:
        """One buffer for all trainable parameters; each becomes a view of it."""
        xp = self.xp
        sizes = [int(initial[name].size) for name in self.trainable]
        self.flat = xp.empty(sum(sizes), self.param_dtype)
        self.flat_grad = xp.zeros_like(self.flat)
        self.views: dict[str, Array] = {}
        #: name -> (offset, shape) of each parameter in the flat buffer
        self.offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, size in zip(self.trainable, sizes, strict=True):
            host = initial[name]
            view = self.flat[offset : offset + size].reshape(host.shape)
            view[...] = self._to_device(host, self.param_dtype)
            self.views[name] = view
            self.offsets[name] = (offset, tuple(host.shape))
            offset += size
        self.lora_projections: dict[str, LoraProjection] = {}
        for layer in self.layers:
            for proj in layer.proj.values():
                if isinstance(proj, LoraProjection):
                    self.lora_projections[proj.name] = proj
                    lora_layer = proj.layer
                    lora_layer.lora_a = self.views[f"{proj.name}.lora_A.weight"]
                    lora_layer.lora_b = self.views[f"{proj.name}.lora_B.weight"]
                    if lora_layer.lora_magnitude is not None:
                        magnitude = self.views[f"{proj.name}.lora_magnitude_vector"]
                        lora_layer.lora_magnitude = magnitude
                elif isinstance(proj, TrainableDense):
                    proj.weight = self.views[f"{proj.name}.weight"]
        for name in self._dense_trainable:
            self.weights[name] = self.views[name]

    # --- switches ----------------------------------------------------------------------------

    def use_fused_kernels(self, fused: bool) -> None:
        """On the GPU, the fused kernels (train/_cuda.py: softmax, SwiGLU, RMSNorm, the heads'
        norm and rotary positions) for bfloat16 and float32; otherwise (and always on the CPU)
        the same math in xp (train/functional.py)."""
        self.softmax: Any = F.SoftmaxKernels(self.xp)
        self.gate: Any = F.GateKernels(self.xp)
        self.norm: Any = F.NormKernels(self.xp)
        self.heads: Any = F.HeadKernels(self.xp)
        if fused and self.backend.cuda_kernels:  # the GPU (or a recording of it)
            from . import _cuda

            if _cuda.supports(self.dtype):
                self.softmax = _cuda.FusedSoftmax()
                self.gate = _cuda.FusedGate()
                self.norm = _cuda.FusedNorm()
                self.heads = _cuda.FusedHeads()

    def train(self, mode: bool = True) -> None:
        self.training = mode
        if self.adapter is not None:
            self.adapter.train(mode)

    # --- pieces used by the layers -------------------------------------------------------------

    def rope(self, length: int) -> tuple[Array, Array]:
        """cos, sin [length, head_dim] in the compute dtype (HF casts them to the activations'
        dtype too)."""
        found = self._rope.get(length)
        if found is None:
            cos, sin = F.rope_tables(self.config, length, self._host_xp)
            found = self._rope[length] = (
                self._to_device(cos, self.dtype),
                self._to_device(sin, self.dtype),
            )
        return found

    def positions(self, batch: int, length: int, starts: Array | None) -> Positions:
        """A batch's positions: 0..length-1 in every row, or, for packed rows (`starts` [B, T]
        on the device, int32: the index where each token's sample begins), the position of
        each token within its sample."""
        cos, sin = self.rope(length)
        if starts is None:
            return Positions(cos, sin)
        within = self.xp.arange(length, dtype=np.int32)[None, :] - starts
        return Positions(cos[within], sin[within], starts)

    def set_grad(self, name: str, grad: Array | None) -> None:
        if grad is not None:
            self.grads[name] = grad

    def collect_projection_grads(self, projections: Iterable[Projection]) -> None:
        for proj in projections:
            for name, grad in proj.gradients().items():
                if grad is not None:
                    self.grads[name] = grad

    def _mm(self, a: Array, b: Array) -> Array:
        return matmul(self.backend, a, b)

    def _compute(self, name: str) -> Array:
        """A dense weight in the compute dtype (a trainable one's master cast for this use)."""
        return self.weights[name].astype(self.dtype, copy=False)

    def head_weight(self) -> Array:
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return self._compute(name)

    # --- forward and backward ----------------------------------------------------------------

    def _embed(self, ids: Array) -> Array:
        return F.embedding_forward(self.weights["model.embed_tokens.weight"], ids, self.dtype)

    def _final(self, x: Array, targets: Array, count: int, grad: bool) -> tuple[Array, _HeadSaved]:
        cfg, xp = self.config, self.xp
        n = x.shape[0] * x.shape[1]
        x2 = x.reshape(n, cfg.hidden_size)
        h, rstd = self.norm.forward(x2, self.weights["model.norm.weight"], cfg.rms_norm_eps)
        head = self.head_weight()
        loss, dh, dw = F.head_cross_entropy(
            xp,
            h,
            head,
            targets.reshape(-1),
            count,
            self._mm,
            grad=grad,
            weight_grad=grad and self.full,
            chunk_elements=self.head_chunk_elements,
        )
        return loss, _HeadSaved(x2, rstd, dh, dw)

    def cast_adapters(self, on: bool) -> None:
        """With `on`, every LoRA projection's A and B in the compute dtype for this step, cast
        in one launch (views of one cast of the flat buffer); without, none (the parameters
        are about to change)."""
        flat = None
        # (where the products run in the compute dtype: the CPU's layers multiply float32)
        if on and not self.backend.float32_products and self.dtype != self.param_dtype:
            flat = self.flat.astype(self.dtype)
        for proj in self.lora_projections.values():
            if flat is None:
                proj.casts = None
                continue
            a, b = (self.offsets[f"{proj.name}.lora_{m}.weight"] for m in "AB")
            proj.casts = (
                flat[a[0] : a[0] + int(np.prod(a[1]))].reshape(a[1]),
                flat[b[0] : b[0] + int(np.prod(b[1]))].reshape(b[1]),
            )

    def loss(self, ids: Array, targets: Array, count: int, starts: Array | None = None) -> Array:
        """Mean cross-entropy (a 0-d device array) of next-token predictions: ids and targets
        [B, T] on the device, `count` targets not ignored (negative ones are); `starts` for
        packed rows (see `positions`)."""
        self.cast_adapters(True)
        try:
            positions = self.positions(int(ids.shape[0]), int(ids.shape[1]), starts)
            x = self._embed(ids)
            for layer in self.layers:
                x, _ = layer.forward(x, False, positions)
            loss, _ = self._final(x, targets, count, grad=False)
        finally:
            self.cast_adapters(False)
        return loss

    def forward_backward(
        self, ids: Array, targets: Array, count: int, starts: Array | None = None
    ) -> Array:
        """The loss of one batch, and every trainable parameter's gradient in `grads` (read
        with `flat_gradients()`)."""
        self.cast_adapters(True)
        try:
            return self._forward_backward(ids, targets, count, starts)
        finally:
            self.cast_adapters(False)

    def _forward_backward(
        self, ids: Array, targets: Array, count: int, starts: Array | None
    ) -> Array:
        if self.frozen:
            raise ValueError("this model is frozen (built for inference): it has nothing to train")
        cfg, xp = self.config, self.xp
        self.grads = {}
        positions = self.positions(int(ids.shape[0]), int(ids.shape[1]), starts)
        x = self._embed(ids)
        inputs: list[Array] = []
        saved: list[_Saved | None] = []
        dropout: list[dict[str, int | None]] = []
        for layer in self.layers:
            if self.gradient_checkpointing:
                inputs.append(x)
                dropout.append(self._dropout_states(layer))
                x, _ = layer.forward(x, False, positions)
            else:
                x, s = layer.forward(x, True, positions)
                saved.append(s)
        loss, head = self._final(x, targets, count, grad=True)
        x2, rstd, dh, dw_head = head.x, head.rstd, head.dh, head.dw
        del x, head
        dx, dw = self.norm.backward(
            dh, x2, rstd, self.weights["model.norm.weight"], self.norms_trainable
        )
        del dh, x2
        self.set_grad("model.norm.weight", dw)
        dx = dx.reshape(ids.shape[0], ids.shape[1], cfg.hidden_size)
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            if self.gradient_checkpointing:
                self._set_dropout_states(layer, dropout[i])
                _, s = layer.forward(inputs.pop(), True, positions)
            else:
                s = saved.pop()
            assert s is not None
            dx = layer.backward(dx, s, positions)
            del s
        if self.full:
            embed = "model.embed_tokens.weight"
            de = F.embedding_backward(
                xp, dx.reshape(-1, cfg.hidden_size), ids.reshape(-1), cfg.vocab_size
            )
            if cfg.tie_word_embeddings:
                de += dw_head
            else:
                self.set_grad("lm_head.weight", dw_head)
            self.set_grad(embed, de.astype(self.param_dtype, copy=False))
        return loss

    # --- inference with a key/value cache ------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> list[LayerCache]:
        """Empty key/value caches for `capacity` positions, one per layer."""
        cfg = self.config
        shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        return [
            LayerCache(self.xp.zeros(shape, self.dtype), self.xp.zeros(shape, self.dtype))
            for _ in self.layers
        ]

    def next_logits(self, ids: Array, cache: list[LayerCache], start: int) -> Array:
        """float32 logits [B, vocab] of the token after ids [B, n] (device), which sit at
        positions start..start+n-1 after the `start` positions the caches hold; the caches
        take the new positions' keys and values. Dropout off, nothing kept for backward."""
        cfg = self.config
        capacity = int(cache[0].k.shape[2])
        t = int(ids.shape[1])
        if start + t > capacity:
            raise ValueError(f"the cache holds {capacity} positions; {start + t} are needed")
        x = self._embed(ids)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer.decode(x, layer_cache, start)
        last = x[:, -1, :]
        h, _ = self.norm.forward(
            self.xp.ascontiguousarray(last), self.weights["model.norm.weight"], cfg.rms_norm_eps
        )
        return self._mm(h, self.head_weight().T).astype(np.float32)

    def logits_at(self, token: Array, cache: list[LayerCache], position: Array) -> Array:
        """`next_logits` of one token per row (token [B, 1] and its position, int32 [1], both
        on the device) with every shape fixed and nothing read back: the step a CUDA graph
        captures (generate.py) and replays for each next token."""
        cfg = self.config
        cos, sin = self.rope(int(cache[0].k.shape[2]))
        rope = Positions(cos[position], sin[position])
        x = self._embed(token)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer.decode_at(x, layer_cache, position, rope)
        h, _ = self.norm.forward(x[:, 0, :], self.weights["model.norm.weight"], cfg.rms_norm_eps)
        return self._mm(h, self.head_weight().T).astype(np.float32)

    def _dropout_states(self, layer: DecoderLayer) -> dict[str, int | None]:
        return {
            p.name: p.dropout_state() for p in layer.proj.values() if isinstance(p, LoraProjection)
        }

    def _set_dropout_states(self, layer: DecoderLayer, states: dict[str, int | None]) -> None:
        for proj in layer.proj.values():
            if isinstance(proj, LoraProjection):
                proj.set_dropout_state(states.get(proj.name))

    def flat_gradients(self) -> Array:
        """The last backward's gradients in the flat buffer's order (0 for a parameter that
        got none)."""
        parts = []
        for name in self.trainable:
            g = self.grads.get(name)
            if g is None:
                g = self.xp.zeros(self.views[name].shape, self.param_dtype)
            parts.append(g.reshape(-1).astype(self.param_dtype, copy=False))
        self.xp.concatenate(parts, out=self.flat_grad)
        self.grads = {}
        return self.flat_grad

    # --- export ------------------------------------------------------------------------------

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight of the base model by HF name, in HF's order (a tied head has none)."""
        cfg = self.config
        out: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)
        }
        shapes = cfg.projection_shapes()
        for layer in self.layers:
            prefix = layer.prefix
            out[f"{prefix}.input_layernorm.weight"] = (cfg.hidden_size,)
            if cfg.qk_norm:
                out[f"{prefix}.self_attn.q_norm.weight"] = (cfg.head_dim,)
                out[f"{prefix}.self_attn.k_norm.weight"] = (cfg.head_dim,)
            out[f"{prefix}.post_attention_layernorm.weight"] = (cfg.hidden_size,)
            for short, path in PROJECTIONS.items():
                out[f"{prefix}.{path}.weight"] = shapes[path]
                if short in cfg.biases:
                    out[f"{prefix}.{path}.bias"] = (shapes[path][0],)
        out["model.norm.weight"] = (cfg.hidden_size,)
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every weight of the base model by HF name, as host float32 (quantized weights
        dequantized, frozen 16-bit ones widened exactly; a tied head has no entry)."""
        to_host = self.backend.to_host
        projections = {f"{p.name}.weight": p for layer in self.layers for p in layer.proj.values()}
        out: dict[str, np.ndarray] = {}
        for name in self.weight_shapes():
            proj = projections.get(name)
            value = proj.base_weight() if proj is not None else self.weights[name]
            out[name] = np.asarray(to_host(value), dtype=np.float32)
        return out

    def named_parameters(self) -> dict[str, Array]:
        """The trainable parameters (views into `flat`), by name: `<module>.lora_A.weight`
        etc. with LoRA, the HF weight names without."""
        return dict(self.views)


__all__ = [
    "COMPUTE_DTYPES",
    "PROJECTIONS",
    "DecoderLM",
    "DecoderLayer",
    "LayerCache",
    "Positions",
    "layer_prefix",
]
