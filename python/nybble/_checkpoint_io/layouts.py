"""The two layouts of a quantized weight in a checkpoint (docs/checkpoints.md, "Layouts"):

nybble's, under the weight's name P (e.g. `model.layers.0.mlp.up_proj.weight`):
  P.codes               U8 [code bytes]     nybble's packing (element 2k in the low nibble)
  P.absmax              F32 [nblocks]       or U8 [nblocks], the nested codes (double quant)
  P.absmax2             F32 [ceil(nblocks/256)]              (double quant)
  P.absmax_offset       F32 []                                (double quant)
  P.quant_state.nybble  U8 JSON: format, codebook, blocksize, shape, dtype, double_quant

bitsandbytes' (what transformers saves for a Linear4bit; docs/bitsandbytes.md), nf4/fp4 only:
  P, P.absmax, P.quant_map, [P.nested_absmax, P.nested_quant_map],
  P.quant_state.bitsandbytes__nf4 (or __fp4)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .. import _json, bnb, formats
from ..errors import FormatError
from ..formats import NESTED_BLOCKSIZE, Codebook, NestedAbsmax, OutputDtype, Packed
from ..safetensors_io import Entry
from ..tensor import NF4Tensor

Layout = Literal["nybble", "bnb"]
LAYOUTS: tuple[Layout, ...] = ("nybble", "bnb")
NYBBLE_STATE = ".quant_state.nybble"
BNB_STATE = ".quant_state.bitsandbytes__"
NYBBLE_FORMAT = "nybble/1"
NYBBLE_ROLES = ("codes", "absmax", "absmax2", "absmax_offset")
BNB_ROLES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
#: Keys of bitsandbytes' 8-bit (LLM.int8) weights, which nybble does not read.
INT8_SUFFIXES = (".SCB", ".weight_format")
#: The longest repr of a float (sign, 17 digits, point, exponent), bounding the JSON of a
#: bitsandbytes state whose nested_offset is known only after quantizing.
_LONGEST_FLOAT = -1.2345678901234567e-300


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize: the codebook, blocksize and double quantization."""

    codebook: Codebook = "nf4"
    blocksize: int = 64
    double_quant: bool = False

    def check(self) -> QuantSpec:
        formats.check_codebook(self.codebook)
        formats.check_blocksize(self.blocksize)
        if not isinstance(self.double_quant, bool):
            raise ValueError(f"double_quant must be True or False, got {self.double_quant!r}")
        return self


@dataclass
class QuantGroup:
    """The tensors of one quantized weight: `prefix` is the weight's name, `members` maps
    each tensor name to its role (`state`, `codes`, `absmax`, ...)."""

    layout: Layout
    prefix: str
    state_key: str
    members: dict[str, str] = field(default_factory=dict)


def find_groups(names: Iterable[str], source: Path) -> dict[str, QuantGroup]:
    """The quantized weights among a checkpoint's tensor names, by weight name."""
    names = list(names)
    present = set(names)
    groups: dict[str, QuantGroup] = {}
    for name in names:
        if name.endswith(INT8_SUFFIXES):
            raise FormatError(
                source,
                "a bitsandbytes 8-bit (LLM.int8) weight; nybble reads 4-bit checkpoints",
                name,
            )
        if name.endswith(NYBBLE_STATE):
            prefix, layout, roles = name[: -len(NYBBLE_STATE)], "nybble", NYBBLE_ROLES
        elif BNB_STATE in name and "." not in name.rsplit(BNB_STATE, 1)[1]:
            prefix, layout, roles = name.rsplit(BNB_STATE, 1)[0], "bnb", BNB_ROLES
        else:
            continue
        if prefix in groups:
            raise FormatError(source, "holds two quantization states for one weight", name)
        group = QuantGroup(layout, prefix, name, {name: "state"})  # type: ignore[arg-type]
        if layout == "bnb" and prefix in present:
            group.members[prefix] = "codes"
        for role in roles:
            if f"{prefix}.{role}" in present:
                group.members[f"{prefix}.{role}"] = role
        groups[prefix] = group
    return groups


# --- reading a quantized weight ------------------------------------------------------------


def load_group(
    group: QuantGroup, read: Callable[[str], np.ndarray], file_of: Callable[[str], Path]
) -> NF4Tensor:
    """The NF4Tensor a group stores; FormatError naming the file and tensor for anything
    malformed or inconsistent."""
    arrays = {name: read(name) for name in group.members}
    if group.layout == "bnb":
        try:
            return bnb.import_state(arrays, prefix=group.prefix)
        except FormatError as e:
            key = (e.field or group.state_key).split(":", 1)[0]
            raise FormatError(file_of(key), e.problem, e.field) from None
    return _import_nybble(group, arrays, file_of)


@dataclass(frozen=True)
class Header:
    """What a quantized weight's state says: enough to plan its outputs before reading it."""

    codebook: Codebook
    blocksize: int
    double_quant: bool
    shape: tuple[int, ...]
    dtype: OutputDtype


def read_header(
    group: QuantGroup, read: Callable[[str], np.ndarray], file_of: Callable[[str], Path]
) -> Header:
    """The group's state, checked field by field (FormatError naming the file and field)."""
    key = group.state_key

    def fail(problem: str, where: str = key) -> FormatError:
        return FormatError(file_of(where), problem, where)

    state = _state_json(read(key), fail)
    if group.layout == "nybble":
        if state.get("format") != NYBBLE_FORMAT:
            raise fail(f"format is {state.get('format')!r}, expected {NYBBLE_FORMAT!r}")
        codebook_field = state.get("codebook")
        dq = state.get("double_quant")
        dtype_field = state.get("dtype")
    else:
        codebook_field = key.rsplit("__", 1)[1]
        if state.get("quant_type", codebook_field) != codebook_field:
            raise fail(f"quant_type {state.get('quant_type')!r} disagrees with the key")
        dq = "nested_offset" in state or f"{group.prefix}.nested_absmax" in group.members
        dtype_field = str(state.get("dtype", "float32")).removeprefix("torch.")
    if not isinstance(dq, bool):
        raise fail(f"double_quant must be true or false, got {dq!r}")
    try:
        codebook = formats.check_codebook(codebook_field)
        blocksize = formats.check_blocksize(state.get("blocksize"))
        shape = formats.check_shape(_int_list(state.get("shape")))
        dtype = formats.output_dtype(dtype_field)
    except ValueError as e:
        raise fail(str(e)) from None
    if group.layout == "bnb" and codebook not in bnb.QUANT_TYPES:
        raise fail(f"quant type {codebook!r} is not nf4 or fp4")
    return Header(codebook, blocksize, dq, shape, dtype)


def _import_nybble(
    group: QuantGroup, arrays: Mapping[str, np.ndarray], file_of: Callable[[str], Path]
) -> NF4Tensor:
    p, key = group.prefix, group.state_key
    h = read_header(group, arrays.__getitem__, file_of)

    def fail(problem: str, where: str = key) -> FormatError:
        return FormatError(file_of(where), problem, where)

    needed = ["codes", "absmax"] + (["absmax2", "absmax_offset"] if h.double_quant else [])
    got = {role: arrays.get(f"{p}.{role}") for role in needed}
    for role, a in got.items():
        if a is None:
            raise fail("missing", f"{p}.{role}")
    nested = None
    absmax = got["absmax"]
    if h.double_quant:
        offset = np.asarray(got["absmax_offset"])
        if offset.dtype != np.float32 or offset.shape != ():
            raise fail("expected a float32 scalar", f"{p}.absmax_offset")
        nested = NestedAbsmax(got["absmax"], got["absmax2"], float(offset))
        absmax = None
    try:
        return NF4Tensor(got["codes"], absmax, h.shape, h.blocksize, h.codebook, nested, h.dtype)
    except ValueError as e:
        raise fail(f"does not match its tensors ({e})") from None


def _state_json(blob: np.ndarray, fail: Callable[[str], FormatError]) -> dict[str, Any]:
    if blob.dtype != np.uint8 or blob.ndim != 1 or blob.size > bnb.MAX_QUANT_STATE_BYTES:
        raise fail(f"expected a short uint8 JSON blob, got {blob.dtype} {list(blob.shape)}")
    try:
        state = _json.loads(blob.tobytes(), "state")
    except FormatError as e:
        raise fail(e.problem) from None
    if not isinstance(state, dict):
        raise fail("not a JSON object")
    return state


def _int_list(value: Any) -> tuple[int, ...] | Any:
    return tuple(value) if isinstance(value, list) else value


# --- writing a quantized weight ------------------------------------------------------------


def entries(
    layout: Layout, prefix: str, shape: tuple[int, ...], spec: QuantSpec, dtype: OutputDtype
) -> list[Entry]:
    """The tensors a weight of `shape` quantized with `spec` takes in `layout`, planned before
    the data is seen."""
    n = math.prod(shape)
    nblocks = formats.block_count(n, spec.blocksize)
    nested = formats.block_count(nblocks, NESTED_BLOCKSIZE)
    code_bytes = formats.code_bytes(n, spec.codebook)
    scales = Entry(f"{prefix}.absmax", "U8" if spec.double_quant else "F32", (nblocks,))
    if layout == "nybble":
        state = _nybble_state(spec, shape, dtype)
        out = [Entry(f"{prefix}.codes", "U8", (code_bytes,)), scales]
        if spec.double_quant:
            out += [
                Entry(f"{prefix}.absmax2", "F32", (nested,)),
                Entry(f"{prefix}.absmax_offset", "F32", ()),
            ]
        return [*out, Entry(prefix + NYBBLE_STATE, "U8", (len(state),))]
    if spec.codebook not in bnb.QUANT_TYPES:
        raise ValueError(f"bitsandbytes' 4-bit layout holds nf4 or fp4, not {spec.codebook}")
    meta: dict[str, Any] = {
        "quant_type": spec.codebook,
        "blocksize": spec.blocksize,
        "dtype": dtype,
        "shape": list(shape),
    }
    out = [
        Entry(prefix, "U8", (code_bytes, 1)),
        scales,
        Entry(f"{prefix}.quant_map", "F32", (16,)),
    ]
    if spec.double_quant:
        meta.update(nested_blocksize=256, nested_dtype="float32", nested_offset=_LONGEST_FLOAT)
        out += [
            Entry(f"{prefix}.nested_absmax", "F32", (nested,)),
            Entry(f"{prefix}.nested_quant_map", "F32", (256,)),
        ]
    bound = len(json.dumps(meta)) + 32
    return [*out, Entry(f"{prefix}{BNB_STATE}{spec.codebook}", "U8", (bound,), max_bytes=bound)]


def export(q: NF4Tensor, layout: Layout, prefix: str) -> dict[str, np.ndarray]:
    """The tensors of a quantized weight in `layout` (host arrays)."""
    q = q.cpu()
    if layout == "bnb":
        return bnb.export_state(q, prefix=prefix)
    spec = QuantSpec(q.codebook, q.blocksize, q.nested is not None)
    out = {f"{prefix}.codes": np.asarray(q.codes, np.uint8)}
    if q.nested is None:
        out[f"{prefix}.absmax"] = np.asarray(q.absmax, np.float32)
    else:
        out[f"{prefix}.absmax"] = np.asarray(q.nested.codes, np.uint8)
        out[f"{prefix}.absmax2"] = np.asarray(q.nested.absmax2, np.float32)
        out[f"{prefix}.absmax_offset"] = np.array(q.nested.offset, np.float32)
    state = _nybble_state(spec, q.shape, q.orig_dtype)
    out[prefix + NYBBLE_STATE] = np.frombuffer(state, np.uint8).copy()
    return out


def spec_of(q: NF4Tensor) -> QuantSpec:
    return QuantSpec(q.codebook, q.blocksize, q.nested is not None)


def _nybble_state(spec: QuantSpec, shape: tuple[int, ...], dtype: str) -> bytes:
    state = {
        "format": NYBBLE_FORMAT,
        "codebook": spec.codebook,
        "blocksize": spec.blocksize,
        "shape": list(shape),
        "dtype": dtype,
        "double_quant": spec.double_quant,
    }
    return json.dumps(state).encode("utf-8")


def element_range(q: NF4Tensor, start: int, stop: int, shape: tuple[int, ...]) -> NF4Tensor:
    """Elements start..stop (flat) of a quantized tensor as a tensor of `shape`, sharing its
    codes; `start` must be a multiple of the blocksize (so of 2 as well) and `stop` one too
    or the end. The scales are plain (double-quantized ones decoded)."""
    if start % q.blocksize or (stop % q.blocksize and stop != q.size):
        raise ValueError(f"elements {start}..{stop} do not start and end on block boundaries")
    per_byte = 2 if formats.code_bits(q.codebook) == 4 else 1
    codes = q.codes[start // per_byte : -(-stop // per_byte)]
    absmax = q.absmax[start // q.blocksize : -(-stop // q.blocksize)]
    return _made_from(q, Packed(codes, absmax, None, shape, q.blocksize, q.codebook))


def plain(q: NF4Tensor) -> NF4Tensor:
    """The same tensor with plain float32 scales (double-quantized ones decoded once)."""
    return q.with_plain_scales()


def _made_from(q: NF4Tensor, packed: Packed) -> NF4Tensor:
    # Decoded nested scales of an all-zero block can come out a hair below zero, which the
    # public constructor refuses for plain scales; these come from a checked tensor, so they
    # are taken as they are (only their sizes are checked), as the library's own code does.
    return NF4Tensor._trusted(packed, q.orig_dtype)
