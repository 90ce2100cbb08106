"""PEFT's LoRA on nybble's `Linear4bit`: `LoraLinear4bit`, a PEFT LoRA layer (PEFT's own
`lora.Linear`, whose adapter bookkeeping, initialisation, saving and loading it keeps) whose
forward runs nybble's fused QLoRA operator (`torch.ops.nybble.qlora_linear`: the base
product, the adapter's products and its backward in nybble's kernels), and whose merge
dequantizes, adds the adapter and quantizes again, as PEFT does for bitsandbytes.

PEFT picks a LoRA layer class by the base layer's type through the mapping a `LoraConfig`
carries (`LoraConfig._register_custom_module`, PEFT's API for custom layers, marked
experimental by PEFT): `register_lora(config)` adds nybble's. Without it PEFT wraps a
`Linear4bit` in its plain `lora.Linear`: the forward and backward still work (the base
product in nybble's kernels, the adapter in torch), but merging fails, since that class adds
the adapter to the stored codes.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from . import _fastpath
from .linear import Linear4bit


def register_lora(config: Any) -> Any:
    """`config` with nybble's LoRA layer registered for `Linear4bit` base layers (in place;
    returned for chaining). Use it on the config given to `get_peft_model`, and on the one
    given to `PeftModel.from_pretrained(model, path, config=...)` when loading an adapter
    (the registration is not saved in adapter_config.json)."""
    if not isinstance(config, LoraConfig):
        raise ValueError(f"expected a peft.LoraConfig, got {type(config).__name__}")
    config._register_custom_module({Linear4bit: LoraLinear4bit})
    return config


class LoraLinear4bit(PeftLoraLinear):  # type: ignore[misc]
    """A PEFT LoRA layer over a nybble `Linear4bit` (plain LoRA and rsLoRA, any dropout;
    DoRA and PEFT's other variants are refused by name)."""

    def __init__(self, base_layer: Any, adapter_name: str, config: Any, **kwargs: Any) -> None:
        base = base_layer.get_base_layer() if hasattr(base_layer, "get_base_layer") else base_layer
        if not isinstance(base, Linear4bit):
            raise ValueError(f"LoraLinear4bit wraps a nybble Linear4bit, got {type(base).__name__}")
        if kwargs.get("fan_in_fan_out") or config.fan_in_fan_out:
            raise ValueError("a Linear4bit stores W as [out, in]: fan_in_fan_out must be False")
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs: Any) -> Any:
        variant = super().resolve_lora_variant(config=config, **kwargs)
        if variant is not None:
            raise ValueError(
                f"nybble's LoRA layer runs plain LoRA (and rsLoRA); {type(variant).__name__} is "
                "not supported on a nybble Linear4bit"
            )
        return None

    def _fused_adapter(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The one active adapter the fused operator can run, or None (several adapters,
        per-sample adapters, a LoRA bias, merged or disabled: PEFT's own path then)."""
        if args or kwargs or self.disable_adapters or self.merged:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1:
            return None
        name = active[0]
        if self.lora_B[name].bias is not None or self.lora_A[name].bias is not None:
            return None
        return name

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        name = self._fused_adapter(args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        base: Any = self.get_base_layer()
        dtype = x.dtype
        if base.compute_dtype is not None and dtype != base.compute_dtype:
            x = x.to(base.compute_dtype)
        keep = None
        dropout = self.lora_dropout[name]
        if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0:
            keep = dropout(torch.ones_like(x))  # 0 where dropped, 1/(1-p) where kept
        lora_a: torch.Tensor = self.lora_A[name].weight  # type: ignore[assignment]
        lora_b: torch.Tensor = self.lora_B[name].weight  # type: ignore[assignment]
        scaling = float(self.scaling[name])
        y = None
        if not torch.compiler.is_compiling() and _fastpath.eager(x):
            # the op's CUDA route and autograd without its dispatch (`_fastpath.QLoraLinear`)
            fast = base._fast_weight()
            if fast is not None and _fastpath.fits(fast, x, keep, lora_a, lora_b, base.bias):
                y = _fastpath.QLoraLinear.apply(
                    x, keep, lora_a, lora_b, base.bias, fast, scaling, base._held()
                )
        if y is None:
            y = torch.ops.nybble.qlora_linear(
                x, keep, *base.weight_args(), lora_a, lora_b, scaling, base.bias
            )
        return y if y.dtype == dtype else y.to(dtype)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """W ← quantize(dequantize(W) + s·B·A) for each adapter (merging into a 4-bit base
        re-quantizes: the merged layer differs from base + adapter by NF4's rounding)."""
        from peft.tuners.tuners_utils import check_adapters_to_merge

        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        warnings.warn(
            "Merging LoRA into a 4-bit nybble Linear4bit quantizes W + BA again: outputs differ "
            "from the unmerged layer by NF4's rounding.",
            UserWarning,
            stacklevel=2,
        )
        base: Any = self.get_base_layer()
        for name in adapter_names:
            if name not in self.lora_A:
                continue
            merged = base.dequantize(torch.float32) + self.get_delta_weight(name).float()
            if safe_merge and not torch.isfinite(merged).all():
                raise ValueError(
                    f"NaNs detected in the merged weights. The adapter {name} seems to be broken"
                )
            if self.lora_bias[name]:
                if base.bias is None:
                    raise RuntimeError("cannot merge lora_bias=True into a layer without a bias")
                with torch.no_grad():
                    base.bias += self.lora_B[name].bias * self.scaling[name]
            dtype = base.weight_dtype
            base.quantize_(merged.to(dtype))
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """W ← quantize(dequantize(W) - s·B·A) for each merged adapter (again through NF4's
        rounding)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", UserWarning, stacklevel=2)
            return
        base: Any = self.get_base_layer()
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name not in self.lora_A:
                continue
            w = base.dequantize(torch.float32) - self.get_delta_weight(name).float()
            if self.lora_bias[name]:
                with torch.no_grad():
                    base.bias -= self.lora_B[name].bias * self.scaling[name]
            base.quantize_(w.to(base.weight_dtype))

    def __repr__(self) -> str:
        return "nybble." + super().__repr__()


__all__ = ["LoraLinear4bit", "register_lora"]
