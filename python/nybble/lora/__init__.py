"""LoRA / QLoRA layers, adapters, the AdamW optimizer and PEFT adapter files."""

from .adapter import LoraAdapter
from .config import LoraConfig
from .layers import LoraLinear, QLoraLinear
from .optim import AdamW

__all__ = ["AdamW", "LoraAdapter", "LoraConfig", "LoraLinear", "QLoraLinear"]
