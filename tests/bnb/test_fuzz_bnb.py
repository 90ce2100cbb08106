"""Mutation fuzzing of bitsandbytes 4-bit state dicts read by `nybble.bnb.import_state`
(docs/testing.md), seeded from states nybble exports and from the Linear4bit states
bitsandbytes itself wrote (tests/fixtures/bnb_*.npz).

A case passes when nybble refuses it with a FormatError, or accepts it and the reference
agrees: the quant-state blob is strict JSON, the scales are finite and >= 0 after decoding,
the codebooks are bitsandbytes' own, and the tensor dequantizes bit for bit to what the oracle
(`nybble.reference`) computes from the state as bitsandbytes lays it out (element 2k in the
high nibble, double-quantized scales `map[code] * absmax2[i // 256] + offset`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble import bnb, reference
from nybble.errors import FormatError
from nybble.tensor import NF4Tensor
from tests import FIXTURES
from tests.fuzzing import (
    FILE_ERRORS,
    Raw,
    Suite,
    cases_for,
    check,
    check_generator,
    dumps,
    hostile_value,
    mutate_json,
    mutate_json_text,
    pick,
    run_suite,
    strict_json_or_none,
)

FIXTURES = FIXTURES
QUANT_STATE = "quant_state.bitsandbytes__"
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
META_FIELDS = (
    "quant_type",
    "blocksize",
    "dtype",
    "shape",
    "nested_blocksize",
    "nested_dtype",
    "nested_offset",
)


@dataclass
class BnbSeed:
    name: str
    state: dict[Any, Any]
    prefix: str


@dataclass
class BnbCase:
    state: Any
    prefix: str
    description: str


def _seeds() -> list[BnbSeed]:
    rng = np.random.default_rng(7)
    seeds = []
    settings: list[tuple[tuple[int, ...], int, str, bool, Any, str]] = [
        ((300,), 64, "nf4", False, np.float32, "weight"),
        ((300,), 64, "nf4", True, np.float32, "weight"),
        ((16, 24), 32, "fp4", False, np.float16, "weight"),
        ((16, 24), 128, "fp4", True, ml_dtypes.bfloat16, "model.layers.0.mlp.down_proj.weight"),
        ((7, 3, 5), 4096, "nf4", True, np.float32, "weight"),
        ((1,), 64, "nf4", False, np.float32, "w"),
        ((600, 40), 32, "nf4", True, np.float16, "weight"),  # 750 blocks: 3 nested blocks
        ((0,), 64, "nf4", False, np.float32, "weight"),
    ]
    for shape, blocksize, codebook, dq, dtype, prefix in settings:
        x = (rng.standard_normal(shape) * rng.uniform(0.01, 100)).astype(dtype)
        q = nybble.quantize(x, blocksize, double_quant=dq, codebook=codebook)
        name = f"{codebook}-{'x'.join(map(str, shape))}-bs{blocksize}{'-dq' if dq else ''}"
        seeds.append(BnbSeed(name, bnb.export_state(q, prefix), prefix))
    for device in ("cpu", "cuda"):
        fixture = np.load(FIXTURES / f"bnb_{device}.npz")
        for dq in (0, 1):
            head = f"state_dq{dq}/"
            state = {k[len(head) :]: fixture[k] for k in fixture.files if k.startswith(head)}
            state = {k: v for k, v in state.items() if k.startswith("weight")}
            seeds.append(BnbSeed(f"bitsandbytes-{device}-dq{dq}", state, "weight"))
    return seeds


SEEDS = _seeds()


def _meta_values(rng: np.random.Generator, name: str) -> Any:
    if name == "quant_type":
        return pick(rng, ["nf4", "fp4", "int8", "NF4", "", None, 4])
    if name in ("blocksize", "nested_blocksize"):
        return pick(rng, [16, 32, 64, 128, 256, 4096, 8192, 63, 0, -64, 64.0, "64", True, 2**64])
    if name in ("dtype", "nested_dtype"):
        return pick(
            rng, ["float32", "float16", "bfloat16", "torch.bfloat16", "float64", "int8", "", 1]
        )
    if name == "shape":
        return pick(
            rng,
            [[300], [20, 15], [299], [301], [0], [], [-300], [2**62], [2**63, 2], [300.0], ["300"]],
        )
    if name == "nested_offset":
        return pick(
            rng,
            [0.0, -1.0, 1e-45, 3.5e38, 1e308, -1e308, 1e39, Raw("NaN"), Raw("Infinity"), "1.0"],
        )
    return hostile_value(rng)


def _bad_array(a: np.ndarray, rng: np.random.Generator) -> tuple[Any, str]:
    """An array (or not) in place of `a`."""
    kind = pick(
        rng,
        ["dtype", "shape", "size", "value", "value", "list", "none", "scalar", "bytes", "order"],
    )
    if kind == "dtype":
        dtype = pick(
            rng,
            [np.int8, np.uint16, np.float16, np.float64, np.float32, np.uint8, bool, np.complex64],
        )
        with np.errstate(all="ignore"):
            return a.astype(dtype), f"as {np.dtype(dtype)}"
    if kind == "shape":
        shapes = [a.reshape(-1, 1).shape, (1, a.size), a.reshape(-1).shape]
        if a.size == 1:
            shapes.append(())
        shape = pick(rng, shapes)
        return a.reshape(shape), f"reshaped {shape}"
    if kind == "size":
        new = pick(rng, [a.reshape(-1)[:-1], np.concatenate([a.reshape(-1), a.reshape(-1)[:1]])])
        return new, f"{new.size} elements"
    if kind == "value" and a.size:
        b = np.array(a, copy=True).reshape(-1)
        index = int(rng.integers(b.size))
        if b.dtype.kind == "f":
            value = pick(rng, [np.nan, np.inf, -np.inf, -1.0, -0.0, 0.0, 1e-45, 3e38, 1e30])
        else:
            value = int(rng.integers(0, 256))
        b[index] = value
        return b.reshape(a.shape), f"element {index} = {value}"
    if kind == "list":
        return a.tolist(), "as a Python list"
    if kind == "none":
        return None, "None"
    if kind == "scalar":
        return pick(rng, [0, 1.5, "x", np.float32(1)]), "a scalar"
    if kind == "bytes":
        return a.tobytes(), "as bytes"
    if kind == "order" and a.dtype.itemsize > 1:
        return a.astype(a.dtype.newbyteorder(">")), "big-endian"
    strided = np.repeat(a.reshape(-1), 2)[::2]
    return strided, "a strided view"


def generate(rng: np.random.Generator) -> BnbCase:
    seed = pick(rng, SEEDS)
    state: dict[Any, Any] = dict(seed.state)
    prefix = seed.prefix
    keys = [k for k in state if isinstance(k, str)]
    key = pick(rng, keys)
    blob_key = next(k for k in keys if QUANT_STATE in k)
    kind = pick(rng, ["meta", "meta", "meta", "blob", "array", "array", "array", "keys", "state"])
    if kind == "meta":
        meta = json.loads(bytes(np.asarray(state[blob_key], np.uint8)))
        parts = []
        for _ in range(int(rng.choice([1, 1, 2]))):
            meta, what = mutate_json(meta, rng, META_FIELDS, _meta_values)
            parts.append(what)
        state[blob_key] = np.frombuffer(dumps(meta).encode(), np.uint8).copy()
        what = f"quant state: {'; '.join(parts)}"
    elif kind == "blob":
        text, what = mutate_json_text(bytes(np.asarray(state[blob_key], np.uint8)), rng)
        blob = np.frombuffer(text, np.uint8).copy()
        form = pick(rng, ["u8", "u8", "i8", "2d", "big"])
        if form == "i8":
            blob = blob.view(np.int8)
        elif form == "2d":
            blob = blob.reshape(1, -1)
        elif form == "big":
            blob = np.zeros(bnb.MAX_QUANT_STATE_BYTES + 1, np.uint8)
            what = "a blob too large to be a quant state"
        state[blob_key] = blob
        what = f"quant state text: {what} ({form})"
    elif kind == "array":
        value = state[key]
        if isinstance(value, np.ndarray):
            state[key], what = _bad_array(value, rng)
            what = f"{key}: {what}"
        else:
            what = "nothing"
    elif kind == "keys":
        op = pick(rng, ["remove", "add", "rename", "non-string", "swap-type", "second-state"])
        if op == "remove":
            del state[key]
            what = f"{key} removed"
        elif op == "add":
            extra = pick(rng, [f"{prefix}.extra", f"{prefix}.absmax2", "bias", f"{prefix}x"])
            state[extra] = np.zeros(3, np.float32)
            what = f"{extra} added"
        elif op == "rename":
            new = pick(rng, [key.upper(), key + ".", key.replace(prefix, "other", 1), "", " "])
            state[new] = state.pop(key)
            what = f"{key} renamed {new!r}"
        elif op == "non-string":
            odd = pick(rng, [1, None, b"weight", ("weight",), 2.5, frozenset()])
            state[odd] = state[key]
            what = f"a key {odd!r} added"
        elif op == "swap-type":
            other = blob_key.replace("nf4", "FP4").replace("fp4", "nf4").replace("FP4", "fp4")
            new = pick(rng, [other, blob_key.replace("bitsandbytes__", "bitsandbytes_"), other])
            state[new] = state.pop(blob_key)
            what = f"{blob_key} renamed {new!r}"
        else:
            other = blob_key.replace("nf4", "fp4") if "nf4" in blob_key else blob_key[:-3] + "nf4"
            state[other] = state[blob_key]
            what = f"a second quant state {other!r}"
    else:
        replacement = pick(rng, [[], None, "weight", list(state.items()), {}, 5])
        return BnbCase(
            replacement, prefix, f"{seed.name}: the state replaced by {replacement!r}"[:200]
        )
    return BnbCase(state, prefix, f"{seed.name}: {what}")


def attempt(case: BnbCase) -> NF4Tensor:
    return bnb.import_state(case.state, prefix=case.prefix)


def verify(case: BnbCase, q: NF4Tensor) -> str | None:
    state, prefix = case.state, case.prefix
    keys = [k for k in state if isinstance(k, str) and k.startswith(f"{prefix}.{QUANT_STATE}")]
    if len(keys) != 1:
        return f"accepted without exactly one quant-state key: {keys}"
    quant_type = keys[0].rsplit("__", 1)[1]
    blob = np.asarray(state[keys[0]])
    if blob.dtype != np.uint8 and blob.dtype != np.int8:
        return f"accepted a quant-state blob that is not bytes: {blob.dtype}"
    ok, meta = strict_json_or_none(np.ascontiguousarray(blob).view(np.uint8).tobytes())
    if not ok or not isinstance(meta, dict):
        return "accepted a quant state that is not a strict JSON object"
    shape, blocksize = tuple(meta.get("shape") or ()), meta.get("blocksize")
    if not all(type(d) is int and d >= 0 for d in shape) or blocksize not in BLOCKSIZES:
        return f"accepted a bad shape or blocksize: {meta.get('shape')!r}, {blocksize!r}"
    n = math.prod(shape)
    codes = np.asarray(state[prefix]).reshape(-1)
    if codes.dtype != np.uint8 or codes.size != -(-n // 2):
        return f"accepted codes of the wrong type or size: {codes.dtype} [{codes.size}] for {n}"
    quant_map = np.asarray(state[f"{prefix}.quant_map"], np.float32).reshape(-1)
    if not np.array_equal(quant_map, reference.CODEBOOKS[quant_type]):
        return "accepted a quant_map that is not the codebook"
    nested = f"{prefix}.nested_absmax" in state or "nested_offset" in meta
    absmax = np.asarray(state[f"{prefix}.absmax"]).reshape(-1)
    if nested:
        nested_map = np.asarray(state[f"{prefix}.nested_quant_map"], np.float32).reshape(-1)
        if not np.array_equal(nested_map, reference.DYNAMIC_MAP):
            return "accepted a nested_quant_map that is not the dynamic map"
        absmax2 = np.asarray(state[f"{prefix}.nested_absmax"]).reshape(-1)
        with np.errstate(all="ignore"):
            scales = reference.double_dequantize(
                absmax.astype(np.uint8), absmax2.astype(np.float32), meta["nested_offset"]
            )
    else:
        scales = absmax.astype(np.float32)
    # Decoded nested scales may be a little below zero where a block is all zeros (its
    # absmax - offset quantized to the next map value down): only plain ones must be >= 0.
    if not np.all(np.isfinite(scales)) or (not nested and np.any(scales < 0)):
        return "accepted scales that are not finite (or plain ones < 0) once decoded"
    # bitsandbytes packs element 2k in the high nibble: swap to the oracle's low-nibble order.
    ours = ((codes >> 4) | (codes << 4)).astype(np.uint8)
    with np.errstate(all="ignore"):
        want = reference.dequantize(ours, scales, n, blocksize, quant_type)
    got = q.dequantize("float32").reshape(-1)
    if q.shape != shape or q.blocksize != blocksize or q.codebook != quant_type:
        return f"a field read otherwise: {q.shape} bs {q.blocksize} {q.codebook}"
    if not np.array_equal(got, want):
        return "dequantizes differently from the oracle's reading of the state"
    dtype = str(meta.get("dtype", "float32")).removeprefix("torch.")
    if q.orig_dtype != dtype:
        return f"a field read otherwise: orig_dtype {q.orig_dtype}, the state says {dtype}"
    return None


def _decoded_nested_scales(state: Any, prefix: str) -> np.ndarray | None:
    """The oracle's decoding of a state's double-quantized scales (None if it has none or
    they cannot be read)."""
    try:
        key = next(k for k in state if isinstance(k, str) and f"{prefix}.{QUANT_STATE}" in k)
        meta = json.loads(np.asarray(state[key]).tobytes())
        with np.errstate(all="ignore"):
            return reference.double_dequantize(
                np.asarray(state[f"{prefix}.absmax"], np.uint8).reshape(-1),
                np.asarray(state[f"{prefix}.nested_absmax"], np.float32).reshape(-1),
                meta["nested_offset"],
            )
    except Exception:
        return None


def known(case: BnbCase, error: BaseException | None) -> str | None:
    """The known bugs (each with a strict xfail test below): none at present."""
    return None


def test_the_seeds_import_and_pass_the_reference() -> None:
    for seed in SEEDS:
        case = BnbCase(seed.state, seed.prefix, seed.name)
        assert verify(case, attempt(case)) is None, seed.name


def test_the_generator_makes_cases_from_any_seed() -> None:
    check_generator("bnb-state", generate, 2000)


def test_fuzz_bitsandbytes_states() -> None:
    suite = Suite("bnb-state", generate, attempt, verify, allowed=FILE_ERRORS, known=known)
    check([run_suite(suite, cases_for(0.3))])


# --- bugs the suite found, fixed since: each stays a test ------------------------------------


def _double_quantized_state() -> dict[str, Any]:
    x = np.random.default_rng(0).standard_normal(300).astype(np.float32)
    return bnb.export_state(nybble.quantize(x, double_quant=True))


@pytest.mark.parametrize("suffix", ["quant_map", "nested_quant_map"])
def test_a_quant_map_that_is_not_numbers_is_a_format_error(suffix: str) -> None:
    state = _double_quantized_state()
    size = state[f"weight.{suffix}"].size
    state[f"weight.{suffix}"] = np.array([chr(65 + i % 26) for i in range(size)])
    with pytest.raises(FormatError) as e:
        bnb.import_state(state)
    assert e.value.field == f"weight.{suffix}"


def test_a_nested_offset_beyond_float32_is_a_format_error() -> None:
    state = _double_quantized_state()
    meta = json.loads(state["weight.quant_state.bitsandbytes__nf4"].tobytes())
    meta["nested_offset"] = 1e308
    state["weight.quant_state.bitsandbytes__nf4"] = np.frombuffer(
        json.dumps(meta).encode(), np.uint8
    )
    with pytest.raises(FormatError) as e:
        bnb.import_state(state)
    assert e.value.field == "weight.quant_state.bitsandbytes__nf4: nested_offset"


@pytest.mark.parametrize("shape", [[0, 10**30], [2**62, 0], [0] * 40, [2**40, 2**40, 0]])
def test_an_empty_shape_with_a_dimension_numpy_cannot_hold_is_refused(shape: list[int]) -> None:
    state = bnb.export_state(nybble.quantize(np.zeros(0, np.float32)))
    key = next(k for k in state if ".quant_state." in k)
    meta = json.loads(bytes(state[key]))
    meta["shape"] = shape
    state[key] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with pytest.raises(FormatError):  # the shape, or (10**30) an integer out of any range
        bnb.import_state(state)
    with pytest.raises(ValueError, match="shape"):
        NF4Tensor(np.zeros(0, np.uint8), np.zeros(0, np.float32), tuple(shape))
