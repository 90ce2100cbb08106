"""Pieces the checkpoint tools share: dtype and size spellings, which weights to quantize,
module kinds, the device, and the report a tool returns."""

from __future__ import annotations

import fnmatch
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from .. import backends, formats
from ..formats import OutputDtype
from ..safetensors_io import TensorInfo

#: safetensors codes of the float dtypes nybble quantizes, and their numpy names.
FLOAT_CODES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
#: The safetensors code of each output dtype.
OUTPUT_CODES: dict[OutputDtype, str] = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_DTYPE_ALIASES: dict[str, OutputDtype] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
}
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
#: Sizes must stay below this (safetensors' offsets are unsigned 64-bit).
MAX_SIZE = 2**64
#: Decoder layers' weights (Llama, Qwen, Mistral, Gemma, Phi-3 and most others name them so).
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def dtype_name(value: Any, what: str = "dtype") -> OutputDtype:
    """An output dtype from its usual spellings (bf16, bfloat16, fp16, f32, ...)."""
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[value.lower().removeprefix("torch.")]
    try:
        return formats.output_dtype(value)
    except ValueError:
        raise ValueError(
            f"{what} must be one of bfloat16 (bf16), float16 (f16), float32 (f32), got {value!r}"
        ) from None


def parse_size(value: Any, what: str = "max_shard_size") -> int:
    """Bytes from an int or a string such as "5GB" (decimal: GB = 10**9 bytes, as
    huggingface_hub reads it) or "2GiB" (binary: GiB = 2**30 bytes), read exactly (no float
    rounding); at least 1 byte and below 2**64 (safetensors' offsets are 64-bit)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = Fraction(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if m is None or m[2].upper() not in _SIZE_UNITS:
            raise ValueError(f"{what} must be a size such as 5GB or 500MiB, got {_short(value)}")
        whole, _, part = m[1].partition(".")
        # Digits beyond these change nothing but could exceed int()'s limit on digits.
        whole = whole.lstrip("0")[:21] or "0"
        size = Fraction(f"{whole}.{part[:30] or 0}") * _SIZE_UNITS[m[2].upper()]
    else:
        raise ValueError(f"{what} must be a size such as 5GB or a number of bytes, got {value!r}")
    if size < 1:
        raise ValueError(f"{what} must be at least 1 byte, got {_short(value)}")
    if size >= MAX_SIZE:
        raise ValueError(
            f"{what} must be below 2**64 bytes (16 EiB, safetensors' limit), got {_short(value)}"
        )
    return int(size)


def _short(value: Any) -> str:
    """repr(value), shortened when long (a size of 400 digits, say)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


def compute_backend(device: str) -> backends.Backend:
    """The backend for `device` ("cpu" or "cuda"; ImportError naming the extra without CuPy)."""
    if device not in backends.DEVICES:
        raise ValueError(f"device must be one of {', '.join(backends.DEVICES)}, got {device!r}")
    return backends.get(device)


def module_of(name: str) -> str:
    """The module path of a parameter name (`model.layers.0.mlp.up_proj.weight` ->
    `model.layers.0.mlp.up_proj`)."""
    return name.rsplit(".", 1)[0] if "." in name else name


def is_float_matrix(info: TensorInfo) -> bool:
    return info.dtype in FLOAT_CODES and len(info.shape) == 2 and info.name.endswith(".weight")


def select_targets(
    infos: Sequence[TensorInfo], patterns: Sequence[str] | None, source: Path
) -> list[str]:
    """The weights to quantize: 2-D float `.weight` tensors; by default those inside decoder
    layers (`...layers.<n>....weight`: the attention and MLP projections; embeddings, norms
    and lm_head stay as they are). A pattern with * ? [ is a glob over the module path; any
    other names a module's last part(s) (`q_proj`, `mlp.down_proj`). A pattern that matches
    no such weight is a ValueError."""
    candidates = [i for i in infos if is_float_matrix(i)]
    if patterns is None:
        return [i.name for i in candidates if _DECODER_LAYER.search(i.name)]
    if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"targets must be a list of non-empty patterns, got {patterns!r}")
    chosen: set[str] = set()
    for pattern in patterns:
        found = [i.name for i in candidates if _matches(module_of(i.name), pattern)]
        if not found:
            raise ValueError(f"target {pattern!r} matches no 2-D float weight in {source}")
        chosen.update(found)
    return [i.name for i in candidates if i.name in chosen]


def _matches(module: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return module == pattern or module.endswith("." + pattern)


#: Module kinds for inspection totals, tried in order on the module path.
MODULE_KINDS = (
    ("lm_head", re.compile(r"(^|\.)(lm_head|embed_out)$|^output$")),
    ("embedding", re.compile(r"embed|(^|\.)(wte|wpe)$")),
    ("norm", re.compile(r"norm|(^|\.)ln_?\w*$")),
    ("attention", re.compile(r"attn|attention|(^|\.)(q|k|v|o|qkv)_proj$")),
    (
        "mlp",
        re.compile(
            r"mlp|feed_forward|ffn|experts|(^|\.)(gate|up|down|gate_up)_proj$|(^|\.)w[123]$"
        ),
    ),
)


def module_kind(name: str) -> str:
    module = module_of(name)
    for kind, pattern in MODULE_KINDS:
        if pattern.search(module):
            return kind
    return "other"


@dataclass
class Report:
    """What a tool did: the files written, bytes read and written, seconds taken, the
    weights by what happened to them (quantized, converted, dequantized, merged, copied),
    and notes (the input's files left out of the output, and why)."""

    action: str
    source: str
    target: str
    files: list[str] = field(default_factory=list)
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    weights: dict[str, list[str]] = field(default_factory=dict)
    #: What the user should know: files of the input not copied, and why.
    notes: list[str] = field(default_factory=list)

    def count(self, what: str) -> int:
        return len(self.weights.get(what, []))

    def summary(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "source": self.source,
            "target": self.target,
            "files": self.files,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "gb_per_s": round(self.bytes_read / self.seconds / 1e9, 3) if self.seconds else None,
            **{what: len(names) for what, names in self.weights.items()},
            "notes": self.notes,
        }


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def written_files(directory: Path) -> tuple[list[str], int]:
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    return names, sum((directory / n).stat().st_size for n in names)


def first(items: Iterable[str], count: int = 3) -> str:
    items = list(items)
    more = f" and {len(items) - count} more" if len(items) > count else ""
    return ", ".join(items[:count]) + more
