"""nybble inside PyTorch, transformers and PEFT (`pip install "nybble[torch]"`; docs/torch.md).

- `torch.ops.nybble.*`: the NF4 kernels as torch operators (quantize, dequantize, matmul,
  matmul_t, the QLoRA linear forward and backward), with fake implementations for
  torch.compile, on the CPU (the Rust core) and CUDA (nybble's kernels on torch's stream).
- `Linear4bit`: an `nn.Linear` holding NF4 weights, with bitsandbytes' state dict.
- `NybbleConfig`: a transformers quantization config (`from_pretrained(...,
  quantization_config=NybbleConfig())` quantizes on load); `pretrained_config(path)` reads a
  bitsandbytes NF4 checkpoint into nybble layers; `replace_bnb(model)` swaps a loaded
  model's bitsandbytes layers in place.
- `register_lora(lora_config)`: PEFT's LoRA on nybble layers runs nybble's fused QLoRA
  forward and backward (`LoraLinear4bit`).
- `nybble.torch.distributed` (docs/multi-gpu.md): `shard_model` (FSDP2, the 4-bit weights
  sharded and gathered as 4-bit data through `NF4Weight`), `data_parallel` (DDP),
  `load_sharded` (each rank quantizes its own rows), `save_adapter` (PEFT's files from rank
  0), `set_quant_storage` (codes stored as a float dtype for FSDP1 / DeepSpeed ZeRO-3).

Importing this module registers the operators, and the quantization method with
transformers where transformers is installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import Any

from . import _ops
from ._packed import NF4Weight
from .linear import Linear4bit, StorageDtypeError

__all__ = [
    "Linear4bit",
    "LoraLinear4bit",
    "NF4Weight",
    "NybbleConfig",
    "NybbleQuantizer",
    "StorageDtypeError",
    "data_parallel",
    "load_sharded",
    "pretrained_config",
    "register_lora",
    "replace_bnb",
    "save_adapter",
    "set_quant_storage",
    "shard_model",
]

#: Names defined by the integrations, by module (loaded on first use).
_LAZY = {
    "NybbleConfig": "_transformers",
    "NybbleQuantizer": "_transformers",
    "pretrained_config": "_transformers",
    "replace_bnb": "_transformers",
    "LoraLinear4bit": "_peft",
    "register_lora": "_peft",
    "shard_model": "distributed",
    "data_parallel": "distributed",
    "load_sharded": "distributed",
    "save_adapter": "distributed",
    "set_quant_storage": "distributed",
}

#: The transformers integration uses transformers 5's weight-loading API.
TRANSFORMERS_MAJOR = 5


def _transformers_version() -> int | None:
    """transformers' major version, or None where it is not installed."""
    if importlib.util.find_spec("transformers") is None:
        return None
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


if (_transformers_version() or 0) >= TRANSFORMERS_MAJOR:
    # A saved nybble checkpoint names the method "nybble": transformers must know it before
    # `from_pretrained` reads one.
    from . import _transformers  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nybble.torch' has no attribute {name!r}")
    if module == "_transformers" and (_transformers_version() or 0) < TRANSFORMERS_MAJOR:
        raise ImportError(
            f"nybble.torch.{name} needs transformers {TRANSFORMERS_MAJOR} or later: "
            "pip install -U transformers"
        )
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)


_ = _ops
