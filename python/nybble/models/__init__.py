"""Pretrained models' files: Hugging Face checkpoint folders (dense or 4-bit), Hub ids in the
local cache, and GGUF files, read tensor by tensor by HF name, with their configs and
tokenizers (docs/training.md, "Fine-tuning a pretrained model")."""

from .files import CheckpointFiles, GGUFFiles, ModelFiles, open_model
from .hub import resolve
from .tokenizer import Tokenizer

__all__ = ["CheckpointFiles", "GGUFFiles", "ModelFiles", "Tokenizer", "open_model", "resolve"]
