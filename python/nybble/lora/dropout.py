"""LoRA dropout masks that are a function of (seed, draw, element): a counter-based hash of
each element's index under a key made of the layer's seed and the number of masks it drew
before (two rounds of the `lowbias32` integer hash). Nothing but that draw count is state, so
gradient checkpointing recomputes a forward with the same mask and a checkpoint resumes the
stream exactly by storing one integer; and the same uint32 arithmetic in numpy and CuPy gives
the same mask on the CPU and the GPU."""

from __future__ import annotations

import math
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import DTypeLike

if TYPE_CHECKING:
    from ..backends import Array

_M32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B


def _hash32(x: int) -> int:
    """lowbias32 on a Python int (the key, made on the host)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL1) & _M32
    x ^= x >> 15
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def _hash32_inplace(z: Array) -> None:
    """lowbias32 on a uint32 array, in place (products wrap modulo 2^32)."""
    z ^= z >> np.uint32(16)
    z *= np.uint32(_MUL1)
    z ^= z >> np.uint32(15)
    z *= np.uint32(_MUL2)
    z ^= z >> np.uint32(16)


def keep_mask(
    xp: ModuleType, shape: tuple[int, ...], p: float, seed: int, draw: int, dtype: DTypeLike
) -> Array:
    """Inverted dropout's multiplier for an array of `shape`: 1/(1-p) where kept, 0 where
    dropped, in `dtype`, on `xp`'s device: mask number `draw` of the stream `seed`."""
    n = math.prod(shape)
    if n > _M32:
        raise ValueError(f"dropout: {n} elements, more than a mask of 2^32 - 1 holds")
    k1 = _hash32(seed ^ _hash32((seed >> 32) ^ _hash32(draw)))
    k2 = _hash32(k1 ^ 0x9E3779B9)
    z = xp.arange(n, dtype=np.uint32)
    z ^= np.uint32(k1)
    _hash32_inplace(z)
    z ^= np.uint32(k2)
    _hash32_inplace(z)
    threshold = np.uint32(min(round(p * 2**32), _M32))
    keep = (z >= threshold).reshape(shape).astype(dtype)
    # A Python float keeps the mask's dtype; CuPy takes no 0-d numpy array as an operand.
    keep *= 1.0 / (1.0 - p)
    return keep
