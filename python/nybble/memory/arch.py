"""Decoder-only transformer architectures: parsed from Hugging Face `config.json` fields.

The estimator needs the shapes of every weight (to size quantized and unquantized storage and
the LoRA adapters) and the attention geometry (GQA, explicit head_dim) that sizes activations.
Covered, by `model_type` (`MODEL_TYPES`): Llama-family decoders (Llama, Mistral, Qwen2, Qwen3:
RMSNorm, rotary embeddings, SwiGLU MLP, optional tied embeddings, q/k norms and attention
biases) and their mixture-of-experts versions (Mixtral, Qwen2-MoE, Qwen3-MoE). Anything else is
refused: a config whose fields the estimator does not understand is never read as another.

Every field is checked for type and range, and a bad one raises `FormatError` naming the
config and the field; config files are read only when they are regular files of at most
`MAX_CONFIG_BYTES`.

Mixture of experts as transformers 5 builds it: the experts of a layer are two fused 3-D
parameters (`gate_up_proj`: experts x 2*intermediate x hidden, `down_proj`), not `nn.Linear`
modules, so bitsandbytes leaves them in bf16 (and `prepare_model_for_kbit_training` makes them
float32) and PEFT's all-linear puts no adapter on them; the router is a plain parameter too.
A shared expert (Qwen2-MoE) is an ordinary MLP of `nn.Linear`s, quantized and adapted, and so
is its one-output gate.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import _json
from ..errors import FormatError
from ..train.config import DECODER_TYPES, HfConfig

#: The linear layers of one decoder layer, in PEFT's module names.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
#: Qwen2-MoE's one-output gate of the shared expert: a linear layer all-linear adapts too.
SHARED_EXPERT_GATE = "shared_expert_gate"
LINEAR_NAMES = (*PROJECTIONS, SHARED_EXPERT_GATE)

#: Config fields the estimate cannot do without (everything else has a default).
REQUIRED_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)

#: model_type -> (q/k RMSNorm on each head, bias on q/k/v, mixture of experts): every decoder
#: type nybble reads (nybble.train.config.DECODER_TYPES, where HF configs are read).
MODEL_TYPES = DECODER_TYPES

#: The activations of the gated MLP the timeline writes (silu(gate) * up).
ACTIVATIONS = ("silu", "swish")

#: Largest config file read (real ones are a few kilobytes).
MAX_CONFIG_BYTES = _json.MAX_FILE_BYTES

#: Ranges of the integer fields (beyond any real model, short of sizes nothing can hold).
_INT_RANGES: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 1 << 20),
    "intermediate_size": (1, 1 << 22),
    "moe_intermediate_size": (1, 1 << 22),
    "shared_expert_intermediate_size": (0, 1 << 22),
    "num_hidden_layers": (1, 1 << 16),
    "num_attention_heads": (1, 1 << 14),
    "num_key_value_heads": (1, 1 << 14),
    "head_dim": (1, 1 << 14),
    "vocab_size": (1, 1 << 24),
    "num_local_experts": (1, 1 << 12),
    "num_experts": (1, 1 << 12),
    "num_experts_per_tok": (1, 1 << 12),
    "decoder_sparse_step": (1, 1 << 16),
}


@dataclass(frozen=True)
class Architecture:
    """The shapes that decide a decoder-only model's memory.

    `head_dim` may differ from `hidden_size // num_attention_heads` (Qwen3 sets it
    explicitly); `num_kv_heads < num_heads` is grouped-query attention. `num_experts > 0`
    makes the layers not in `dense_layers` mixture-of-experts layers: `num_experts` experts
    of `expert_intermediate_size`, `experts_per_token` of them per token, plus a shared expert
    of `shared_expert_intermediate_size` when that is not 0.
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
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()
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
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"experts_per_token must be from 1 to num_experts ({self.num_experts}), "
                    f"got {self.experts_per_token}"
                )
            if self.expert_intermediate_size < 1:
                raise ValueError("expert_intermediate_size must be a positive integer")

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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse(self, layer: int) -> bool:
        """True when decoder layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse(i) for i in range(self.num_layers))

    def linear_shapes(self, layer: int = 0) -> dict[str, tuple[int, int]]:
        """`{name: (out_features, in_features)}` of the `nn.Linear` layers of decoder layer
        `layer` (of a mixture-of-experts layer: the attention and the shared expert)."""
        h = self.hidden_size
        shapes = {
            "q_proj": (self.q_dim, h),
            "k_proj": (self.kv_dim, h),
            "v_proj": (self.kv_dim, h),
            "o_proj": (h, self.q_dim),
        }
        if self.is_sparse(layer):
            i = self.shared_expert_intermediate_size
            if i:
                shapes.update(gate_proj=(i, h), up_proj=(i, h), down_proj=(h, i))
                shapes[SHARED_EXPERT_GATE] = (1, h)
            return shapes
        i = self.intermediate_size
        shapes.update(gate_proj=(i, h), up_proj=(i, h), down_proj=(h, i))
        return shapes

    def linear_names(self) -> tuple[str, ...]:
        """Every linear layer name some decoder layer has, in `LINEAR_NAMES` order."""
        names = {n for layer in self._layer_kinds() for n in self.linear_shapes(layer)}
        return tuple(n for n in LINEAR_NAMES if n in names)

    def _layer_kinds(self) -> list[int]:
        """One layer index of each kind (dense, sparse) the model has."""
        kinds: dict[bool, int] = {}
        for i in range(self.num_layers):
            kinds.setdefault(self.is_sparse(i), i)
            if len(kinds) == 2:
                break
        return list(kinds.values())

    def linear_biases(self, layer: int = 0) -> dict[str, int]:
        """`{name: bias length}` for the linear layers of decoder layer `layer` with a bias."""
        shapes = self.linear_shapes(layer)
        out: dict[str, int] = {}
        for name in ("q_proj", "k_proj", "v_proj"):
            if self.qkv_bias:
                out[name] = shapes[name][0]
        if self.o_bias:
            out["o_proj"] = shapes["o_proj"][0]
        if self.mlp_bias:
            for name in MLP_PROJECTIONS:
                if name in shapes:
                    out[name] = shapes[name][0]
        return out

    def norm_sizes(self) -> list[int]:
        """Lengths of the RMSNorm weights of one decoder layer."""
        sizes = [self.hidden_size, self.hidden_size]
        if self.qk_norm:
            sizes += [self.head_dim, self.head_dim]
        return sizes

    def expert_shapes(self) -> dict[str, tuple[int, int, int]]:
        """The fused expert parameters of one mixture-of-experts layer and its router:
        `{name: (experts, out, in)}`."""
        e, h, i = self.num_experts, self.hidden_size, self.expert_intermediate_size
        return {"router": (1, e, h), "gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}

    # --- parameter counts -------------------------------------------------------------

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of a separate output projection (0 when tied to the embeddings)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def layer_params(self, layer: int) -> int:
        """Every parameter of decoder layer `layer`."""
        n = sum(o * i for o, i in self.linear_shapes(layer).values())
        n += sum(self.norm_sizes()) + sum(self.linear_biases(layer).values())
        if self.is_sparse(layer):
            n += sum(e * o * i for e, o, i in self.expert_shapes().values())
        return n

    @property
    def linear_params_per_layer(self) -> int:
        """Parameters of the linear layers of a dense decoder layer."""
        return sum(o * i for o, i in self.linear_shapes(0).values())

    @property
    def other_params_per_layer(self) -> int:
        """Norm weights and biases of one decoder layer (kept unquantized)."""
        return sum(self.norm_sizes()) + sum(self.linear_biases(0).values())

    @property
    def num_parameters(self) -> int:
        kinds = {self.is_sparse(i) for i in range(self.num_layers)}
        per_kind = {s: self.layer_params(self._first(s)) for s in kinds}
        layers = sum(per_kind[self.is_sparse(i)] for i in range(self.num_layers))
        return self.embedding_params + self.lm_head_params + layers + self.hidden_size

    def _first(self, sparse: bool) -> int:
        return next(i for i in range(self.num_layers) if self.is_sparse(i) == sparse)

    def lora_parameters(self, r: int, targets: tuple[str, ...]) -> int:
        """LoRA parameters `r * (in + out)` over the target linear layers of every layer."""
        total = 0
        for layer in range(self.num_layers):
            shapes = self.linear_shapes(layer)
            total += sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)
        return total

    def with_layers(self, num_layers: int) -> Architecture:
        return replace(self, num_layers=num_layers)

    # --- parsing ----------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str | None = None) -> Architecture:
        """From a Hugging Face `config.json` dict (text_config of a multimodal one is used).
        FormatError (a ValueError) naming the field for anything missing, mistyped, out of
        range or not understood."""
        source = name or "the model config"
        if not isinstance(config, Mapping):
            raise FormatError(
                source, f"a model config must be a JSON object, got {type(config).__name__}"
            )
        cfg = dict(config)
        if "text_config" in cfg and "hidden_size" not in cfg:
            text = cfg["text_config"]
            if not isinstance(text, Mapping):
                raise FormatError(source, "must be a JSON object", "text_config")
            cfg = {**cfg, **dict(text)}
        r = HfConfig(cfg, source, ranges=_INT_RANGES, whole_floats=True)
        for key in REQUIRED_FIELDS:
            if cfg.get(key) is None:
                raise r.fail(key, "missing: the estimate needs it")
        model_type = r.model_type(
            MODEL_TYPES,
            "{name} is not one the estimator models (it models {known}); its memory would be "
            "guessed, so it is refused",
        )
        qk_norm, qkv_bias, moe = MODEL_TYPES[model_type]
        act = cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise r.fail("hidden_act", f"{act!r} is not a gated SiLU MLP, the one modelled")
        hidden, heads, kv, head_dim = r.heads()
        attention_bias = r.flag("attention_bias", False)
        experts = dict(
            num_experts=0, experts_per_token=0, expert_intermediate_size=0,
            shared_expert_intermediate_size=0, dense_layers=frozenset(),
        )  # fmt: skip
        layers = r.integer("num_hidden_layers")
        if moe:
            experts = _moe_fields(r, model_type, layers)
        return cls(
            name=name or r.text("_name_or_path", model_type) or model_type,
            hidden_size=hidden,
            intermediate_size=r.integer("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            vocab_size=r.integer("vocab_size"),
            tie_word_embeddings=r.flag("tie_word_embeddings", False),
            qk_norm=qk_norm,
            qkv_bias=r.flag("qkv_bias", qkv_bias) or attention_bias,
            o_bias=attention_bias,
            mlp_bias=r.flag("mlp_bias", False),
            model_type=model_type,
            source=cfg,
            **experts,  # type: ignore[arg-type]
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Architecture:
        """A config.json (or a folder holding one): a regular file of at most
        `MAX_CONFIG_BYTES`, read once; FormatError for what is not a valid config."""
        p = Path(path)
        try:
            if p.is_dir():
                p = p / "config.json"
            info = p.stat()
        except OSError as e:
            raise FormatError(p, f"cannot read it: {e.strerror or e}") from None
        if not stat.S_ISREG(info.st_mode):
            raise FormatError(p, "not a regular file (a config.json is read from a file)")
        if info.st_size > MAX_CONFIG_BYTES:
            raise FormatError(
                p,
                f"{info.st_size} bytes: larger than any config.json "
                f"({MAX_CONFIG_BYTES} bytes at most)",
            )
        try:
            # O_NONBLOCK: were it swapped for a FIFO since the check, open must not wait
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise FormatError(p, "not a regular file")
                data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise FormatError(p, f"cannot read it: {e.strerror or e}") from None
        if len(data) > MAX_CONFIG_BYTES:
            raise FormatError(p, f"larger than any config.json ({MAX_CONFIG_BYTES} bytes at most)")
        return cls.from_config(_json.loads(data, p, int_digits=_json.MAX_INT_DIGITS), name=str(p))


def _moe_fields(r: HfConfig, model_type: str, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config."""
    if model_type == "mixtral":
        experts = r.integer("num_local_experts")
        expert_size = r.integer("intermediate_size")
        shared = 0
        dense: frozenset[int] = frozenset()
    else:
        experts = r.integer("num_experts")
        expert_size = r.integer("moe_intermediate_size")
        shared = r.integer("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        step = r.integer("decoder_sparse_step", 1)
        only = r.raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in only
        ):
            raise r.fail("mlp_only_layers", f"must be a list of layer indices below {layers}")
        dense = frozenset(i for i in range(layers) if i in only or (i + 1) % step)
    per_token = r.integer("num_experts_per_tok")
    if per_token > experts:
        raise r.fail("num_experts_per_tok", f"{per_token} is more than the {experts} experts")
    return dict(
        num_experts=experts,
        experts_per_token=per_token,
        expert_intermediate_size=expert_size,
        shared_expert_intermediate_size=shared,
        dense_layers=dense,
    )
