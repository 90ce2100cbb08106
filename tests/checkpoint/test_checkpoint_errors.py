"""Malformed inputs to the checkpoint tools: each is a FormatError naming the file and the
tensor or field, before any output appears (no OUT, no staging directory left)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from nybble.checkpoint import (
    dequantize_checkpoint,
    inspect_checkpoint,
    merge_adapter,
    quantize_checkpoint,
)
from nybble.errors import FormatError
from tests.checkpoint.test_checkpoint_fixtures import make_checkpoint, write_adapter

Q = "model.layers.0.self_attn.q_proj.weight"


def _refused(call: Callable[[], Any], tmp_path: Path) -> FormatError:
    with pytest.raises(FormatError) as e:
        call()
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    return e.value


def _rewrite_header(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


@pytest.fixture
def dense(tmp_path: Path) -> Path:
    make_checkpoint(tmp_path / "dense", "llama", shards=2)
    return tmp_path / "dense"


def _shard_of(directory: Path, name: str) -> Path:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][name]


def test_corrupt_and_truncated_headers(dense: Path, tmp_path: Path) -> None:
    shard = _shard_of(dense, Q)
    good = shard.read_bytes()
    for bad in (
        b"\xff" * 16 + good[16:],
        good[:20],
        good[:-1],
        struct.pack("<Q", 2**40) + good[8:],
    ):
        shard.write_bytes(bad)
        e = _refused(lambda: quantize_checkpoint(dense, tmp_path / "out"), tmp_path)
        assert e.source == str(shard)
    shard.write_bytes(good)


def test_lying_offsets_and_mismatched_shapes(dense: Path, tmp_path: Path) -> None:
    shard = _shard_of(dense, Q)
    good = shard.read_bytes()

    def shift(h: dict[str, Any]) -> None:
        h[Q]["data_offsets"][1] += 2

    def shape(h: dict[str, Any]) -> None:
        h[Q]["shape"] = [h[Q]["shape"][0] + 1, h[Q]["shape"][1]]

    for change in (shift, shape):
        shard.write_bytes(good)
        _rewrite_header(shard, change)
        e = _refused(lambda: quantize_checkpoint(dense, tmp_path / "out"), tmp_path)
        assert e.source == str(shard)


def test_missing_shard_and_index_problems(dense: Path, tmp_path: Path) -> None:
    index_path = dense / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = _shard_of(dense, Q)
    moved = shard.with_name("elsewhere.bin")
    shard.rename(moved)
    e = _refused(lambda: quantize_checkpoint(dense, tmp_path / "out"), tmp_path)
    assert e.source == str(index_path) and shard.name in e.problem
    moved.rename(shard)
    for weight_map, field in (
        ({**index["weight_map"], "extra.weight": index["weight_map"][Q]}, "extra.weight"),
        ({**index["weight_map"], Q: "../model.safetensors"}, Q),
        ({k: v for k, v in index["weight_map"].items() if k != Q}, Q),
        ("not a map", "weight_map"),
    ):
        index_path.write_text(json.dumps({**index, "weight_map": weight_map}))
        e = _refused(lambda: dequantize_checkpoint(dense, tmp_path / "out"), tmp_path)
        assert e.field == field
    index_path.write_text("{not json")
    assert _refused(lambda: inspect_checkpoint(dense), tmp_path).source == str(index_path)
    index_path.unlink()
    e = _refused(lambda: quantize_checkpoint(dense, tmp_path / "out"), tmp_path)
    assert e.source == str(dense) and "several" in e.problem
    assert _refused(lambda: quantize_checkpoint(tmp_path / "none", tmp_path / "out"), tmp_path)


def test_bad_config(dense: Path, tmp_path: Path) -> None:
    config = dense / "config.json"
    original = json.loads(config.read_text())
    config.write_text("[1, 2]")
    assert _refused(lambda: quantize_checkpoint(dense, tmp_path / "out"), tmp_path).source == str(
        config
    )
    config.write_text(json.dumps({**original, "quantization_config": {"quant_method": "fp8"}}))
    e = _refused(lambda: quantize_checkpoint(dense, tmp_path / "out"), tmp_path)
    assert e.field == "quantization_config"


def _quantized(tmp_path: Path, layout: str) -> Path:
    make_checkpoint(tmp_path / "dense", "llama")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q", layout=layout, double_quant=True)  # type: ignore[arg-type]
    return tmp_path / "q"


@pytest.mark.parametrize("layout", ["nybble", "bnb"])
def test_quantized_weights_with_wrong_dtypes_shapes_or_states(tmp_path: Path, layout: str) -> None:
    q = _quantized(tmp_path, layout)
    path = q / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    state_key = next(k for k in tensors if k.startswith(Q + ".quant_state"))
    codes_key = Q + ".codes" if layout == "nybble" else Q
    state = json.loads(tensors[state_key].tobytes())

    def blob(obj: Any) -> np.ndarray:
        return np.frombuffer(json.dumps(obj).encode(), np.uint8).copy()

    cases = {
        "codes as float32": {codes_key: tensors[codes_key].astype(np.float32)},
        "codes too short": {codes_key: tensors[codes_key][:-1]},
        "absmax as float16": {Q + ".absmax": tensors[Q + ".absmax"].astype(np.float16)},
        "shape that does not fit": {state_key: blob({**state, "shape": [3, 3]})},
        "blocksize not a power of two": {state_key: blob({**state, "blocksize": 48})},
        "state not JSON": {state_key: np.frombuffer(b"{oops", np.uint8).copy()},
        "dtype unknown": {state_key: blob({**state, "dtype": "int3"})},
    }
    for case, change in cases.items():
        safetensors.numpy.save_file({**tensors, **change}, str(path), {"format": "pt"})
        for call in (
            lambda: dequantize_checkpoint(q, tmp_path / "out"),
            lambda: quantize_checkpoint(q, tmp_path / "out", layout="bnb"),
        ):
            e = _refused(call, tmp_path)
            assert e.source == str(path), case
            assert e.field is not None and e.field.startswith(Q), case


def test_non_finite_weights_are_named(tmp_path: Path) -> None:
    _, tensors = make_checkpoint(tmp_path / "dense", "llama")
    tensors[Q] = tensors[Q].copy()
    tensors[Q][3, 5] = np.inf
    safetensors.numpy.save_file(tensors, str(tmp_path / "dense" / "model.safetensors"))
    e = _refused(lambda: quantize_checkpoint(tmp_path / "dense", tmp_path / "out"), tmp_path)
    assert e.field == Q and str(3 * tensors[Q].shape[1] + 5) in e.problem


def test_adapter_problems(tmp_path: Path) -> None:
    _, tensors = make_checkpoint(tmp_path / "dense", "llama")
    adapter = tmp_path / "ad"
    lora = write_adapter(adapter, tensors)
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in lora.items()}
    safetensors.numpy.save_file(renamed, str(adapter / "adapter_model.safetensors"))
    e = _refused(lambda: merge_adapter(tmp_path / "dense", adapter, tmp_path / "out"), tmp_path)
    assert e.source == str(adapter / "adapter_model.safetensors")
    assert e.field is not None and "layers.7" in e.field and "model.layers.7" in e.problem
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    for bad in (np.ones((3, 4), np.float32), np.full(lora[key].shape, np.nan, np.float32)):
        safetensors.numpy.save_file({**lora, key: bad}, str(adapter / "adapter_model.safetensors"))
        e = _refused(lambda: merge_adapter(tmp_path / "dense", adapter, tmp_path / "out"), tmp_path)
        assert e.field == key
    safetensors.numpy.save_file(lora, str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": "8"}))
    e = _refused(lambda: merge_adapter(tmp_path / "dense", adapter, tmp_path / "out"), tmp_path)
    assert e.field == "r"
    (adapter / "adapter_config.json").unlink()
    e = _refused(lambda: merge_adapter(tmp_path / "dense", adapter, tmp_path / "out"), tmp_path)
    assert e.source == str(adapter / "adapter_config.json")


def test_8bit_bitsandbytes_and_other_dtypes(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "dense", "llama")
    path = tmp_path / "dense" / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    safetensors.numpy.save_file({**tensors, Q + ".SCB": np.ones(64, np.float32)}, str(path))
    e = _refused(lambda: dequantize_checkpoint(tmp_path / "dense", tmp_path / "out"), tmp_path)
    assert e.field == Q + ".SCB"
    # weights of a dtype nybble does not quantize are carried over as they are
    fp8 = {k: v.astype(np.float32).astype(ml_dtypes.float8_e4m3fn) for k, v in tensors.items()}
    from nybble import safetensors_io

    safetensors_io.save(fp8, path)
    r = quantize_checkpoint(tmp_path / "dense", tmp_path / "out")
    assert r.count("quantized") == 0 and r.count("copied") == len(fp8)
