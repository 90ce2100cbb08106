"""Decoder-only transformer architectures: parsed from Hugging Face `config.json` fields.

The estimator needs the shapes of every weight (to size quantized and unquantized storage and
the LoRA adapters) and the attention geometry (GQA, explicit head_dim) that sizes activations.
Llama-family decoders are covered: Llama, Mistral, Qwen2/Qwen3 and the like (RMSNorm, rotary
embeddings, SwiGLU MLP, optional tied embeddings, optional q/k norms and attention biases).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

#: The linear layers of one decoder layer, in PEFT's module names.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS

#: Config fields the estimate cannot do without (everything else has a default).
REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)

#: model_type -> (q/k RMSNorm on each head, bias on q/k/v) where the config has no field for it.
_FAMILY_DEFAULTS: dict[str, tuple[bool, bool]] = {
    "qwen3": (True, False),
    "qwen2": (False, True),
}


@dataclass(frozen=True)
class Architecture:
    """The shapes that decide a decoder-only model's memory.

    `head_dim` may differ from `hidden_size // num_attention_heads` (Qwen3 sets it
    explicitly); `num_kv_heads < num_heads` is grouped-query attention.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    # --- geometry ---------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_gqa(self) -> bool:
        return self.num_kv_heads != self.num_heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """`{name: (out_features, in_features)}` of the linear layers of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (self.q_dim, h),
            "k_proj": (self.kv_dim, h),
            "v_proj": (self.kv_dim, h),
            "o_proj": (h, self.q_dim),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    def linear_biases(self) -> dict[str, int]:
        """`{name: bias length}` for the linear layers that have a bias."""
        shapes = self.linear_shapes()
        out: dict[str, int] = {}
        for name in ("q_proj", "k_proj", "v_proj"):
            if self.qkv_bias:
                out[name] = shapes[name][0]
        if self.o_bias:
            out["o_proj"] = shapes["o_proj"][0]
        if self.mlp_bias:
            for name in MLP_PROJECTIONS:
                out[name] = shapes[name][0]
        return out

    def norm_sizes(self) -> list[int]:
        """Lengths of the RMSNorm weights of one decoder layer."""
        sizes = [self.hidden_size, self.hidden_size]
        if self.qk_norm:
            sizes += [self.head_dim, self.head_dim]
        return sizes

    # --- parameter counts -------------------------------------------------------------

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of a separate output projection (0 when tied to the embeddings)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def linear_params_per_layer(self) -> int:
        return sum(o * i for o, i in self.linear_shapes().values())

    @property
    def other_params_per_layer(self) -> int:
        """Norm weights and biases of one decoder layer (kept unquantized)."""
        return sum(self.norm_sizes()) + sum(self.linear_biases().values())

    @property
    def num_parameters(self) -> int:
        per_layer = self.linear_params_per_layer + self.other_params_per_layer
        return (
            self.embedding_params
            + self.lm_head_params
            + self.num_layers * per_layer
            + self.hidden_size  # final norm
        )

    def lora_parameters(self, r: int, targets: tuple[str, ...]) -> int:
        """LoRA parameters `r * (in + out)` over the target projections of every layer."""
        shapes = self.linear_shapes()
        return self.num_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)

    def with_layers(self, num_layers: int) -> Architecture:
        return replace(self, num_layers=num_layers)

    # --- parsing ----------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str | None = None) -> Architecture:
        """From a Hugging Face `config.json` dict (text_config of a multimodal one is used)."""
        if not isinstance(config, Mapping):
            raise ValueError(f"a model config must be a dict, got {type(config).__name__}")
        cfg = dict(config)
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = {**cfg, **dict(cfg["text_config"])}
        for key in REQUIRED_FIELDS:
            if cfg.get(key) is None:
                label = f"config {name!r}" if name else "the model config"
                raise ValueError(f"{label} is missing the field {key!r} the estimate needs")
        model_type = str(cfg.get("model_type", "llama"))
        heads = _int(cfg, "num_attention_heads")
        kv = cfg.get("num_key_value_heads")
        head_dim = cfg.get("head_dim")
        hidden = _int(cfg, "hidden_size")
        qk_norm, qkv_bias = _FAMILY_DEFAULTS.get(model_type, (False, False))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            name=name or str(cfg.get("_name_or_path") or model_type),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=_int(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads if kv is None else _int(cfg, "num_key_value_heads"),
            head_dim=hidden // heads if head_dim is None else _int(cfg, "head_dim"),
            vocab_size=_int(cfg, "vocab_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            model_type=model_type,
            source=cfg,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Architecture:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            text = p.read_text()
        except OSError as e:
            raise ValueError(f"cannot read {p}: {e.strerror or e}") from None
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from None
        return cls.from_config(cfg, name=str(p))


def _int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"config field {key!r} must be an integer, got {value!r}")
    return value
