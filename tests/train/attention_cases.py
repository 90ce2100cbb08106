"""What the flash attention tests share (tests/train/test_attention_emulated.py runs the
kernels under the CPU emulator, test_attention_gpu.py on a GPU): the packed samples' starts."""

from __future__ import annotations

import numpy as np


def sample_starts(rng: np.random.Generator, kind: str, b: int, t: int) -> np.ndarray:
    """Where each position's sample starts, [b, t]: "packed", samples of random lengths;
    "decreasing", samples of 64 tokens and row 0's last token's start moved back to 0 (still a
    valid start, at or before the token; a dK/dV block must then go on past query tiles that
    see none of its keys)."""
    if kind == "decreasing":
        starts = np.tile(np.arange(t) // 64 * 64, (b, 1))
        starts[0, t - 1] = 0
        return starts
    if kind != "packed":
        raise ValueError(f"unknown kind of starts {kind!r}")
    starts = np.zeros((b, t), np.int64)
    for row in range(b):
        at = 0
        while at < t:
            n = int(rng.integers(1, max(2, t // 3)))
            starts[row, at : at + n] = at
            at += n
    return starts
