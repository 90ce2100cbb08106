"""LoraConfig: the hyper-parameters of a LoRA adapter, with PEFT's meanings (docs/lora.md)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from .. import _json
from ..errors import FormatError

Init = Literal["kaiming", "gaussian"]
INITS: tuple[Init, ...] = ("kaiming", "gaussian")
#: PEFT's default lora_alpha, what a config file without the field means.
PEFT_DEFAULT_ALPHA = 8
#: PEFT's adapter config file.
CONFIG_FILE = "adapter_config.json"
#: An adapter config is a few kilobytes; reading stops well beyond.
MAX_CONFIG_BYTES = _json.MAX_FILE_BYTES
#: The largest float32: a scaling beyond it cannot multiply a float32 product.
_F32_MAX = 3.4028234663852886e38


class InvalidField(ValueError):
    """A LoraConfig field with a bad type or value; `field` is its name (nybble's)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"LoraConfig.{field} {message}")


#: nybble's field names as PEFT writes them in adapter_config.json.
PEFT_NAMES = {"alpha": "lora_alpha", "dropout": "lora_dropout", "init": "init_lora_weights"}


def _pairs(value: Any, what: str) -> tuple[tuple[str, float], ...]:
    """A PEFT pattern dict ({module-path regex: value}, or its (key, value) pairs) as pairs in
    insertion order; InvalidField for anything else, a key that is no string or a value that
    is a non-finite number."""
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise InvalidField(
            what, f"must be a mapping of module patterns to numbers, got {value!r:.80}"
        )
    for key, number in value.items():
        if not isinstance(key, str):
            raise InvalidField(what, f"keys must be module-path patterns (strings), got {key!r}")
        _finite(number, f"{what}[{key!r}]")
    return tuple((k, v) for k, v in value.items())


def _finite(value: Any, what: str) -> None:
    """InvalidField for a float that is NaN or infinite (1e999 reads as inf): nothing it
    sets can be computed, and JSON cannot hold it."""
    if isinstance(value, float) and not math.isfinite(value):
        name = what.split("[", 1)[0]
        index = what[len(name) :] + " " if what != name else ""
        raise InvalidField(name, f"{index}must be a finite number, got {value!r}")


@dataclass(frozen=True, init=False)
class LoraConfig:
    """r: rank; alpha (PEFT: lora_alpha): scale numerator, scaling = alpha / r, or alpha /
    sqrt(r) with rsLoRA; dropout (PEFT: lora_dropout): probability on the LoRA branch in
    training; target_modules: module names (a leaf such as "q_proj" or a dotted path
    suffix), a regular expression that must match the whole module path when a single
    string (as PEFT reads a string), or "all-linear"; fan_in_fan_out: the base weight is
    stored [in, out]; init (PEFT: init_lora_weights True / "gaussian"): "kaiming" (A ~
    U(±1/sqrt(in)), PEFT's default) or "gaussian" (A ~ N(0, 1/r)); B = 0 either way;
    rank_pattern / alpha_pattern: per-module r / alpha by regex on the module path, as PEFT;
    seed: for the init and dropout."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    init: Init = "kaiming"
    seed: int = 0
    rank_pattern: tuple[tuple[str, float], ...] = field(default=())
    alpha_pattern: tuple[tuple[str, float], ...] = field(default=())

    def __init__(
        self,
        r: int = 8,
        alpha: float | None = None,
        dropout: float | None = None,
        target_modules: tuple[str, ...] | list[str] | str = ("q_proj", "v_proj"),
        use_rslora: bool = False,
        use_dora: bool = False,
        fan_in_fan_out: bool = False,
        init: str | None = None,
        seed: int = 0,
        *,
        lora_alpha: float | None = None,
        lora_dropout: float | None = None,
        init_lora_weights: bool | str | None = None,
        rank_pattern: Mapping[str, int] | tuple[tuple[str, float], ...] | None = None,
        alpha_pattern: Mapping[str, float] | tuple[tuple[str, float], ...] | None = None,
    ) -> None:
        """Takes nybble's names or PEFT's (`lora_alpha`, `lora_dropout`, `init_lora_weights`);
        giving both spellings of one field with different values is a ValueError."""
        values = {
            "r": r,
            "alpha": _either("alpha", alpha, "lora_alpha", lora_alpha, 16.0),
            "dropout": _either("dropout", dropout, "lora_dropout", lora_dropout, 0.0),
            "target_modules": (
                tuple(target_modules) if isinstance(target_modules, list) else target_modules
            ),
            "use_rslora": use_rslora,
            "use_dora": use_dora,
            "fan_in_fan_out": fan_in_fan_out,
            "init": _either(
                "init", init, "init_lora_weights", _peft_init(init_lora_weights), "kaiming"
            ),
            "seed": seed,
            "rank_pattern": _pairs(rank_pattern, "rank_pattern"),
            "alpha_pattern": _pairs(alpha_pattern, "alpha_pattern"),
        }
        for name in ("alpha", "dropout"):
            _finite(values[name], name)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    # --- derived ------------------------------------------------------------------------

    @property
    def lora_alpha(self) -> float:
        return self.alpha

    @property
    def lora_dropout(self) -> float:
        return self.dropout

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def validate(self, need_targets: bool = False) -> LoraConfig:
        """Raises InvalidField (a ValueError naming the field) for the first bad field;
        returns self."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or not 1 <= self.r < 2**31:
            raise InvalidField("r", f"must be an integer from 1 to 2^31 - 1, got {self.r!r}")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not 0 < self.alpha <= _F32_MAX  # compared as given: no int -> float overflow
        ):
            raise InvalidField(
                "alpha", f"must be a number > 0 that float32 can hold, got {self.alpha!r}"
            )
        if not self.scaling <= _F32_MAX:
            raise InvalidField(
                "alpha",
                f"={self.alpha!r} gives a scaling beyond float32 ({self.scaling:.3g}); LoRA "
                "products would overflow",
            )
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0.0 <= self.dropout < 1.0
        ):
            raise InvalidField("dropout", f"must be in [0, 1), got {self.dropout!r}")
        for flag in ("use_rslora", "use_dora", "fan_in_fan_out"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidField(flag, f"must be True or False, got {getattr(self, flag)!r}")
        if self.init not in INITS:
            raise InvalidField("init", f"must be one of {INITS}, got {self.init!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidField("seed", f"must be an integer >= 0, got {self.seed!r}")
        targets = self.target_modules
        if isinstance(targets, str):
            if targets != "all-linear":
                _regex(targets, "target_modules")
        elif not isinstance(targets, tuple) or not all(
            isinstance(t, str) and t and "." not in (t[0], t[-1]) for t in targets
        ):
            raise InvalidField(
                "target_modules",
                f"must be 'all-linear', a regular expression, or a list of module names, "
                f"got {targets!r}",
            )
        if need_targets and not targets:
            raise InvalidField("target_modules", "is empty; name the modules to adapt")
        for key, rank in self.rank_pattern:
            _regex(key, "rank_pattern")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < 2**31:
                raise InvalidField("rank_pattern", f"[{key!r}] is {rank!r}; expected a rank >= 1")
        for key, alpha in self.alpha_pattern:
            _regex(key, "alpha_pattern")
            number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
            # r >= 1, so alpha bounds the scaling: below float32's largest, products stay finite
            if not number or not 0 < alpha <= _F32_MAX:
                raise InvalidField(
                    "alpha_pattern",
                    f"[{key!r}] is {alpha!r}; expected a number > 0 that float32 can hold",
                )
        return self

    def targets(self, name: str) -> bool:
        """Whether a module path (e.g. model.layers.0.self_attn.q_proj) is a target: "all-
        linear" takes every one; a single string is a regular expression matched against the
        whole path; a list names leaves or dotted suffixes of the path."""
        _module_path(name)
        t = self.target_modules
        if t == "all-linear":  # as PEFT: every linear layer but the output layer
            return name.rsplit(".", 1)[-1] != "lm_head"
        if isinstance(t, str):
            return re.fullmatch(t, name) is not None
        return any(name == m or name.endswith("." + m) for m in t)

    def for_module(self, name: str) -> LoraConfig:
        """The config of one module: r and alpha from rank_pattern / alpha_pattern where a
        pattern matches the end of its path (PEFT's rule), this config's otherwise."""
        _module_path(name)
        r = _pattern(self.rank_pattern, name, self.r)
        alpha = _pattern(self.alpha_pattern, name, self.alpha)
        if r == self.r and alpha == self.alpha:
            return self
        return replace(self, r=int(r), alpha=float(alpha), rank_pattern=(), alpha_pattern=())

    def with_(self, **changes: Any) -> LoraConfig:
        unknown = sorted(set(changes) - set(self.__dataclass_fields__))
        if unknown:
            known = ", ".join(self.__dataclass_fields__)
            raise ValueError(f"LoraConfig has no field {unknown[0]!r} (its fields: {known})")
        return replace(self, **changes)

    # --- PEFT's adapter_config.json ---------------------------------------------------------

    @classmethod
    def from_peft(cls, source: Mapping[str, Any] | str | os.PathLike[str]) -> LoraConfig:
        """A config from PEFT's adapter_config.json: the parsed dict, the file, or its
        directory. Fields are checked by type and range; a field that changes the math and
        that nybble does not implement is refused, naming it (FormatError)."""
        path: Path | None = None
        if isinstance(source, Mapping):
            raw: Any = source
        elif not isinstance(source, (str, os.PathLike)):
            raise ValueError(
                "source must be adapter_config.json's dict, the file or its directory, got "
                f"{type(source).__name__}"
            )
        else:
            path = Path(source)
            if path.is_dir():
                path = path / CONFIG_FILE
            raw = read_json(path)
        where = str(path) if path is not None else CONFIG_FILE
        if not isinstance(raw, Mapping):
            raise FormatError(where, "not a JSON object")
        if raw.get("peft_type", "LORA") != "LORA":
            raise FormatError(where, f"must be 'LORA', got {raw.get('peft_type')!r}", "peft_type")
        for key, default in _UNSUPPORTED.items():
            if key in raw and raw[key] not in default:
                raise FormatError(where, f"{raw[key]!r} is not supported by nybble", key)
        kwargs: dict[str, Any] = {}
        for key, name, kind in _PEFT_FIELDS:
            if key not in raw or (raw[key] is None and name not in ("r", "lora_alpha")):
                continue
            value = raw[key]
            if not _is(value, kind):
                raise FormatError(where, f"expected {kind}, got {value!r}", key)
            kwargs[name] = value
        if "r" not in kwargs:
            raise FormatError(where, "missing", "r")
        kwargs.setdefault("lora_alpha", PEFT_DEFAULT_ALPHA)  # a file without it means PEFT's
        targets = kwargs.pop("target_modules", None)
        if targets is not None:
            kwargs["target_modules"] = targets if isinstance(targets, str) else tuple(targets)
        else:
            kwargs["target_modules"] = ()
        try:
            return cls(**kwargs).validate()
        except InvalidField as e:
            raise FormatError(where, str(e), PEFT_NAMES.get(e.field, e.field)) from None

    def to_peft(self) -> dict[str, Any]:
        """The fields of PEFT's adapter_config.json this config sets (validated first: what
        is written is what `from_peft` reads back)."""
        self.validate()
        targets: str | list[str] = (
            self.target_modules
            if isinstance(self.target_modules, str)
            else sorted(self.target_modules)
        )
        return {
            "peft_type": "LORA",
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": targets,
            "use_rslora": self.use_rslora,
            "use_dora": self.use_dora,
            "fan_in_fan_out": self.fan_in_fan_out,
            "bias": "none",
            "init_lora_weights": True if self.init == "kaiming" else "gaussian",
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
        }


#: PEFT fields read, nybble's name, and the JSON kind each must have.
_PEFT_FIELDS = (
    ("r", "r", "int"),
    ("lora_alpha", "lora_alpha", "number"),
    ("lora_dropout", "lora_dropout", "number"),
    ("target_modules", "target_modules", "str or list of str"),
    ("use_rslora", "use_rslora", "bool"),
    ("use_dora", "use_dora", "bool"),
    ("fan_in_fan_out", "fan_in_fan_out", "bool"),
    ("init_lora_weights", "init_lora_weights", "bool or str"),
    ("rank_pattern", "rank_pattern", "object"),
    ("alpha_pattern", "alpha_pattern", "object"),
)
#: PEFT fields that change the math, with the values nybble implements (the defaults).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "layer_replication": (None, []),
    "use_qalora": (False, None),
    "lora_bias": (False, None),
    "megatron_config": (None,),
    "trainable_token_indices": (None,),
}


def _is(value: Any, kind: str) -> bool:
    # An int beyond float's range is a number JSON allows; compared, never converted.
    number = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and math.isfinite(value)
    )
    return {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": number,
        "bool": isinstance(value, bool),
        "bool or str": isinstance(value, (bool, str)),
        "object": isinstance(value, Mapping) and all(isinstance(k, str) for k in value),
        "str or list of str": isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
    }[kind]


def _either(name: str, value: Any, peft_name: str, peft_value: Any, default: Any) -> Any:
    if value is not None and peft_value is not None and not _same(value, peft_value):
        raise InvalidField(name, f"={value!r} and {peft_name}={peft_value!r} disagree")
    if value is not None:
        return value
    return peft_value if peft_value is not None else default


def _same(a: Any, b: Any) -> bool:
    """a == b for the plain values a field takes; False for what has no single truth value
    (arrays), which validate() refuses anyway."""
    try:
        return bool(a is b or a == b)
    except (TypeError, ValueError):
        return False


def _module_path(name: object) -> None:
    if not isinstance(name, str):
        raise ValueError(f"name must be a module path (a string), got {name!r}")


def _peft_init(value: bool | str | None) -> str | None:
    if value is None:
        return None
    if value is True or value is False:
        # False is PEFT's random init that is not a no-op at start (B random too): for an
        # adapter read from files its init is past; a new one gets nybble's default.
        return "kaiming"
    if value == "gaussian":
        return "gaussian"
    raise InvalidField(
        "init",
        f"(init_lora_weights) {value!r} is not supported; nybble initialises A with "
        "kaiming-uniform (True) or a gaussian ('gaussian'), B with zeros",
    )


def _regex(pattern: str, what: str) -> re.Pattern[str]:
    """`pattern` compiled as it is used: alone for target_modules, inside PEFT's suffix match
    for the patterns (where a flag such as '(?i)' in the middle does not compile)."""
    try:
        if what in ("rank_pattern", "alpha_pattern"):
            return re.compile(_SUFFIX_MATCH.format(pattern))
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        raise InvalidField(what, f"{pattern!r} is not a regular expression ({e})") from None


#: PEFT's rule for rank/alpha pattern keys: the key matches the end of the module path.
_SUFFIX_MATCH = r"(.*\.)?(?:{})"


def _pattern(pairs: tuple[tuple[str, float], ...], name: str, default: float) -> float:
    """PEFT's rank/alpha patterns: the first key matching the end of the module path."""
    for key, value in pairs:
        if re.fullmatch(_SUFFIX_MATCH.format(key), name):
            return value
    return default


def read_json(path: Path) -> Any:
    """A JSON file, read with limits (nybble._json): FormatError naming the file otherwise."""
    return _json.read_file(path, MAX_CONFIG_BYTES)


__all__ = ["CONFIG_FILE", "INITS", "InvalidField", "LoraConfig", "read_json"]
