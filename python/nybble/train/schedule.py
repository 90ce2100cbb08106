"""Learning-rate schedules: a linear warmup from 0, then constant, linear decay to 0, or a
cosine decay to 0 at `total_steps` (transformers' get_*_schedule_with_warmup)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    kind: str = "constant"
    warmup_steps: int = 0
    #: the step where linear and cosine reach 0 (None: constant after warmup)
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"schedule: expected one of {KINDS}, got {self.kind!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise ValueError(f"warmup_steps: expected an integer, got {self.warmup_steps!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.kind != "constant" and (
            not isinstance(self.total_steps, int) or self.total_steps < 1
        ):
            raise ValueError(
                f"a {self.kind} schedule needs total_steps >= 1, got {self.total_steps!r}"
            )

    def factor(self, step: int) -> float:
        """The multiple of the peak learning rate for the update that makes `step` steps
        (0 for the first update, as transformers counts)."""
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        assert self.total_steps is not None
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["KINDS", "LRSchedule"]
