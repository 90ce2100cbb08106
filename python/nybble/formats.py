"""The formats' facts, each defined once: codebook names, bits and tables, the code of zero,
the blocksize and shape rules, the dtypes nybble reads and writes, and the arrays of a
quantized tensor as the backends take them. The numbers come from the Rust core
(rust/codebook.rs, rust/layout.rs, rust/double_quant.rs); docs/formats.md states them.

`nybble.reference` (the oracle) keeps its own literal statement of the same tables on purpose,
so that tests compare two independent statements; production code never imports it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import ml_dtypes
import numpy as np
import numpy.typing as npt

from . import _core

#: The base formats of a quantized weight.
Codebook = Literal["nf4", "fp4", "int8"]
CODEBOOKS: Final[tuple[Codebook, ...]] = get_args(Codebook)
#: The formats the kernels encode: the base formats plus the dynamic 8-bit map that
#: quantizes the scales under double quantization.
KernelCodebook = Literal["nf4", "fp4", "int8", "dynamic8"]

#: Float dtypes an input may have (float64 is rounded to float32 first).
FloatDtype = Literal["float32", "float16", "bfloat16", "float64"]
FLOAT_DTYPES: Final[tuple[FloatDtype, ...]] = get_args(FloatDtype)
#: Dtypes a dequantized tensor (or a layer's activation) may have.
OutputDtype = Literal["float32", "float16", "bfloat16"]
OUTPUT_DTYPES: Final[tuple[OutputDtype, ...]] = get_args(OutputDtype)
BFLOAT16: Final = np.dtype(ml_dtypes.bfloat16)

#: Scales per nested block under double quantization (bitsandbytes' choice).
NESTED_BLOCKSIZE: Final[int] = _core.NESTED_BLOCKSIZE
MIN_BLOCKSIZE: Final[int] = _core.MIN_BLOCKSIZE
MAX_BLOCKSIZE: Final[int] = _core.MAX_BLOCKSIZE
#: The 36-byte GPU block layout: values per block, bytes per block (f32 absmax + codes).
BLOCK36_VALUES: Final[int] = _core.BLOCK36_VALUES
BLOCK36_BYTES: Final[int] = _core.BLOCK36_BYTES
#: Elements a tensor may have: sizes and offsets are signed 64-bit in the kernels.
MAX_ELEMENTS: Final[int] = 2**62


# --- tables (from the core) ------------------------------------------------------------------


def _frozen(values: list[float] | list[int], dtype: Any) -> np.ndarray:
    a = np.array(values, dtype=dtype)
    a.flags.writeable = False
    return a


@functools.cache
def values(codebook: KernelCodebook) -> npt.NDArray[np.float32]:
    """The value of each code (16 entries for 4-bit formats, 256 for 8-bit ones)."""
    return _frozen(_core.codebook_values(codebook), np.float32)


@functools.cache
def thresholds(codebook: KernelCodebook) -> npt.NDArray[np.float32]:
    """The decision thresholds, ascending: NF4 and the dynamic map their midpoints, FP4 its
    magnitude thresholds, int8 none (it rounds). A value on a threshold takes the lower code."""
    return _frozen(_core.codebook_thresholds(codebook), np.float32)


@functools.cache
def fp4_magnitude_codes() -> npt.NDArray[np.uint8]:
    """The FP4 code of the k-th smallest magnitude."""
    return _frozen(_core.fp4_magnitude_codes(), np.uint8)


@functools.cache
def code_bits(codebook: KernelCodebook) -> int:
    return _core.code_bits(codebook)


@functools.cache
def zero_code(codebook: KernelCodebook) -> int:
    """The code that decodes to zero: all-zero blocks and padding hold it."""
    return _core.zero_code(codebook)


# --- rules -------------------------------------------------------------------------------------


def check_blocksize(blocksize: object) -> int:
    if (
        not isinstance(blocksize, (int, np.integer))
        or isinstance(blocksize, bool)
        or not MIN_BLOCKSIZE <= blocksize <= MAX_BLOCKSIZE
        or blocksize & (blocksize - 1)
    ):
        raise ValueError(
            f"blocksize must be a power of two from {MIN_BLOCKSIZE} to {MAX_BLOCKSIZE}, "
            f"got {blocksize!r}"
        )
    return int(blocksize)


def check_codebook(codebook: object) -> Codebook:
    for name in CODEBOOKS:
        if codebook == name:
            return name
    raise ValueError(f"codebook must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")


#: The most dimensions a shape may have (numpy's arrays take at most 64).
MAX_DIMS = 32


def check_shape(shape: object, what: str = "shape") -> tuple[int, ...]:
    """A tuple of non-negative ints whose product nybble can index (< 2^62), each dimension
    one numpy can hold too: an empty dimension does not excuse a huge one beside it."""
    dims = shape if isinstance(shape, (tuple, list)) else (shape,)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
        raise ValueError(f"{what} must be a tuple of non-negative ints, got {shape!r}")
    out = tuple(int(d) for d in dims)
    if (
        len(out) > MAX_DIMS
        or any(d < 0 for d in out)
        or math.prod(max(d, 1) for d in out) >= MAX_ELEMENTS
    ):
        raise ValueError(
            f"{what} must be at most {MAX_DIMS} non-negative ints whose product (counting 0 "
            f"as 1) is below 2^62, got {str(shape)[:200]}"
        )
    return out


def dtype_name(dtype: object) -> str:
    """'float32' for "float32", np.float32, np.dtype('float32'), ml_dtypes.bfloat16, ...
    Remembered per dtype object (np.dtype or scalar type): numpy computes `dtype.name` in
    Python, slowly enough to show in the per-call cost of a GPU launch."""
    if isinstance(dtype, str):
        return dtype
    if dtype is None:  # numpy reads None as float64: no dtype is given
        return "None"
    try:
        name = _DTYPE_NAMES.get(dtype)
    except TypeError:  # unhashable
        name = None
    if name is not None:
        return name
    try:
        name = str(np.dtype(dtype).name)  # type: ignore[call-overload]
    except TypeError:
        return str(dtype)
    if isinstance(dtype, (np.dtype, type)):
        _DTYPE_NAMES[dtype] = name
    return name


_DTYPE_NAMES: dict[Any, str] = {}


def output_dtype(dtype: object, what: str = "dtype") -> OutputDtype:
    """The name of a dtype a result may have, or ValueError naming the argument `what`."""
    name = dtype_name(dtype)
    for known in OUTPUT_DTYPES:
        if name == known:
            return known
    got = repr(dtype) if isinstance(dtype, str) or dtype is None else f"{dtype!r} ({name})"
    raise ValueError(f"{what} must be one of {', '.join(OUTPUT_DTYPES)}, got {got}")


def float_dtype(dtype: object, what: str = "x") -> FloatDtype:
    """The name of an input's float dtype, or ValueError naming the argument."""
    name = dtype_name(dtype)
    for known in FLOAT_DTYPES:
        if name == known:
            return known
    raise ValueError(f"{what} has dtype {name}; expected one of {', '.join(FLOAT_DTYPES)}")


@functools.cache
def numpy_dtype(name: str) -> np.dtype[Any]:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def code_bytes(n: int, codebook: KernelCodebook) -> int:
    """Bytes of codes for n values: two 4-bit codes per byte, or one 8-bit code."""
    return -(-n // 2) if code_bits(codebook) == 4 else n


def block_count(n: int, blocksize: int) -> int:
    """Blocks covering n values (the last one may be partial)."""
    return -(-n // blocksize)


# --- the arrays of a quantized tensor ----------------------------------------------------------


@dataclass(frozen=True)
class NestedAbsmax:
    """Double-quantized scales (docs/formats.md): `absmax = map[codes] * absmax2[i // 256] +
    offset`, with bitsandbytes' signed dynamic 8-bit map."""

    codes: Any  # uint8 [nblocks], numpy or CuPy
    absmax2: Any  # float32 [ceil(nblocks / 256)]
    offset: float  # the float32 mean that was subtracted

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.absmax2.nbytes + 4)


@dataclass(frozen=True, eq=False)
class Packed:
    """The arrays and format of a blockwise-quantized tensor, as the backends take them: codes
    (4-bit formats two per byte, element 2k in the low nibble) and either plain float32 scales
    (`absmax`) or nested ones. Compared by identity, so a backend may key what it prepares
    for a weight on it."""

    codes: Any
    absmax: Any | None
    nested: NestedAbsmax | None
    shape: tuple[int, ...]
    blocksize: int
    codebook: Codebook

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nblocks(self) -> int:
        return block_count(self.size, self.blocksize)

    @property
    def scale_bytes(self) -> int:
        """Bytes of the scales as stored (nested ones with their absmax2 and offset)."""
        if self.nested is not None:
            return self.nested.nbytes
        return 0 if self.absmax is None else int(self.absmax.nbytes)

    def check(self) -> Packed:
        """ValueError unless the arrays' dtypes and sizes match the format and shape."""
        n = self.size
        expected = code_bytes(n, self.codebook)
        c = self.codes
        if dtype_name(c.dtype) != "uint8" or c.ndim != 1 or c.size != expected:
            raise ValueError(
                f"codes: expected a flat uint8 array of {expected} bytes for shape {self.shape}, "
                f"got {dtype_name(c.dtype)} {tuple(c.shape)}"
            )
        if (self.absmax is None) == (self.nested is None):
            raise ValueError("give plain scales (absmax) or nested ones, exactly one")
        if self.nested is not None:
            scales, kind = self.nested.codes, "uint8"
            a2 = self.nested.absmax2
            if dtype_name(a2.dtype) != "float32" or a2.ndim != 1:
                raise ValueError(f"nested absmax2: expected flat float32, got {a2.dtype}")
            if a2.size != block_count(self.nblocks, NESTED_BLOCKSIZE):
                raise ValueError(
                    f"nested absmax2: expected {block_count(self.nblocks, NESTED_BLOCKSIZE)} "
                    f"values for {self.nblocks} blocks, got {a2.size}"
                )
            if not math.isfinite(self.nested.offset):
                raise ValueError(f"nested offset must be finite, got {self.nested.offset}")
        else:
            scales, kind = self.absmax, "float32"
        if dtype_name(scales.dtype) != kind or scales.ndim != 1 or scales.size != self.nblocks:
            raise ValueError(
                f"absmax: expected {self.nblocks} {kind} scales for shape {self.shape} and "
                f"blocksize {self.blocksize}, got {dtype_name(scales.dtype)} {tuple(scales.shape)}"
            )
        return self
