"""Named model configurations (the fields of their Hugging Face `config.json`), the GPU table
and how memory sizes are read."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

GiB = 1 << 30
MiB = 1 << 20

_LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    high_freq_factor=4.0,
    low_freq_factor=1.0,
    original_max_position_embeddings=8192,
)

#: Model presets. `tiny` is the convergence contracts' model (docs/contracts.md; hidden 64,
#: 2 layers, 4 heads, vocab 256, SwiGLU), with intermediate 4 x hidden and no grouping of the
#: KV heads.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        model_type="qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
    ),
    "llama-3.2-3b": dict(
        model_type="llama",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_scaling=_LLAMA3_ROPE,
    ),
    "llama-3.1-70b": dict(
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_scaling=_LLAMA3_ROPE,
    ),
    "llama-2-7b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "mistral-7b": dict(
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32768,
        tie_word_embeddings=False,
    ),
    # mixtures of experts (memory.arch: transformers 5 keeps the experts unquantized)
    "mixtral-8x7b": dict(
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe",
        hidden_size=2048,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=151936,
        num_experts=60,
        num_experts_per_tok=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's memory as `fits` compares with it. `total_bytes` is the total the card reports
    (nvidia-smi's memory.total) where it was read off a card, else the label's size in GiB;
    `generation` names the architecture (for runtime figures measured per generation)."""

    name: str
    label: str
    total_bytes: int
    generation: str | None = None
    aliases: tuple[str, ...] = field(default=(), compare=False)


def _gpu(name: str, label: str, mib: int, generation: str, *aliases: str) -> tuple[str, GpuSpec]:
    return name, GpuSpec(name, label, mib * MiB, generation, aliases)


#: Common training GPUs from 8 to 141 GB, datacenter and consumer. Sizes in MiB as nvidia-smi
#: reports them where known (H100 80GB HBM3: 81559, read on the measurement machine), else the
#: label's GiB. `a100` and `h100` mean their 80 GB versions; say `a100-40g` for the other.
GPUS: dict[str, GpuSpec] = dict(
    [
        # datacenter
        _gpu("h200", "H200 141GB", 143771, "hopper", "h200-141g", "h200sxm"),
        _gpu("h100-94g", "H100 NVL 94GB", 95830, "hopper", "h100nvl"),
        _gpu("h100-80g", "H100 80GB", 81559, "hopper", "h100", "h100sxm", "h100pcie"),
        _gpu("a100-80g", "A100 80GB", 81920, "ampere", "a100", "a100sxm"),
        _gpu("a100-40g", "A100 40GB", 40960, "ampere", "a100pcie"),
        _gpu("l40s", "L40S 48GB", 46068, "ada", "l40s-48g"),
        _gpu("l40", "L40 48GB", 46068, "ada", "l40-48g"),
        _gpu("a6000", "RTX A6000 48GB", 49140, "ampere", "rtxa6000"),
        _gpu("rtx6000-ada", "RTX 6000 Ada 48GB", 49140, "ada", "rtx6000ada", "6000ada"),
        _gpu("a40", "A40 48GB", 46068, "ampere", "a40-48g"),
        _gpu("v100-32g", "V100 32GB", 32768, "volta", "v10032"),
        _gpu("v100-16g", "V100 16GB", 16384, "volta", "v100", "v10016"),
        _gpu("a10g", "A10G 24GB", 23028, "ampere", "a10g-24g"),
        _gpu("a10", "A10 24GB", 23028, "ampere", "a10-24g"),
        _gpu("l4", "L4 24GB", 23034, "ada", "l4-24g"),
        _gpu("t4", "T4 16GB", 15360, "turing", "t4-16g", "teslat4"),
        # consumer
        _gpu("rtx5090", "RTX 5090 32GB", 32 * 1024, "blackwell", "5090"),
        _gpu("rtx5080", "RTX 5080 16GB", 16 * 1024, "blackwell", "5080"),
        _gpu("rtx4090", "RTX 4090 24GB", 24564, "ada", "4090"),
        _gpu("rtx4080", "RTX 4080 16GB", 16 * 1024, "ada", "4080", "rtx4080super"),
        _gpu("rtx4070ti-super", "RTX 4070 Ti Super 16GB", 16 * 1024, "ada", "4070tisuper"),
        _gpu("rtx4070", "RTX 4070 12GB", 12 * 1024, "ada", "4070"),
        _gpu("rtx4060ti-16g", "RTX 4060 Ti 16GB", 16 * 1024, "ada", "4060ti16"),
        _gpu("rtx4060", "RTX 4060 8GB", 8 * 1024, "ada", "4060"),
        _gpu("rtx3090", "RTX 3090 24GB", 24576, "ampere", "3090", "rtx3090ti"),
        _gpu("rtx3080", "RTX 3080 10GB", 10 * 1024, "ampere", "3080"),
        _gpu("rtx3060", "RTX 3060 12GB", 12 * 1024, "ampere", "3060"),
        _gpu("rtx2080ti", "RTX 2080 Ti 11GB", 11 * 1024, "turing", "2080ti"),
    ]
)

#: GPU name -> bytes (kept for callers that only want the size).
GPU_PRESETS: dict[str, int] = {name: spec.total_bytes for name, spec in GPUS.items()}

#: Size units. GPU makers' "GB" is the binary gigabyte (a "24 GB" card holds 24 GiB), so every
#: unit here is binary: k/kb/kib = 2^10, m/mb/mib = 2^20, g/gb/gib = 2^30, t/tb/tib = 2^40;
#: a bare number is bytes.
_UNITS = {"": 0, "b": 0, "k": 10, "m": 20, "g": 30, "t": 40}

#: No GPU holds a petabyte: larger sizes are typing mistakes, refused.
MAX_GPU_BYTES = 1 << 50


def _normalize_gpu(text: str) -> str:
    key = re.sub(r"[\s_\-.]+", "", text.strip().lower())
    for prefix in ("nvidia", "geforce", "tesla", "quadro"):
        key = key.removeprefix(prefix)
    return key.removesuffix("b") if re.search(r"\dg?b$", key) else key


def _gpu_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for name, spec in GPUS.items():
        for alias in (name, *spec.aliases):
            index.setdefault(_normalize_gpu(alias), name)
    return index


_GPU_INDEX = _gpu_index()


def parse_size(text: str | int | float) -> int:
    """Bytes from `24GB`, `24GiB`, `24 gb`, `80g`, `512MiB`, `12582912`, or a GPU name
    (`rtx4090`, `H100-80GB`, `a100`; see `GPUS`). Units are binary, as on GPU labels: GB = GiB.
    """
    return resolve_gpu(text).total_bytes


def resolve_gpu(text: str | int | float) -> GpuSpec:
    """A GPU by name (case and punctuation ignored: `H100-80GB`, `h100`, `RTX 4090`) or a plain
    size (`24GB`, bytes as a number); ValueError naming the closest names otherwise."""
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise ValueError(f"not a GPU memory size or GPU name: {text!r}")
    if not isinstance(text, str):
        nbytes = parse_bytes(text, "a GPU memory size")
        return GpuSpec(_size_label(nbytes), _size_label(nbytes), nbytes)
    key = _normalize_gpu(text)
    if key in _GPU_INDEX:
        return GPUS[_GPU_INDEX[key]]
    try:
        nbytes = parse_bytes(text, "a GPU memory size")
    except ValueError:
        close = difflib.get_close_matches(key, list(_GPU_INDEX), n=3, cutoff=0.6)
        if close:
            names = " or ".join(dict.fromkeys(_GPU_INDEX[c] for c in close))
            raise ValueError(f"unknown GPU {text!r}: did you mean {names}?") from None
        if re.match(r"\s*[0-9.]", text):  # a size, just a bad one: say why
            raise
        raise ValueError(
            f"not a GPU memory size or known GPU: {text!r} (known GPUs: {', '.join(GPUS)}; "
            "sizes look like 24GB, 24GiB or 512MiB, all binary units)"
        ) from None
    return GpuSpec(text.strip(), _size_label(nbytes), nbytes)


def parse_bytes(text: str | int | float, what: str = "a memory size", minimum: int = 1) -> int:
    """Bytes from a size (`24GB`, `751MiB`, `0.75g`, a number of bytes), binary units; from
    `minimum` to 1 PiB. ValueError naming `what` otherwise."""
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise ValueError(f"{what} must be a size such as 24GB or a number of bytes, got {text!r}")
    if isinstance(text, str):
        m = re.fullmatch(
            r"([0-9]{1,20}(?:\.[0-9]{0,12})?|\.[0-9]{1,12})\s*([kmgt]?)(i?b)?", text.strip().lower()
        )
        if m is None:
            raise ValueError(
                f"{what} must look like 24GB, 24GiB, 512MiB or a number of bytes, got {text!r}"
            )
        value = Fraction(m.group(1)) * (1 << _UNITS[m.group(2)])
    elif not math.isfinite(text):
        raise ValueError(f"{what} must be finite, got {text!r}")
    else:
        value = Fraction(text)
    if not minimum <= value <= MAX_GPU_BYTES:
        raise ValueError(f"{what} must be from {minimum} byte(s) to 1 PiB, got {text!r}")
    return int(value)


def _size_label(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= MiB else f"{nbytes} bytes"
