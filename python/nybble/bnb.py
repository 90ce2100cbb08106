"""bitsandbytes / transformers 4-bit interop: the state-dict entries of a `Linear4bit` weight.

A `Linear4bit` saves, under its weight's prefix (here `weight`):
  weight                                  uint8 [ceil(n/2), 1], element 2k in the HIGH nibble
  weight.absmax                           float32 [nblocks], or uint8 codes with double quant
  weight.quant_map                        float32 [16], the codebook
  weight.nested_absmax                    float32 [ceil(nblocks/256)]      (double quant)
  weight.nested_quant_map                 float32 [256], the dynamic map   (double quant)
  weight.quant_state.bitsandbytes__nf4    uint8 bytes of a JSON object: quant_type, blocksize,
                                          dtype, shape (+ nested_blocksize, nested_dtype,
                                          nested_offset with double quant)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _arrays, reference
from .errors import FormatError
from .tensor import NESTED_BLOCKSIZE, NestedAbsmax, NF4Tensor, check_blocksize

QUANT_TYPES = ("nf4", "fp4")


def swap_nibbles(codes: np.ndarray) -> np.ndarray:
    """bitsandbytes packs element 2k in the high nibble, nybble in the low one: converting
    either way swaps the two nibbles of every byte."""
    return ((codes >> 4) | (codes << 4)).astype(np.uint8)


def export_state(q: NF4Tensor, prefix: str = "weight", dtype: Any = None) -> dict[str, np.ndarray]:
    """The state-dict entries bitsandbytes writes for this quantized weight. `dtype` (default:
    the dtype that was quantized) is what bitsandbytes will dequantize to."""
    if q.codebook not in QUANT_TYPES:
        raise ValueError(f"bitsandbytes 4-bit states hold nf4 or fp4, not {q.codebook}")
    q = q.cpu()
    meta: dict[str, Any] = {
        "quant_type": q.codebook,
        "blocksize": q.blocksize,
        "dtype": _arrays.output_dtype(dtype) if dtype is not None else q.orig_dtype,
        "shape": list(q.shape),
    }
    state = {
        prefix: swap_nibbles(q.codes).reshape(-1, 1),
        f"{prefix}.quant_map": reference.codebook_values(q.codebook).copy(),
    }
    if q.nested is None:
        state[f"{prefix}.absmax"] = np.asarray(q.absmax, np.float32)
    else:
        state[f"{prefix}.absmax"] = np.asarray(q.nested.codes, np.uint8)
        state[f"{prefix}.nested_absmax"] = np.asarray(q.nested.absmax2, np.float32)
        state[f"{prefix}.nested_quant_map"] = reference.DYNAMIC_MAP.copy()
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
        raise FormatError(f"bitsandbytes state: missing key {key!r}")
    value = state[key]
    if hasattr(value, "detach"):  # a torch tensor, perhaps on a GPU
        value = value.detach().cpu()
    return np.asarray(_arrays.as_host_array(value, key))


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise FormatError(f"bitsandbytes state: {message}")


def import_state(state: Mapping[str, Any], prefix: str = "weight") -> NF4Tensor:
    """An NF4Tensor from the entries `export_state` (or bitsandbytes) writes."""
    found = [k for k in state if k.startswith(f"{prefix}.quant_state.bitsandbytes__")]
    _expect(
        len(found) == 1, f"expected one '{prefix}.quant_state.bitsandbytes__*' key, found {found}"
    )
    quant_type = found[0].rsplit("__", 1)[1]
    _expect(quant_type in QUANT_TYPES, f"quant type {quant_type!r} is not nf4 or fp4")
    try:
        meta = json.loads(_array(state, found[0]).astype(np.uint8).tobytes().decode("utf-8"))
        blocksize = check_blocksize(int(meta["blocksize"]))
        shape = tuple(int(d) for d in meta["shape"])
        orig_dtype = _arrays.output_dtype(str(meta.get("dtype", "float32")))
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"bitsandbytes state: unreadable {found[0]!r} ({e})") from None
    _expect(meta.get("quant_type", quant_type) == quant_type, "quant_type disagrees with the key")

    n = int(np.prod(shape))
    nblocks = -(-n // blocksize)
    codes = _array(state, prefix)
    _expect(codes.dtype == np.uint8, f"{prefix!r} has dtype {codes.dtype}, expected uint8")
    _expect(
        codes.size == -(-n // 2),
        f"{prefix!r} has {codes.size} bytes, shape {shape} needs {-(-n // 2)}",
    )
    quant_map = _array(state, f"{prefix}.quant_map")
    _expect(
        np.array_equal(quant_map.astype(np.float32), reference.codebook_values(quant_type)),
        f"{prefix}.quant_map is not the standard {quant_type} codebook",
    )
    absmax = _array(state, f"{prefix}.absmax").reshape(-1)
    _expect(
        absmax.size == nblocks, f"{prefix}.absmax has {absmax.size} entries, expected {nblocks}"
    )

    nested = None
    if "nested_offset" in meta or f"{prefix}.nested_absmax" in state:
        _expect(absmax.dtype == np.uint8, f"{prefix}.absmax must be uint8 codes under double quant")
        _expect(
            int(meta.get("nested_blocksize", -1)) == NESTED_BLOCKSIZE,
            "nested_blocksize must be 256",
        )
        nested_map = _array(state, f"{prefix}.nested_quant_map").astype(np.float32)
        _expect(
            np.array_equal(nested_map, reference.DYNAMIC_MAP),
            "nested_quant_map is not the dynamic map",
        )
        absmax2 = _array(state, f"{prefix}.nested_absmax").astype(np.float32).reshape(-1)
        _expect(
            absmax2.size == -(-nblocks // NESTED_BLOCKSIZE), "nested_absmax has the wrong length"
        )
        try:
            offset = float(np.float32(meta["nested_offset"]))
        except (KeyError, TypeError, ValueError):
            raise FormatError("bitsandbytes state: nested_offset missing or not a number") from None
        nested = NestedAbsmax(np.ascontiguousarray(absmax), np.ascontiguousarray(absmax2), offset)
        absmax_f32 = None
    else:
        absmax_f32 = np.ascontiguousarray(absmax, dtype=np.float32)
        _expect(bool(np.all(np.isfinite(absmax_f32))), f"{prefix}.absmax has non-finite values")
    codes_ours = swap_nibbles(np.ascontiguousarray(codes).reshape(-1))
    return NF4Tensor(codes_ours, absmax_f32, shape, blocksize, quant_type, nested, orig_dtype)
