"""LoRA and QLoRA linear layers: a frozen base weight W [out, in] plus a trainable low-rank
update, y = x Wᵀ + s·dropout(x) Aᵀ Bᵀ (+ bias), with PEFT's conventions (A [r, in] kaiming-
uniform, B [out, r] zero, DoRA's detached row norm). `nybble.reference.lora_forward` and
`lora_backward` state the same math in float64.

Arrays are float32 numpy on the CPU (products in the Rust core) or CuPy on the GPU.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from .. import _arrays
from ..tensor import NF4Tensor, quantize
from ._ops import DenseBase, QuantBase, is_gpu, mm, xp_of
from .config import LoraConfig


def _float_matrix(w: Any, what: str) -> np.ndarray:
    """A float32 copy of a 2-D host or device array (the layer owns its weight)."""
    if _arrays.is_cuda(w):
        import cupy

        a = cupy.asarray(w)
        xp: Any = cupy
    else:
        a = _arrays.as_host_array(w, what)
        xp = np
    if a.dtype.name not in _arrays.FLOAT_DTYPES:
        raise ValueError(f"{what} has dtype {a.dtype.name}; expected a float dtype")
    if a.ndim != 2:
        raise ValueError(f"{what} must be 2-D [out, in], got shape {tuple(a.shape)}")
    out = xp.array(a, dtype=np.float32, copy=True)
    if not _all_finite(out):
        raise ValueError(f"{what} has non-finite values")
    return out  # type: ignore[no-any-return]


def _all_finite(a: Any) -> bool:
    """No NaN or inf in `a`, without a temporary the size of `a` (max and min propagate NaN)."""
    return a.size == 0 or bool(xp_of(a).isfinite(a.max()) and xp_of(a).isfinite(a.min()))


def _seed(config: LoraConfig, name: str) -> int:
    """A per-layer seed: stable across runs and independent of the order layers are added."""
    return (config.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


class _LoraLayer:
    """The shared math of LoraLinear and QLoraLinear; subclasses supply the frozen base."""

    _base: DenseBase | QuantBase

    def _init_adapter(self, config: LoraConfig, bias: Any, name: str) -> None:
        self.config = config.validate()
        out_f, in_f = self._base.shape
        if config.r > min(in_f, out_f):
            raise ValueError(
                f"LoRA rank r={config.r} exceeds min(in_features, out_features) "
                f"= {min(in_f, out_f)}"
            )
        self.in_features, self.out_features = in_f, out_f
        self.scaling = config.scaling
        self.name = name
        rng = np.random.default_rng(_seed(config, name))
        if config.init == "kaiming":
            bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform(a=sqrt(5)) as PEFT initialises A
            a = rng.uniform(-bound, bound, size=(config.r, in_f))
        else:
            a = rng.normal(0.0, 1.0 / config.r, size=(config.r, in_f))
        self.lora_a: Any = a.astype(np.float32)
        self.lora_b: Any = np.zeros((out_f, config.r), np.float32)
        self.bias: Any = None
        if bias is not None:
            b = _arrays.as_host_array(bias, "bias").astype(np.float32).reshape(-1)
            if b.shape != (out_f,):
                raise ValueError(f"bias must have shape ({out_f},), got {b.shape}")
            self.bias = b
        # DoRA: the magnitude starts at the row norms of W, so a fresh adapter changes nothing.
        self.lora_magnitude: Any = None
        if config.use_dora:
            self.lora_magnitude = np.asarray(self._row_norms(), np.float32)
        self.training = True
        self.merged = False
        self.enabled = True
        self.grad_a: Any = None
        self.grad_b: Any = None
        self.grad_magnitude: Any = None
        self._dropout_rng = np.random.default_rng(_seed(config, name) + 1)
        self._cache: dict[str, Any] | None = None
        self._merge_norms: Any = None

    # --- parameters -----------------------------------------------------------------------

    @property
    def device(self) -> str:
        return "cuda" if is_gpu(self.lora_a) else "cpu"

    @property
    def trainable_params(self) -> int:
        """r·(in + out) (+ out for the DoRA magnitude)."""
        extra = self.out_features if self.config.use_dora else 0
        return self.config.r * (self.in_features + self.out_features) + extra

    @property
    def total_params(self) -> int:
        bias = self.out_features if self.bias is not None else 0
        return self.in_features * self.out_features + bias + self.trainable_params

    @property
    def compression_ratio(self) -> float:
        """Frozen base parameters per trainable parameter."""
        return self.in_features * self.out_features / self.trainable_params

    def parameters(self) -> dict[str, Any]:
        """The trainable arrays, by PEFT name (updated in place by an optimizer)."""
        p = {"lora_A.weight": self.lora_a, "lora_B.weight": self.lora_b}
        if self.lora_magnitude is not None:
            p["lora_magnitude_vector"] = self.lora_magnitude
        return p

    def gradients(self) -> dict[str, Any]:
        """The gradients of the last backward (None where that backward made none)."""
        g = {"lora_A.weight": self.grad_a, "lora_B.weight": self.grad_b}
        if self.lora_magnitude is not None:
            g["lora_magnitude_vector"] = self.grad_magnitude
        return g

    def _set(self, value: Any, shape: tuple[int, ...], what: str) -> Any:
        xp = xp_of(self.lora_a)
        v = xp.asarray(_arrays.as_host_array(value, what) if xp is np else value)
        if tuple(v.shape) != shape:
            raise ValueError(f"{what} must have shape {shape}, got {tuple(v.shape)}")
        if v.dtype.name not in _arrays.FLOAT_DTYPES:
            raise ValueError(f"{what} has dtype {v.dtype.name}; expected a float dtype")
        v = v.astype(np.float32)
        if not _all_finite(v):
            raise ValueError(f"{what} has non-finite values")
        if self.merged:
            raise ValueError(f"cannot set {what} while merged; unmerge() first")
        return v

    def set_lora_a(self, a: Any) -> None:
        self.lora_a[...] = self._set(a, (self.config.r, self.in_features), "lora_A")

    def set_lora_b(self, b: Any) -> None:
        self.lora_b[...] = self._set(b, (self.out_features, self.config.r), "lora_B")

    def set_lora_magnitude(self, m: Any) -> None:
        if self.lora_magnitude is None:
            raise ValueError("this layer has no DoRA magnitude (use_dora=False)")
        self.lora_magnitude[...] = self._set(m, (self.out_features,), "lora_magnitude")

    # --- modes ----------------------------------------------------------------------------

    def train(self, mode: bool = True) -> _LoraLayer:
        self.training = mode
        return self

    def eval(self) -> _LoraLayer:
        return self.train(False)

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        """Forward as the plain base layer (an unmerged adapter is simply skipped)."""
        self.enabled = False

    # --- forward / backward ---------------------------------------------------------------

    def _row_norms(self) -> Any:
        return self._base.row_norms(self.lora_b, self.lora_a, self.scaling)

    def _input(self, x: Any) -> Any:
        gpu = self.device == "cuda"
        if gpu != _arrays.is_cuda(x):
            raise ValueError(
                f"x is on the {'GPU' if not gpu else 'CPU'} but the layer is on {self.device}"
            )
        if gpu:
            import cupy

            a = cupy.asarray(x)
        else:
            a = _arrays.as_host_array(x, "x")
        if a.dtype.name not in _arrays.FLOAT_DTYPES:
            raise ValueError(f"x has dtype {a.dtype.name}; expected a float dtype")
        if a.ndim == 0 or a.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape [..., {self.in_features}], got {tuple(a.shape)}")
        if not gpu:
            a = np.ascontiguousarray(a, dtype=np.float32)
        elif a.dtype.name == "float64":
            a = a.astype(np.float32)
        if not _all_finite(a):
            raise ValueError("x has non-finite values (NaN or inf)")
        return a

    def _keep_mask(self, shape: tuple[int, ...], xp: Any, dtype: Any) -> Any:
        """Inverted dropout: 1/(1-p) where kept, 0 where dropped; None when inactive."""
        p = self.config.dropout
        if not self.training or p == 0.0:
            return None
        keep = (self._dropout_rng.random(shape) >= p).astype(np.float32) / np.float32(1.0 - p)
        return xp.asarray(keep, dtype=dtype)

    def forward(self, x: Any) -> Any:
        """y = x Wᵀ + s·dropout(x) Aᵀ Bᵀ (+ bias) for x of shape [in] or [..., in]."""
        x = self._input(x)
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, self.in_features)
        xp = xp_of(x2)
        y = self._base.forward(x2)
        cache: dict[str, Any] = {"x_shape": tuple(x.shape), "active": False}
        if self.enabled and not self.merged:
            a = self.lora_a.astype(x2.dtype, copy=False)
            b = self.lora_b.astype(x2.dtype, copy=False)
            keep = self._keep_mask(tuple(x2.shape), xp, x2.dtype)
            xd = x2 if keep is None else x2 * keep
            h = mm(xd, a.T)  # [m, r]
            cache.update(active=True, xd=xd, h=h, keep=keep)
            if self.lora_magnitude is None:
                mm(h, b.T, alpha=self.scaling, out=y, accumulate=True)
            else:
                norms = self._row_norms()  # detached: a constant for the gradients
                g = (self.lora_magnitude / norms).astype(y.dtype)
                base_d = y if keep is None else self._base.forward(xd)
                lora = mm(h, b.T, alpha=self.scaling)
                cache.update(g=g, norms=norms, dora_out=base_d + lora)
                y += (g - 1) * base_d + g * lora
        if self.bias is not None:
            y += xp.asarray(self.bias, dtype=y.dtype)
        self._cache = cache
        return y.reshape(*lead, self.out_features)

    __call__ = forward

    def backward(self, grad_y: Any) -> Any:
        """grad_x for the last forward; fills grad_a, grad_b (and grad_magnitude). W is frozen."""
        c = self._cache
        if c is None:
            raise ValueError("backward() needs a forward() first")
        out_shape = (*c["x_shape"][:-1], self.out_features)
        if tuple(grad_y.shape) != out_shape:
            raise ValueError(f"grad_y must have shape {out_shape}, got {tuple(grad_y.shape)}")
        dy = self._input_grad(grad_y).reshape(-1, self.out_features)
        if not c["active"]:
            self.grad_a = self.grad_b = self.grad_magnitude = None
            return self._base.backward(dy).reshape(c["x_shape"])
        xd, h, keep = c["xd"], c["h"], c["keep"]
        a = self.lora_a.astype(dy.dtype, copy=False)
        b = self.lora_b.astype(dy.dtype, copy=False)
        if self.lora_magnitude is None:
            dyg = dy
        else:
            g = c["g"]
            self.grad_magnitude = (dy * c["dora_out"]).sum(axis=0).astype(np.float32) / c["norms"]
            dyg = dy * g
        self.grad_b = mm(dyg.T, h, alpha=self.scaling).astype(np.float32, copy=False)
        gh = mm(dyg, b, alpha=self.scaling)  # dL/dh, [m, r]
        self.grad_a = mm(gh.T, xd).astype(np.float32, copy=False)
        if self.lora_magnitude is None or keep is None:
            # Without DoRA, or DoRA without dropout: dx = dyg W + (gh A) ⊙ keep.
            dx = self._base.backward(dyg)
            if keep is None:
                mm(gh, a, out=dx, accumulate=True)
            else:
                dx += mm(gh, a) * keep
        else:
            # DoRA with dropout: y = x Wᵀ + (g-1)·(x_d Wᵀ) + g·s·(x_d Aᵀ Bᵀ).
            dx = self._base.backward(dy)
            dxd = self._base.backward(dy * (g - 1))
            mm(gh, a, out=dxd, accumulate=True)
            dx += dxd * keep
        return dx.reshape(c["x_shape"])

    def _input_grad(self, g: Any) -> Any:
        if self.device == "cpu":
            g = np.ascontiguousarray(_arrays.as_host_array(g, "grad_y"), dtype=np.float32)
        if not _all_finite(g):
            raise ValueError("grad_y has non-finite values (NaN or inf)")
        return g

    def _move(self, to: Any) -> None:
        """Moves the adapter's arrays with `to` (cupy.asarray or cupy.asnumpy)."""
        for attr in ("lora_a", "lora_b", "lora_magnitude", "bias", "_merge_norms"):
            v = getattr(self, attr)
            if v is not None:
                setattr(self, attr, to(v))
        self.grad_a = self.grad_b = self.grad_magnitude = None
        self._cache = None

    # --- merging ----------------------------------------------------------------------------

    def delta_weight(self) -> Any:
        """s·B·A [out, in] in float32."""
        return mm(self.lora_b, self.lora_a, alpha=self.scaling)

    def _merged_dense(self, w: Any) -> tuple[Any, Any]:
        """(W + ΔW, or its DoRA form; the DoRA norms used) computed from the unmerged W."""
        with np.errstate(over="ignore", invalid="ignore"):  # callers check finiteness
            merged = w + self.delta_weight()
        if self.lora_magnitude is None:
            return merged, None
        xp = xp_of(merged)
        norms = xp.linalg.norm(merged, axis=1).astype(np.float32)
        return merged * (self.lora_magnitude / norms)[:, None], norms


class LoraLinear(_LoraLayer):
    """A dense frozen weight W [out, in] ([in, out] with fan_in_fan_out) plus LoRA."""

    def __init__(self, weight: Any, config: LoraConfig, bias: Any = None, name: str = "") -> None:
        self.weight = _float_matrix(weight, "weight")
        self._base = DenseBase(self.weight.T if config.fan_in_fan_out else self.weight)
        self._init_adapter(config, bias, name)

    def merge(self) -> None:
        """W ← W + s·B·A (DoRA: m·(W + sBA)/||W + sBA||). Refused (W unchanged) when already
        merged or when the result would not be finite."""
        if self.merged:
            raise ValueError("the adapter is already merged")
        w = self._base.dense()
        merged, norms = self._merged_dense(w)
        if not _all_finite(merged):
            raise ValueError(
                "merging would put non-finite values into the weight; weight unchanged"
            )
        w[...] = merged
        self._merge_norms = norms
        self.merged = True

    def unmerge(self) -> None:
        """Restores W (to within float32 rounding)."""
        if not self.merged:
            raise ValueError("the adapter is not merged")
        w = self._base.dense()
        if self._merge_norms is not None:
            w *= (self._merge_norms / self.lora_magnitude)[:, None]
        w -= self.delta_weight()
        self._merge_norms = None
        self.merged = False

    def merged_weight(self, dtype: Any = "float32") -> Any:
        """W + ΔW in the stored layout, without changing the layer."""
        name = _arrays.output_dtype(dtype)
        w = self._base.dense()
        m = w if self.merged else self._merged_dense(w)[0]
        m = m.T if self.config.fan_in_fan_out else m
        return m.astype(_arrays.numpy_dtype(name))

    def cuda(self) -> LoraLinear:
        import cupy

        self.weight = cupy.asarray(self.weight)
        self._base = DenseBase(self.weight.T if self.config.fan_in_fan_out else self.weight)
        self._move(cupy.asarray)
        return self

    def cpu(self) -> LoraLinear:
        import cupy

        self.weight = cupy.asnumpy(self.weight)
        self._base = DenseBase(self.weight.T if self.config.fan_in_fan_out else self.weight)
        self._move(cupy.asnumpy)
        return self


class QLoraLinear(_LoraLayer):
    """LoRA over a frozen base stored as NF4 (or fp4/int8): the f32 weight is never held whole;
    products dequantize a few rows at a time."""

    def __init__(
        self,
        weight: Any,
        config: LoraConfig,
        blocksize: int = 64,
        double_quant: bool = False,
        bias: Any = None,
        name: str = "",
        codebook: str = "nf4",
    ) -> None:
        if isinstance(weight, NF4Tensor):
            q = weight
            if q.ndim != 2:
                raise ValueError(f"the quantized weight must be 2-D [out, in], got shape {q.shape}")
        else:
            w = _float_matrix(weight, "weight")
            if config.fan_in_fan_out:
                w = w.T.copy()  # the NF4 base is always stored [out, in]
            q = quantize(w, blocksize=blocksize, double_quant=double_quant, codebook=codebook)
        self.qweight = q
        self._base = QuantBase(q)
        self._init_adapter(config, bias, name)

    def dequantize_weight(self, dtype: Any = "float32") -> Any:
        """The base weight W [out, in] dequantized (materializes it: for inspection and export)."""
        return self.qweight.dequantize(dtype)

    def merged_weight(self, dtype: Any = "float32") -> Any:
        """deq(W) + ΔW (DoRA form when enabled), without changing the layer."""
        name = _arrays.output_dtype(dtype)
        merged = self._merged_dense(self.qweight.dequantize("float32"))[0]
        merged = merged.T if self.config.fan_in_fan_out else merged
        return merged.astype(_arrays.numpy_dtype(name))

    def memory_saved_bytes(self) -> int:
        """Bytes of a float32 base weight minus bytes of the quantized one."""
        return 4 * self.in_features * self.out_features - self.qweight.nbytes

    def merge(self) -> None:
        raise ValueError(
            "a QLoRA layer keeps its base quantized; use merged_weight() for W + ΔW "
            "(re-quantizing the sum would lose the adapter's precision)"
        )

    def unmerge(self) -> None:
        raise ValueError("a QLoRA layer is never merged")

    def cuda(self) -> QLoraLinear:
        import cupy

        self.qweight = self.qweight.cuda()
        self._base = QuantBase(self.qweight)
        self._move(cupy.asarray)
        return self

    def cpu(self) -> QLoraLinear:
        import cupy

        self.qweight = self.qweight.cpu()
        self._base = QuantBase(self.qweight)
        self._move(cupy.asnumpy)
        return self
