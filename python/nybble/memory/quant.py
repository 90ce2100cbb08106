"""Bytes of a weight stored in each base format, as the nybble codec allocates them.

For the 4-bit formats (`nf4`, `fp4`) the codes take `ceil(n/2)` bytes and each block of
`blocksize` elements one float32 absmax; with double quantization the absmax become one uint8
per block plus one float32 per 256 blocks plus a 4-byte offset (docs/formats.md). `int8` stores one
byte per element with the same scales. The float formats store the weight as it is.
These figures equal `nybble.quantize(x, ...).nbytes` (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Base formats: quantized (codes + scales) and plain floating point.
QUANTIZED_FORMATS = ("nf4", "fp4", "int8")
FLOAT_FORMATS = {"bfloat16": 2, "float16": 2, "float32": 4}
FORMAT_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32"}
FORMAT_ALIASES.update({"f32": "float32", "none": "bfloat16"})

#: Blocks of absmax per second-level (nested) block under double quantization.
NESTED_BLOCKSIZE = 256


def normalize_format(quant: str | None) -> str:
    """A base format's name; None (no quantization) is a bfloat16 base, as "none"."""
    if quant is not None and not isinstance(quant, str):
        known = ", ".join(QUANTIZED_FORMATS + tuple(FLOAT_FORMATS))
        raise ValueError(f"quant must be a format name ({known}), got {quant!r}")
    key = str(quant).strip().lower()
    key = FORMAT_ALIASES.get(key, key)
    if key not in QUANTIZED_FORMATS and key not in FLOAT_FORMATS:
        known = ", ".join(QUANTIZED_FORMATS + tuple(FLOAT_FORMATS))
        raise ValueError(f"unknown quant format {quant!r} (known: {known})")
    return key


def normalize_dtype(dtype: str, what: str) -> str:
    if not isinstance(dtype, str):  # str(None) would read as "none", a bfloat16 alias
        raise ValueError(f"{what} must be one of {', '.join(FLOAT_FORMATS)}, got {dtype!r}")
    key = dtype.strip().lower()
    key = FORMAT_ALIASES.get(key, key)
    if key not in FLOAT_FORMATS:
        raise ValueError(f"{what} must be one of {', '.join(FLOAT_FORMATS)}, got {dtype!r}")
    return key


def numpy_scalar(value: object, kinds: str) -> bool:
    """Whether `value` is a numpy scalar of one of the dtype `kinds` ("b" bool, "iu" integer),
    told without numpy's help (any numpy integer or bool, of any numpy version)."""
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return (
        type(value).__module__ == "numpy"
        and getattr(value, "ndim", None) == 0
        and (kind is not None and kind in kinds)
    )


def check_blocksize(blocksize: int) -> int:
    if numpy_scalar(blocksize, "iu"):
        blocksize = int(blocksize)
    if isinstance(blocksize, bool) or not isinstance(blocksize, int):
        raise ValueError(f"blocksize must be an integer, got {blocksize!r}")
    if blocksize < 32 or blocksize > 4096 or blocksize & (blocksize - 1):
        raise ValueError(f"blocksize must be a power of two from 32 to 4096, got {blocksize}")
    return blocksize


@dataclass(frozen=True)
class StoredWeight:
    """Bytes of one stored weight, split as the breakdown reports them."""

    codes: int
    constants: int
    nblocks: int
    nested_blocks: int

    @property
    def nbytes(self) -> int:
        return self.codes + self.constants


def stored_weight(
    n: int, quant: str, blocksize: int = 64, double_quant: bool = False
) -> StoredWeight:
    """Codes and quantization constants of an `n`-element weight in the nybble codec."""
    fmt = normalize_format(quant)
    if n < 0:
        raise ValueError(f"element count must be >= 0, got {n}")
    if fmt in FLOAT_FORMATS:
        return StoredWeight(n * FLOAT_FORMATS[fmt], 0, 0, 0)
    check_blocksize(blocksize)
    codes = (n + 1) // 2 if fmt in ("nf4", "fp4") else n
    nblocks = -(-n // blocksize)
    if double_quant:
        nested = -(-nblocks // NESTED_BLOCKSIZE)
        constants = nblocks + 4 * nested + 4
    else:
        nested = 0
        constants = 4 * nblocks
    return StoredWeight(codes, constants, nblocks, nested)


def codec_nbytes(n: int, quant: str, blocksize: int = 64, double_quant: bool = False) -> int:
    """Total bytes (codes + constants) of an `n`-element weight; equals `NF4Tensor.nbytes`."""
    return stored_weight(n, quant, blocksize, double_quant).nbytes
