"""LoraConfig: the hyper-parameters of a LoRA adapter, with PEFT's meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

INITS = ("kaiming", "gaussian")


@dataclass(frozen=True)
class LoraConfig:
    """r: rank; alpha: scale numerator (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA);
    dropout: probability on the LoRA branch in training; target_modules: module names (or
    "all-linear") an adapter attaches to; fan_in_fan_out: the base weight is stored [in, out];
    init: "kaiming" (A ~ U(±1/sqrt(in)), PEFT's default) or "gaussian" (A ~ N(0, 1/r)); B = 0
    either way; seed: for the init and dropout."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = field(default=("q_proj", "v_proj"))
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    init: str = "kaiming"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def validate(self, need_targets: bool = False) -> LoraConfig:
        """Raises ValueError naming the first bad field; returns self."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoraConfig.r must be an integer >= 1, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0 or math.isinf(self.alpha):
            raise ValueError(f"LoraConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in INITS:
            raise ValueError(f"LoraConfig.init must be one of {INITS}, got {self.init!r}")
        if need_targets and not self.target_modules:
            raise ValueError("LoraConfig.target_modules is empty; name the modules to adapt")
        return self

    def targets(self, name: str) -> bool:
        """Whether a module path (e.g. model.layers.0.self_attn.q_proj) is a target."""
        if self.target_modules == "all-linear":
            return True
        leaf = name.rsplit(".", 1)[-1]
        return any(name == t or leaf == t or name.endswith("." + t) for t in self.target_modules)

    def with_(self, **changes: Any) -> LoraConfig:
        return replace(self, **changes)
