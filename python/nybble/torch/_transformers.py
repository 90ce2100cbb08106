"""nybble as a transformers quantization method ("nybble"), through transformers' plugin API
(`register_quantization_config`, `register_quantizer`), and the swap of bitsandbytes layers.

- `from_pretrained(path, quantization_config=NybbleConfig(...))` builds the model on the meta
  device, puts a `Linear4bit` where each `nn.Linear` is (but the output embeddings, tied
  weights, the last module and `skip_modules`), and quantizes each float weight as it is read
  from the checkpoint, on the device it is loaded to (streaming: one weight at a time).
- A checkpoint saved from such a model has bitsandbytes' state dict and
  `quant_method: "nybble"` in its config; `from_pretrained(path)` reads it back into nybble
  layers (once `nybble.torch` is imported).
- A bitsandbytes NF4 checkpoint (`quant_method: "bitsandbytes"`, `load_in_4bit`) names
  bitsandbytes in its config, which transformers then insists on. `pretrained_config(path)`
  is its config with that quantization read by nybble instead:
  `from_pretrained(path, config=nybble.torch.pretrained_config(path))`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, BitsAndBytesConfig
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer, get_keys_to_not_convert
from transformers.utils.quantization_config import QuantizationConfigMixin

from .. import formats
from .linear import QUANT_TYPE, Linear4bit

METHOD = "nybble"
#: bitsandbytes' 4-bit entries under a weight's key, as transformers collects them.
BNB_KEYS = (
    "weight.nested_absmax",
    "weight.nested_quant_map",
    "weight.quant_map",
    "weight.absmax",
    "weight.quant_state.bitsandbytes__nf4",
    "weight.quant_state.bitsandbytes__fp4",
    "weight",
)
_FIELDS = ("quant_type", "blocksize", "double_quant", "compute_dtype", "skip_modules")


def _torch_dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"{what} must be a float torch dtype or its name, got {value!r}")
    return found


class NybbleConfig(QuantizationConfigMixin):  # type: ignore[misc]
    """nybble's NF4 quantization for `from_pretrained` (quant_method "nybble").

    blocksize     elements per scale (64, as bitsandbytes)
    double_quant  double-quantized scales (bitsandbytes' `bnb_4bit_use_double_quant`)
    compute_dtype the dtype the layers multiply in (None: the activations' own), as
                  bitsandbytes' `bnb_4bit_compute_dtype`
    skip_modules  module names (or suffixes) left unquantized besides transformers' default
                  ones (output embeddings, tied weights, the last module); bitsandbytes'
                  `llm_int8_skip_modules`
    """

    def __init__(
        self,
        blocksize: int = 64,
        double_quant: bool = False,
        compute_dtype: Any = None,
        skip_modules: list[str] | None = None,
        quant_type: str = QUANT_TYPE,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("quant_method", None)
        if kwargs:
            raise ValueError(
                f"NybbleConfig: unknown argument(s) {', '.join(sorted(kwargs))}; it takes "
                f"{', '.join(_FIELDS)}"
            )
        if quant_type != QUANT_TYPE:
            raise ValueError(f"NybbleConfig: quant_type must be {QUANT_TYPE!r}, got {quant_type!r}")
        self.quant_method: Any = METHOD
        self.quant_type = QUANT_TYPE
        self.blocksize = formats.check_blocksize(blocksize)
        if not isinstance(double_quant, bool):
            raise ValueError(
                f"NybbleConfig: double_quant must be True or False, got {double_quant!r}"
            )
        self.double_quant = double_quant
        self.compute_dtype = _torch_dtype(compute_dtype, "NybbleConfig: compute_dtype")
        self.skip_modules = None if skip_modules is None else [str(m) for m in skip_modules]

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": METHOD,
            "quant_type": self.quant_type,
            "blocksize": self.blocksize,
            "double_quant": self.double_quant,
            "compute_dtype": None
            if self.compute_dtype is None
            else str(self.compute_dtype).removeprefix("torch."),
            "skip_modules": None if self.skip_modules is None else list(self.skip_modules),
        }

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    @classmethod
    def from_bnb(cls, config: BitsAndBytesConfig | dict[str, Any]) -> NybbleConfig:
        """The same quantization as a bitsandbytes 4-bit NF4 config (object or dict); FP4 and
        8-bit configs are refused by name."""
        if not isinstance(config, dict):
            config = config.to_dict()
        if config.get("load_in_8bit"):
            raise ValueError("nybble reads 4-bit NF4 bitsandbytes checkpoints, not 8-bit ones")
        quant_type = config.get("bnb_4bit_quant_type", "fp4")
        if quant_type != QUANT_TYPE:
            raise ValueError(
                f"nybble reads NF4 bitsandbytes checkpoints; this one is bnb_4bit_quant_type="
                f"{quant_type!r}"
            )
        storage = str(config.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
        if storage != "uint8":
            raise ValueError(
                f"nybble reads bitsandbytes' uint8 code storage, not bnb_4bit_quant_storage="
                f"{storage!r}"
            )
        compute = config.get("bnb_4bit_compute_dtype")
        return cls(
            double_quant=bool(config.get("bnb_4bit_use_double_quant", False)),
            compute_dtype=None if compute in (None, "float32") else compute,
            skip_modules=config.get("llm_int8_skip_modules"),
        )

    def to_bnb(self) -> BitsAndBytesConfig:
        """bitsandbytes' config for the same quantization (what a checkpoint saved by nybble
        needs in its config for bitsandbytes to load it: the weights are its format)."""
        if self.blocksize != 64:
            raise ValueError("bitsandbytes' 4-bit layers quantize in blocks of 64")
        make: Any = BitsAndBytesConfig
        return make(  # type: ignore[no-any-return]
            load_in_4bit=True,
            bnb_4bit_quant_type=QUANT_TYPE,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=self.compute_dtype or torch.float32,
            llm_int8_skip_modules=self.skip_modules,
        )


def _initialized(module: Any) -> None:
    """Marks a layer as loaded, so that transformers does not initialize it afterwards."""
    module._is_hf_initialized = True


class _Quantize(ConversionOps):  # type: ignore[misc]
    """Quantizes a float weight read from the checkpoint into its Linear4bit."""

    def __init__(self, hf_quantizer: NybbleQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: Any = None,
        target_patterns: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        model = kwargs["model"]
        result = {}
        for name, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            module: Any = model.get_submodule(name.rpartition(".")[0])
            module.quantize_(tensor)
            _initialized(module)
            result[name] = module.weight
        return result


class _Deserialize(ConversionOps):  # type: ignore[misc]
    """Reads a weight's bitsandbytes entries into its Linear4bit (nybble.bnb.import_state's
    checks; FormatError naming the key for anything malformed)."""

    def __init__(self, hf_quantizer: NybbleQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(
        self,
        input_dict: dict[str, Any],
        source_patterns: Any = None,
        target_patterns: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        model, full_layer_name = kwargs["model"], str(kwargs["full_layer_name"])
        if len(input_dict) == 1:  # a plain weight (norms, embeddings): loaded as it is
            return input_dict
        state = {k: v[0] if isinstance(v, list) else v for k, v in input_dict.items()}
        module: Any = model.get_submodule(full_layer_name.rpartition(".")[0])
        if not isinstance(module, Linear4bit):
            raise ValueError(
                f"{full_layer_name}: the checkpoint holds a quantized weight here, the model a "
                f"{type(module).__name__} (add it to NybbleConfig(skip_modules=...)?)"
            )
        weight = state["weight"]
        module.load_bnb_state(state, "weight", device=weight.device)
        _initialized(module)
        return {"weight": module.weight}


def _skipped(name: str, patterns: list[str]) -> bool:
    return any(
        name == p or name.startswith(p + ".") or name.endswith("." + p) for p in patterns if p
    )


class NybbleQuantizer(HfQuantizer):  # type: ignore[misc]
    """transformers' side of the "nybble" method (see the module's docstring)."""

    requires_calibration = False
    quantization_config: NybbleConfig

    def __init__(self, quantization_config: NybbleConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []

    @property
    def quantized_element_size(self) -> float:
        return 0.5

    def param_element_size(self, model: Any, param_name: str, param: torch.Tensor) -> float:
        if self.param_needs_quantization(model, param_name):
            return 0.5
        return float(param.element_size())

    def param_needs_quantization(self, model: Any, param_name: str, **kwargs: Any) -> bool:
        module_name, _, name = param_name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return False
        return isinstance(module, Linear4bit) and name == "weight"

    def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        config = self.quantization_config
        skip = list(config.skip_modules or [])
        if config.skip_modules is None:
            skip += get_keys_to_not_convert(model)
        skip += list(getattr(model, "_keep_in_fp32_modules", None) or [])
        self.modules_to_not_convert = skip
        for name, module in list(model.named_modules()):
            if type(module) is not nn.Linear or _skipped(name, skip):
                continue
            layer = Linear4bit(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                device="meta",
                dtype=module.weight.dtype,
                blocksize=config.blocksize,
                double_quant=config.double_quant,
                compute_dtype=config.compute_dtype,
            )
            layer.requires_grad_(False)
            model.set_submodule(name, layer)
        return model

    def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
        empty = [
            n for n, m in model.named_modules() if isinstance(m, Linear4bit) and m.weight.is_meta
        ]
        if empty:
            raise ValueError(
                f"{len(empty)} quantized layer(s) got no weight from the checkpoint, e.g. "
                f"{empty[0]}"
            )
        return model

    def is_serializable(self, safe_serialization: Any = None) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True

    def get_quantize_ops(self) -> ConversionOps:
        return _Quantize(self)

    def get_weight_conversions(self, *args: Any, **kwargs: Any) -> list[Any]:
        if not self.pre_quantized:
            return []
        return [
            WeightConverter(
                source_patterns=list(BNB_KEYS),
                target_patterns="weight",
                operations=[_Deserialize(self)],
            )
        ]

    def _dequantize(self, model: Any, dtype: torch.dtype | None = None) -> Any:
        for name, module in list(model.named_modules()):
            if not isinstance(module, Linear4bit):
                continue
            w = module.dequantize(dtype or module.weight_dtype)
            linear = nn.Linear(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                device="meta",
                dtype=w.dtype,
            )
            linear.weight = nn.Parameter(w, requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.detach().to(w.dtype))
            model.set_submodule(name, linear)
        return model


def _register() -> None:
    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(NybbleConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(NybbleQuantizer)


_register()


def pretrained_config(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """A checkpoint's config (AutoConfig.from_pretrained(path, **kwargs)) whose bitsandbytes
    4-bit NF4 quantization, if it has one, is read by nybble instead (NybbleConfig.from_bnb):
    `from_pretrained(path, config=pretrained_config(path))` then loads bitsandbytes' weights
    into nybble layers, bit for bit, without bitsandbytes. A config already "nybble" is
    returned as it is; one without quantization gets none (pass quantization_config=
    NybbleConfig() to from_pretrained for that); other methods are refused by name."""
    config = AutoConfig.from_pretrained(path, **kwargs)
    found = getattr(config, "quantization_config", None)
    if found is None:
        return config
    data = found if isinstance(found, dict) else found.to_dict()
    found_method = data.get("quant_method", "")
    method = str(getattr(found_method, "value", found_method))
    if method == METHOD:
        return config
    if method.startswith("bitsandbytes") or data.get("load_in_4bit") or data.get("load_in_8bit"):
        config.quantization_config = NybbleConfig.from_bnb(data).to_dict()
        return config
    raise ValueError(f"{path}: quantized with {method!r}, which nybble does not read")


def replace_bnb(model: nn.Module) -> nn.Module:
    """Swaps every bitsandbytes `Linear4bit` (NF4) in `model` for a nybble `Linear4bit` with
    the same codes, scales, bias and compute dtype (bit for bit: the same products' inputs),
    in place; returns the model. Call it before `get_peft_model` (a PEFT LoRA layer made over
    a bitsandbytes layer keeps bitsandbytes' own forward for its adapter)."""
    swaps = [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__ == "Linear4bit"
        and type(module).__module__.startswith("bitsandbytes")
    ]
    for name, module in swaps:
        model.set_submodule(name, Linear4bit.from_bnb(module))
    return model


__all__ = [
    "METHOD",
    "NybbleConfig",
    "NybbleQuantizer",
    "pretrained_config",
    "replace_bnb",
]
