"""LoraAdapter: named LoRA/QLoRA layers of one model, and PEFT's adapter files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from .. import safetensors_io
from .._files import atomic_write
from ..errors import FormatError
from ..tensor import NF4Tensor
from .config import LoraConfig
from .layers import LoraLinear, QLoraLinear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: PEFT keys: base_model.model.<module path>.lora_A.weight (etc.).
KEY_PREFIX = "base_model.model."
KEY_SUFFIXES = {
    "lora_A.weight": "lora_a",
    "lora_B.weight": "lora_b",
    "lora_magnitude_vector": "lora_magnitude",
}

Layer = LoraLinear | QLoraLinear


class LoraAdapter:
    """LoRA layers by module path (e.g. `model.layers.0.self_attn.q_proj`)."""

    def __init__(self, config: LoraConfig, base_model_name_or_path: str | None = None) -> None:
        self.config = config.validate()
        self.base_model_name_or_path = base_model_name_or_path
        self.layers: dict[str, Layer] = {}

    def add_layer(
        self,
        name: str,
        weight: Any,
        bias: Any = None,
        config: LoraConfig | None = None,
    ) -> Layer:
        """A LoraLinear over a dense weight, or a QLoraLinear over an NF4Tensor."""
        if name in self.layers:
            raise ValueError(f"a layer named {name!r} already exists")
        if not name or any(part == "" for part in name.split(".")):
            raise ValueError(f"layer name must be a dotted module path, got {name!r}")
        cfg = config or self.config
        layer: Layer
        if isinstance(weight, NF4Tensor):
            layer = QLoraLinear(weight, cfg, bias=bias, name=name)
        else:
            layer = LoraLinear(weight, cfg, bias=bias, name=name)
        self.layers[name] = layer
        return layer

    def __getitem__(self, name: str) -> Layer:
        if name not in self.layers:
            raise KeyError(f"no layer named {name!r}; layers: {sorted(self.layers)}")
        return self.layers[name]

    def __contains__(self, name: object) -> bool:
        return name in self.layers

    def __len__(self) -> int:
        return len(self.layers)

    def forward_layer(self, name: str, x: Any) -> Any:
        return self[name].forward(x)

    def backward_layer(self, name: str, grad_y: Any) -> Any:
        return self[name].backward(grad_y)

    def merge_all(self) -> None:
        for layer in self.layers.values():
            layer.merge()

    def unmerge_all(self) -> None:
        for layer in self.layers.values():
            layer.unmerge()

    def merged_weights(self, dtype: Any = "float32") -> dict[str, Any]:
        """{"<name>.weight": W + ΔW} for every layer, without changing any layer."""
        return {f"{n}.weight": layer.merged_weight(dtype) for n, layer in self.layers.items()}

    def parameters(self) -> dict[str, Any]:
        """All trainable arrays as {"<name>.lora_A.weight": ...} (for an optimizer)."""
        return {
            f"{n}.{k}": v for n, layer in self.layers.items() for k, v in layer.parameters().items()
        }

    def gradients(self) -> dict[str, Any]:
        return {
            f"{n}.{k}": v for n, layer in self.layers.items() for k, v in layer.gradients().items()
        }

    def summary(self) -> dict[str, Any]:
        trainable = sum(layer.trainable_params for layer in self.layers.values())
        frozen = sum(layer.total_params - layer.trainable_params for layer in self.layers.values())
        return {
            "layers": len(self.layers),
            "trainable": trainable,
            "frozen": frozen,
            "ratio": trainable / (trainable + frozen) if trainable + frozen else 0.0,
            "r": self.config.r,
            "alpha": self.config.alpha,
        }

    def train(self, mode: bool = True) -> LoraAdapter:
        for layer in self.layers.values():
            layer.train(mode)
        return self

    def eval(self) -> LoraAdapter:
        return self.train(False)

    # --- PEFT files -----------------------------------------------------------------------

    def peft_config(self) -> dict[str, Any]:
        c = self.config
        targets: str | list[str] = "all-linear"
        if c.target_modules != "all-linear":
            leaves = {n.rsplit(".", 1)[-1] for n in self.layers}
            targets = sorted(leaves | set(c.target_modules))
        return {
            "peft_type": "LORA",
            "task_type": None,
            "base_model_name_or_path": self.base_model_name_or_path,
            "r": c.r,
            "lora_alpha": c.alpha,
            "lora_dropout": c.dropout,
            "target_modules": targets,
            "use_rslora": c.use_rslora,
            "use_dora": c.use_dora,
            "fan_in_fan_out": c.fan_in_fan_out,
            "bias": "none",
            "init_lora_weights": True if c.init == "kaiming" else "gaussian",
            "inference_mode": True,
            "modules_to_save": None,
            "rank_pattern": {},
            "alpha_pattern": {},
        }

    def state_dict(self) -> dict[str, np.ndarray]:
        """The adapter's tensors under PEFT's keys, as host float32 arrays."""
        out: dict[str, np.ndarray] = {}
        for name, layer in self.layers.items():
            for suffix, attr in KEY_SUFFIXES.items():
                v = getattr(layer, attr)
                if v is not None:
                    out[f"{KEY_PREFIX}{name}.{suffix}"] = _to_host(v)
        return out

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Writes adapter_config.json and adapter_model.safetensors as PEFT does."""
        if not self.layers:
            raise ValueError("the adapter has no layers to save")
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        safetensors_io.save(self.state_dict(), d / WEIGHTS_FILE, metadata={"format": "pt"})
        with atomic_write(d / CONFIG_FILE, "w") as f:
            json.dump(self.peft_config(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        base: dict[str, Any],
        bias: dict[str, Any] | None = None,
    ) -> LoraAdapter:
        """Reads an adapter written by PEFT (or by save_pretrained). `base` maps
        "<module path>.weight" to the frozen weight: a dense array, or an NF4Tensor for QLoRA."""
        d = Path(directory)
        config, raw = read_peft_config(d / CONFIG_FILE)
        tensors = safetensors_io.load(d / WEIGHTS_FILE)
        modules = _group_by_module(tensors)
        adapter = cls(config, raw.get("base_model_name_or_path"))
        for name, parts in sorted(modules.items()):
            if "lora_A.weight" not in parts or "lora_B.weight" not in parts:
                raise FormatError(f"{WEIGHTS_FILE}: module {name!r} lacks lora_A or lora_B")
            key = f"{name}.weight"
            if key not in base:
                raise KeyError(f"the adapter has a layer {name!r} but base has no {key!r}")
            a, b = parts["lora_A.weight"], parts["lora_B.weight"]
            r = int(a.shape[0])
            alpha = _pattern(raw.get("alpha_pattern") or {}, name, config.alpha)
            layer_cfg = config.with_(r=r, alpha=float(alpha))
            layer = adapter.add_layer(name, base[key], (bias or {}).get(f"{name}.bias"), layer_cfg)
            if layer_cfg.use_dora and "lora_magnitude_vector" not in parts:
                raise FormatError(
                    f"{WEIGHTS_FILE}: DoRA module {name!r} lacks lora_magnitude_vector"
                )
            layer.set_lora_a(np.asarray(a, np.float32))
            layer.set_lora_b(np.asarray(b, np.float32))
            if layer_cfg.use_dora:
                layer.set_lora_magnitude(np.asarray(parts["lora_magnitude_vector"], np.float32))
        return adapter


def _to_host(v: Any) -> np.ndarray:
    if isinstance(v, np.ndarray):
        return np.ascontiguousarray(v, np.float32)
    import cupy

    return np.ascontiguousarray(cupy.asnumpy(v), np.float32)


def _pattern(pattern: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's rank/alpha patterns: the first key matching the end of the module path."""
    for key, value in pattern.items():
        if re.fullmatch(rf"(.*\.)?{key}", name):
            return value
    return default


def _group_by_module(tensors: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        if not key.startswith(KEY_PREFIX):
            raise FormatError(f"{WEIGHTS_FILE}: key {key!r} does not start with {KEY_PREFIX!r}")
        rest = key[len(KEY_PREFIX) :]
        for suffix in KEY_SUFFIXES:
            if rest.endswith("." + suffix):
                modules.setdefault(rest[: -len(suffix) - 1], {})[suffix] = value
                break
        else:
            raise FormatError(f"{WEIGHTS_FILE}: key {key!r} is not a LoRA tensor nybble reads")
    return modules


def read_peft_config(path: Path) -> tuple[LoraConfig, dict[str, Any]]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FormatError(f"{path}: not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        found = raw.get("peft_type") if isinstance(raw, dict) else raw
        raise FormatError(f"{path}: peft_type must be 'LORA', got {found!r}")
    try:
        targets = raw.get("target_modules") or ()
        config = LoraConfig(
            r=int(raw["r"]),
            alpha=float(raw["lora_alpha"]),
            dropout=float(raw.get("lora_dropout", 0.0)),
            target_modules=targets if isinstance(targets, str) else tuple(targets),
            use_rslora=bool(raw.get("use_rslora", False)),
            use_dora=bool(raw.get("use_dora", False)),
            fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{path}: missing or bad field ({e})") from None
    return config, raw
