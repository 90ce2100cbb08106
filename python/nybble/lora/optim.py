"""AdamW over named arrays, with gradient accumulation and global-norm clipping."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import backends


class AdamW:
    """AdamW (decoupled weight decay, bias-corrected moments; `reference.adamw_step` states
    it). `params` maps names to float32 arrays, updated in place.

    `step(grads)` adds one micro-batch of gradients; every `accumulation_steps` calls it
    averages them, clips them to `max_grad_norm` (global L2 norm, when set) and updates the
    parameters, and returns True. `step_count` counts those updates."""

    def __init__(
        self,
        params: Mapping[str, Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accumulation_steps: int = 1,
        max_grad_norm: float | None = None,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps > 0 or weight_decay < 0:
            raise ValueError(f"eps must be > 0 and weight_decay >= 0, got {eps}, {weight_decay}")
        if isinstance(accumulation_steps, bool) or not int(accumulation_steps) >= 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self.params = dict(params)
        self._backend = backends.same(*self.params.values())
        xp = self._backend.xp
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.accumulation_steps = int(accumulation_steps)
        self.max_grad_norm = max_grad_norm
        self.step_count = 0
        self.micro_steps = 0
        self.m = {k: xp.zeros_like(p) for k, p in self.params.items()}
        self.v = {k: xp.zeros_like(p) for k, p in self.params.items()}
        self._accum = {k: xp.zeros_like(p) for k, p in self.params.items()}
        self._finite = self._backend.finite_check()
        self.last_grad_norm: float | None = None

    def step(self, grads: Mapping[str, Any]) -> bool:
        """Accumulates `grads` (None entries are skipped); applies an update when due. A
        non-finite gradient raises NonFiniteError naming it, before any state changes (on the
        GPU this is the step's one wait for the device)."""
        unknown = set(grads) - set(self.params)
        if unknown:
            raise KeyError(f"gradients for unknown parameters: {sorted(unknown)}")
        given = {k: g for k, g in grads.items() if g is not None}
        for k, g in given.items():
            if tuple(g.shape) != tuple(self.params[k].shape):
                raise ValueError(
                    f"gradient {k!r} has shape {tuple(g.shape)}, "
                    f"expected {tuple(self.params[k].shape)}"
                )
            if backends.of(g).device != self._backend.device:
                raise ValueError(f"gradient {k!r} is not on {self._backend.device}")
            self._finite.record(g, f"gradient {k!r}")
        self._finite.raise_pending()
        for k, g in given.items():
            self._accum[k] += g
        self.micro_steps += 1
        if self.micro_steps < self.accumulation_steps:
            return False
        self._apply()
        return True

    def _apply(self) -> None:
        xp = self._backend.xp
        scale = 1.0 / self.micro_steps
        squares = sum((a * a).sum(dtype=np.float64) for a in self._accum.values())
        norm = math.sqrt(float(squares)) * scale  # one read back on the GPU
        self.last_grad_norm = norm
        if self.max_grad_norm is not None and norm > self.max_grad_norm:
            scale *= self.max_grad_norm / (norm + 1e-6)
        self.step_count += 1
        t = self.step_count
        b1, b2 = self.betas
        c1, c2 = 1 - b1**t, 1 - b2**t
        for k, p in self.params.items():
            g = self._accum[k] * np.float32(scale)
            m, v = self.m[k], self.v[k]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p *= np.float32(1 - self.lr * self.weight_decay)
            p -= np.float32(self.lr) * (m / c1) / (xp.sqrt(v / c2) + np.float32(self.eps))
            self._accum[k][...] = 0
        self.micro_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: moments, the pending accumulation, counters, settings."""
        return {
            "step_count": self.step_count,
            "micro_steps": self.micro_steps,
            "m": {k: v.copy() for k, v in self.m.items()},
            "v": {k: v.copy() for k, v in self.v.items()},
            "accum": {k: v.copy() for k, v in self._accum.items()},
            "hyper": {
                "lr": self.lr,
                "betas": tuple(self.betas),
                "eps": self.eps,
                "weight_decay": self.weight_decay,
                "accumulation_steps": self.accumulation_steps,
                "max_grad_norm": self.max_grad_norm,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for part in ("m", "v", "accum"):
            if set(state[part]) != set(self.params):
                raise KeyError(
                    f"optimizer state {part!r} names {sorted(state[part])}, "
                    f"expected {sorted(self.params)}"
                )
        for k in self.params:
            self.m[k][...] = state["m"][k]
            self.v[k][...] = state["v"][k]
            self._accum[k][...] = state["accum"][k]
        self.step_count = int(state["step_count"])
        self.micro_steps = int(state["micro_steps"])
        h = state["hyper"]
        self.lr, self.betas, self.eps = h["lr"], tuple(h["betas"]), h["eps"]
        self.weight_decay, self.max_grad_norm = h["weight_decay"], h["max_grad_norm"]
        self.accumulation_steps = int(h["accumulation_steps"])
