"""Checkpoint tools: quantize, dequantize, merge and inspect Hugging Face safetensors
checkpoints, streaming one tensor at a time into outputs that appear complete or not at all
(docs/checkpoints.md). The `nybble quantize / dequantize / merge / inspect` commands call
these functions."""

from __future__ import annotations

from .._checkpoint_io.layouts import LAYOUTS, Layout, QuantSpec, find_groups, load_group
from .._checkpoint_io.source import Checkpoint
from ._common import Report, parse_size, select_targets
from ._output import DEFAULT_MAX_SHARD_SIZE
from ._pipeline import Progress, ProgressBar
from .dequantize import dequantize_checkpoint
from .inspect import ErrorStats, ErrorTotals, Inspection, TensorEntry, inspect_checkpoint
from .merge import Adapter, merge_adapter
from .quantize import quantize_checkpoint

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "LAYOUTS",
    "Adapter",
    "Checkpoint",
    "ErrorStats",
    "ErrorTotals",
    "Inspection",
    "Layout",
    "Progress",
    "ProgressBar",
    "QuantSpec",
    "Report",
    "TensorEntry",
    "dequantize_checkpoint",
    "find_groups",
    "inspect_checkpoint",
    "load_group",
    "merge_adapter",
    "parse_size",
    "quantize_checkpoint",
    "select_targets",
]
