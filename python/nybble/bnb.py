"""bitsandbytes / transformers 4-bit interop: the state-dict entries of a `Linear4bit` weight
(docs/bitsandbytes.md).

A `Linear4bit` saves, under its weight's prefix (here `weight`):
  weight                                  uint8 [ceil(n/2), 1], element 2k in the HIGH nibble
  weight.absmax                           float32 [nblocks], or uint8 codes with double quant
  weight.quant_map                        float32 [16], the codebook
  weight.nested_absmax                    float32 [ceil(nblocks/256)]      (double quant)
  weight.nested_quant_map                 float32 [256], the dynamic map   (double quant)
  weight.quant_state.bitsandbytes__nf4    uint8 bytes of a JSON object: quant_type, blocksize,
                                          dtype, shape (+ nested_blocksize, nested_dtype,
                                          nested_offset with double quant)

bitsandbytes' own names are accepted where users pass them: `quant_type` for the codebook,
`compress_statistics` for double quantization (`quantize_4bit`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from . import _json, backends, formats
from .errors import FormatError
from .formats import NESTED_BLOCKSIZE, Codebook, NestedAbsmax, OutputDtype, Packed
from .tensor import NF4Tensor, quantize, scale_problem

QuantType = Literal["nf4", "fp4"]
QUANT_TYPES: tuple[QuantType, ...] = ("nf4", "fp4")
#: What a state dict is called in error messages.
SOURCE = "bitsandbytes state"
#: The largest JSON blob a quant state holds in practice is a few hundred bytes.
MAX_QUANT_STATE_BYTES = 1 << 16


#: Every byte with its nibbles swapped: one table lookup a byte.
_SWAPPED = ((np.arange(256) >> 4) | (np.arange(256) << 4)).astype(np.uint8)


def swap_nibbles(codes: np.ndarray) -> np.ndarray:
    """bitsandbytes packs element 2k in the high nibble, nybble in the low one: converting
    either way swaps the two nibbles of every byte."""
    return _SWAPPED[np.asarray(codes, np.uint8)]


def quantize_4bit(
    x: Any, blocksize: int = 64, compress_statistics: bool = False, quant_type: str = "fp4"
) -> NF4Tensor:
    """`nybble.quantize` under bitsandbytes' names and defaults (`quantize_4bit`: FP4 unless
    `quant_type="nf4"`; `compress_statistics` is double quantization)."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quant_type must be one of {', '.join(QUANT_TYPES)}, got {quant_type!r}")
    return quantize(x, blocksize, bool(compress_statistics), quant_type)


def export_state(q: NF4Tensor, prefix: str = "weight", dtype: Any = None) -> dict[str, np.ndarray]:
    """The state-dict entries bitsandbytes writes for this quantized weight. `dtype` (default:
    the dtype that was quantized) is what bitsandbytes will dequantize to."""
    if q.codebook not in QUANT_TYPES:
        raise ValueError(f"bitsandbytes 4-bit states hold nf4 or fp4, not {q.codebook}")
    q = q.cpu()
    meta: dict[str, Any] = {
        "quant_type": q.codebook,
        "blocksize": q.blocksize,
        "dtype": formats.output_dtype(dtype) if dtype is not None else q.orig_dtype,
        "shape": list(q.shape),
    }
    state = {
        prefix: swap_nibbles(q.codes).reshape(-1, 1),
        f"{prefix}.quant_map": formats.values(q.codebook).copy(),
    }
    if q.nested is None:
        state[f"{prefix}.absmax"] = np.asarray(q.absmax, np.float32)
    else:
        state[f"{prefix}.absmax"] = np.asarray(q.nested.codes, np.uint8)
        state[f"{prefix}.nested_absmax"] = np.asarray(q.nested.absmax2, np.float32)
        state[f"{prefix}.nested_quant_map"] = formats.values("dynamic8").copy()
        meta.update(
            nested_blocksize=NESTED_BLOCKSIZE,
            nested_dtype="float32",
            nested_offset=float(np.float32(q.nested.offset)),
        )
    key = f"{prefix}.quant_state.bitsandbytes__{q.codebook}"
    state[key] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8).copy()
    return state


def _array(state: Mapping[str, Any], key: str) -> np.ndarray:
    if key not in state:
        raise FormatError(SOURCE, "missing", key)
    value = state[key]
    if hasattr(value, "detach"):  # a torch tensor, perhaps on a GPU
        value = value.detach().cpu()
    try:
        return backends.get("cpu").asarray(value, key)
    except ValueError as e:
        raise FormatError(SOURCE, f"not an array ({e})", key) from None


#: The largest float32: a nested offset beyond it would decode every scale to inf.
_F32_MAX = float(np.finfo(np.float32).max)


def _table(state: Mapping[str, Any], key: str) -> np.ndarray:
    """A value table (quant_map, nested_quant_map) as flat float32, or FormatError."""
    table = _array(state, key)
    _expect(table.dtype.kind in "fiu", key, f"expected numbers, got dtype {table.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        return table.astype(np.float32).ravel()


def _expect(cond: bool, field: str, problem: str) -> None:
    if not cond:
        raise FormatError(SOURCE, problem, field)


def _meta(state: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The quant state's JSON object, read with limits (size, nesting, numbers)."""
    blob = _array(state, key)
    _expect(blob.dtype.itemsize == 1, key, f"expected bytes (uint8), got {blob.dtype}")
    _expect(blob.size <= MAX_QUANT_STATE_BYTES, key, f"{blob.size} bytes is not a quant state")
    meta = _json.loads(np.ascontiguousarray(blob).view(np.uint8).tobytes(), SOURCE, key)
    _expect(isinstance(meta, dict), key, "not a JSON object")
    return meta  # type: ignore[no-any-return]


def _int_field(meta: Mapping[str, Any], name: str, key: str) -> int:
    value = meta.get(name)
    _expect(
        isinstance(value, int) and not isinstance(value, bool),
        f"{key}: {name}",
        f"expected an integer, got {value!r}",
    )
    return int(value)  # type: ignore[arg-type]


#: What a reader of a state knows of one of its arrays before reading its values: (number of
#: elements, dtype); FormatError (missing) where the state has no such key.
ArrayInfo = Callable[[str], tuple[int, np.dtype[Any]]]


@dataclass(frozen=True)
class StateHeader:
    """What a weight's bitsandbytes entries say of it, every field checked but the values of
    its codes and scales (`read_header`): enough to read a range of its blocks alone
    (`packed`)."""

    prefix: str
    key: str  # the quant state's key
    codebook: Codebook
    blocksize: int
    shape: tuple[int, ...]
    orig_dtype: OutputDtype
    #: Double quantization's offset (the scales' mean), or None for plain float32 scales.
    nested_offset: float | None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nblocks(self) -> int:
        return formats.block_count(self.size, self.blocksize)

    def packed(
        self, codes: Any, absmax: Any, absmax2: Any = None, blocks: tuple[int, int] | None = None
    ) -> Packed:
        """Blocks [k0, k1) of the weight (default: all) as a flat Packed in nybble's nibble
        order, from their arrays as stored: the codes' bytes, the scales [k0, k1) and under
        double quantization the nested scales of their groups (k0 a multiple of
        NESTED_BLOCKSIZE, k1 one or the end). FormatError for a bad scale, naming its key."""
        k0, k1 = blocks if blocks is not None else (0, self.nblocks)
        if self.nested_offset is not None and (k0 % NESTED_BLOCKSIZE or k1 > self.nblocks):
            raise ValueError(f"blocks [{k0}, {k1}) do not start a group of nested scales")
        n = min(k1 * self.blocksize, self.size) - k0 * self.blocksize
        shape = self.shape if (k0, k1) == (0, self.nblocks) else (n,)
        codes_ours = swap_nibbles(np.ascontiguousarray(codes).reshape(-1))
        absmax = np.ascontiguousarray(absmax).reshape(-1)
        if self.nested_offset is None:
            packed = Packed(codes_ours, absmax, None, shape, self.blocksize, self.codebook)
        else:
            absmax2 = np.ascontiguousarray(absmax2).reshape(-1)
            nested = NestedAbsmax(absmax, absmax2, self.nested_offset)
            packed = Packed(codes_ours, None, nested, shape, self.blocksize, self.codebook)
        problem = scale_problem(packed)  # NaN, inf, or a scale that would flip its block's signs
        if problem is not None:
            fields = {
                "nested offset": f"{self.key}: nested_offset",
                "nested absmax2": f"{self.prefix}.nested_absmax",
            }
            first = next((f for k, f in fields.items() if problem.startswith(k)), None)
            raise FormatError(SOURCE, problem, first or f"{self.prefix}.absmax")
        return packed


def read_header(state: Mapping[str, Any], prefix: str, info: ArrayInfo) -> StateHeader:
    """The checked header of the weight under `prefix`: its quant state and value maps read
    from `state`, the sizes and dtypes of its codes and scales from `info` (their values are
    not read). Anything malformed, inconsistent or not understood raises FormatError naming
    the key and field."""
    if not isinstance(state, Mapping):
        raise FormatError(SOURCE, f"expected a mapping of names to arrays, got {type(state)}")
    head = f"{prefix}.quant_state.bitsandbytes__"
    found = [k for k in state if isinstance(k, str) and k.startswith(head)]
    _expect(len(found) == 1, f"{head}*", f"expected exactly one such key, found {found}")
    key = found[0]
    quant_type = key.rsplit("__", 1)[1]
    _expect(quant_type in QUANT_TYPES, key, f"quant type {quant_type!r} is not nf4 or fp4")
    codebook = formats.check_codebook(quant_type)
    meta = _meta(state, key)
    _expect(
        meta.get("quant_type", quant_type) == quant_type,
        f"{key}: quant_type",
        f"{meta.get('quant_type')!r} disagrees with the key",
    )
    blocksize = _int_field(meta, "blocksize", key)
    try:
        formats.check_blocksize(blocksize)
    except ValueError as e:
        raise FormatError(SOURCE, str(e), f"{key}: blocksize") from None
    raw_shape = meta.get("shape")
    _expect(isinstance(raw_shape, list), f"{key}: shape", f"expected a list, got {raw_shape!r}")
    try:
        shape = formats.check_shape(tuple(raw_shape))  # type: ignore[arg-type]
    except ValueError as e:
        raise FormatError(SOURCE, str(e), f"{key}: shape") from None
    dtype = meta.get("dtype", "float32")
    try:
        orig_dtype = formats.output_dtype(str(dtype).removeprefix("torch."))
    except ValueError as e:
        raise FormatError(SOURCE, str(e), f"{key}: dtype") from None

    n = math.prod(shape)
    nblocks = formats.block_count(n, blocksize)
    size, codes_dtype = info(prefix)
    _expect(codes_dtype == np.uint8, prefix, f"dtype {codes_dtype}, expected uint8")
    _expect(
        size == formats.code_bytes(n, codebook),
        prefix,
        f"{size} bytes, shape {list(shape)} needs {formats.code_bytes(n, codebook)}",
    )
    quant_map = _table(state, f"{prefix}.quant_map")
    _expect(
        quant_map.size == 16 and np.array_equal(quant_map, formats.values(codebook)),
        f"{prefix}.quant_map",
        f"not the standard {quant_type} codebook",
    )
    size, absmax_dtype = info(f"{prefix}.absmax")
    _expect(size == nblocks, f"{prefix}.absmax", f"{size} entries, expected {nblocks}")

    nested_keys = [f"{prefix}.nested_absmax", f"{prefix}.nested_quant_map"]
    if not ("nested_offset" in meta or any(k in state for k in nested_keys)):
        _expect(
            absmax_dtype == np.float32,
            f"{prefix}.absmax",
            f"dtype {absmax_dtype}; without nested_offset the scales are float32",
        )
        return StateHeader(prefix, key, codebook, blocksize, shape, orig_dtype, None)
    _expect(
        absmax_dtype == np.uint8,
        f"{prefix}.absmax",
        f"dtype {absmax_dtype}; double quantization stores uint8 codes",
    )
    _expect(
        _int_field(meta, "nested_blocksize", key) == NESTED_BLOCKSIZE,
        f"{key}: nested_blocksize",
        f"must be {NESTED_BLOCKSIZE}",
    )
    nested_map = _table(state, f"{prefix}.nested_quant_map")
    _expect(
        np.array_equal(nested_map, formats.values("dynamic8")),
        f"{prefix}.nested_quant_map",
        "not the dynamic 8-bit map",
    )
    size, absmax2_dtype = info(f"{prefix}.nested_absmax")
    _expect(
        absmax2_dtype == np.float32,
        f"{prefix}.nested_absmax",
        f"dtype {absmax2_dtype}, expected float32",
    )
    want = formats.block_count(nblocks, NESTED_BLOCKSIZE)
    _expect(size == want, f"{prefix}.nested_absmax", f"{size} entries, expected {want}")
    offset = meta.get("nested_offset")
    _expect(
        isinstance(offset, (int, float))
        and not isinstance(offset, bool)
        and abs(offset) <= _F32_MAX,
        f"{key}: nested_offset",
        f"expected a finite float32 number, got {offset!r}",
    )
    return StateHeader(prefix, key, codebook, blocksize, shape, orig_dtype, float(offset))  # type: ignore[arg-type]


def import_state(state: Mapping[str, Any], prefix: str = "weight") -> NF4Tensor:
    """An NF4Tensor from the entries `export_state` (or bitsandbytes) writes. Anything
    malformed, inconsistent or not understood raises FormatError naming the key and field."""
    arrays: dict[str, np.ndarray] = {}

    def info(key: str) -> tuple[int, np.dtype[Any]]:
        if key not in arrays:
            arrays[key] = _array(state, key)
        return arrays[key].size, arrays[key].dtype

    header = read_header(state, prefix, info)
    absmax2 = arrays.get(f"{prefix}.nested_absmax")
    packed = header.packed(arrays[prefix], arrays[f"{prefix}.absmax"], absmax2)
    return NF4Tensor._trusted(packed, header.orig_dtype)
