"""`Linear4bit`: an `nn.Linear` whose weight is stored as NF4 (nybble's codes and scales, as
tensors that move with `.to()` / `.cuda()`), computed by nybble's kernels through the ops of
`_ops`, with bitsandbytes' state dict. docs/torch.md shows it in use."""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import bnb, formats
from ..errors import FormatError
from ..formats import NESTED_BLOCKSIZE
from ..tensor import NF4Tensor
from . import _fastpath, _ops  # _ops registers torch.ops.nybble
from ._packed import Layout, NF4Weight

#: The quant types bitsandbytes' 4-bit state may name; the layer holds NF4.
QUANT_TYPE = "nf4"
#: The dtypes the packed codes may be stored as (`quant_storage`): bytes, or the bytes viewed
#: as a float dtype for engines that flatten all parameters of a unit into one dtype (FSDP1,
#: DeepSpeed ZeRO-3), as bitsandbytes' `bnb_4bit_quant_storage`.
QUANT_STORAGE_DTYPES = (torch.uint8, torch.float32, torch.float16, torch.bfloat16)


class StorageDtypeError(ValueError):
    """A layer's packed codes are not in the dtype they were stored as: something cast them
    (their values are then no longer the codes), or they are not gathered whole."""


def swap_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """bitsandbytes packs element 2k in the high nibble, nybble in the low one: converting
    either way swaps the nibbles of every byte (on the tensor's device)."""
    return (codes >> 4) | (codes << 4)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Linear4bit(nn.Linear):  # type: ignore[misc]
    """y = x Wᵀ + b with W [out_features, in_features] stored as NF4 in blocks of `blocksize`
    (optionally with double-quantized scales), computed by nybble's kernels (the Rust core on
    the CPU, kernels/nf4.cu on CUDA); gradients flow to x (and to the bias when it requires
    grad), never to W, and the backward never holds W dequantized whole on the CPU.

    Stored as (all moving with `.to()`, `.cuda()`, `.cpu()`; none cast by `.to(dtype)` or
    `.half()`):
      weight   uint8 [ceil(n/2), 1]  parameter (requires_grad False): the codes, element 2k
               in the low nibble (nybble's packing; the state dict swaps to bitsandbytes')
      absmax   the scales as int32 bits of float32 [nblocks] (bits, so that a dtype cast of
               the module leaves them exact), or uint8 [nblocks] nested codes under double
               quantization, with `absmax2` (int32 bits of float32 [ceil(nblocks/256)]) and
               the float `offset`
    `weight_dtype` is the dtype that was quantized (bitsandbytes' `dtype`, what `dequantize`
    returns by default).

    Two other forms of `weight` exist for multi-GPU engines (docs/multi-gpu.md):
    - `quant_storage` (`set_quant_storage(dtype)`): the codes' bytes viewed as a float dtype,
      `weight` [ceil(nbytes/itemsize), 1], for FSDP1 and DeepSpeed ZeRO-3, which flatten a
      unit's parameters into one dtype. Module casts (`.to(dtype)`, `.half()`) leave the bytes
      alone; a weight found in another dtype (an engine's mixed precision cast it) or of
      another size (not gathered) is a `StorageDtypeError`, never a product of garbage.
    - packed (`pack_()`): `weight` is an `NF4Weight` holding codes and scales together (the
      absmax buffers are then None), which FSDP2's `fully_shard` shards and gathers as 4-bit
      data. `compute_dtype`, when set, is the dtype activations are cast to for
    the product (the result is cast back), as bitsandbytes' layer does; by default the
    product runs in the activations' dtype.

    `state_dict()` is bitsandbytes' `Linear4bit` state (`weight`, `weight.absmax`,
    `weight.quant_map`, `weight.nested_absmax`, `weight.nested_quant_map`,
    `weight.quant_state.bitsandbytes__nf4`, `bias`; docs/bitsandbytes.md), and
    `load_state_dict` reads it (or a float `weight` [out, in], which it quantizes).

    A new layer (not on the meta device) holds nn.Linear's initialization, quantized.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        blocksize: int = 64,
        double_quant: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"in_features and out_features must be positive, got {in_features}, {out_features}"
            )
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.blocksize = formats.check_blocksize(blocksize)
        self.double_quant = bool(double_quant)
        self.compute_dtype = compute_dtype
        self.quant_type = QUANT_TYPE
        self.weight_dtype: torch.dtype = dtype or torch.get_default_dtype()
        self.quant_storage: torch.dtype = torch.uint8
        self.offset = 0.0
        n = self.in_features * self.out_features
        nblocks = -(-n // self.blocksize)
        if torch.device(device or "cpu").type == "meta":
            # Before loading (transformers builds models on the meta device): a placeholder
            # of the float weight to come, whose dtype is the one loaders read it in.
            placeholder = torch.empty(
                (self.out_features, self.in_features), dtype=self.weight_dtype, device=device
            )
            self.weight = nn.Parameter(placeholder, requires_grad=False)
        else:
            codes = torch.zeros((-(-n // 2), 1), dtype=torch.uint8, device=device)
            self.weight = nn.Parameter(codes, requires_grad=False)
        if self.double_quant:
            absmax = torch.zeros(nblocks, dtype=torch.uint8, device=device)
            absmax2 = torch.zeros(-(-nblocks // NESTED_BLOCKSIZE), dtype=torch.int32, device=device)
        else:
            absmax = torch.zeros(nblocks, dtype=torch.int32, device=device)
            absmax2 = None
        # Persistent (so that loaders re-creating non-persistent buffers leave them alone),
        # though the state dict holds them under bitsandbytes' names (_save_to_state_dict).
        self.register_buffer("absmax", absmax)
        self.register_buffer("absmax2", absmax2)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(out_features, dtype=self.weight_dtype, device=device)
            )
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.reset_parameters()

    # --- construction ---------------------------------------------------------------------

    def reset_parameters(self) -> None:
        """nn.Linear's initialization (kaiming-uniform W, uniform bias), W quantized."""
        w = torch.empty(
            (self.out_features, self.in_features), dtype=torch.float32, device=self.weight.device
        )
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        self.quantize_(w.to(self.weight_dtype))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            with torch.no_grad():
                self.bias.uniform_(-bound, bound)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        blocksize: int = 64,
        double_quant: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> Linear4bit:
        """A Linear4bit holding `linear`'s weight quantized (on its device) and its bias."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            dtype=w.dtype,
            blocksize=blocksize,
            double_quant=double_quant,
            compute_dtype=compute_dtype,
        )
        layer.quantize_(w.detach())
        if linear.bias is not None:
            layer.bias = nn.Parameter(
                linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad
            )
        return layer

    @classmethod
    def from_nf4(
        cls,
        q: NF4Tensor,
        bias: torch.Tensor | None = None,
        *,
        device: Any = None,
        compute_dtype: torch.dtype | None = None,
    ) -> Linear4bit:
        """A Linear4bit over an NF4Tensor [out, in] (its codes and scales, copied to `device`,
        default the CPU)."""
        if not isinstance(q, NF4Tensor) or q.ndim != 2:
            raise ValueError(f"q must be a 2-D NF4Tensor [out, in], got {q!r}")
        if q.codebook != QUANT_TYPE:
            raise ValueError(f"Linear4bit holds NF4 weights; this tensor is {q.codebook}")
        out_f, in_f = q.shape
        layer = cls(
            in_f,
            out_f,
            bias=bias is not None,
            device="meta",
            dtype=getattr(torch, q.orig_dtype),
            blocksize=q.blocksize,
            double_quant=q.double_quant,
            compute_dtype=compute_dtype,
        )
        layer._set_nf4(q, torch.device(device or "cpu"))
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone().to(layer.weight.device))
        return layer

    @classmethod
    def from_bnb(cls, module: Any) -> Linear4bit:
        """A Linear4bit equal to a bitsandbytes `Linear4bit` (NF4, quantized: on a GPU, or
        after its first move there) bit for bit: its state dict read as nybble's, on its
        device, with its compute dtype, and its bias shared."""
        name = f"{type(module).__module__}.{type(module).__qualname__}"
        if not name.startswith("bitsandbytes.") or type(module).__name__ != "Linear4bit":
            raise ValueError(f"expected a bitsandbytes.nn.Linear4bit, got {name}")
        state = module.state_dict()
        if not any(k.startswith("weight.quant_state.") for k in state):
            raise ValueError(
                "this bitsandbytes Linear4bit holds no quantized weight yet (bitsandbytes "
                "quantizes on the first move to a GPU)"
            )
        layer = cls(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device="meta",
            compute_dtype=getattr(module, "compute_dtype", None),
        )
        layer.load_bnb_state(state, device=module.weight.device)
        if module.bias is not None:
            layer.bias = module.bias
        return layer

    # --- the quantized state ----------------------------------------------------------------

    def quantize_(self, weight: torch.Tensor) -> Linear4bit:
        """Quantizes a float weight [out_features, in_features] into this layer, on the
        weight's device (nybble's codes: bitsandbytes' CPU codes bit for bit). Records its
        dtype as `weight_dtype`."""
        shape = (self.out_features, self.in_features)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
            got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"weight must be a float tensor of shape {list(shape)}, got {got}")
        if weight.dtype not in (*_ops.WEIGHT_DTYPES, torch.float64):
            raise ValueError(f"weight must be float32/float16/bfloat16/float64, got {weight.dtype}")
        if weight.device.type == "meta":
            raise ValueError("weight is on the meta device: there are no values to quantize")
        w = weight.detach()
        codes, absmax = torch.ops.nybble.quantize(w, self.blocksize, QUANT_TYPE)
        self.weight_dtype = torch.float32 if w.dtype == torch.float64 else w.dtype
        if self.double_quant:
            nested = _backend_double_quantize(absmax)
            self._set_state(codes, nested[0], nested[1], nested[2])
        else:
            self._set_state(codes, absmax, None, 0.0)
        return self

    def _set_state(
        self,
        codes: torch.Tensor,
        absmax: torch.Tensor,
        absmax2: torch.Tensor | None,
        offset: float,
    ) -> None:
        """Installs codes (uint8, nybble's packing) and scales (float32, or uint8 nested codes
        with float32 absmax2) as this layer's, replacing the tensors (so any cached launch
        state keyed on the old addresses is never reused for new values)."""
        self._forget()
        self.weight = nn.Parameter(
            _stored(codes.reshape(-1).contiguous(), self.quant_storage), requires_grad=False
        )
        self.double_quant = absmax2 is not None
        if absmax2 is None:
            self.absmax = absmax.contiguous().view(torch.int32)
            self.absmax2 = None
        else:
            self.absmax = absmax.contiguous()
            self.absmax2 = absmax2.contiguous().view(torch.int32)
        self.offset = float(offset)

    def _set_nf4(self, q: NF4Tensor, device: torch.device) -> None:
        if q.codebook != QUANT_TYPE:
            raise ValueError(f"Linear4bit holds NF4 weights, not {q.codebook}")
        if tuple(q.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight shape {list(q.shape)} does not match the layer's "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.blocksize = q.blocksize

        def tensor(a: Any) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        q = q.cpu()
        codes = tensor(q.codes)
        if q.nested is None:
            self._set_state(codes, tensor(np.asarray(q.absmax, np.float32)), None, 0.0)
        else:
            n = q.nested
            self._set_state(codes, tensor(n.codes), tensor(n.absmax2), float(np.float32(n.offset)))
        self.weight_dtype = getattr(torch, q.orig_dtype)

    @property
    def scales(self) -> torch.Tensor:
        """The stored scales: float32 [nblocks], or the uint8 nested codes."""
        return self._arrays()[1]

    @property
    def nbytes_codes(self) -> int:
        """Bytes of packed codes: ceil(out * in / 2)."""
        return -(-(self.out_features * self.in_features) // 2)

    def _arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes uint8 [nbytes], scales, nested scales float32 or None), checked."""
        w = self.weight
        if isinstance(w, NF4Weight):
            return w.arrays()
        if type(w).__name__ == "DTensor" or hasattr(w, "_local_tensor"):
            raise ValueError(
                "this Linear4bit's weight is sharded (a DTensor): FSDP gathers it only inside "
                "the model's forward and backward"
            )
        codes = self._codes(w)
        if self.absmax is None:
            raise ValueError("this Linear4bit has no scales (a packed weight was removed?)")
        if self.absmax2 is None:
            return codes, self.absmax.view(torch.float32), None
        return codes, self.absmax, self.absmax2.view(torch.float32)

    def _codes(self, w: torch.Tensor) -> torch.Tensor:
        """The stored codes as uint8 [nbytes], after checking that the weight is still in its
        storage dtype and whole."""
        shape = (self.out_features, self.in_features)
        if w.is_meta and w.is_floating_point() and tuple(w.shape) == shape:
            raise ValueError(
                "this Linear4bit's weight is not loaded yet (the meta-device placeholder of "
                "its float weight)"
            )
        if w.dtype != self.quant_storage:
            raise StorageDtypeError(
                f"Linear4bit [{self.out_features}, {self.in_features}]: its packed NF4 codes are "
                f"stored as {_dtype_name(self.quant_storage)}, but the weight is now "
                f"{_dtype_name(w.dtype)}: something cast it (module.to(dtype) on the parameter "
                "itself, or an engine's mixed precision: FSDP1's MixedPrecision(param_dtype=...), "
                "DeepSpeed's fp16/bf16), so its values are no longer the codes. Store the codes "
                "in the dtype the engine casts parameters to "
                "(nybble.torch.set_quant_storage(model, dtype)) before wrapping the model."
            )
        size = _storage_numel(self.nbytes_codes, self.quant_storage)
        if w.numel() != size:
            raise StorageDtypeError(
                f"Linear4bit [{self.out_features}, {self.in_features}]: the weight holds "
                f"{w.numel()} {_dtype_name(w.dtype)} values, expected {size} (the packed codes "
                "whole): it is a shard or a flattened view that was not gathered"
            )
        flat = w.reshape(-1)
        if w.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        return flat[: self.nbytes_codes]

    def weight_args(self) -> tuple[Any, ...]:
        """The weight as the ops take it: (codes, absmax, absmax2, offset, shape, blocksize,
        codebook). The checks run once for the tensors the layer holds (`_kept`); a later
        call over the same tensors only makes the views."""
        if not torch.compiler.is_compiling():
            kept = self._kept()
            if kept is not None and kept.plain:
                w: Any = self._parameters["weight"]
                absmax: Any = self._buffers["absmax"]
                absmax2 = self._buffers["absmax2"]
                return (
                    w.view(-1),
                    absmax.view(torch.float32) if absmax2 is None else absmax,
                    None if absmax2 is None else absmax2.view(torch.float32),
                    self.offset,
                    [self.out_features, self.in_features],
                    self.blocksize,
                    QUANT_TYPE,
                )
        return self._weight_args()

    def _weight_args(self) -> tuple[Any, ...]:
        codes, scales, absmax2 = self._arrays()
        return (
            codes,
            scales,
            absmax2,
            self.offset,
            [self.out_features, self.in_features],
            self.blocksize,
            QUANT_TYPE,
        )

    def _kept(self) -> _Kept | None:
        """What this layer keeps of its checked weight while it holds the same tensors at the
        same addresses (`_Kept`), made by checking them (the errors of `_arrays` raised);
        None while the weight is not a plain parameter (packed, sharded): those are read and
        checked per call."""
        w = self._parameters.get("weight")
        if type(w) is not nn.Parameter:
            return None
        absmax, absmax2 = self._buffers.get("absmax"), self._buffers.get("absmax2")
        state = (
            w.data_ptr(),
            w.numel(),
            w.dtype,
            w.is_cuda,
            None if absmax is None else (absmax.data_ptr(), absmax.numel(), absmax.dtype),
            None if absmax2 is None else (absmax2.data_ptr(), absmax2.numel(), absmax2.dtype),
            self.offset,
            self.blocksize,
            self.quant_storage,
        )
        kept: _Kept | None = self.__dict__.get("_nybble_kept")
        if (
            kept is not None
            and kept.state == state
            and kept.weight() is w
            and kept.absmax() is absmax
            and kept.absmax2() is absmax2
        ):
            return kept
        self._weight_args()  # the checks, raising what they find
        kept = _Kept(w, absmax, absmax2, state)
        self.__dict__["_nybble_kept"] = kept
        return kept

    def _forget(self) -> None:
        """Drops what `_kept` holds (the weight's tensors are being replaced or moved)."""
        self.__dict__.pop("_nybble_kept", None)

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        state.pop("_nybble_kept", None)  # weak references and launches: made again on use
        return state

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [out_features, in_features] dequantized (by default to `weight_dtype`)."""
        return torch.ops.nybble.dequantize(*self.weight_args(), dtype or self.weight_dtype)

    def nf4_tensor(self) -> NF4Tensor:
        """The weight as a nybble NF4Tensor (on the host: its arrays copied there)."""
        return bnb.import_state(self.bnb_state(), "weight")

    # --- compute ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.compute_dtype is not None and dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        y = None
        if not torch.compiler.is_compiling() and _fastpath.eager(x):
            y = self._eager(x)
        if y is None:
            y = torch.ops.nybble.matmul(x, *self.weight_args())
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y if y.dtype == dtype else y.to(dtype)

    def _eager(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W.T without the op's dispatch, for eager 16-bit CUDA calls (`_fastpath.eager`):
        the same kernels and products as the op's CUDA route, through the weight's launches
        prepared once, under `_fastpath.Matmul` where autograd follows x. None where the op
        must take the call (its checks then say what is wrong)."""
        fast = self._fast_weight()
        if fast is None or x.shape[-1] != fast.cols or x.get_device() != fast.index:
            return None
        if x.requires_grad and torch.is_grad_enabled():
            y: torch.Tensor = _fastpath.Matmul.apply(x, fast, self._held())
            return y
        return _fastpath.linear(fast, x)

    def _fast_weight(self) -> _fastpath.FastWeight | None:
        """The weight's prepared CUDA launches (kept in `_kept`), or None where the ops must
        take the layer's calls (a packed or sharded weight, a weight on the CPU, no driver)."""
        kept = self._kept()
        if kept is None:
            return None
        fast = kept.fast
        if fast is None:
            weight = _ops.weight("matmul", *self.weight_args())
            made = _fastpath.prepared(weight) if weight.codes.is_cuda else None
            fast = kept.fast = False if made is None else made
        return None if fast is False else fast

    def _held(self) -> tuple[Any, ...]:
        """The weight's tensors, for an autograd node to keep alive until its backward."""
        return (
            self._parameters.get("weight"),
            self._buffers.get("absmax"),
            self._buffers.get("absmax2"),
        )

    def extra_repr(self) -> str:
        dq = ", double_quant=True" if self.double_quant else ""
        cd = "" if self.compute_dtype is None else f", compute_dtype={self.compute_dtype}"
        st = "" if self.quant_storage == torch.uint8 else f", quant_storage={self.quant_storage}"
        pk = ", packed" if isinstance(self.weight, NF4Weight) else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, nf4, blocksize={self.blocksize}{dq}{cd}{st}{pk}"
        )

    # --- storage forms for multi-GPU engines (docs/multi-gpu.md) ------------------------------

    def set_quant_storage(self, dtype: torch.dtype) -> Linear4bit:
        """Stores the packed codes as `dtype` (uint8, or a float dtype whose values are the
        codes' bytes, for FSDP1 / DeepSpeed ZeRO-3, which flatten a unit's parameters into one
        dtype). The bytes are unchanged; a packed layer is unpacked first."""
        if dtype not in QUANT_STORAGE_DTYPES:
            names = "/".join(_dtype_name(d) for d in QUANT_STORAGE_DTYPES)
            raise ValueError(f"quant_storage must be one of {names}, got {dtype}")
        if isinstance(self.weight, NF4Weight):
            self.unpack_()
        self._forget()
        if self.weight.device.type == "meta":
            self.quant_storage = dtype
            return self
        codes = self._codes(self.weight)
        self.quant_storage = dtype
        self.weight = nn.Parameter(_stored(codes, dtype), requires_grad=False)
        return self

    def pack_(self) -> Linear4bit:
        """Holds the weight as one `NF4Weight` parameter (codes and scales together: what
        FSDP2's `fully_shard` shards and gathers as 4-bit data); the absmax buffers become
        None. `unpack_()` undoes it."""
        if isinstance(self.weight, NF4Weight):
            return self
        codes, scales, absmax2 = self._arrays()
        self._forget()
        layout = self.nf4_layout()
        self.weight = nn.Parameter(
            NF4Weight.from_arrays(layout, codes.clone(), scales.clone(), _clone(absmax2)),
            requires_grad=False,
        )
        self._buffers["absmax"] = None
        self._buffers["absmax2"] = None
        self.quant_storage = torch.uint8
        return self

    def unpack_(self) -> Linear4bit:
        """Back from `pack_()`: codes in `weight`, scales in the absmax buffers (the weight
        must be whole: not while FSDP shards it)."""
        w = self.weight
        if not isinstance(w, NF4Weight):
            return self
        codes, scales, absmax2 = w.arrays()
        self.quant_storage = torch.uint8
        self._set_state(codes.clone(), scales.clone(), _clone(absmax2), self.offset)
        return self

    def nf4_layout(self) -> Layout:
        """The weight's format, as `NF4Weight` records it."""
        return Layout(
            self.out_features,
            self.in_features,
            self.blocksize,
            self.double_quant,
            float(self.offset),
            self.weight_dtype,
        )

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """Module casts and moves (`.to()`, `.cuda()`, `.half()`, ...) move a float-stored
        weight's bytes without converting them (they are codes, not values)."""
        self._forget()
        w = self._parameters.get("weight")
        if w is None or w.dtype == torch.uint8 or isinstance(w, NF4Weight) or w.is_meta:
            return super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        if w.dtype != self.quant_storage:  # already cast: leave it for the check to report
            return super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        dtype = w.dtype
        self._parameters["weight"] = nn.Parameter(w.detach().view(torch.uint8), requires_grad=False)
        try:
            return super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        finally:
            moved = self._parameters["weight"]
            assert moved is not None
            self._parameters["weight"] = nn.Parameter(
                moved.detach().view(dtype), requires_grad=False
            )

    # --- bitsandbytes' state dict -------------------------------------------------------------

    def bnb_state(self, prefix: str = "weight") -> dict[str, torch.Tensor]:
        """The state-dict entries bitsandbytes' `Linear4bit` writes for this weight (on this
        layer's device; the JSON blob on the host), nybble.bnb.export_state's keys and bytes."""
        meta: dict[str, Any] = {
            "quant_type": QUANT_TYPE,
            "blocksize": self.blocksize,
            "dtype": _dtype_name(self.weight_dtype),
            "shape": [self.out_features, self.in_features],
        }
        codes, scales, absmax2 = self._arrays()
        device = codes.device
        state = {
            prefix: swap_nibbles(codes.detach()).reshape(-1, 1),
            f"{prefix}.absmax": scales.detach().clone(),
            f"{prefix}.quant_map": torch.from_numpy(formats.values(QUANT_TYPE).copy()).to(device),
        }
        if absmax2 is not None:
            state[f"{prefix}.nested_absmax"] = absmax2.detach().clone()
            state[f"{prefix}.nested_quant_map"] = torch.from_numpy(
                formats.values("dynamic8").copy()
            ).to(device)
            meta.update(
                nested_blocksize=NESTED_BLOCKSIZE,
                nested_dtype="float32",
                nested_offset=float(np.float32(self.offset)),
            )
        blob = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8).copy()
        state[f"{prefix}.quant_state.bitsandbytes__{QUANT_TYPE}"] = torch.from_numpy(blob)
        return state

    def load_bnb_state(
        self, state: Mapping[str, Any], prefix: str = "weight", device: Any = None
    ) -> Linear4bit:
        """Reads bitsandbytes' entries under `prefix` (nybble.bnb.import_state: every field
        checked, FormatError naming the key otherwise) onto `device` (default: this layer's
        device; where the state's codes are when the layer is on the meta device). A state of
        another quant type than NF4 is a FormatError naming it."""
        head = f"{prefix}.quant_state.bitsandbytes__"
        other = [k for k in state if k.startswith(head) and not k.endswith(f"__{QUANT_TYPE}")]
        if other:
            raise FormatError(
                bnb.SOURCE,
                f"nybble.torch.Linear4bit holds NF4 weights; this state is "
                f"{other[0].rsplit('__', 1)[1]}",
                other[0],
            )
        q = bnb.import_state(state, prefix)
        if device is None:
            device = self.weight.device
            if device.type == "meta":
                device = getattr(state.get(prefix), "device", torch.device("cpu"))
        self._set_nf4(q, torch.device(device))
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        w = self.weight
        whole = not isinstance(w, NF4Weight) or w.is_whole()
        if w.device.type == "meta" or hasattr(w, "_local_tensor") or not whole:
            # Before loading (transformers' placeholder), or one rank's shard (FSDP): as is.
            destination[prefix + "weight"] = w if keep_vars else w.detach()
        else:
            for key, value in self.bnb_state(prefix + "weight").items():
                destination[key] = value
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Reads bitsandbytes' entries (or a float `weight`, quantized) and the bias; the
        layer keeps its device, or takes the state's when it is on the meta device."""
        key = prefix + "weight"
        here = self.weight.device if self.weight.device.type != "meta" else None
        if key not in state_dict:
            missing_keys.append(key)
        else:
            value = state_dict[key]
            try:
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.quantize_(value if here is None else value.to(here))
                else:
                    self.load_bnb_state(state_dict, key, device=here)
            except (ValueError, FormatError) as e:
                error_msgs.append(f"{key}: {e}")
        bias_key = prefix + "bias"
        if self.bias is not None and bias_key not in state_dict:
            missing_keys.append(bias_key)
        elif self.bias is not None:
            value = state_dict[bias_key]
            if tuple(value.shape) != (self.out_features,):
                error_msgs.append(
                    f"{bias_key}: shape {list(value.shape)}, expected [{self.out_features}]"
                )
            elif self.bias.device.type == "meta":
                grad = self.bias.requires_grad
                self.bias = nn.Parameter(value.detach().clone(), requires_grad=grad)
            else:
                with torch.no_grad():
                    self.bias.copy_(value)
        if strict:  # as nn.Module counts them, with bitsandbytes' entries under weight
            for k in state_dict:
                if not k.startswith(prefix):
                    continue
                head, _, tail = k[len(prefix) :].partition(".")
                if head == "weight" and (not tail or _bnb_key(tail)):
                    continue
                if head == "bias" and not tail and self.bias is not None:
                    continue
                unexpected_keys.append(k)


class _Kept:
    """What a `Linear4bit` keeps of its checked weight (`Linear4bit._kept`): weak references
    to the tensors it checked and their addresses, sizes and dtypes with the layer's format,
    so that it never keeps memory alive and goes stale once any of them changes; and, made on
    the first eager call, the weight's prepared CUDA launches (`_fastpath.FastWeight`, which
    holds addresses, not tensors; False where that route does not take the weight)."""

    __slots__ = ("absmax", "absmax2", "fast", "plain", "state", "weight")

    def __init__(
        self,
        weight: torch.Tensor,
        absmax: torch.Tensor | None,
        absmax2: torch.Tensor | None,
        state: tuple[Any, ...],
    ) -> None:
        self.weight = weakref.ref(weight)
        self.absmax = _none if absmax is None else weakref.ref(absmax)
        self.absmax2 = _none if absmax2 is None else weakref.ref(absmax2)
        self.state = state
        #: Whether `weight_args` may read the checked tensors as views: uint8 codes, whole
        #: and contiguous, and scales.
        self.plain = (
            weight.dtype == torch.uint8
            and weight.is_contiguous()
            and absmax is not None
            and absmax.is_contiguous()
            and (absmax2 is None or absmax2.is_contiguous())
        )
        self.fast: Any = None


def _none() -> None:
    return None


def _bnb_key(suffix: str) -> bool:
    """Whether `weight.<suffix>` is one of bitsandbytes' 4-bit entries."""
    return suffix in {
        "absmax",
        "quant_map",
        "nested_absmax",
        "nested_quant_map",
    } or suffix.startswith("quant_state.bitsandbytes__")


def _storage_numel(nbytes: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` holding `nbytes` bytes (the last one padded with zero bytes)."""
    size = torch.empty((), dtype=dtype).element_size()
    return -(-nbytes // size)


def _stored(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes [nbytes] as the weight [k, 1] in the storage dtype (bytes padded with zeros
    to a whole number of elements)."""
    if dtype == torch.uint8:
        return codes.reshape(-1, 1)
    size = torch.empty((), dtype=dtype).element_size()
    pad = -codes.numel() % size
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    return codes.reshape(-1, size).view(dtype).reshape(-1, 1).contiguous()


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _backend_double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Double quantization of float32 scales (nybble's backend: the Rust core; on CUDA the
    scales are read back to the host, as nybble does, which waits for the device)."""
    host = absmax.detach().cpu().numpy()
    from ..backends import cpu

    nested = cpu.BACKEND.double_quantize(host)
    codes = torch.from_numpy(np.ascontiguousarray(nested.codes)).to(absmax.device)
    absmax2 = torch.from_numpy(np.ascontiguousarray(nested.absmax2)).to(absmax.device)
    return codes, absmax2, float(nested.offset)


__all__ = [
    "QUANT_STORAGE_DTYPES",
    "QUANT_TYPE",
    "Linear4bit",
    "StorageDtypeError",
    "swap_nibbles",
]
