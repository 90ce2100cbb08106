"""nybble: NF4 quantization and LoRA/QLoRA layer math, bit-exact with bitsandbytes.

numpy in -> numpy out (the Rust core, on the CPU); CuPy in -> CuPy out (CUDA kernels).
`nybble.reference` is the pure-numpy oracle that states the math.
"""

from . import bnb, reference
from .errors import FormatError
from .lora import AdamW, LoraAdapter, LoraConfig, LoraLinear, QLoraLinear
from .memory import estimate_memory
from .tensor import NF4Tensor, dequantize, quantize

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "FormatError",
    "LoraAdapter",
    "LoraConfig",
    "LoraLinear",
    "NF4Tensor",
    "QLoraLinear",
    "bnb",
    "dequantize",
    "estimate_memory",
    "quantize",
    "reference",
]
