"""Named model configurations (the fields of their Hugging Face `config.json`) and GPU sizes."""

from __future__ import annotations

import re
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

#: Model presets. `tiny` is the training config of SPEC §3 (hidden 64, 2 layers, 4 heads,
#: vocab 256, SwiGLU), with intermediate 4 x hidden and no grouping of the KV heads.
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

#: GPU memory sizes by name (bytes the card reports as total, the figure `fits` compares with).
GPU_PRESETS: dict[str, int] = {
    "t4": 15 * GiB,
    "rtx3060": 12 * GiB,
    "rtx3090": 24 * GiB,
    "rtx4070": 12 * GiB,
    "rtx4080": 16 * GiB,
    "rtx4090": 24 * GiB,
    "rtx5090": 32 * GiB,
    "l4": 22 * GiB + 512 * MiB,
    "a10g": 22 * GiB + 512 * MiB,
    "v100-16g": 16 * GiB,
    "v100-32g": 32 * GiB,
    "a100-40g": 40 * GiB,
    "a100-80g": 80 * GiB,
    "l40s": 45 * GiB,
    "h100-80g": 79 * GiB + 648 * MiB,
    "h200": 140 * GiB + 411 * MiB,
}

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(text: str | int | float) -> int:
    """Bytes from `24GiB`, `24 GB`, `80g`, `12582912`, or a GPU name such as `rtx4090`.

    GB means 10^9 bytes and GiB 2^30; a bare `g` is read as GiB, as GPU makers quote them.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a memory size: {text!r}")
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ValueError(f"a memory size must be positive, got {text!r}")
        return int(text)
    key = text.strip().lower()
    if key in GPU_PRESETS:
        return GPU_PRESETS[key]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", key)
    if not m or m.group(2) not in _UNITS:
        known = ", ".join(sorted(GPU_PRESETS))
        raise ValueError(
            f"not a memory size or known GPU: {text!r} (use e.g. 24GiB, 16GB, or one of: {known})"
        )
    unit = m.group(2)
    scale = 1 << 30 if unit == "g" else _UNITS[unit]
    value = float(m.group(1)) * scale
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value)
