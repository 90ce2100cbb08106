"""The pure-numpy oracle: the readable statement of nybble's math.

Slow and obvious on purpose. Every fast path (Rust SIMD, CUDA) is tested against these
functions, which follow docs/formats.md (the codec) and docs/lora.md (LoRA, DoRA, AdamW) line
by line. The tables below are this module's own literal statement of the formats: nybble's
production code takes them from the Rust core instead, and never imports this module, so
the two statements check each other. Inputs are flat float32 arrays unless said otherwise;
`nybble.quantize` and friends handle dtypes, shapes and devices.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .errors import NonFiniteError

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

#: bitsandbytes FP4 in code order: bit 3 is the sign, bits 0-2 the magnitude. Code 8 is
#: +0.0, as in bitsandbytes' table (its "-0" entry is the integer 0).
FP4 = np.array(
    [0.0, 0.0052083333, 0.6666667, 1.0, 0.33333334, 0.5, 0.16666667, 0.25,
     0.0, -0.0052083333, -0.6666667, -1.0, -0.33333334, -0.5, -0.16666667, -0.25],
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

#: bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True)), sorted; it
#: quantizes the scales under double quantization. DYNAMIC_MAP[127] == 0, [255] == 1.
DYNAMIC_MAP = np.array(
    [
        -0.99296874, -0.9789063, -0.96484375, -0.9507812, -0.93671876,
        -0.92265624, -0.9085938, -0.89453125, -0.8804687, -0.86640626,
        -0.85234374, -0.8382813, -0.82421875, -0.8101562, -0.79609376,
        -0.78203124, -0.7679688, -0.75390625, -0.7398437, -0.72578126,
        -0.7117188, -0.6976563, -0.68359375, -0.6695312, -0.65546876,
        -0.6414063, -0.6273438, -0.61328125, -0.5992187, -0.58515626,
        -0.5710938, -0.5570313, -0.54296875, -0.5289062, -0.5148437,
        -0.50078124, -0.4867187, -0.47265625, -0.45859373, -0.44453126,
        -0.43046874, -0.41640624, -0.40234375, -0.38828123, -0.37421876,
        -0.36015624, -0.34609374, -0.33203125, -0.31796873, -0.30390626,
        -0.28984374, -0.27578127, -0.26171875, -0.24765624, -0.23359375,
        -0.21953125, -0.20546874, -0.19140625, -0.17734376, -0.16328125,
        -0.14921875, -0.13515624, -0.12109375, -0.107031256, -0.09859375,
        -0.09578126, -0.092968754, -0.09015625, -0.08734375, -0.08453125,
        -0.08171876, -0.07890625, -0.07609375, -0.07328125, -0.070468746,
        -0.067656256, -0.06484375, -0.06203125, -0.059218753, -0.05640625,
        -0.05359375, -0.05078125, -0.04796875, -0.04515625, -0.042343747,
        -0.03953125, -0.036718752, -0.03390625, -0.03109375, -0.028281251,
        -0.02546875, -0.02265625, -0.019843752, -0.01703125, -0.01421875,
        -0.01140625, -0.00971875, -0.009156249, -0.00859375, -0.00803125,
        -0.00746875, -0.00690625, -0.00634375, -0.00578125, -0.0052187503,
        -0.0046562497, -0.00409375, -0.0035312497, -0.00296875, -0.00240625,
        -0.00184375, -0.0012812499, -0.0009437501, -0.00083125, -0.00071875006,
        -0.0006062501, -0.00049375003, -0.00038125002, -0.00026875004, -0.00015625001,
        -0.00008875, -0.00006625, -0.00004375, -0.000021249998, -0.00000775,
        -0.0000032500002, -0.00000055000004, 0., 0.00000055000004, 0.0000032500002,
        0.00000775, 0.000021249998, 0.00004375, 0.00006625, 0.00008875,
        0.00015625001, 0.00026875004, 0.00038125002, 0.00049375003, 0.0006062501,
        0.00071875006, 0.00083125, 0.0009437501, 0.0012812499, 0.00184375,
        0.00240625, 0.00296875, 0.0035312497, 0.00409375, 0.0046562497,
        0.0052187503, 0.00578125, 0.00634375, 0.00690625, 0.00746875,
        0.00803125, 0.00859375, 0.009156249, 0.00971875, 0.01140625,
        0.01421875, 0.01703125, 0.019843752, 0.02265625, 0.02546875,
        0.028281251, 0.03109375, 0.03390625, 0.036718752, 0.03953125,
        0.042343747, 0.04515625, 0.04796875, 0.05078125, 0.05359375,
        0.05640625, 0.059218753, 0.06203125, 0.06484375, 0.067656256,
        0.070468746, 0.07328125, 0.07609375, 0.07890625, 0.08171876,
        0.08453125, 0.08734375, 0.09015625, 0.092968754, 0.09578126,
        0.09859375, 0.107031256, 0.12109375, 0.13515624, 0.14921875,
        0.16328125, 0.17734376, 0.19140625, 0.20546874, 0.21953125,
        0.23359375, 0.24765624, 0.26171875, 0.27578127, 0.28984374,
        0.30390626, 0.31796873, 0.33203125, 0.34609374, 0.36015624,
        0.37421876, 0.38828123, 0.40234375, 0.41640624, 0.43046874,
        0.44453126, 0.45859373, 0.47265625, 0.4867187, 0.50078124,
        0.5148437, 0.5289062, 0.54296875, 0.5570313, 0.5710938,
        0.58515626, 0.5992187, 0.61328125, 0.6273438, 0.6414063,
        0.65546876, 0.6695312, 0.68359375, 0.6976563, 0.7117188,
        0.72578126, 0.7398437, 0.75390625, 0.7679688, 0.78203124,
        0.79609376, 0.8101562, 0.82421875, 0.8382813, 0.85234374,
        0.86640626, 0.8804687, 0.89453125, 0.9085938, 0.92265624,
        0.93671876, 0.9507812, 0.96484375, 0.9789063, 0.99296874,
        1.,
    ],
    dtype=np.float32,
)  # fmt: skip
DYNAMIC_MIDPOINTS = ((DYNAMIC_MAP[:-1] + DYNAMIC_MAP[1:]) * np.float32(0.5)).astype(np.float32)

CODEBOOKS = {"nf4": NF4, "fp4": FP4, "int8": INT8, "dynamic8": DYNAMIC_MAP}
ZERO_CODE = {"nf4": 7, "fp4": 0, "int8": 0, "dynamic8": 127}
BITS = {"nf4": 4, "fp4": 4, "int8": 8, "dynamic8": 8}


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
    if codebook == "dynamic8":
        return np.searchsorted(DYNAMIC_MIDPOINTS, v, side="left").astype(np.uint8)
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
        raise NonFiniteError(bad)
    n = x.size
    nblocks = -(-n // blocksize)
    padded = np.zeros(nblocks * blocksize, dtype=np.float32)
    padded[:n] = x  # the padding of a partial last block is 0 and changes no absmax
    blocks = padded.reshape(nblocks, blocksize)
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


# --- double quantization -------------------------------------------------------------

NESTED_BLOCKSIZE = 256


def double_quantize(absmax: F32) -> tuple[U8, F32, np.float32]:
    """Scales -> (codes, absmax2, offset): subtract the mean (summed in order in float64,
    rounded once to float32), then quantize blockwise (256) with the dynamic map."""
    absmax = np.asarray(absmax, dtype=np.float32)
    total = np.cumsum(absmax, dtype=np.float64)[-1] if absmax.size else 0.0
    offset = np.float32(total / max(absmax.size, 1))
    codes, absmax2 = quantize(absmax - offset, NESTED_BLOCKSIZE, "dynamic8")
    return codes, absmax2, offset


def double_dequantize(codes: U8, absmax2: F32, offset: float) -> F32:
    """map[code] * absmax2[i // 256] + offset, rounded to float32 after each operation."""
    scaled = dequantize(codes, absmax2, codes.size, NESTED_BLOCKSIZE, "dynamic8")
    return (scaled + np.float32(offset)).astype(np.float32)


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


# --- LoRA / DoRA (float64, PEFT's conventions: W [out, in], A [r, in], B [out, r]) -------


def lora_scaling(r: int, alpha: float, use_rslora: bool = False) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return float(alpha / np.sqrt(r)) if use_rslora else float(alpha / r)


def dora_row_norms(W: np.ndarray, A: np.ndarray, B: np.ndarray, scaling: float) -> np.ndarray:
    """||W + s·B·A|| of each output row (DoRA's denominator, treated as a constant)."""
    return np.linalg.norm(W + scaling * (B @ A), axis=1)


def lora_forward(
    x: np.ndarray,
    W: np.ndarray,
    A: np.ndarray,
    B: np.ndarray,
    scaling: float,
    bias: np.ndarray | None = None,
    magnitude: np.ndarray | None = None,
    keep: np.ndarray | None = None,
) -> np.ndarray:
    """y = x Wᵀ + s·(x_d Aᵀ) Bᵀ (+ bias), with x_d = x * keep (dropout: keep is mask / (1-p)).

    DoRA (magnitude m given, g = m / ||W + sBA||_row): y = x Wᵀ + (g-1)·(x_d Wᵀ) + g·s·(x_d Aᵀ Bᵀ),
    which without dropout is x (g·(W + sBA))ᵀ.
    """
    xd = x if keep is None else x * keep
    lora = scaling * (xd @ A.T) @ B.T
    y = x @ W.T
    if magnitude is None:
        y = y + lora
    else:
        g = magnitude / dora_row_norms(W, A, B, scaling)
        y = y + (g - 1) * (xd @ W.T) + g * lora
    return y if bias is None else y + bias


def lora_backward(
    grad_y: np.ndarray,
    x: np.ndarray,
    W: np.ndarray,
    A: np.ndarray,
    B: np.ndarray,
    scaling: float,
    magnitude: np.ndarray | None = None,
    keep: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Gradients of `lora_forward` with respect to x, A, B (and the DoRA magnitude), W frozen."""
    xd = x if keep is None else x * keep
    k = np.ones_like(x) if keep is None else keep
    if magnitude is None:
        g = np.ones(W.shape[0])
        grad_m = None
    else:
        norms = dora_row_norms(W, A, B, scaling)
        g = magnitude / norms
        grad_m = (grad_y * (xd @ W.T + scaling * (xd @ A.T) @ B.T)).sum(axis=0) / norms
    dyg = grad_y * g
    grad_b = scaling * dyg.T @ (xd @ A.T)
    grad_h = scaling * dyg @ B
    grad_a = grad_h.T @ xd
    grad_x = grad_y @ W + (grad_y * (g - 1) @ W + grad_h @ A) * k
    return grad_x, grad_a, grad_b, grad_m


def lora_merge(
    W: np.ndarray, A: np.ndarray, B: np.ndarray, scaling: float, magnitude: np.ndarray | None = None
) -> np.ndarray:
    """The merged weight: W + s·B·A, or with DoRA m · (W + s·B·A) / ||W + s·B·A||_row."""
    merged = W + scaling * (B @ A)
    if magnitude is None:
        return merged
    return (magnitude / np.linalg.norm(merged, axis=1))[:, None] * merged


def adamw_step(
    param: np.ndarray,
    grad: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    t: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One AdamW step (decoupled weight decay, bias-corrected moments); t counts from 1."""
    b1, b2 = betas
    param = param * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    m_hat = m / (1 - b1**t)
    v_hat = v / (1 - b2**t)
    return param - lr * m_hat / (np.sqrt(v_hat) + eps), m, v
