"""TransformerConfig: the shape of a decoder-only LM in Hugging Face Llama's terms, read from
a Llama / Mistral / Qwen2 / Qwen3 `config.json` or built by hand (docs/training.md, "The
model").

`HfConfig` is nybble's one model of a Hugging Face `config.json`: every field read with its
type, range and default, a bad one a FormatError naming the config and the field; the
decoder types nybble knows and what each implies (`DECODER_TYPES`); the attention's heads as
the fields give them (`HfConfig.heads`). The trainer reads its TransformerConfig through it,
and the memory estimator its Architecture (nybble.memory.arch), each then refusing what it
does not model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .._json import read_file as read_json
from ..errors import FormatError

#: Every decoder `model_type` nybble reads, with what the type implies: (an RMSNorm of each q
#: and k head, a bias on q/k/v, mixture-of-experts MLPs). Llama's decoder (RMSNorm, rotary,
#: GQA, SwiGLU; SmolLM is a Llama), Mistral's (the same, with an optional sliding window),
#: Qwen2's (with biases on q, k and v), Qwen3's (with an RMSNorm of q and k per head before the
#: rotation), and their mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE).
DECODER_TYPES: dict[str, tuple[bool, bool, bool]] = {
    "llama": (False, False, False),
    "mistral": (False, False, False),
    "qwen2": (False, True, False),
    "qwen3": (True, False, False),
    "mixtral": (False, False, True),
    "qwen2_moe": (False, True, True),
    "qwen3_moe": (True, False, True),
}
#: The model types whose math the trainer implements: the dense ones.
MODEL_TYPES = tuple(name for name, (_, _, moe) in DECODER_TYPES.items() if not moe)
#: Projections that may carry a bias (HF: Qwen2's q/k/v always; Llama's and Qwen3's
#: `attention_bias` q/k/v/o, Llama's `mlp_bias` gate/up/down).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: Rotary variants: HF's "default", "linear" (positions divided by `factor`) and "llama3"
#: (Llama 3.1's frequency-dependent scaling).
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are rescaled (HF's rope_scaling / rope_parameters)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only LM: `num_hidden_layers` blocks of (RMSNorm, causal self-attention with
    rotary positions and `num_key_value_heads` shared key/value heads, residual; RMSNorm,
    SwiGLU MLP `down(silu(gate(x)) * up(x))`, residual), a final RMSNorm and an LM head (the
    embedding's transpose when `tie_word_embeddings`). Names and meanings are HF Llama's.
    `num_key_value_heads` and `head_dim` default to `num_attention_heads` and
    `hidden_size // num_attention_heads`."""

    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    #: Qwen3: RMSNorm over each head of q and k (weights `q_norm`, `k_norm` of size head_dim).
    qk_norm: bool = False
    #: Mistral: a token attends to at most this many positions (itself included); None: all.
    sliding_window: int | None = None
    model_type: str = "llama"
    #: Standard deviation of the random initial weights (HF's initializer_range).
    initializer_range: float = 0.02
    #: The projections (short names, `q_proj` ...) that add a bias to their product.
    biases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_key_value_heads == 0:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if (
            self.head_dim == 0
            and _is_int(self.num_attention_heads)
            and self.num_attention_heads > 0
            and _is_int(self.hidden_size)
            and self.hidden_size % self.num_attention_heads == 0
        ):
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self.validate()

    @classmethod
    def tiny(cls) -> TransformerConfig:
        """The convergence contracts' tiny model (docs/contracts.md): hidden 64, 2 layers,
        4 heads (head_dim 16), vocab 256, intermediate 256 (4 x hidden), no grouping of the
        key/value heads, untied head."""
        return cls()

    # --- derived ----------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        """Width of q_proj's output: num_attention_heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of k_proj's and v_proj's outputs: num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """[out, in] of each linear projection of a decoder layer, by HF's module path below
        `model.layers.{i}.`."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "self_attn.q_proj": (self.q_size, h),
            "self_attn.k_proj": (self.kv_size, h),
            "self_attn.v_proj": (self.kv_size, h),
            "self_attn.o_proj": (h, self.q_size),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }

    def num_parameters(self) -> int:
        shapes = self.projection_shapes()
        per_layer = sum(o * i for o, i in shapes.values())
        per_layer += sum(o for path, (o, _) in shapes.items() if path.split(".")[1] in self.biases)
        per_layer += 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_hidden_layers * per_layer + embed + head + self.hidden_size

    def with_(self, **changes: Any) -> TransformerConfig:
        return replace(self, **changes)

    # --- checks -----------------------------------------------------------------------------

    def validate(self) -> TransformerConfig:
        """ValueError naming the first bad field; returns self."""
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
        ):
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value < 2**31:
                raise ValueError(f"TransformerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TransformerConfig.num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"TransformerConfig.head_dim must be even (rotary pairs), got {self.head_dim}"
            )
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < math.inf:
                raise ValueError(f"TransformerConfig.{name} must be a number > 0, got {value!r}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"TransformerConfig.model_type must be one of {MODEL_TYPES}, "
                f"got {self.model_type!r}"
            )
        if self.sliding_window is not None and (
            not _is_int(self.sliding_window) or self.sliding_window < 1
        ):
            raise ValueError(
                "TransformerConfig.sliding_window must be None or an integer >= 1, "
                f"got {self.sliding_window!r}"
            )
        for name in ("tie_word_embeddings", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TransformerConfig.{name} must be True or False")
        known = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
        if not isinstance(self.biases, tuple) or not all(b in known for b in self.biases):
            raise ValueError(
                f"TransformerConfig.biases must be a tuple of projection names {known}, "
                f"got {self.biases!r}"
            )
        rope = self.rope_scaling
        if not isinstance(rope, RopeScaling) or rope.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"TransformerConfig.rope_scaling must be a RopeScaling of type {ROPE_TYPES}"
            )
        if not _is_number(rope.factor) or not 0 < rope.factor < math.inf:
            raise ValueError(f"rope_scaling.factor must be > 0, got {rope.factor!r}")
        if rope.rope_type == "llama3" and not (
            _is_number(rope.low_freq_factor)
            and _is_number(rope.high_freq_factor)
            and 0 < rope.low_freq_factor < rope.high_freq_factor < math.inf
            and _is_int(rope.original_max_position_embeddings)
            and rope.original_max_position_embeddings >= 1
        ):
            raise ValueError(
                "rope_scaling (llama3) needs 0 < low_freq_factor < high_freq_factor and "
                f"original_max_position_embeddings >= 1, got {rope}"
            )
        return self

    # --- Hugging Face configs -----------------------------------------------------------------

    def to_hf(self) -> dict[str, Any]:
        """The fields of an HF `config.json` describing this model (LlamaConfig, MistralConfig
        or Qwen3Config by `model_type`), for `AutoConfig.for_model(**fields)`."""
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": [_ARCHITECTURES[self.model_type]],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "initializer_range": self.initializer_range,
            "attention_dropout": 0.0,
        }
        attention_bias = set(ATTENTION_PROJECTIONS) <= set(self.biases)
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = attention_bias
        if self.model_type == "llama":
            out["mlp_bias"] = set(MLP_PROJECTIONS) <= set(self.biases)
        rope = self.rope_scaling
        if rope.rope_type == "default":
            out["rope_scaling"] = None
        else:
            scaling: dict[str, Any] = {"rope_type": rope.rope_type, "factor": rope.factor}
            if rope.rope_type == "llama3":
                scaling.update(
                    low_freq_factor=rope.low_freq_factor,
                    high_freq_factor=rope.high_freq_factor,
                    original_max_position_embeddings=rope.original_max_position_embeddings,
                )
            out["rope_scaling"] = scaling
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        return out

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON values (the inverse of `from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> TransformerConfig:
        """The inverse of `to_dict` (a checkpoint's record); FormatError naming a field that
        is missing, unknown or bad."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise FormatError(source, "is not a TransformerConfig field", unknown[0])
        kwargs = dict(data)
        if isinstance(kwargs.get("biases"), list):
            kwargs["biases"] = tuple(kwargs["biases"])
        rope = kwargs.get("rope_scaling")
        if isinstance(rope, Mapping):
            try:
                kwargs["rope_scaling"] = RopeScaling(**rope)
            except TypeError as e:
                raise FormatError(source, str(e), "rope_scaling") from None
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise FormatError(source, str(e)) from None

    @classmethod
    def from_hf(
        cls, source: Mapping[str, Any] | str | os.PathLike[str], where: str | None = None
    ) -> TransformerConfig:
        """A config from an HF `config.json` (the parsed dict, the file, or its directory) of a
        Llama, Mistral, Qwen2 or Qwen3 model. A field that changes the math in a way nybble does not
        implement (another activation, biases, MoE, another rotary scaling, a sliding window
        on Qwen, attention dropout) is refused with a FormatError naming it (and `where`, the
        file to name in errors when `source` is a dict)."""
        path: Path | None = None
        if isinstance(source, Mapping):
            raw: Any = source
        elif not isinstance(source, (str, os.PathLike)):
            raise ValueError(
                f"source: expected a config dict or a path, got {type(source).__name__}"
            )
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            raw = read_json(path)
        where = where or (str(path) if path is not None else "config.json")
        if not isinstance(raw, Mapping):
            raise FormatError(where, "not a JSON object")
        return _HfReader(raw, where).read()


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
#: What HF's modules of each type put biases on: Qwen2's q/k/v always, the others' by flag.
_FIXED_BIASES = {
    name: ATTENTION_PROJECTIONS[:3] for name, (_, qkv_bias, _) in DECODER_TYPES.items() if qkv_bias
}


class HfConfig:
    """One Hugging Face config dict, read field by field: each read checks the field's type
    (and range) and gives its default when it is absent or null; a bad or missing field is a
    FormatError naming `where` and the field. `ranges` bounds integer fields by name (others:
    at least 1); `whole_floats` takes an integer written as a float (64.0)."""

    def __init__(
        self,
        raw: Mapping[str, Any],
        where: str,
        ranges: Mapping[str, tuple[int, int]] | None = None,
        whole_floats: bool = False,
    ) -> None:
        self.raw = raw
        self.where = where
        self.ranges = dict(ranges or {})
        self.whole_floats = whole_floats

    def fail(self, field: str, problem: str) -> FormatError:
        return FormatError(self.where, problem, field)

    def integer(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name)
        if value is None:
            if default is None:
                raise self.fail(name, "missing")
            return default
        if self.whole_floats and isinstance(value, float) and value.is_integer():
            value = int(value)
        lo, hi = self.ranges.get(name, (1, None))
        if not _is_int(value) or value < lo or (hi is not None and value > hi):
            within = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
            raise self.fail(name, f"expected an integer {within}, got {value!r}")
        return int(value)

    def number(self, name: str, default: float) -> float:
        value = self.raw.get(name)
        if value is None:
            return default
        if not _is_number(value) or not 0 < value < math.inf:
            raise self.fail(name, f"expected a number > 0, got {value!r}")
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(name, f"expected true or false, got {value!r}")
        return value

    def text(self, name: str, default: str | None = None) -> str:
        value = self.raw.get(name, default)
        if value is None:
            raise self.fail(name, "missing")
        if not isinstance(value, str):
            raise self.fail(name, f"expected a string, got {value!r}")
        return value

    def require(self, name: str, allowed: tuple[Any, ...], why: str) -> None:
        """A field that must be absent, null, or one of `allowed`."""
        if name in self.raw and self.raw[name] is not None and self.raw[name] not in allowed:
            raise self.fail(name, f"{self.raw[name]!r} is not supported: {why}")

    def model_type(self, known: Iterable[str], refusal: str, default: str | None = None) -> str:
        """The config's model_type, one of `known`; otherwise a FormatError whose problem is
        `refusal` with {name} (the type given) and {known} (the known ones) filled in."""
        names = tuple(known)
        model_type = self.text("model_type", default)
        if model_type not in names:
            problem = refusal.format(name=repr(model_type), known=", ".join(names))
            raise self.fail("model_type", problem)
        return model_type

    def heads(self) -> tuple[int, int, int, int]:
        """(hidden_size, num_attention_heads, num_key_value_heads, head_dim): the key/value
        heads default to the attention heads and must divide them; head_dim defaults to
        hidden_size / num_attention_heads, which must then be whole."""
        heads = self.integer("num_attention_heads")
        hidden = self.integer("hidden_size")
        if self.raw.get("head_dim") is None and hidden % heads:
            raise self.fail(
                "head_dim",
                f"missing, and hidden_size {hidden} is not a multiple "
                f"of num_attention_heads {heads}",
            )
        kv_heads = self.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise self.fail(
                "num_key_value_heads",
                f"{kv_heads} does not divide num_attention_heads {heads}",
            )
        return hidden, heads, kv_heads, self.integer("head_dim", hidden // heads)


class _HfReader(HfConfig):
    """Reads one HF config dict into the trainer's TransformerConfig."""

    def read(self) -> TransformerConfig:
        model_type = self.model_type(
            MODEL_TYPES, "{name} is not supported; nybble trains {known}", default="llama"
        )
        for name in ("hidden_act", "hidden_activation"):
            self.require(name, ("silu",), "the MLP is SwiGLU with silu")
        self.require("attention_dropout", (0, 0.0), "attention has no dropout")
        self.require("partial_rotary_factor", (1, 1.0), "rotary covers the whole head")
        for name in ("num_experts", "num_local_experts", "n_routed_experts"):
            self.require(name, (0,), "mixture-of-experts layers are not implemented")
        hidden, heads, kv_heads, head_dim = self.heads()
        if head_dim % 2:
            raise self.fail("head_dim", f"must be even for rotary positions, got {head_dim}")
        theta, rope = self.rope()
        values: dict[str, Any] = dict(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=self.integer("intermediate_size"),
            num_hidden_layers=self.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=self.integer("vocab_size"),
            rms_norm_eps=self.number("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope,
            tie_word_embeddings=self.flag("tie_word_embeddings", False),
            qk_norm=DECODER_TYPES[model_type][0],
            sliding_window=self.sliding_window(model_type),
            initializer_range=self.number("initializer_range", 0.02),
            biases=self.biases(model_type),
        )
        try:
            return TransformerConfig(**values)
        except ValueError as e:
            raise FormatError(self.where, str(e)) from None

    def rope(self) -> tuple[float, RopeScaling]:
        """rope_theta and the scaling, from `rope_parameters` (transformers 5) or from
        `rope_theta` and `rope_scaling` (earlier files)."""
        params = self.raw.get("rope_parameters")
        field_name = "rope_parameters"
        if params is None:
            params = self.raw.get("rope_scaling")
            field_name = "rope_scaling"
        theta = self.number("rope_theta", 10000.0)
        if params is None:
            return theta, RopeScaling()
        if not isinstance(params, Mapping):
            raise self.fail(field_name, f"expected an object, got {params!r}")
        if field_name == "rope_parameters" and params.get("rope_theta") is not None:
            value = params["rope_theta"]
            if not _is_number(value) or not 0 < value < math.inf:
                raise self.fail(field_name, f"rope_theta must be a number > 0, got {value!r}")
            theta = float(value)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise self.fail(
                field_name,
                f"rope_type {kind!r} is not supported; nybble implements {', '.join(ROPE_TYPES)}",
            )
        if kind == "default":
            return theta, RopeScaling()
        try:
            factor = float(params["factor"])
            if kind == "linear":
                scaling = RopeScaling("linear", factor)
            else:
                scaling = RopeScaling(
                    "llama3",
                    factor,
                    float(params["low_freq_factor"]),
                    float(params["high_freq_factor"]),
                    int(params["original_max_position_embeddings"]),
                )
        except (KeyError, TypeError, ValueError) as e:
            raise self.fail(field_name, f"incomplete {kind} scaling ({e!r})") from None
        return theta, scaling

    def biases(self, model_type: str) -> tuple[str, ...]:
        """The projections with a bias: Qwen2's q/k/v, and what `attention_bias` (Llama,
        Qwen3) and `mlp_bias` (Llama) switch on; the flags of other types must be off."""
        fixed = _FIXED_BIASES.get(model_type, ())
        flags = {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",)}
        out = list(fixed)
        for name in ("attention_bias", "mlp_bias"):
            if name in flags.get(model_type, ()):
                if self.flag(name, False):
                    out += ATTENTION_PROJECTIONS if name == "attention_bias" else MLP_PROJECTIONS
            else:
                self.require(name, (False,), f"{model_type} projections have no such bias")
        return tuple(dict.fromkeys(out))

    def sliding_window(self, model_type: str) -> int | None:
        raw = self.raw
        if model_type in ("qwen2", "qwen3"):
            self.require(
                "use_sliding_window", (False,), "Qwen's per-layer window is not implemented"
            )
            window = None
        elif model_type == "mistral":
            window = raw.get("sliding_window")
            if window is not None and (not _is_int(window) or window < 1):
                raise self.fail("sliding_window", f"expected an integer >= 1, got {window!r}")
        else:
            window = None
        kinds = raw.get("layer_types")
        if kinds is not None:
            allowed = {"full_attention"} | ({"sliding_attention"} if window else set())
            if not isinstance(kinds, list) or not set(kinds) <= allowed or len(set(kinds)) > 1:
                raise self.fail(
                    "layer_types",
                    "every layer must have the same attention "
                    f"({' or '.join(sorted(allowed))}), got {kinds!r}",
                )
            if window and kinds and kinds[0] == "full_attention":
                window = None
        return int(window) if window is not None else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = [
    "ATTENTION_PROJECTIONS",
    "DECODER_TYPES",
    "MLP_PROJECTIONS",
    "MODEL_TYPES",
    "ROPE_TYPES",
    "HfConfig",
    "RopeScaling",
    "TransformerConfig",
]
