"""The model shapes the GPU benchmarks write random checkpoints of: each a Hugging Face
config's fields (`config.json` as the published model has them, less the layer count, which
each benchmark sets), so that transformers, PEFT, bitsandbytes and nybble all read the same
model. `benchmarks/finetune_gpu.py`, `torch_gpu.py` and `fsdp_gpu.py` take theirs from here;
the memory estimator's presets (`nybble.memory.presets`) describe the same models for the
estimate, without the fields a checkpoint needs (norm epsilon, rope, positions)."""

from __future__ import annotations

from typing import Any

#: Llama 3.1's rope scaling (every size).
LLAMA3_ROPE: dict[str, Any] = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=152064,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        use_sliding_window=False,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=2560,
        intermediate_size=9728,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
}

#: Llama-3.1-70B: the 8B's config but its hidden size, MLP width and query heads.
SHAPES["llama-3.1-70b"] = dict(
    SHAPES["llama-3.1-8b"], hidden_size=8192, intermediate_size=28672, num_attention_heads=64
)


def shapes(*names: str) -> dict[str, dict[str, Any]]:
    """The named shapes, in that order."""
    return {name: SHAPES[name] for name in names}
