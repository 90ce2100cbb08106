"""Hugging Face checkpoint folders as files: reading one (`source.Checkpoint`: config.json and
the safetensors shards, every file checked first) and the two layouts of a 4-bit weight in one
(`layouts`: nybble's and bitsandbytes', found, read and written). Below `lora` (an adapter's
base read from a folder), `models` and the `checkpoint` tools, which export these names
(docs/architecture.md, "Who imports whom"; docs/checkpoints.md)."""

from __future__ import annotations

from .layouts import LAYOUTS, Layout, QuantGroup, QuantSpec, find_groups, load_group
from .source import Checkpoint

__all__ = [
    "LAYOUTS",
    "Checkpoint",
    "Layout",
    "QuantGroup",
    "QuantSpec",
    "find_groups",
    "load_group",
]
