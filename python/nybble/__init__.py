"""nybble: NF4 quantization and LoRA/QLoRA layer math, bit-exact with bitsandbytes.

numpy in -> numpy out (the Rust core, on the CPU); CuPy in -> CuPy out (CUDA kernels).
`nybble.reference` is the pure-numpy oracle that states the math (imported on first use).
docs/architecture.md shows how the package fits together.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import bnb
from .errors import FormatError, NonFiniteError
from .lora import AdamW, LoraAdapter, LoraConfig, LoraLinear, QLoraLinear
from .memory import estimate_memory
from .tensor import NF4Tensor, dequantize, quantize

if TYPE_CHECKING:
    from . import reference

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "FormatError",
    "LoraAdapter",
    "LoraConfig",
    "LoraLinear",
    "NF4Tensor",
    "NonFiniteError",
    "QLoraLinear",
    "bnb",
    "dequantize",
    "estimate_memory",
    "quantize",
    "reference",
]


#: The public modules: imported on first use (`nybble.train`, `nybble.reference`, ...).
_MODULES = (
    "bnb",
    "checkpoint",
    "cuda",
    "errors",
    "lora",
    "memory",
    "models",
    "reference",
    "torch",
    "train",
)


def __getattr__(name: str) -> Any:
    # The oracle is for tests and readers: the package itself never imports it; the other
    # modules too load when first named.
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'nybble' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API, its modules and the version; not the helpers the package imports."""
    return sorted({*__all__, *_MODULES, "__version__"})
