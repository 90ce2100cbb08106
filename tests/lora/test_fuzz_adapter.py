"""Mutation fuzzing of PEFT adapter directories (docs/testing.md): adapter_model.safetensors
and adapter_config.json, seeded from adapters nybble saves and from the PEFT-written fixtures,
loaded by `LoraAdapter.from_pretrained` over dense and NF4 bases.

A case passes when nybble refuses it with a FormatError (or a NonFiniteError for NaN/inf
weights, a KeyError for a layer the base lacks, a ValueError for a tensor whose shape
disagrees with the base weight), or accepts it and the reference agrees: the safetensors
library reads the weights file, the config is strict JSON, every field nybble read has the
value PEFT reads (PEFT's defaults where a field is absent, its rank/alpha pattern rule), and
every tensor nybble loaded equals the library's, converted to float32.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors

import nybble
from nybble import LoraAdapter, LoraConfig
from nybble.errors import FormatError
from tests import FIXTURES
from tests.fuzzing import (
    FILE_ERRORS,
    REGEXES,
    Raw,
    Suite,
    cases_for,
    check,
    check_generator,
    dumps,
    hostile_value,
    join_safetensors,
    mutate_bytes,
    mutate_json,
    mutate_json_text,
    pick,
    run_suite,
    scratch_directory,
    split_safetensors,
    strict_json_or_none,
)

PEFT_FIXTURES = FIXTURES / "peft"
PREFIX = "base_model.model."
SUFFIXES = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")
#: Where an accepted adapter may legitimately be refused, beyond FILE_ERRORS: a layer the base
#: lacks (KeyError) or a tensor whose shape disagrees with the base weight (ValueError).
ADAPTER_ERRORS = (*FILE_ERRORS, KeyError, ValueError)
#: PEFT's LoraConfig defaults for the fields nybble reads (peft/tuners/lora/config.py).
PEFT_DEFAULTS: dict[str, Any] = {
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "rank_pattern": {},
    "alpha_pattern": {},
}

#: numpy dtypes of the safetensors dtype codes (the format's table, stated here on its own).
NUMPY_OF_CODE: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "C64": np.dtype("<c8"),
}
CODE_OF_NUMPY = {dt: code for code, dt in NUMPY_OF_CODE.items()}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")


# --- seeds ----------------------------------------------------------------------------------------


@dataclass
class AdapterSeed:
    name: str
    weights: bytes  # as saved (nybble's carry the digest of their config)
    plain_weights: bytes  # the same without nybble's metadata, as PEFT writes them
    config: bytes
    base: dict[str, Any]
    quantized_base: dict[str, Any]


def build_safetensors(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None) -> bytes:
    """A safetensors file as the format defines it (contiguous data in key order, header
    padded with spaces to 8 bytes)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    chunks, offset = [], 0
    for name, a in tensors.items():
        code = CODE_OF_NUMPY[a.dtype]
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": code,
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def _small_adapter(kind: str) -> LoraAdapter:
    rng = np.random.default_rng(len(kind))
    if kind == "dora_rslora":
        config = LoraConfig(
            r=2, alpha=3, use_dora=True, use_rslora=True, target_modules=("q_proj", "k_proj")
        )
        shapes = {"q_proj": (8, 12), "k_proj": (4, 12)}
    elif kind == "patterns":
        config = LoraConfig(
            r=4,
            alpha=8,
            target_modules=("q_proj", "v_proj", "down_proj"),
            rank_pattern={"v_proj": 2},
            alpha_pattern={"layers\\.0\\.self_attn\\.q_proj": 3.0},
        )
        shapes = {"q_proj": (8, 12), "v_proj": (4, 12), "down_proj": (12, 6)}
    else:
        config = LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj"))
        shapes = {"q_proj": (8, 12), "v_proj": (4, 12)}
    adapter = LoraAdapter(config)
    for layer in (0, 1) if kind == "patterns" else (0,):
        for proj, shape in shapes.items():
            part = "mlp" if proj == "down_proj" else "self_attn"
            w = rng.standard_normal(shape).astype(np.float32)
            lay = adapter.add_layer(f"model.layers.{layer}.{part}.{proj}", w)
            lay.set_lora_b(rng.standard_normal(lay.lora_b.shape) * 0.1)
            if lay.lora_magnitude is not None:
                lay.set_lora_magnitude(lay.lora_magnitude * 1.5)
    return adapter


def _plain(weights: bytes) -> bytes:
    header, body = split_safetensors(weights)
    header["__metadata__"] = {"format": "pt"}
    return join_safetensors(header, body)


def _seeds(tmp: Path) -> list[AdapterSeed]:
    seeds = []
    for kind in ("lora", "dora_rslora", "patterns"):
        adapter = _small_adapter(kind)
        adapter.save_pretrained(tmp / kind)
        base = {f"{n}.weight": layer.weight for n, layer in adapter.layers.items()}
        weights = (tmp / kind / "adapter_model.safetensors").read_bytes()
        seeds.append(
            AdapterSeed(
                kind,
                weights,
                _plain(weights),
                (tmp / kind / "adapter_config.json").read_bytes(),
                base,
                {k: nybble.quantize(v, blocksize=32) for k, v in base.items()},
            )
        )
    for d in sorted(p for p in PEFT_FIXTURES.iterdir() if p.is_dir()):
        expected = np.load(d / "expected.npz")
        base = {k: expected[k] for k in expected.files if k.endswith(".weight")}
        weights = (d / "adapter_model.safetensors").read_bytes()
        seeds.append(
            AdapterSeed(
                f"peft-{d.name}",
                weights,
                weights,
                (d / "adapter_config.json").read_bytes(),
                base,
                {k: nybble.quantize(v) for k, v in base.items()},
            )
        )
    return seeds


# --- cases ----------------------------------------------------------------------------------------


@dataclass
class AdapterCase:
    seed: AdapterSeed
    weights: bytes
    config: bytes
    quantized: bool
    description: str
    directory: Path = field(default=Path("."))


class Workdirs:
    """One directory per seed, rewritten only where a case's file differs from the last."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.written: dict[tuple[str, str], bytes] = {}

    def place(self, case: AdapterCase) -> Path:
        d = self.root / case.seed.name
        d.mkdir(exist_ok=True)
        for name, data in (
            ("adapter_model.safetensors", case.weights),
            ("adapter_config.json", case.config),
        ):
            if self.written.get((case.seed.name, name)) != data:
                # A new file renamed over the old one: truncating a file in place costs ms
                # on filesystems mounted with `discard`.
                (d / f"{name}.next").write_bytes(data)
                os.replace(d / f"{name}.next", d / name)
                self.written[(case.seed.name, name)] = data
        return d


def load(case: AdapterCase, dirs: Workdirs) -> LoraAdapter:
    d = dirs.place(case)
    case.directory = d
    return LoraAdapter.from_pretrained(
        d, case.seed.quantized_base if case.quantized else case.seed.base
    )


_DTYPE_CANDIDATES = [
    *NUMPY_OF_CODE,
    "F8_E4M3FNUZ",
    "F8_E8M0",
    "F4",
    "F31",
    "f32",
    "float32",
    "",
    None,
    4,
    ["F32"],
]


def _shape_candidates(shape: list[int], rng: np.random.Generator) -> list[Any]:
    n = math.prod(shape)
    return [
        [],
        [0],
        [n],
        shape[::-1],
        [*shape, 1],
        [1, *shape],
        [-1, *shape[1:]],
        [2**62, 2**62],
        [2**64],
        [2**63 - 1, 0],
        [float(shape[0]), *shape[1:]],
        [str(shape[0]), *shape[1:]],
        None,
        [shape],
        [n * 2] if n else [1],
        [int(rng.integers(0, 70)), int(rng.integers(0, 70))],
    ]


def _offset_candidates(begin: int, end: int, size: int, others: list[list[int]]) -> list[Any]:
    other = others[0] if others else [0, 0]
    return [
        [begin, end + 1],
        [begin - 1, end],
        [begin + 1, end + 1],
        [end, begin],
        [begin, begin],
        [0, end],
        other,
        [begin, size + 4],
        [begin, 2**64 - 1],
        [begin, 2**64],
        [-1, end],
        [begin, end, 0],
        [begin],
        [],
        [float(begin), float(end)],
        [str(begin), end],
        [2**63, 2**63 + end - begin],
        None,
        Raw(f"[{begin}, 1e999]"),
    ]


def _name_candidates(name: str, names: list[str]) -> list[str]:
    module = name[len(PREFIX) :].rsplit(".", 2)[0] if name.startswith(PREFIX) else name
    return [
        name[len(PREFIX) :],
        name.replace("lora_A", "lora_a"),
        name.replace("lora_A", "lora_B") if "lora_A" in name else name.replace("lora_B", "lora_A"),
        name.replace(".weight", ""),
        name + ".weight",
        name.replace("layers.0", "layers.9"),
        name.replace("self_attn", "mlp"),
        PREFIX + module + ".lora_C.weight",
        PREFIX + module + ".lora_magnitude_vector",
        PREFIX + ".lora_A.weight",
        "",
        "__metadata__",
        name.replace("q_proj", "q_proj\u0000"),
        name + "é",
        PREFIX + module + "..lora_A.weight",
        *names[:2],
    ]


def mutate_header(weights: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    header, body = split_safetensors(weights)
    names = [k for k in header if k != "__metadata__"]
    entry = pick(rng, names)
    info = header[entry]
    kind = pick(
        rng,
        [
            "offsets",
            "swap",
            "dtype",
            "shape",
            "rename",
            "remove",
            "add",
            "metadata",
            "entry",
            "length",
            "padding",
            "order",
        ],
    )
    length_delta = 0
    if kind == "offsets":
        begin, end = info["data_offsets"]
        others = [header[k]["data_offsets"] for k in names if k != entry]
        info["data_offsets"] = pick(rng, _offset_candidates(begin, end, len(body), others))
        what = f"{entry}: data_offsets = {json.dumps(info['data_offsets'], default=str)}"
    elif kind == "swap" and len(names) > 1:
        other = pick(rng, [k for k in names if k != entry])
        info["data_offsets"], header[other]["data_offsets"] = (
            header[other]["data_offsets"],
            info["data_offsets"],
        )
        what = f"data_offsets of {entry} and {other} swapped"
    elif kind == "dtype":
        info["dtype"] = pick(rng, _DTYPE_CANDIDATES)
        what = f"{entry}: dtype = {info['dtype']!r}"
    elif kind == "shape":
        info["shape"] = pick(rng, _shape_candidates(list(info["shape"]), rng))
        what = f"{entry}: shape = {info['shape']!r}"
    elif kind == "rename":
        new = pick(rng, _name_candidates(entry, names))
        header = {(new if k == entry else k): v for k, v in header.items()}
        what = f"{entry} renamed {new!r}"
    elif kind == "remove":
        del header[entry]
        what = f"{entry} removed from the header"
    elif kind == "add":
        new = pick(rng, _name_candidates(entry, names))
        end = info["data_offsets"][1]
        header[new] = pick(
            rng,
            [
                dict(info),
                {"dtype": "F32", "shape": [0], "data_offsets": [end, end]},
                {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]},
                {"dtype": "U8", "shape": [4], "data_offsets": [len(body), len(body) + 4]},
            ],
        )
        what = f"entry {new!r} added: {header[new]}"
    elif kind == "metadata":
        meta = header.get("__metadata__", {})
        header["__metadata__"], what = mutate_json(
            meta, rng, ("format", "nybble.adapter_config_sha256")
        )
        what = f"__metadata__: {what}"
    elif kind == "entry":
        header[entry], what = mutate_json(info, rng, ("dtype", "shape", "data_offsets"))
        what = f"{entry}: {what}"
    elif kind == "length":
        length_delta = int(pick(rng, [-8, -1, 1, 7, 8, 1 << 20, 1 << 40, -(1 << 20)]))
        what = f"header length off by {length_delta}"
    elif kind == "padding":
        text = json.dumps(header).encode() + pick(rng, [b" " * 8, b"\n", b"\x00" * 8, b" " * 3])
        return struct.pack("<Q", len(text)) + text + body, "header padded"
    else:
        items = list(header.items())
        rng.shuffle(items)  # type: ignore[arg-type]
        header = dict(items)
        what = "header entries reordered"
    if length_delta > 0 and length_delta >= 1 << 20:
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text) + length_delta) + text + body, what
    return join_safetensors(header, body, length_delta), what


def _tensors(weights: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    header, _ = split_safetensors(weights)
    arrays = {
        name: np.frombuffer(bytes(info["data"]), NUMPY_OF_CODE[info["dtype"]]).reshape(
            info["shape"]
        )
        for name, info in safetensors.deserialize(weights)
    }
    order = [k for k in header if k != "__metadata__"]
    return {k: arrays[k] for k in order}, dict(header.get("__metadata__") or {})


def reencode(weights: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """A valid file with other contents: dtypes, special values, shapes, names, metadata."""
    tensors, metadata = _tensors(weights)
    names = list(tensors)
    name = pick(rng, names)
    a = tensors[name]
    kind = pick(
        rng,
        [
            "dtype",
            "dtype",
            "special",
            "special",
            "shape",
            "drop",
            "add",
            "rename",
            "empty",
            "metadata",
            "big-endian",
        ],
    )
    if kind == "dtype":
        code = pick(rng, [*FLOAT_CODES, "I32", "U8", "BOOL", "C64", "F8_E4M3", "I64"])
        with np.errstate(all="ignore"):
            tensors[name] = a.astype(NUMPY_OF_CODE[code])
        what = f"{name} stored as {code}"
    elif kind == "special":
        b = a.astype(pick(rng, [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]))
        value = pick(
            rng,
            [
                np.nan,
                np.inf,
                -np.inf,
                0.0,
                -0.0,
                1e-45,
                1e-40,
                3.4e38,
                1e39,
                65504.0,
                1e300,
                -1e300,
            ],
        )
        if b.size:
            index = int(rng.integers(b.size))
            with np.errstate(all="ignore"):
                b.reshape(-1)[index] = value
            tensors[name] = b
            what = f"{name} ({b.dtype}) element {index} = {value}"
        else:
            what = "nothing (empty tensor)"
    elif kind == "shape":
        shape = pick(
            rng,
            [
                a.reshape(-1).shape,
                a.T.shape,
                (1, *a.shape),
                (*a.shape, 1),
                (0, a.shape[-1] if a.ndim else 0),
                (),
            ],
        )
        if math.prod(shape) == a.size:
            tensors[name] = (
                a.reshape(shape) if shape != a.T.shape or a.ndim != 2 else np.ascontiguousarray(a.T)
            )
        else:
            tensors[name] = np.zeros(shape, a.dtype)
        what = f"{name} reshaped {list(shape)}"
    elif kind == "drop":
        del tensors[name]
        what = f"{name} dropped"
    elif kind == "add":
        new = pick(rng, _name_candidates(name, names))
        tensors[new] = pick(
            rng, [a.copy(), np.zeros((0,), np.float32), np.ones((2, 3), np.float32)]
        )
        what = f"tensor {new!r} added"
    elif kind == "rename":
        new = pick(rng, _name_candidates(name, names))
        tensors = {(new if k == name else k): v for k, v in tensors.items()}
        what = f"{name} renamed {new!r}"
    elif kind == "empty":
        tensors = {}
        what = "no tensors"
    elif kind == "metadata":
        metadata = pick(
            rng,
            [
                {},
                {"format": "tf"},
                {"format": "pt", "nybble.adapter_config_sha256": "0" * 64},
                {"format": "pt"},
                dict(metadata, extra="x"),
            ],
        )
        what = f"metadata = {metadata}"
    else:
        tensors[name] = (
            a.astype(a.dtype.newbyteorder(">")).view(a.dtype) if a.dtype.itemsize > 1 else a
        )
        what = f"{name}'s bytes in big-endian order"
    return build_safetensors(tensors, metadata or None), what


def generate_weights_case(seeds: list[AdapterSeed], rng: np.random.Generator) -> AdapterCase:
    seed = pick(rng, seeds)
    roll = rng.random()
    if roll < 0.4:
        data, what = mutate_header(seed.weights, rng)
    elif roll < 0.65:
        data, what = reencode(seed.weights, rng)
    else:
        (n,) = struct.unpack("<Q", seed.weights[:8])
        region = (0, 8 + n) if rng.random() < 0.6 else None
        data, what = mutate_bytes(seed.weights, rng, region)
    quantized = bool(rng.random() < 0.2)
    return AdapterCase(
        seed,
        data,
        seed.config,
        quantized,
        f"{seed.name} weights: {what}{' (NF4 base)' if quantized else ''}",
    )


PEFT_FIELDS = (
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "use_rslora",
    "use_dora",
    "fan_in_fan_out",
    "init_lora_weights",
    "rank_pattern",
    "alpha_pattern",
    "peft_type",
    "bias",
    "modules_to_save",
    "layers_to_transform",
    "use_qalora",
    "lora_bias",
    "base_model_name_or_path",
)


def _field_values(rng: np.random.Generator, name: str) -> Any:
    if name in ("rank_pattern", "alpha_pattern"):
        key = pick(rng, REGEXES)
        value = pick(rng, [1, 2, 3, 4, 8, 0, -1, 1.5, 2**31, 1e308, True, None, "2", Raw("NaN")])
        return {key: value}
    if name == "target_modules":
        return pick(
            rng,
            [
                pick(rng, REGEXES),
                ["q_proj", pick(rng, ["", ".q_proj", "q_proj.", 1, None, "k_proj"])],
                [],
                "all-linear",
                "ALL-LINEAR",
            ],
        )
    if name in ("r", "lora_alpha"):
        return pick(
            rng,
            [
                1,
                2,
                3,
                4,
                8,
                16,
                0,
                -4,
                2**31,
                2**31 - 1,
                1.0,
                4.0,
                0.5,
                1e-30,
                1e308,
                3.5e38,
                True,
                "4",
                None,
                Raw("1e999"),
            ],
        )
    if name == "lora_dropout":
        return pick(rng, [0.0, 0.1, 0.99, 1.0, -0.1, 1, True, "0.1", Raw("NaN")])
    if name == "init_lora_weights":
        return pick(rng, [True, False, "gaussian", "pissa", "loftq", "olora", 1, None])
    if name == "peft_type":
        return pick(rng, ["LORA", "lora", "LOHA", "", None, 1])
    if name == "bias":
        return pick(rng, ["none", "all", "lora_only", None, False])
    return hostile_value(rng)


def generate_config_case(seeds: list[AdapterSeed], rng: np.random.Generator) -> AdapterCase:
    seed = pick(rng, seeds)
    # Weights without nybble's config digest let a changed config reach the layers; with it,
    # any change must be refused as a config that does not belong with the weights.
    weights = seed.plain_weights if rng.random() < 0.85 else seed.weights
    doc = json.loads(seed.config)
    what_parts = []
    for _ in range(int(rng.choice([1, 1, 1, 2, 3]))):
        doc, what = mutate_json(doc, rng, PEFT_FIELDS, _field_values)
        what_parts.append(what)
    text = dumps(doc).encode()
    if rng.random() < 0.2:
        text, what = mutate_json_text(text, rng)
        what_parts.append(what)
    digest = " (weights with the config digest)" if weights is seed.weights else ""
    quantized = bool(rng.random() < 0.2)
    return AdapterCase(
        seed, weights, text, quantized, f"{seed.name} config: {'; '.join(what_parts)}{digest}"
    )


# --- the reference --------------------------------------------------------------------------------


def peft_pattern(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern rule (peft.utils.other.get_pattern_key): the first key that
    matches the end of the module path, as a regular expression."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def verify(case: AdapterCase, adapter: LoraAdapter) -> str | None:
    try:
        entries = safetensors.deserialize(case.weights)
    except Exception as e:
        return f"accepted a weights file the safetensors library rejects ({e})"
    ok, raw = strict_json_or_none(case.config)
    if not ok:
        return "accepted an adapter_config.json that is not strict JSON"
    if not isinstance(raw, dict):
        return "accepted an adapter_config.json that is not an object"
    cfg = adapter.config
    expected = {k: raw.get(k) if raw.get(k) is not None else v for k, v in PEFT_DEFAULTS.items()}
    read = {
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "use_rslora": cfg.use_rslora,
        "use_dora": cfg.use_dora,
        "fan_in_fan_out": cfg.fan_in_fan_out,
    }
    if raw.get("r") != cfg.r or type(raw.get("r")) is not int:
        return f"a field read otherwise: r: PEFT reads {raw.get('r')!r}, nybble {cfg.r!r}"
    for key, value in read.items():
        want = expected[key]
        if key.startswith(("use_", "fan_")):
            same = type(want) is bool and type(value) is bool and want == value
        else:
            number = isinstance(want, (int, float)) and not isinstance(want, bool)
            same = number and math.isfinite(want) and want == value
        if not same:
            return f"a field read otherwise: {key}: PEFT reads {want!r}, nybble {value!r}"
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(expected[key], dict):
            return f"a field read otherwise: {key} is {expected[key]!r}, not an object"
    arrays: dict[str, np.ndarray] = {}
    for name, info in entries:
        dtype = NUMPY_OF_CODE.get(info["dtype"])
        if dtype is None:
            return f"accepted a tensor that is not float: {info['dtype']}"
        arrays[name] = np.frombuffer(bytes(info["data"]), dtype).reshape(info["shape"])
    used = set()
    for name, layer in adapter.layers.items():
        try:
            r = peft_pattern(expected["rank_pattern"], name, raw["r"])
            alpha = peft_pattern(expected["alpha_pattern"], name, expected["lora_alpha"])
        except (re.error, OverflowError, RecursionError):
            return "accepted a pattern that is not a regular expression"
        if layer.config.r != r:
            return f"a layer read otherwise: {name}: r {layer.config.r}, PEFT's {r}"
        scaling = alpha / math.sqrt(r) if expected["use_rslora"] else alpha / r
        if not math.isclose(layer.scaling, scaling, rel_tol=1e-12):
            return f"a layer read otherwise: {name}: scaling {layer.scaling}, PEFT's {scaling}"
        for suffix, attr in zip(SUFFIXES, ("lora_a", "lora_b", "lora_magnitude"), strict=True):
            key = f"{PREFIX}{name}.{suffix}"
            if attr == "lora_magnitude" and not expected["use_dora"]:
                used.add(key)
                continue
            if key not in arrays:
                return f"a layer read otherwise: {name}: {attr} is not in the file"
            used.add(key)
            with np.errstate(all="ignore"):
                want_array = arrays[key].astype(np.float32)
            got = np.asarray(getattr(layer, attr))
            if got.shape != want_array.shape or not np.array_equal(got, want_array):
                return f"a tensor differs from the file's: {name} {attr}"
    if set(arrays) - used:
        return f"tensors loaded by no layer: {sorted(set(arrays) - used)[:3]}"
    return None


def known(case: AdapterCase, error: BaseException | None) -> str | None:
    """The known bugs (each with a strict xfail test below): none at present."""
    return None


def _huge(value: Any) -> bool:
    number = isinstance(value, int) and not isinstance(value, bool)
    return number and abs(value) > sys.float_info.max


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> list[AdapterSeed]:
    return _seeds(tmp_path_factory.mktemp("adapter-seeds"))


def test_the_seeds_load_and_pass_the_reference(seeds: list[AdapterSeed], tmp_path: Path) -> None:
    dirs = Workdirs(tmp_path)
    for seed in seeds:
        for weights in (seed.weights, seed.plain_weights):
            for quantized in (False, True):
                case = AdapterCase(seed, weights, seed.config, quantized, seed.name)
                assert verify(case, load(case, dirs)) is None, seed.name


def _suites(seeds: list[AdapterSeed], dirs: Workdirs) -> list[Suite[AdapterCase]]:
    common: dict[str, Any] = dict(
        attempt=lambda c: load(c, dirs), verify=verify, allowed=ADAPTER_ERRORS, known=known
    )
    return [
        Suite("adapter-weights", lambda rng: generate_weights_case(seeds, rng), **common),
        Suite("adapter-config", lambda rng: generate_config_case(seeds, rng), **common),
    ]


def test_the_generators_make_cases_from_any_seed(seeds: list[AdapterSeed]) -> None:
    check_generator("adapter-weights", lambda rng: generate_weights_case(seeds, rng), 2000)
    check_generator("adapter-config", lambda rng: generate_config_case(seeds, rng), 2000)


def test_fuzz_adapter_directories(seeds: list[AdapterSeed], tmp_path: Path) -> None:
    with scratch_directory(tmp_path) as scratch:
        weights, config = _suites(seeds, Workdirs(scratch))
        tallies = [run_suite(weights, cases_for(0.3)), run_suite(config, cases_for(0.2))]
    check(tallies)


# --- bugs the suite found, fixed since: each stays a test ------------------------------------


def _with_config(tmp_path: Path, **changes: Any) -> Path:
    """The "patterns" seed saved, its config changed (fields set, or removed when None), the
    weights without the config digest (as PEFT writes them)."""
    adapter = _small_adapter("patterns")
    adapter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    weights = (tmp_path / "adapter_model.safetensors").read_bytes()
    (tmp_path / "adapter_model.safetensors").write_bytes(_plain(weights))
    return tmp_path


def _base() -> dict[str, Any]:
    adapter = _small_adapter("patterns")
    return {f"{n}.weight": layer.weight for n, layer in adapter.layers.items()}


def test_absent_lora_alpha_takes_peft_default(tmp_path: Path) -> None:
    assert LoraConfig.from_peft(_with_config(tmp_path, lora_alpha=None)).alpha == 8


def test_a_pattern_with_global_flags_is_a_format_error(tmp_path: Path) -> None:
    directory = _with_config(tmp_path, alpha_pattern={"(?i)Q_PROJ": 2})
    with pytest.raises(FormatError) as e:
        LoraAdapter.from_pretrained(directory, _base())
    assert e.value.field == "alpha_pattern"


@pytest.mark.parametrize("field_name", ["r", "use_dora", "init_lora_weights", "lora_dropout"])
def test_a_huge_integer_in_a_field_is_a_format_error(tmp_path: Path, field_name: str) -> None:
    path = _with_config(tmp_path, **{field_name: "HUGE"}) / "adapter_config.json"
    path.write_text(path.read_text().replace('"HUGE"', "1" + "0" * 400))
    with pytest.raises(FormatError) as e:
        LoraConfig.from_peft(path)
    assert e.value.field == field_name


def test_an_alpha_pattern_value_is_checked_with_the_file(tmp_path: Path) -> None:
    directory = _with_config(tmp_path, alpha_pattern={"q_proj": 1e308})
    with pytest.raises(FormatError) as e:
        LoraAdapter.from_pretrained(directory, _base())
    assert e.value.field == "alpha_pattern"


def test_a_refused_config_names_the_file(tmp_path: Path) -> None:
    """The FormatError of a bad config names adapter_config.json (the classifier checks that
    a source is there; this checks it is the right one)."""
    adapter = _small_adapter("lora")
    adapter.save_pretrained(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"r": NaN}')
    with pytest.raises(FormatError) as e:
        LoraAdapter.from_pretrained(tmp_path, {})
    assert e.value.source == str(tmp_path / "adapter_config.json")
