"""NF4Tensor: a blockwise-quantized tensor (NF4, FP4 or int8 codes + per-block scales)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays, _core

#: The formats and their bits per code.
CODEBOOKS = {"nf4": 4, "fp4": 4, "int8": 8}
#: Scales per nested block under double quantization (bitsandbytes' choice).
NESTED_BLOCKSIZE = 256


def check_blocksize(blocksize: int) -> int:
    if (
        not isinstance(blocksize, (int, np.integer))
        or isinstance(blocksize, bool)
        or not 32 <= blocksize <= 4096
        or blocksize & (blocksize - 1)
    ):
        raise ValueError(f"blocksize must be a power of two from 32 to 4096, got {blocksize!r}")
    return int(blocksize)


def check_codebook(codebook: str) -> str:
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")
    return codebook


def check_shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    except (TypeError, ValueError):
        raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    return dims


@dataclass(frozen=True)
class NestedAbsmax:
    """Double-quantized scales (QLoRA §3): `absmax = map[codes] * absmax2[i // 256] + offset`,
    with bitsandbytes' signed dynamic 8-bit map."""

    codes: Any  # uint8 [nblocks]
    absmax2: Any  # float32 [ceil(nblocks / 256)]
    offset: float  # the float32 mean that was subtracted

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.absmax2.nbytes + 4)

    def decode(self) -> Any:
        """The float32 scales (a CuPy array when the codes are on the GPU)."""
        if not isinstance(self.codes, np.ndarray):
            from . import cuda

            return cuda.double_dequantize(self)
        return _core.double_dequantize(self.codes, self.absmax2, np.float32(self.offset))

    @staticmethod
    def encode(absmax: np.ndarray) -> NestedAbsmax:
        (codes, absmax2), offset = _core.double_quantize(np.ascontiguousarray(absmax, np.float32))
        return NestedAbsmax(codes, absmax2, float(offset))


class NF4Tensor:
    """Codes and scales of a tensor quantized in blocks of `blocksize` (row-major flat order).

    `codes`: 4-bit formats pack two codes per byte (element 2k in the low nibble), `ceil(n/2)`
    bytes; int8 stores one two's-complement byte per element. `absmax`: one float32 per block
    (decoded on access when double-quantized). Made by `nybble.quantize`, `from_blocks`, or
    `nybble.bnb.import_state`.
    """

    def __init__(
        self,
        codes: Any,
        absmax: Any,
        shape: Any,
        blocksize: int = 64,
        codebook: str = "nf4",
        nested: NestedAbsmax | None = None,
        orig_dtype: str = "float32",
    ) -> None:
        self.shape = check_shape(shape)
        #: The dtype of the tensor that was quantized (bitsandbytes records it as `dtype`).
        self.orig_dtype = _arrays.output_dtype(orig_dtype)
        self.blocksize = check_blocksize(blocksize)
        self.codebook = check_codebook(codebook)
        n = self.size
        nblocks = -(-n // self.blocksize)
        code_bytes = -(-n // 2) if CODEBOOKS[codebook] == 4 else n
        if codes.dtype != np.uint8 or codes.ndim != 1 or codes.size != code_bytes:
            raise ValueError(
                f"codes: expected a flat uint8 array of {code_bytes} bytes for shape {self.shape}, "
                f"got {codes.dtype} {tuple(codes.shape)}"
            )
        scales = nested.codes if nested is not None else absmax
        if scales.ndim != 1 or scales.size != nblocks:
            raise ValueError(
                f"absmax: expected {nblocks} scales for shape {self.shape} and blocksize "
                f"{self.blocksize}, got {tuple(scales.shape)}"
            )
        self.codes = codes
        self._absmax: Any = absmax if nested is None else None
        self.nested = nested

    # --- properties ---------------------------------------------------------------------

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.nested is not None

    @property
    def absmax(self) -> Any:
        """The float32 scale of each block (decoded from the nested form if double-quantized)."""
        if self.nested is not None:
            return self.nested.decode()
        return self._absmax

    @property
    def device(self) -> str:
        return "cpu" if isinstance(self.codes, np.ndarray) else "cuda"

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales (plus the nested state under double quantization)."""
        if self.nested is not None:
            return int(self.codes.nbytes + self.nested.nbytes)
        return int(self.codes.nbytes + self._absmax.nbytes)

    def __repr__(self) -> str:
        dq = ", double_quant=True" if self.double_quant else ""
        return (
            f"NF4Tensor(shape={self.shape}, codebook={self.codebook!r}, "
            f"blocksize={self.blocksize}{dq}, device={self.device!r}, nbytes={self.nbytes})"
        )

    # --- conversions --------------------------------------------------------------------

    def dequantize(self, dtype: Any = "float32") -> Any:
        """`value(code) * absmax` in float32, rounded (nearest-even) to float32/float16/bfloat16."""
        name = _arrays.output_dtype(dtype)
        if self.device == "cuda":
            from . import cuda

            return cuda.dequantize(self, name)
        out = np.empty(self.shape, _arrays.numpy_dtype(name))
        flat = out.reshape(-1)
        if name == "float32":
            _core.dequantize_into(self.codes, self.absmax, self.blocksize, self.codebook, flat)
        else:
            bits = flat.view(np.uint16)
            _core.dequantize_into(
                self.codes, self.absmax, self.blocksize, self.codebook, bits, name
            )
        return out

    def to_blocks(self) -> np.ndarray:
        """The 36-byte GPU layout: per 64 values, f32 absmax (little-endian) + 32 code bytes."""
        if self.codebook == "int8" or self.blocksize != 64:
            raise ValueError(
                "the 36-byte block layout holds 4-bit codes in blocks of 64; this tensor is "
                f"{self.codebook} with blocksize {self.blocksize}"
            )
        t = self.cpu()
        return _core.to_blocks36(t.codes, t.absmax, t.size, t.codebook)

    @classmethod
    def from_blocks(cls, buf: Any, shape: Any, codebook: str = "nf4") -> NF4Tensor:
        """The inverse of `to_blocks` for a tensor of `shape`."""
        dims = check_shape(shape)
        check_codebook(codebook)
        if CODEBOOKS[codebook] != 4:
            raise ValueError(f"the 36-byte block layout holds 4-bit codes, not {codebook}")
        if isinstance(buf, (bytes, bytearray, memoryview)):
            buf = np.frombuffer(buf, dtype=np.uint8)
        b = _arrays.as_host_array(buf, "buf")
        if b.dtype.itemsize != 1:
            raise ValueError(f"buf: expected a buffer of bytes (uint8), got dtype {b.dtype}")
        flat = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
        codes, absmax = _core.from_blocks36(flat, math.prod(dims))
        return cls(codes, absmax, dims, 64, codebook)

    def cpu(self) -> NF4Tensor:
        if self.device == "cpu":
            return self
        from . import cuda

        return cuda.to_cpu(self)

    def cuda(self) -> NF4Tensor:
        from . import cuda

        return cuda.to_cuda(self)


def quantize(
    x: Any, blocksize: int = 64, double_quant: bool = False, codebook: str = "nf4"
) -> NF4Tensor:
    """Quantizes an array of any shape blockwise (row-major flat order).

    `x`: float32, float16, bfloat16 or float64, any strides; numpy (or any host `__dlpack__`
    array) runs on the CPU, a CuPy / CUDA array on the GPU. NaN or inf -> ValueError naming
    the first flat index.
    """
    check_blocksize(blocksize)
    check_codebook(codebook)
    if _arrays.is_cuda(x):
        from . import cuda

        return cuda.quantize(x, blocksize, double_quant, codebook)
    host = _arrays.as_host_array(x)
    a = _arrays.float_input(host)
    if a.dtype.name in ("float16", "bfloat16"):
        codes, absmax = _core.quantize(a.view(np.uint16), blocksize, codebook, a.dtype.name)
    else:
        codes, absmax = _core.quantize(a, blocksize, codebook)
    nested = NestedAbsmax.encode(absmax) if double_quant else None
    orig = "float32" if a.dtype.name == "float64" else a.dtype.name
    return NF4Tensor(codes, absmax, host.shape, blocksize, codebook, nested, orig)


def dequantize(q: NF4Tensor, dtype: Any = "float32") -> Any:
    """Same as `q.dequantize(dtype)`."""
    return q.dequantize(dtype)
