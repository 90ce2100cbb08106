"""LoRA and QLoRA linear layers: a frozen base weight W [out, in] plus a trainable low-rank
update, y = x Wᵀ + s·dropout(x) Aᵀ Bᵀ (+ bias), with PEFT's conventions (A [r, in] kaiming-
uniform, B [out, r] zero, DoRA's detached row norm); docs/lora.md. `nybble.reference`'s
`lora_forward` and `lora_backward` state the same math in float64.

The layer's arrays live on one device (numpy on the CPU, CuPy on the GPU) and its work goes
to that device's backend. Dtypes, the same rule on both devices: activations keep their dtype
(float32, float16 or bfloat16 in gives the same out; float64 is computed and returned as
float32); products sum in float32; the trainable parameters and their gradients are float32.
On the CPU every product runs in float32 and only the result is rounded to the activation
dtype; on the GPU the products take the activation dtype (cuBLAS, float32 sums), as PEFT does.

Non-finite activations: on the CPU forward/backward raise NonFiniteError at once; on the GPU
they are found on the device without a wait and raised by `check()`, which AdamW.step's own
gradient check makes unnecessary in training (a NaN input gives NaN gradients).

Threads: the state of a forward/backward pair (what backward needs, the gradients it fills)
belongs to the thread that ran it, so threads sharing a layer each get their own gradients.
"""

from __future__ import annotations

import math
import threading
import zlib
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .. import backends, formats
from ..backends import Array, Backend
from ..errors import NonFiniteError
from ..formats import OutputDtype, Packed
from ..tensor import NF4Tensor, quantize
from . import dropout
from .config import LoraConfig


class _CallState(threading.local):
    """One thread's forward/backward state."""

    cache: dict[str, Any] | None = None
    grad_a: Array | None = None
    grad_b: Array | None = None
    grad_magnitude: Array | None = None


class DenseBase:
    """A frozen dense weight W [out, in] (possibly a transposed view of the stored array)."""

    def __init__(self, w: Array, backend: Backend) -> None:
        self.w = w
        self.backend = backend
        self._casts: dict[str, Array] = {}  # W in a 16-bit activation dtype, made once

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.w.shape[0]), int(self.w.shape[1]))

    def _as(self, dtype: DTypeLike) -> Array:
        if dtype == self.w.dtype:
            return self.w
        name = formats.dtype_name(dtype)
        cast = self._casts.get(name)
        if cast is None:
            cast = self._casts[name] = self.w.astype(dtype)
        return cast

    def forward(self, x: Array, out: Array | None = None, accumulate: bool = False) -> Array:
        """x @ Wᵀ (into `out`, or added to it)"""
        return self.backend.matmul(x, self._as(x.dtype).T, out=out, accumulate=accumulate)

    def backward(self, dy: Array, out: Array | None = None, accumulate: bool = False) -> Array:
        """dy @ W (into `out`, or added to it)"""
        return self.backend.matmul(dy, self._as(dy.dtype), out=out, accumulate=accumulate)

    def row_norms(self, b: Array, a: Array, scaling: float) -> Array:
        """||W + s·B·A|| per row."""
        return self.backend.dora_row_norms(self.w, b, a, scaling)

    def dense(self) -> Array:
        return self.w

    def changed(self) -> None:
        """W was changed in place (merge, unmerge): its casts are stale."""
        self._casts.clear()


class QuantBase:
    """A frozen quantized weight W [out, in]; products dequantize tiles, never all of W in
    float32."""

    def __init__(self, q: NF4Tensor) -> None:
        self.q = q
        self.packed: Packed = q.packed
        self.backend = backends.of(q.codes)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def forward(self, x: Array, out: Array | None = None, accumulate: bool = False) -> Array:
        return self.backend.quantized_matmul(x, self.packed, True, out, accumulate)

    def backward(self, dy: Array, out: Array | None = None, accumulate: bool = False) -> Array:
        return self.backend.quantized_matmul(dy, self.packed, False, out, accumulate)

    def row_norms(self, b: Array, a: Array, scaling: float) -> Array:
        return self.backend.dora_row_norms(self.packed, b, a, scaling)

    def dense(self) -> Array:
        return self.q.dequantize("float32")

    def changed(self) -> None:
        pass


def _check_config(config: object) -> None:
    if not isinstance(config, LoraConfig):
        raise ValueError(
            f"config must be a nybble.LoraConfig (LoraConfig(r=..., alpha=...)), got "
            f"{type(config).__name__}"
        )


def _float_matrix(w: object, what: str) -> Array:
    """A float32 copy of a 2-D host or device array (the layer owns its weight), finite."""
    backend = backends.of(w)
    a = backend.float_array(w, what)
    if a.ndim != 2:
        raise ValueError(f"{what} must be 2-D [out, in], got shape {tuple(a.shape)}")
    with np.errstate(over="ignore"):  # float64 beyond float32: inf, refused just below
        out = backend.xp.array(a, dtype=np.float32, copy=True)
    bad = backend.first_non_finite(out)
    if bad is not None:
        raise NonFiniteError(bad, what)
    return out


def _dense_base(weight: Any, fan_in_fan_out: bool) -> DenseBase:
    """The frozen base over a stored weight: [out, in], or [in, out] with fan_in_fan_out."""
    return DenseBase(weight.T if fan_in_fan_out else weight, backends.of(weight))


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
        backend = self._base.backend
        rng = backend.random(_seed(config, name))
        if config.init == "kaiming":
            bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform(a=sqrt(5)) as PEFT initialises A
            a = rng.uniform(-bound, bound, size=(config.r, in_f))
        else:
            a = rng.normal(0.0, 1.0 / config.r, size=(config.r, in_f))
        self.lora_a: Array = backend.from_host(a.astype(np.float32))
        self.lora_b: Array = backend.xp.zeros((out_f, config.r), np.float32)
        self.bias: Array | None = None
        if bias is not None:
            self.bias = self._checked(bias, (out_f,), "bias", backend)
        # DoRA: the magnitude starts at the row norms of W, so a fresh adapter changes nothing.
        self.lora_magnitude: Array | None = None
        if config.use_dora:
            self.lora_magnitude = backend.xp.asarray(self._row_norms(), np.float32)
        self.training = True
        self.merged = False
        self.enabled = True
        self._calls = _CallState()
        self._finite = backend.finite_check()
        self._dropout_seed = _seed(config, name) + 1
        #: Dropout masks drawn so far; with the seed, all that decides the next one.
        self.dropout_draws = 0
        self._merge_norms: Array | None = None
        self._casts: tuple[Array, Array] | None = None

    # --- parameters -----------------------------------------------------------------------

    @property
    def device(self) -> backends.Device:
        return self._base.backend.device

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

    @property
    def grad_a(self) -> Any:
        """dL/dA of this thread's last backward (None before one, or when the adapter was
        inactive)."""
        return self._calls.grad_a

    @property
    def grad_b(self) -> Any:
        return self._calls.grad_b

    @property
    def grad_magnitude(self) -> Any:
        return self._calls.grad_magnitude

    def parameters(self) -> dict[str, Any]:
        """The trainable arrays, by PEFT name (updated in place by an optimizer)."""
        p = {"lora_A.weight": self.lora_a, "lora_B.weight": self.lora_b}
        if self.lora_magnitude is not None:
            p["lora_magnitude_vector"] = self.lora_magnitude
        return p

    def gradients(self) -> dict[str, Any]:
        """The gradients of this thread's last backward (None where it made none)."""
        g = {"lora_A.weight": self.grad_a, "lora_B.weight": self.grad_b}
        if self.lora_magnitude is not None:
            g["lora_magnitude_vector"] = self.grad_magnitude
        return g

    def _checked(self, value: object, shape: tuple[int, ...], what: str, backend: Backend) -> Array:
        """`value` as a finite float32 array of `shape` on the layer's device (host values are
        copied to a GPU layer)."""
        source = backends.of(value)
        v = source.float_array(value, what)
        if source.device != backend.device:
            if source.device != "cpu":
                raise ValueError(f"{what} is on {source.device}, the layer on {backend.device}")
            v = backend.from_host(v)
        if tuple(v.shape) != shape:
            raise ValueError(f"{what} must have shape {shape}, got {tuple(v.shape)}")
        with np.errstate(over="ignore"):  # float64 beyond float32: inf, refused just below
            v = v.astype(np.float32)
        bad = backend.first_non_finite(v)
        if bad is not None:
            raise NonFiniteError(bad, what)
        return v

    def _set(self, value: object, shape: tuple[int, ...], what: str) -> Array:
        v = self._checked(value, shape, what, self._base.backend)
        if self.merged:
            raise ValueError(f"cannot set {what} while merged; unmerge() first")
        return v

    def use_casts(self, casts: tuple[Array, Array] | None) -> None:
        """A and B already cast to an activation dtype, for the forwards that follow (None:
        cast them in each forward, the default). A trainer casts all its adapters' parameters
        in one launch per step instead of two per forward, and clears these before the
        parameters change; setting A or B clears them too."""
        self._casts = casts

    def set_lora_a(self, a: Any) -> None:
        self.lora_a[...] = self._set(a, (self.config.r, self.in_features), "lora_A")
        self._casts = None

    def set_lora_b(self, b: Any) -> None:
        self.lora_b[...] = self._set(b, (self.out_features, self.config.r), "lora_B")
        self._casts = None

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
        """Forward as the plain base layer: a merged adapter is unmerged first (as PEFT
        does), an unmerged one is simply skipped."""
        if self.merged:
            self.unmerge()
        self.enabled = False

    def unmerge(self) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        c = self.config
        extras = [f"r={c.r}", f"lora_alpha={c.alpha:g}", f"scaling={self.scaling:g}"]
        if c.dropout:
            extras.append(f"lora_dropout={c.dropout:g}")
        extras += [flag for flag in ("use_dora", "use_rslora") if getattr(c, flag)]
        state = [
            s
            for s, on in (
                ("merged", self.merged),
                ("disabled", not self.enabled),
                ("eval", not self.training),
            )
            if on
        ]
        name = f"{self.name!r}, " if self.name else ""
        return (
            f"{type(self).__name__}({name}in={self.in_features}, out={self.out_features}, "
            f"{', '.join(extras)}, {self._base_repr()}, device={self.device!r}"
            f"{', ' + ', '.join(state) if state else ''})"
        )

    def _base_repr(self) -> str:
        return "bias" if self.bias is not None else "no bias"

    def check(self) -> None:
        """NonFiniteError if an activation or gradient given to this layer since the last
        check held NaN or ±inf (on the GPU, where forward and backward do not wait for the
        device to find out; on the CPU they raise at once and this does nothing)."""
        self._finite.raise_pending()

    # --- forward / backward ---------------------------------------------------------------

    def _row_norms(self) -> Array:
        return self._base.row_norms(self.lora_b, self.lora_a, self.scaling)

    def _activation(
        self, x: object, what: str, width: int, scan: bool = True
    ) -> tuple[Array, OutputDtype, tuple[int, ...]]:
        """x as a 2-D array of the compute dtype, the dtype to return results in, and x's
        leading shape; checked for non-finite values (unless `scan` is False, for a caller
        that checks a product of it instead: see _record_rows)."""
        backend = self._base.backend
        source = backends.of(x)
        if source.device != backend.device:
            raise ValueError(f"{what} is on {source.device} but the layer is on {backend.device}")
        a = backend.float_array(x, what)
        if a.ndim == 0 or a.shape[-1] != width:
            raise ValueError(f"{what} must have shape [..., {width}], got {tuple(a.shape)}")
        name = formats.dtype_name(a.dtype)
        out: OutputDtype = "float32" if name == "float64" else formats.output_dtype(name)
        compute = backends.compute_dtype(backend, out)
        lead = tuple(a.shape[:-1])
        if a.ndim != 2:
            a = a.reshape(-1, width)
        if name == "float64":
            with np.errstate(over="ignore"):  # float64 beyond float32 becomes inf, found next
                a = backend.xp.ascontiguousarray(a, dtype=compute)
        else:
            a = backend.xp.ascontiguousarray(a, dtype=compute)
        if scan or backends.checks_at_once(backend):
            self._finite.record(a, what)
        return a, out, lead

    def _record_rows(self, product: Array, a: Array, what: str) -> None:
        """On the GPU, the non-finite check of an activation `a` [m, width] through its
        product with a LoRA matrix ([m, r]): a NaN or ±inf anywhere in a row of `a` makes
        that whole row of the product NaN or ±inf (inf·0 is NaN), so scanning the product,
        r values a row, finds every row the full scan would, without another pass over `a`.
        The error then names the first element of the first such row. (The CPU scans `a`
        itself, at once, where the scan costs no wait.)"""
        if not backends.checks_at_once(self._base.backend):
            self._finite.record(product, what, row_stride=int(a.shape[-1]))

    def _result(
        self, y: Array, dtype: OutputDtype, shape: tuple[int, ...], out: Any, what: str
    ) -> Any:
        """y of `shape` in `dtype`; written into `out` (checked) when one is given."""
        if y.shape != shape:
            y = y.reshape(shape)
        if formats.dtype_name(y.dtype) != dtype:
            y = y.astype(formats.numpy_dtype(dtype))
        if out is None:
            return y
        if (
            backends.of(out).device != self.device
            or tuple(out.shape) != shape
            or formats.dtype_name(out.dtype) != dtype
        ):
            raise ValueError(
                f"{what}: expected a {dtype} array of shape {shape} on {self.device}, got "
                f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}"
            )
        out[...] = y
        return out

    def _keep_mask(self, shape: tuple[int, ...], dtype: DTypeLike) -> Array | None:
        """Inverted dropout: 1/(1-p) where kept, 0 where dropped; None when inactive. Made on
        the layer's device from (seed, draw count, element) alone (nybble.lora.dropout): the
        same masks on the CPU and the GPU, and `dropout_draws` is the whole stream's state."""
        p = self.config.dropout
        if not self.training or p == 0.0:
            return None
        xp = self._base.backend.xp
        keep = dropout.keep_mask(xp, shape, p, self._dropout_seed, self.dropout_draws, dtype)
        self.dropout_draws += 1
        return keep

    def forward(self, x: Any, out: Any = None) -> Any:
        """y = x Wᵀ + s·dropout(x) Aᵀ Bᵀ (+ bias) for x of shape [in] or [..., in], in x's
        dtype (float32 for float64); written into `out` when given."""
        active = self.enabled and not self.merged
        x2, out_dtype, lead = self._activation(x, "x", self.in_features, scan=not active)
        backend = self._base.backend
        cache: dict[str, Any] = {"lead": lead, "active": active}
        if not active:
            y = self._base.forward(x2)
        else:
            # The parameters in the compute dtype, cast once for this forward and its backward.
            casts = self._casts
            if casts is not None and casts[0].dtype == x2.dtype:
                a, b = casts
            else:
                a, b = backend.astype_pair(self.lora_a, self.lora_b, x2.dtype)
            keep = self._keep_mask(tuple(x2.shape), x2.dtype)
            xd = x2 if keep is None else x2 * keep
            h = backend.matmul(xd, a.T)  # [m, r]
            self._record_rows(h, x2, "x")
            cache.update(xd=xd, h=h, keep=keep, a=a, b=b)
            if self.lora_magnitude is None:
                # s·h·Bᵀ first, then the base product adds itself to it inside its GEMM.
                y = backend.matmul(h, b.T, alpha=self.scaling)
                self._base.forward(x2, out=y, accumulate=True)
            else:
                norms = self._row_norms()  # detached: a constant for the gradients
                g = (self.lora_magnitude / norms).astype(x2.dtype)
                lora = backend.matmul(h, b.T, alpha=self.scaling)
                y = self._base.forward(x2)
                base_d = y if keep is None else self._base.forward(xd)
                dora_out = base_d + lora
                cache.update(g=g, norms=norms, dora_out=dora_out)
                if keep is None:
                    y = dora_out * g  # x (g·(W + sBA))ᵀ
                else:
                    y += (g - 1) * base_d + g * lora
        if self.bias is not None:
            y += self.bias.astype(y.dtype, copy=False)
        self._calls.cache = cache
        return self._result(y, out_dtype, (*lead, self.out_features), out, "out")

    __call__ = forward

    def backward(self, grad_y: Any, out: Any = None) -> Any:
        """grad_x for this thread's last forward, in grad_y's dtype (into `out` when given);
        fills grad_a, grad_b (and grad_magnitude) in float32. W is frozen."""
        c = self._calls.cache
        if c is None:
            raise ValueError("backward() needs a forward() first (in this thread)")
        out_shape = (*c["lead"], self.out_features)
        shape = tuple(getattr(grad_y, "shape", np.shape(grad_y)))
        if shape != out_shape:
            raise ValueError(f"grad_y must have shape {out_shape}, got {shape}")
        dy, gx_dtype, _ = self._activation(
            grad_y, "grad_y", self.out_features, scan=not c["active"]
        )
        calls = self._calls
        in_shape = (*c["lead"], self.in_features)
        if not c["active"]:
            calls.grad_a = calls.grad_b = calls.grad_magnitude = None
            return self._result(self._base.backward(dy), gx_dtype, in_shape, out, "out")
        backend = self._base.backend
        xd, h, keep, a, b = c["xd"], c["h"], c["keep"], c["a"], c["b"]
        if dy.dtype != xd.dtype:  # a gradient in another dtype than the forward's activation
            dy = dy.astype(xd.dtype)
        f32 = np.float32
        if self.lora_magnitude is None:
            dyg = dy
        else:
            g = c["g"]
            grad_m = (dy * c["dora_out"]).sum(axis=0, dtype=f32) / c["norms"]
            calls.grad_magnitude = grad_m.astype(f32, copy=False)
            dyg = dy * g
        # The order of these allocations decides which blocks CuPy's pool reuses (the memory
        # estimator records it from this code: nybble.memory.trainer_run).
        calls.grad_b = backend.matmul(dyg.T, h, alpha=self.scaling, out_dtype=f32)
        gh = backend.matmul(dyg, b, alpha=self.scaling)  # dL/dh, [m, r]
        self._record_rows(gh, dy, "grad_y")
        calls.grad_a = backend.matmul(gh.T, xd, out_dtype=f32)
        dx = backend.matmul(gh, a)  # the LoRA branch's part of dL/dx, [m, in]
        if keep is not None:
            dx *= keep
        if self.lora_magnitude is None:
            self._base.backward(dyg, out=dx, accumulate=True)  # + dyg·W, inside the GEMM
        elif keep is None:  # DoRA without dropout: dx = (dy·g)·W + (gh·A)
            self._base.backward(dyg, out=dx, accumulate=True)
        else:
            # DoRA with dropout: y = x Wᵀ + (g-1)·(x_d Wᵀ) + g·s·(x_d Aᵀ Bᵀ).
            dx += self._base.backward(dy * (g - 1)) * keep
            self._base.backward(dy, out=dx, accumulate=True)
        return self._result(dx, gx_dtype, in_shape, out, "out")

    def _move(self, to: Backend) -> None:
        """Moves the adapter's arrays to `to`'s device."""
        source = backends.of(self.lora_a)
        for attr in ("lora_a", "lora_b", "lora_magnitude", "bias", "_merge_norms"):
            v = getattr(self, attr)
            if v is not None:
                setattr(self, attr, to.from_host(source.to_host(v)))
        self._calls = _CallState()
        self._finite = to.finite_check()

    # --- merging ----------------------------------------------------------------------------

    def delta_weight(self) -> Any:
        """s·B·A [out, in] in float32."""
        return self._base.backend.matmul(self.lora_b, self.lora_a, alpha=self.scaling)

    def _merged_dense(self, w: Array) -> tuple[Array, Array | None]:
        """(W + ΔW, or its DoRA form; the DoRA norms used) computed from the unmerged W."""
        xp = self._base.backend.xp
        with np.errstate(over="ignore", invalid="ignore"):  # callers check finiteness
            merged = w + self.delta_weight()
            if self.lora_magnitude is None:
                return merged, None
            norms = xp.linalg.norm(merged, axis=1).astype(np.float32)
            return merged * (self.lora_magnitude / norms)[:, None], norms

    def _merged_result(self, merged: Array, dtype: DTypeLike) -> Array:
        name = formats.output_dtype(dtype)
        m = merged.T if self.config.fan_in_fan_out else merged
        return m.astype(formats.numpy_dtype(name))


class LoraLinear(_LoraLayer):
    """A dense frozen weight W [out, in] ([in, out] with fan_in_fan_out) plus LoRA."""

    def __init__(self, weight: Any, config: LoraConfig, bias: Any = None, name: str = "") -> None:
        _check_config(config)
        self.weight = _float_matrix(weight, "weight")
        self._base = _dense_base(self.weight, config.fan_in_fan_out)
        self._init_adapter(config, bias, name)

    def merge(self) -> None:
        """W ← W + s·B·A (DoRA: m·(W + sBA)/||W + sBA||). Refused (W unchanged) when already
        merged or when the result would not be finite."""
        if self.merged:
            raise ValueError("the adapter is already merged")
        w = self._base.dense()
        merged, norms = self._merged_dense(w)
        if self._base.backend.first_non_finite(merged) is not None:
            raise ValueError(
                "merging would put non-finite values into the weight; weight unchanged"
            )
        w[...] = merged
        self._base.changed()
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
        self._base.changed()
        self._merge_norms = None
        self.merged = False

    def merged_weight(self, dtype: Any = "float32") -> Any:
        """W + ΔW in the stored layout, without changing the layer."""
        w = self._base.dense()
        return self._merged_result(w if self.merged else self._merged_dense(w)[0], dtype)

    def cuda(self) -> LoraLinear:
        return self._to(backends.get("cuda"))

    def cpu(self) -> LoraLinear:
        return self._to(backends.get("cpu"))

    def _to(self, to: Backend) -> LoraLinear:
        self.weight = to.from_host(backends.of(self.weight).to_host(self.weight))
        self._base = _dense_base(self.weight, self.config.fan_in_fan_out)
        self._move(to)
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
        _check_config(config)
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
        merged = self._merged_dense(self.qweight.dequantize("float32"))[0]
        return self._merged_result(merged, dtype)

    def memory_saved_bytes(self) -> int:
        """Bytes of a float32 base weight minus bytes of the quantized one."""
        return 4 * self.in_features * self.out_features - self.qweight.nbytes

    def _base_repr(self) -> str:
        q = self.qweight
        dq = "+dq" if q.double_quant else ""
        return f"base={q.codebook}{dq}/{q.blocksize}, {super()._base_repr()}"

    def merge(self) -> None:
        raise ValueError(
            "a QLoRA layer keeps its base quantized; use merged_weight() for W + ΔW "
            "(re-quantizing the sum would lose the adapter's precision)"
        )

    def unmerge(self) -> None:
        raise ValueError("a QLoRA layer is never merged")

    def cuda(self) -> QLoraLinear:
        return self._to(backends.get("cuda"))

    def cpu(self) -> QLoraLinear:
        return self._to(backends.get("cpu"))

    def _to(self, to: Backend) -> QLoraLinear:
        self.qweight = self.qweight._moved(to)
        self._base = QuantBase(self.qweight)
        self._move(to)
        return self
