"""Small checkpoints with real architectures' names and shapes (Llama, Qwen2, Qwen3, Mistral;
scaled down) and random weights, written with the `safetensors` library itself (not nybble's
writer), and PEFT-style adapters for them. Other checkpoint tests import these builders; the
tests here check the builders against the architectures' published shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors.numpy

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_config(
    arch: str = "llama",
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 96,
    head_dim: int | None = None,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """A config.json of the architecture, scaled down."""
    config = dict(ARCHITECTURES[arch])
    config.update(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=256,
        torch_dtype=dtype,
        bos_token_id=1,
        eos_token_id=2,
    )
    if head_dim is not None or arch == "qwen3":
        config["head_dim"] = head_dim or hidden // heads
    return config


def parameter_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The state dict's names and shapes, in the order transformers lists them."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    arch = config["model_type"]
    out: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], h))
    ]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj.weight", (heads * hd, h)),
            (f"{p}.self_attn.k_proj.weight", (kv * hd, h)),
            (f"{p}.self_attn.v_proj.weight", (kv * hd, h)),
            (f"{p}.self_attn.o_proj.weight", (h, heads * hd)),
        ]
        if arch == "qwen2":
            out += [
                (f"{p}.self_attn.q_proj.bias", (heads * hd,)),
                (f"{p}.self_attn.k_proj.bias", (kv * hd,)),
                (f"{p}.self_attn.v_proj.bias", (kv * hd,)),
            ]
        if arch == "qwen3":
            out += [
                (f"{p}.self_attn.q_norm.weight", (hd,)),
                (f"{p}.self_attn.k_norm.weight", (hd,)),
            ]
        out += [
            (f"{p}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.mlp.down_proj.weight", (h, inter)),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not config.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (config["vocab_size"], h)))
    return out


def random_weights(
    config: dict[str, Any], dtype: Any = ml_dtypes.bfloat16, seed: int = 0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in parameter_shapes(config):
        if name.endswith("norm.weight"):
            a = 1.0 + 0.05 * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / math.sqrt(shape[-1])
        out[name] = a.astype(np.float32).astype(dtype)
    return out


def write_checkpoint(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, np.ndarray],
    shards: int = 1,
    extra_files: bool = True,
) -> Path:
    """config.json, the weights (in `shards` files with an index when more than one), and a
    tokenizer-like file and README to be copied by the tools."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    names = list(tensors)
    if shards == 1:
        safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"), {"format": "pt"})
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
            safetensors.numpy.save_file(part, str(directory / file), {"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": weight_map,
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    if extra_files:
        (directory / "tokenizer.json").write_text('{"version": "1.0", "model": {}}')
        (directory / "generation_config.json").write_text('{"bos_token_id": 1}')
        (directory / "README.md").write_text("a test model\n")
    return directory


def make_checkpoint(
    directory: Path, arch: str = "llama", shards: int = 1, seed: int = 0, **config_args: Any
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    config = make_config(arch, **config_args)
    tensors = random_weights(config, seed=seed)
    write_checkpoint(directory, config, tensors, shards)
    return config, tensors


def write_adapter(
    directory: Path,
    tensors: dict[str, np.ndarray],
    r: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
    use_dora: bool = False,
    use_rslora: bool = False,
    seed: int = 1,
    extra: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """An adapter as PEFT saves one (adapter_config.json, adapter_model.safetensors with
    base_model.model.<module>.lora_A/B.weight), with non-zero B; returns its tensors."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
            continue
        out_f, in_f = w.shape
        key = f"base_model.model.{module}"
        out[f"{key}.lora_A.weight"] = (rng.standard_normal((r, in_f)) / math.sqrt(in_f)).astype(
            np.float32
        )
        out[f"{key}.lora_B.weight"] = (0.1 * rng.standard_normal((out_f, r))).astype(np.float32)
        if use_dora:
            norms = np.linalg.norm(np.asarray(w, np.float32), axis=1)
            out[f"{key}.lora_magnitude_vector"] = (
                norms * (1 + 0.1 * rng.standard_normal(out_f))
            ).astype(np.float32)
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "use_rslora": use_rslora,
        "use_dora": use_dora,
        "fan_in_fan_out": False,
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "inference_mode": True,
        **(extra or {}),
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    safetensors.numpy.save_file(out, str(directory / "adapter_model.safetensors"), {"format": "pt"})
    return out


def test_builders_give_the_published_shapes_when_not_scaled_down() -> None:
    """Full-size configs give the parameter counts of the real models: Llama-3.1-8B
    8,030,261,248 (docs/contracts.md) and Qwen3-4B 4,022,468,096."""
    llama = make_config("llama", 4096, 14336, 32, 32, 8, 128256)
    assert sum(math.prod(s) for _, s in parameter_shapes(llama)) == 8_030_261_248
    qwen3 = make_config("qwen3", 2560, 9728, 36, 32, 8, 151936, head_dim=128)
    assert sum(math.prod(s) for _, s in parameter_shapes(qwen3)) == 4_022_468_096


def test_written_checkpoints_read_back_with_the_library(tmp_path: Path) -> None:
    _, tensors = make_checkpoint(tmp_path / "m", "qwen2", shards=3)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    for file in set(index["weight_map"].values()):
        for name, a in safetensors.numpy.load_file(str(tmp_path / "m" / file)).items():
            assert a.tobytes() == tensors[name].tobytes()
    assert "model.layers.0.self_attn.q_proj.bias" in tensors and "lm_head.weight" not in tensors
