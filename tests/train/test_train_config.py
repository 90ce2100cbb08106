"""TransformerConfig: the tiny preset, HF config.json files of Llama, Mistral and Qwen3 (read
from a dict, a file or a folder), the fields it refuses (FormatError naming them), and the
round trips through to_hf / to_dict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nybble.errors import FormatError
from nybble.train import RopeScaling, TransformerConfig

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 36,
    "max_position_embeddings": 40960,
    "bos_token_id": 151643,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
LLAMA_31_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "mlp_bias": False,
    "pretraining_tp": 1,
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "sliding_window": 4096,
    "rope_theta": 10000.0,
}


def test_tiny_is_the_spec_model() -> None:
    c = TransformerConfig.tiny()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size) == (
        64,
        2,
        4,
        256,
    )
    assert c.head_dim == 16 and c.num_key_value_heads == 4 and c.group_size == 1
    assert c.model_type == "llama" and not c.qk_norm and c.sliding_window is None
    assert c.projection_shapes()["mlp.down_proj"] == (64, 256)


def test_qwen3_4b_counts_match_the_fixture_facts() -> None:
    c = TransformerConfig.from_hf(QWEN3_4B)
    assert c.qk_norm and c.tie_word_embeddings and c.head_dim == 128 and c.group_size == 4
    assert c.num_parameters() == 4_022_468_096  # docs/contracts.md, estimator fixture facts
    assert c.rope_theta == 1e6


def test_llama_31_8b_reads_the_llama3_rope_scaling() -> None:
    c = TransformerConfig.from_hf(LLAMA_31_8B)
    assert c.num_parameters() == 8_030_261_248
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert c.head_dim == 128 and not c.tie_word_embeddings and not c.qk_norm


def test_mistral_keeps_its_sliding_window() -> None:
    c = TransformerConfig.from_hf(MISTRAL_7B)
    assert c.sliding_window == 4096 and c.model_type == "mistral"


def test_transformers_5_rope_parameters() -> None:
    raw = dict(LLAMA_31_8B)
    del raw["rope_theta"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 250000.0}
    raw["rope_scaling"] = None
    c = TransformerConfig.from_hf(raw)
    assert c.rope_theta == 250000.0 and c.rope_scaling.rope_type == "default"


def test_reads_a_file_or_its_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    assert TransformerConfig.from_hf(tmp_path) == TransformerConfig.from_hf(
        tmp_path / "config.json"
    )
    with pytest.raises(FormatError) as e:
        TransformerConfig.from_hf(tmp_path / "missing.json")
    assert e.value.source.endswith("missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(FormatError):
        TransformerConfig.from_hf(tmp_path / "bad.json")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "gemma2"}, "model_type"),
        ({"model_type": "phi3"}, "model_type"),
        ({"model_type": "mistral", "attention_bias": True}, "attention_bias"),
        ({"model_type": "qwen2", "mlp_bias": True}, "mlp_bias"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"num_local_experts": 8}, "num_local_experts"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"hidden_size": None}, "hidden_size"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"head_dim": 127}, "head_dim"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_refuses_what_it_does_not_implement(change: dict[str, Any], field: str) -> None:
    with pytest.raises(FormatError) as e:
        TransformerConfig.from_hf({**LLAMA_31_8B, **change})
    assert e.value.field == field


def test_reads_the_biases_of_each_model_type() -> None:
    assert TransformerConfig.from_hf(LLAMA_31_8B).biases == ()
    llama = TransformerConfig.from_hf({**LLAMA_31_8B, "attention_bias": True, "mlp_bias": True})
    assert llama.biases == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    )  # fmt: skip
    qwen2 = TransformerConfig.from_hf({**LLAMA_31_8B, "model_type": "qwen2"})
    assert qwen2.biases == ("q_proj", "k_proj", "v_proj")
    assert TransformerConfig.from_dict(qwen2.to_dict()) == qwen2
    assert TransformerConfig.from_hf({**QWEN3_4B, "attention_bias": True}).biases[:4] == (
        "q_proj", "k_proj", "v_proj", "o_proj"
    )  # fmt: skip


def test_refuses_qwen_sliding_windows_and_mixed_layer_types() -> None:
    with pytest.raises(FormatError) as e:
        TransformerConfig.from_hf({**QWEN3_4B, "use_sliding_window": True})
    assert e.value.field == "use_sliding_window"
    kinds = ["full_attention", "sliding_attention"]
    with pytest.raises(FormatError) as e:
        TransformerConfig.from_hf({**MISTRAL_7B, "layer_types": kinds})
    assert e.value.field == "layer_types"
    full = TransformerConfig.from_hf({**QWEN3_4B, "layer_types": ["full_attention"] * 36})
    assert full.sliding_window is None


def test_not_a_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        TransformerConfig.from_hf([1, 2])  # type: ignore[arg-type]
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(FormatError):
        TransformerConfig.from_hf(tmp_path)


@pytest.mark.parametrize("raw", [QWEN3_4B, LLAMA_31_8B, MISTRAL_7B])
def test_to_hf_and_to_dict_round_trip(raw: dict[str, Any]) -> None:
    c = TransformerConfig.from_hf(raw)
    assert TransformerConfig.from_hf(c.to_hf()) == c
    assert TransformerConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_from_dict_names_an_unknown_field() -> None:
    with pytest.raises(FormatError) as e:
        TransformerConfig.from_dict({**TransformerConfig.tiny().to_dict(), "dropout": 0.1})
    assert e.value.field == "dropout"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"hidden_size": 0},
        {"num_attention_heads": 3},  # 64 is no multiple of 3 and no head_dim is given
        {"num_key_value_heads": 3},
        {"head_dim": 15},
        {"model_type": "bert"},
        {"sliding_window": 0},
        {"rope_theta": float("inf")},
        {"rope_scaling": RopeScaling("dynamic")},
    ],
)
def test_constructor_checks_fields(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TransformerConfig(**kwargs)
