"""NF4Tensor: a blockwise-quantized tensor (NF4, FP4 or int8 codes + per-block scales), on the
CPU (numpy arrays) or the GPU (CuPy arrays). The work is done by the backend of its arrays
(nybble.backends); docs/formats.md states the formats."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import backends, formats
from .backends import Device
from .formats import Codebook, NestedAbsmax, OutputDtype, Packed

__all__ = ["NF4Tensor", "NestedAbsmax", "dequantize", "quantize", "scale_problem"]


class NF4Tensor:
    """Codes and scales of a tensor quantized in blocks of `blocksize` (row-major flat order).

    `codes`: 4-bit formats pack two codes per byte (element 2k in the low nibble), `ceil(n/2)`
    bytes; int8 stores one two's-complement byte per element. `absmax`: one float32 per block
    (decoded on access when double-quantized: `nested` holds them as stored). Made by
    `nybble.quantize`, `from_blocks`, or `nybble.bnb.import_state`; the arrays are not to be
    changed in place once made (a GPU weight keeps what it prepared for them).
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
        """Checks everything: dtypes and sizes against the shape and format, and that every
        scale is finite and >= 0 (which reads them back from the GPU)."""
        backend = backends.of(codes)

        def array(a: Any, what: str) -> Any:
            # C-contiguous and aligned, as the core and the kernels read them (a copy only
            # where needed)
            return backend.contiguous(backend.asarray(a, what))

        codes = array(codes, "codes")
        if nested is not None and not isinstance(nested, NestedAbsmax):
            raise ValueError(
                "nested must be a nybble.tensor.NestedAbsmax (codes, absmax2, offset) or None, "
                f"got {type(nested).__name__}"
            )
        if nested is not None and absmax is not None:
            raise ValueError("give plain scales (absmax) or nested ones, not both")
        if nested is not None:
            nested = NestedAbsmax(
                array(nested.codes, "nested.codes"),
                array(nested.absmax2, "nested.absmax2"),
                _finite_offset(nested.offset),
            )
            absmax = None
        elif absmax is not None:
            absmax = array(absmax, "absmax")
        packed = Packed(
            codes,
            absmax,
            nested,
            formats.check_shape(shape),
            formats.check_blocksize(blocksize),
            formats.check_codebook(codebook),
        ).check()
        self._init(packed, formats.output_dtype(orig_dtype, "orig_dtype"))
        problem = scale_problem(packed)
        if problem is not None:
            raise ValueError(problem)

    def _init(self, packed: Packed, orig_dtype: OutputDtype) -> None:
        self._packed = packed
        self._backend = backends.of(packed.codes)
        #: The GPU's per-call paths for this tensor, each set once a checked call prepared it
        #: (each holds what it launches on): the fused GEMV's per-token call, nybble.cuda.
        #: nf4_matmul's first try; the whole tensor's dequantize, `dequantize`'s first try.
        self._gemv_call: Any = None
        self._dequantize_call: Any = None
        #: The dtype of the tensor that was quantized (bitsandbytes records it as `dtype`).
        self.orig_dtype: OutputDtype = orig_dtype

    @classmethod
    def _trusted(cls, packed: Packed, orig_dtype: OutputDtype, check: bool = True) -> NF4Tensor:
        """A tensor of arrays nybble made itself (quantized or moved): shapes checked unless
        `check` is False (arrays a backend's quantize just sized from the shape: the check
        costs ~2 us of a GPU call's host time), values not read back (they are right by
        construction, and reading them would wait on a GPU)."""
        t = cls.__new__(cls)
        t._init(packed.check() if check else packed, orig_dtype)
        return t

    # --- properties ---------------------------------------------------------------------

    @property
    def packed(self) -> Packed:
        """The arrays and format, as the backends take them."""
        return self._packed

    @property
    def codes(self) -> Any:
        return self._packed.codes

    @property
    def nested(self) -> NestedAbsmax | None:
        return self._packed.nested

    @property
    def shape(self) -> tuple[int, ...]:
        return self._packed.shape

    @property
    def blocksize(self) -> int:
        return self._packed.blocksize

    @property
    def codebook(self) -> Codebook:
        return self._packed.codebook

    @property
    def size(self) -> int:
        return self._packed.size

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.nested is not None

    @property
    def absmax(self) -> Any:
        """The float32 scale of each block (decoded from the nested form if double-quantized)."""
        p = self._packed
        if p.nested is not None:
            return self._backend.double_dequantize(p.nested)
        return p.absmax

    @property
    def device(self) -> Device:
        return self._backend.device

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales (plus the nested state under double quantization)."""
        p = self._packed
        return int(p.codes.nbytes) + p.scale_bytes

    def __repr__(self) -> str:
        dq = ", double_quant=True" if self.double_quant else ""
        return (
            f"NF4Tensor(shape={self.shape}, codebook={self.codebook!r}, "
            f"blocksize={self.blocksize}{dq}, orig_dtype={self.orig_dtype!r}, "
            f"device={self.device!r}, nbytes={self.nbytes})"
        )

    # --- conversions --------------------------------------------------------------------

    def dequantize(self, dtype: Any = "float32", out: Any = None) -> Any:
        """`value(code) * absmax` in float32, rounded (nearest-even) to float32/float16/bfloat16;
        an array of this tensor's shape on its device (or `out`, a C-contiguous array of its
        size and `dtype` on its device, filled and returned)."""
        out = _plain(out)
        quick = self._dequantize_call
        if quick is not None and type(dtype) is str:
            found = quick(dtype, out)
            if found is not None:
                return found
        result = self._backend.dequantize(self._packed, formats.output_dtype(dtype), out)
        if quick is None:
            self._dequantize_call = self._backend.dequantize_call(self._packed)
        return result

    def _keep_gemv_call(self) -> None:
        """Keeps the backend's per-token GEMV call for this tensor once a checked GEMV has
        prepared it (nybble.cuda.nf4_matmul's first try), as `dequantize` keeps its own."""
        if self._gemv_call is None:
            self._gemv_call = self._backend.gemv_call(self._packed)

    def to_blocks(self) -> np.ndarray:
        """The 36-byte GPU layout: per 64 values, f32 absmax (little-endian) + 32 code bytes;
        a host array. The layout is NF4's, in blocks of 64 (without double quantization's
        nested form, which it stores decoded): it carries no codebook, so an FP4 tensor
        would come back from `from_blocks` as NF4, and is refused."""
        if self.codebook != "nf4" or self.blocksize != formats.BLOCK36_VALUES:
            raise ValueError(
                "the 36-byte block layout holds NF4 codes in blocks of 64; this tensor is "
                f"{self.codebook} with blocksize {self.blocksize}"
            )
        return backends.get("cpu").to_blocks36(self.cpu()._packed)

    @classmethod
    def from_blocks(cls, buf: Any, shape: Any, codebook: str = "nf4") -> NF4Tensor:
        """The inverse of `to_blocks` for a tensor of `shape`. `codebook="fp4"` reads FP4
        codes stored the same way by other tools."""
        host = backends.get("cpu")
        dims = formats.check_shape(shape)
        cb = formats.check_codebook(codebook)
        if formats.code_bits(cb) != 4:
            raise ValueError(f"the 36-byte block layout holds 4-bit codes, not {cb}")
        if isinstance(buf, (bytes, bytearray, memoryview)):
            buf = np.frombuffer(buf, dtype=np.uint8)
        b = host.asarray(buf, "buf")
        if b.dtype.itemsize != 1 or b.dtype.kind not in "uib":
            raise ValueError(f"buf: expected a buffer of bytes (uint8), got dtype {b.dtype}")
        flat = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
        codes, absmax = host.from_blocks36(flat, math.prod(dims))
        packed = Packed(codes, absmax, None, dims, formats.BLOCK36_VALUES, cb)
        problem = scale_problem(packed, decoded_negatives=True)
        if problem is not None:
            raise ValueError(f"buf (the 36-byte block layout): {problem}")
        return cls._trusted(packed, "float32")

    def with_plain_scales(self) -> NF4Tensor:
        """This tensor with plain float32 scales: double-quantized ones decoded once (itself
        when they are plain). Decoded scales of an all-zero block can fall a hair below
        zero, which the constructor refuses from a user; here they come from a checked
        tensor and are kept as decoded."""
        p = self._packed
        if p.nested is None:
            return self
        plain = Packed(p.codes, self.absmax, None, p.shape, p.blocksize, p.codebook)
        return NF4Tensor._trusted(plain, self.orig_dtype)

    def cpu(self) -> NF4Tensor:
        """This tensor with its arrays on the host (itself when they are)."""
        return self._moved(backends.get("cpu"))

    def cuda(self) -> NF4Tensor:
        """This tensor with its arrays on the current GPU (itself when they are); needs CuPy."""
        return self._moved(backends.get("cuda"))

    def _moved(self, to: backends.Backend) -> NF4Tensor:
        source = self._backend
        if source.device == to.device:
            return self

        def move(a: Any) -> Any:
            return to.from_host(source.to_host(a))

        p = self._packed
        nested = None
        if p.nested is not None:
            nested = NestedAbsmax(move(p.nested.codes), move(p.nested.absmax2), p.nested.offset)
        absmax = None if p.absmax is None else move(p.absmax)
        packed = Packed(move(p.codes), absmax, nested, p.shape, p.blocksize, p.codebook)
        return NF4Tensor._trusted(packed, self.orig_dtype)


#: The widest gap between neighbouring entries of the signed dynamic 8-bit map (0.0141): a
#: double-quantized scale decodes to within one gap x its group's absmax2 of the scale it
#: stands for (bitsandbytes' CPU quantizer may take the farther neighbour), so a scale >= 0
#: never decodes below -gap x absmax2 (absmax2 is at most the largest scale). Blocks far
#: below the mean scale do land a hair below zero.
_NESTED_MAP_GAP = float(np.diff(np.sort(formats.values("dynamic8"))).max())


def _first(bad: Any, backend: backends.Backend) -> int | None:
    """Index of the first true entry of a boolean array, or None."""
    if not bool(backend.xp.any(bad)):
        return None
    return int(backend.xp.argmax(bad))


def scale_problem(packed: Packed, decoded_negatives: bool = False) -> str | None:
    """What is wrong with a tensor's scales, naming the first bad block, or None: a plain
    scale must be finite and >= 0 (a negative one flips the signs of its block); a nested
    state's absmax2 likewise, its offset (the mean of the scales) >= 0, and no scale may
    decode below zero by more than the map's rounding. With `decoded_negatives`, plain scales
    may also be negative as double quantization's decoding leaves them (what `to_blocks`
    writes of a double-quantized tensor): at most two map gaps of the largest scale below
    zero, and not below the rounding of sums of the mean's size (2^-50 of the mean), which a
    stray tiny negative (-2.35e-38) is. Reads the scales back from a GPU."""
    backend = backends.of(packed.codes)
    xp = backend.xp
    nested = packed.nested
    if nested is None:
        scales: Any = packed.absmax
        finite = xp.isfinite(scales)
        bad = ~(finite & (scales >= 0))
        if decoded_negatives and bool(xp.any(bad & finite)):
            magnitude = xp.where(finite, xp.abs(scales), 0)
            hi = 2 * _NESTED_MAP_GAP * float(xp.max(xp.where(finite, scales, 0)))
            lo = 2.0**-50 * float(xp.mean(magnitude, dtype=xp.float64))
            bad &= ~(finite & (magnitude <= hi) & (magnitude >= lo))
        i = _first(bad, backend)
        if i is None:
            return None
        return (
            f"absmax: block {i} has scale {float(scales[i])!r}; scales must be finite and >= 0 "
            "(a negative one flips the signs of its block)"
        )
    a2 = nested.absmax2
    i = _first(~(xp.isfinite(a2) & (a2 >= 0)), backend)
    if i is not None:
        return f"nested absmax2: entry {i} is {float(a2[i])!r}; it must be finite and >= 0"
    if not nested.offset >= 0:
        return (
            f"nested offset is {nested.offset!r}; it is the mean of the scales, which are >= 0, "
            "so it must be >= 0"
        )
    decoded = backend.double_dequantize(nested)
    group = xp.repeat(a2, formats.NESTED_BLOCKSIZE)[: decoded.size]
    i = _first(decoded < -_NESTED_MAP_GAP * group, backend)
    if i is not None:
        return (
            f"nested scales: block {i} decodes to {float(decoded[i])!r}, below zero by more than "
            "the 8-bit map's rounding: a negative scale flips the signs of its block"
        )
    return None


def _finite_offset(offset: object) -> float:
    try:
        value = float(offset)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"nested offset must be a number, got {offset!r}") from None
    if not abs(value) <= float(np.finfo(np.float32).max):  # it is applied in float32
        raise ValueError(f"nested offset must be a finite float32 number, got {value}")
    return value


def quantize(
    x: Any, blocksize: int = 64, double_quant: bool = False, codebook: str = "nf4"
) -> NF4Tensor:
    """Quantizes an array of any shape blockwise (row-major flat order).

    `x`: float32, float16, bfloat16 or float64, any strides, either byte order; numpy (or any
    host `__dlpack__` array) runs on the CPU, a CuPy / CUDA array on the GPU. NaN or inf:
    NonFiniteError with the first flat index (`.index`). A numpy subclass (np.matrix, a masked
    array without masked elements) is read as the plain array it holds."""
    bs = formats.check_blocksize(blocksize)
    cb = formats.check_codebook(codebook)
    if not isinstance(double_quant, (bool, np.bool_)):
        raise ValueError(f"double_quant must be True or False, got {double_quant!r}")
    if isinstance(x, np.ma.MaskedArray) and np.ma.is_masked(x):
        raise ValueError(
            "x is a masked array with masked elements: quantize reads every element; pass "
            "x.filled(value) or the unmasked values"
        )
    x = _plain(x)
    backend = backends.of(x)
    a = backend.float_array(x)
    codes, absmax = backend.quantize(a, bs, cb)
    nested = backend.double_quantize(absmax) if double_quant else None
    name = formats.dtype_name(a.dtype)  # remembered per dtype (numpy's .name is slow)
    orig: OutputDtype = "float32" if name == "float64" else formats.output_dtype(name)
    packed = Packed(codes, None if nested else absmax, nested, tuple(a.shape), bs, cb)
    return NF4Tensor._trusted(packed, orig, check=False)


def dequantize(q: NF4Tensor, dtype: Any = "float32", out: Any = None) -> Any:
    """Same as `q.dequantize(dtype, out)`."""
    if not isinstance(q, NF4Tensor):
        raise ValueError(f"q must be an NF4Tensor (from nybble.quantize), got {type(q).__name__}")
    return q.dequantize(dtype, out)


def _plain(a: Any) -> Any:
    """A numpy subclass (np.matrix, np.ma.MaskedArray, np.memmap) as a plain ndarray view of
    the same memory: the core reads plain arrays only."""
    if isinstance(a, np.ndarray) and type(a) is not np.ndarray:
        return a.view(np.ndarray)
    return a
