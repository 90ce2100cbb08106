"""The pure-numpy oracle: the readable statement of nybble's math.

Slow and obvious on purpose. Every fast path (Rust SIMD, CUDA) is tested against these
functions, which follow ../shared/SPEC.md line by line. Inputs are flat float32 arrays
unless said otherwise; `nybble.quantize` and friends handle dtypes, shapes and devices.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

# --- codebooks -----------------------------------------------------------------------

#: NF4 (index -> value), the exact float32 values of bitsandbytes and the QLoRA paper.
NF4 = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=np.float32,
)  # fmt: skip
#: NF4 decision thresholds (c[k] + c[k+1]) / 2 in float32; a tie takes the lower code.
NF4_MIDPOINTS = ((NF4[:-1] + NF4[1:]) * np.float32(0.5)).astype(np.float32)

#: bitsandbytes FP4 in code order: bit 3 is the sign, bits 0-2 the magnitude.
FP4 = np.array(
    [0.0, 0.0052083333, 0.6666667, 1.0, 0.33333334, 0.5, 0.16666667, 0.25,
     -0.0, -0.0052083333, -0.6666667, -1.0, -0.33333334, -0.5, -0.16666667, -0.25],
    dtype=np.float32,
)  # fmt: skip
#: FP4 magnitude thresholds as bitsandbytes writes them, ascending.
FP4_THRESHOLDS = np.array(
    [0.00260417, 0.0859375, 0.20833333, 0.29166667, 0.4166667, 0.583333, 0.8333333],
    dtype=np.float32,
)
#: Code of the k-th smallest FP4 magnitude.
FP4_MAGNITUDE_CODES = np.array([0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011], np.uint8)

#: int8: code q (two's complement) stands for q / 127.
INT8 = (np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32) / np.float32(127)).astype(
    np.float32
)

CODEBOOKS = {"nf4": NF4, "fp4": FP4, "int8": INT8}
ZERO_CODE = {"nf4": 7, "fp4": 0, "int8": 0}
BITS = {"nf4": 4, "fp4": 4, "int8": 8}


def codebook_values(codebook: str) -> F32:
    """The value table of a format, indexed by code."""
    return CODEBOOKS[codebook]


def encode(v: F32, codebook: str) -> U8:
    """Codes of normalised values v = x / absmax (one code per byte)."""
    if codebook == "nf4":
        # The number of thresholds strictly below v.
        return np.searchsorted(NF4_MIDPOINTS, v, side="left").astype(np.uint8)
    if codebook == "fp4":
        magnitude = np.searchsorted(FP4_THRESHOLDS, np.abs(v), side="left")
        return (np.where(v < 0, 0b1000, 0) | FP4_MAGNITUDE_CODES[magnitude]).astype(np.uint8)
    if codebook == "int8":
        q = np.clip(np.rint(v * np.float32(127)), -127, 127)
        with np.errstate(invalid="ignore"):  # NaN in all-zero blocks, overwritten by the caller
            return q.astype(np.int8).view(np.uint8)
    raise ValueError(f"unknown codebook {codebook!r}")


# --- nibble order ----------------------------------------------------------------------


def pack_nibbles(codes: U8, zero_code: int) -> U8:
    """Two codes per byte: element 2k in the low nibble, 2k+1 in the high one."""
    if codes.size % 2:
        codes = np.append(codes, np.uint8(zero_code))
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: U8, n: int) -> U8:
    """The first n codes of a packed buffer."""
    codes = np.empty(packed.size * 2, dtype=np.uint8)
    codes[0::2] = packed & 0x0F
    codes[1::2] = packed >> 4
    return codes[:n]


# --- blockwise quantization -----------------------------------------------------------


def first_non_finite(x: F32) -> int | None:
    bad = np.flatnonzero(~np.isfinite(x))
    return int(bad[0]) if bad.size else None


def quantize(x: F32, blocksize: int = 64, codebook: str = "nf4") -> tuple[U8, F32]:
    """Blockwise absmax quantization of a flat float32 array -> (codes, absmax)."""
    x = np.asarray(x, dtype=np.float32).ravel()
    bad = first_non_finite(x)
    if bad is not None:
        raise ValueError(f"input has a non-finite value (NaN or inf) at flat index {bad}")
    n = x.size
    nblocks = -(-n // blocksize)
    blocks = np.zeros(nblocks * blocksize, dtype=np.float32)
    blocks[:n] = x  # the padding of a partial last block is 0 and changes no absmax
    blocks = blocks.reshape(nblocks, blocksize)
    absmax = np.abs(blocks).max(axis=1) if n else np.zeros(0, np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inverse = np.float32(1) / absmax  # the reciprocal in float32, as bitsandbytes
        v = blocks * inverse[:, None]
        # Tiny blocks whose reciprocal overflows are normalised by division instead.
        tiny = np.isinf(inverse) & (absmax > 0)
        v[tiny] = blocks[tiny] / absmax[tiny, None]
    codes = encode(v, codebook)
    codes[absmax == 0] = ZERO_CODE[codebook]
    codes = codes.ravel()[:n]
    if BITS[codebook] == 4:
        codes = pack_nibbles(codes, ZERO_CODE[codebook])
    return codes, absmax.astype(np.float32)


def dequantize(codes: U8, absmax: F32, n: int, blocksize: int = 64, codebook: str = "nf4") -> F32:
    """value(code) * absmax in float32 (round to another dtype afterwards)."""
    if BITS[codebook] == 4:
        codes = unpack_nibbles(codes, n)
    scale = np.repeat(absmax.astype(np.float32), blocksize)[:n]
    return (CODEBOOKS[codebook][codes[:n]] * scale).astype(np.float32)


# --- the 36-byte block layout ----------------------------------------------------------

BLOCK36_VALUES = 64


def to_blocks(codes: U8, absmax: F32, n: int, zero_code: int = 7) -> U8:
    """Per block of 64 values: absmax as little-endian f32, then 32 bytes of packed codes."""
    nblocks = absmax.size
    padded = np.full(nblocks * 32, (zero_code << 4) | zero_code, dtype=np.uint8)
    padded[: codes.size] = codes
    if n % 2:
        padded[n // 2] = (padded[n // 2] & 0x0F) | (zero_code << 4)
    scale_bytes = absmax.astype("<f4").view(np.uint8).reshape(nblocks, 4)
    return np.concatenate([scale_bytes, padded.reshape(nblocks, 32)], axis=1).ravel()


def from_blocks(buf: U8, n: int) -> tuple[U8, F32]:
    """The inverse of to_blocks: (codes, absmax) for n values."""
    blocks = buf.reshape(-1, 36)
    absmax = blocks[:, :4].copy().view("<f4").ravel().astype(np.float32)
    codes = blocks[:, 4:].ravel()[: -(-n // 2)].copy()
    return codes, absmax
