"""The model shapes the GPU benchmarks write random checkpoints of, and the writer: each shape
a Hugging Face config's fields (`config.json` as the published model has them, less the layer
count, which each benchmark sets), so that transformers, PEFT, bitsandbytes and nybble all
read the same model. `benchmarks/finetune_gpu.py`, `torch_gpu.py` and `fsdp_gpu.py` take
theirs from here; the memory estimator's presets (`nybble.memory.presets`) describe the same
models for the estimate, without the fields a checkpoint needs (norm epsilon, rope,
positions)."""

from __future__ import annotations

import json
from pathlib import Path
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


def write_checkpoint(fields: dict[str, Any], directory: Path, per_layer: bool = False) -> None:
    """Random weights of the model `fields` describe (std 0.02 from a seeded generator, norms
    1; Qwen2's q/k/v biases, Qwen3's q/k norms; the head unless tied) as a bf16 safetensors
    folder: one file, or with `per_layer` one file per decoder layer and an index, written a
    layer at a time. config.json comes last: its presence marks a complete folder (the
    benchmarks' --checkpoint-dir / --work-dir reuse one)."""
    import torch
    from safetensors.torch import save_file

    h, i, d = fields["hidden_size"], fields["intermediate_size"], fields["head_dim"]
    heads, kv, vocab = (
        fields["num_attention_heads"],
        fields["num_key_value_heads"],
        fields["vocab_size"],
    )
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int) -> Any:
        w = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(0.02)
        return w.to(torch.bfloat16)

    def ones(n: int) -> Any:
        return torch.ones(n, dtype=torch.bfloat16)

    projections = {
        "self_attn.q_proj": (heads * d, h),
        "self_attn.k_proj": (kv * d, h),
        "self_attn.v_proj": (kv * d, h),
        "self_attn.o_proj": (h, heads * d),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    biased = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    whole: dict[str, Any] = {}

    def save(name: str, tensors: dict[str, Any]) -> None:
        if not per_layer:
            whole.update(tensors)
            return
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    save("embed.safetensors", {"model.embed_tokens.weight": normal(vocab, h)})
    for n in range(fields["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors = {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        }
        for proj, shape in projections.items():
            tensors[p + proj + ".weight"] = normal(*shape)
            if fields["model_type"] == "qwen2" and proj in biased:
                tensors[p + proj + ".bias"] = normal(shape[0])
        if fields["model_type"] == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = ones(d)
            tensors[p + "self_attn.k_norm.weight"] = ones(d)
        save(f"layer-{n:03d}.safetensors", tensors)
    head = {"model.norm.weight": ones(h)}
    if not fields["tie_word_embeddings"]:
        head["lm_head.weight"] = normal(vocab, h)
    save("head.safetensors", head)
    if per_layer:
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    else:
        save_file(whole, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(fields, indent=2))
