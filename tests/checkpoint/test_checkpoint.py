"""The checkpoint tools' library functions: quantize -> dequantize round trips on real
architectures' names and shapes, nybble <-> bitsandbytes layouts lossless, transformers'
sharding and index, targets, configs, copied files, overwriting, stale staging directories,
progress, and memory bounded by the largest tensor (docs/checkpoints.md)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors

import nybble
from nybble import bnb
from nybble.checkpoint import (
    Checkpoint,
    ProgressBar,
    _pipeline,
    dequantize_checkpoint,
    find_groups,
    load_group,
    quantize_checkpoint,
)
from nybble.checkpoint._output import DEFAULT_MAX_SHARD_SIZE, remove_stale
from nybble.errors import FormatError
from tests.checkpoint.test_checkpoint_fixtures import (
    make_checkpoint,
    make_config,
    random_weights,
    write_checkpoint,
)

F32 = np.float32


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, read with the safetensors library (bytes and dtype)."""
    out = {}
    files = [p for p in directory.glob("*.safetensors")]
    for f in files:
        for name, v in safetensors.deserialize(f.read_bytes()):
            out[name] = (v["dtype"], tuple(v["shape"]), bytes(v["data"]))
    return out  # type: ignore[return-value]


def _dense(directory: Path) -> dict[str, np.ndarray]:
    with Checkpoint(directory) as ckpt:
        return {n: ckpt.read(n) for n in ckpt.names()}


def _is_target(name: str) -> bool:
    return ".layers." in name and name.endswith("_proj.weight")


@pytest.mark.parametrize(
    ("arch", "codebook", "double_quant", "blocksize"),
    [
        ("llama", "nf4", False, 64),
        ("qwen2", "nf4", True, 64),
        ("qwen3", "fp4", False, 128),
        ("mistral", "int8", True, 32),
    ],
)
def test_quantize_then_dequantize_round_trip(
    tmp_path: Path, arch: str, codebook: str, double_quant: bool, blocksize: int
) -> None:
    _, tensors = make_checkpoint(tmp_path / "dense", arch, shards=2)
    report = quantize_checkpoint(
        tmp_path / "dense",
        tmp_path / "q",
        codebook=codebook,  # type: ignore[arg-type]
        blocksize=blocksize,
        double_quant=double_quant,
    )
    targets = [n for n in tensors if _is_target(n)]
    assert sorted(report.weights["quantized"]) == sorted(targets)
    assert len(report.weights["copied"]) == len(tensors) - len(targets)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "nybble",
        "format": "nybble/1",
        "codebook": codebook,
        "blocksize": blocksize,
        "double_quant": double_quant,
    }
    back = dequantize_checkpoint(tmp_path / "q", tmp_path / "back", dtype="float32")
    assert sorted(back.weights["dequantized"]) == sorted(targets)
    dense = _dense(tmp_path / "back")
    assert set(dense) == set(tensors)
    for name, w in tensors.items():
        if name not in targets:
            assert dense[name].dtype == w.dtype and dense[name].tobytes() == w.tobytes()
            continue
        q = nybble.quantize(w, blocksize, double_quant, codebook)
        assert dense[name].dtype == F32 and dense[name].shape == w.shape
        assert dense[name].tobytes() == q.dequantize("float32").tobytes()
        if codebook == "nf4":  # C-NF4-001, per element relative to its block's absmax
            x = w.astype(F32).reshape(-1)
            err = np.abs(dense[name].reshape(-1) - x)
            pad = -x.size % blocksize
            absmax = np.repeat(np.pad(np.abs(x), (0, pad)).reshape(-1, blocksize).max(1), blocksize)
            assert float((err / absmax[: x.size]).max()) < (0.17 if double_quant else 0.16)
    config_back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config_back
    assert config_back == json.loads((tmp_path / "dense" / "config.json").read_text())
    for extra in ("tokenizer.json", "generation_config.json", "README.md"):
        assert (tmp_path / "back" / extra).read_bytes() == (tmp_path / "dense" / extra).read_bytes()
    # the default dtype is the one each weight was quantized from
    dequantize_checkpoint(tmp_path / "q", tmp_path / "back16")
    assert {a.dtype for a in _dense(tmp_path / "back16").values()} == {np.dtype(ml_dtypes.bfloat16)}


def test_bnb_layout_is_export_state_and_lossless_with_nybbles(tmp_path: Path) -> None:
    _, tensors = make_checkpoint(tmp_path / "dense", "llama")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "nyb", double_quant=True)
    quantize_checkpoint(tmp_path / "dense", tmp_path / "bnb", layout="bnb", double_quant=True)
    stored = _tensors(tmp_path / "bnb")
    for name, w in tensors.items():
        if not _is_target(name):
            continue
        expected = bnb.export_state(nybble.quantize(w, 64, True), prefix=name)
        for key, a in expected.items():
            _, shape, data = stored[key]  # type: ignore[misc]
            assert shape == a.shape and data == a.tobytes(), key
    # the two layouts hold the same quantized tensors, bit for bit
    with Checkpoint(tmp_path / "nyb") as a, Checkpoint(tmp_path / "bnb") as b:
        ga, gb = find_groups(a.names(), a.path), find_groups(b.names(), b.path)
        assert set(ga) == set(gb) == {n for n in tensors if _is_target(n)}
        for prefix in ga:
            qa = load_group(ga[prefix], a.read, a.file_of)
            qb = load_group(gb[prefix], b.read, b.file_of)
            assert qa.codes.tobytes() == qb.codes.tobytes()
            assert qa.nested is not None and qb.nested is not None
            assert qa.nested.codes.tobytes() == qb.nested.codes.tobytes()
            assert qa.nested.absmax2.tobytes() == qb.nested.absmax2.tobytes()
            assert np.float32(qa.nested.offset) == np.float32(qb.nested.offset)
            assert qa.orig_dtype == qb.orig_dtype == "bfloat16" and qa.shape == qb.shape
    # converting either way carries the tensors over unchanged
    r1 = quantize_checkpoint(tmp_path / "nyb", tmp_path / "nyb2bnb", layout="bnb")
    r2 = quantize_checkpoint(tmp_path / "bnb", tmp_path / "bnb2nyb", layout="nybble")
    assert r1.count("converted") == r2.count("converted") == 14 and r1.count("quantized") == 0
    assert _tensors(tmp_path / "nyb2bnb") == stored
    assert _tensors(tmp_path / "bnb2nyb") == _tensors(tmp_path / "nyb")
    d1 = dequantize_checkpoint(tmp_path / "nyb", tmp_path / "d1")
    d2 = dequantize_checkpoint(tmp_path / "bnb", tmp_path / "d2")
    assert d1.count("dequantized") == d2.count("dequantized") == 14
    assert _tensors(tmp_path / "d1") == _tensors(tmp_path / "d2")


def test_bnb_config_lists_the_dense_modules_for_transformers(tmp_path: Path) -> None:
    config = make_config("qwen3")
    tensors = random_weights(config)
    # an MoE-style router `mlp.gate` beside `mlp.gate_proj`: a prefix of a quantized module
    tensors["model.layers.0.mlp.gate.weight"] = np.ones((4, 64), ml_dtypes.bfloat16)
    write_checkpoint(tmp_path / "dense", config, tensors)
    quantize_checkpoint(
        tmp_path / "dense",
        tmp_path / "bnb",
        layout="bnb",
        targets=["*_proj"],
        codebook="fp4",
        compute_dtype="f16",
    )
    qc = json.loads((tmp_path / "bnb" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes" and qc["load_in_4bit"] is True
    assert qc["bnb_4bit_quant_type"] == "fp4" and qc["bnb_4bit_compute_dtype"] == "float16"
    assert qc["bnb_4bit_use_double_quant"] is False
    skip = qc["llm_int8_skip_modules"]
    assert "model.embed_tokens" in skip and "lm_head" in skip
    assert r"model\.layers\.0\.mlp\.gate$" in skip  # anchored: must not catch gate_proj
    import re

    for module in [n.removesuffix(".weight") for n in tensors if n.endswith("_proj.weight")]:
        for entry in skip:
            assert not (re.match(entry + r"\.", module) or re.match(entry, module))
            assert not module.endswith(entry)


def test_shards_and_index_follow_transformers(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "dense", "mistral", intermediate=256)
    limit = 20_000
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q", max_shard_size=limit, layout="bnb")
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "q").glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    stored = _tensors(tmp_path / "q")
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in stored.values())  # type: ignore[index]
    for file in files:
        names = [k for k, f in index["weight_map"].items() if f == file]
        size = sum(len(stored[k][2]) for k in names)  # type: ignore[index]
        assert size <= limit or len(names) == 1
        with safetensors.safe_open(str(tmp_path / "q" / file), "numpy") as f:
            assert set(f.keys()) == set(names) and f.metadata() == {"format": "pt"}
    # under the default 5 GB limit: one model.safetensors, no index
    assert DEFAULT_MAX_SHARD_SIZE == 5 * 10**9
    quantize_checkpoint(tmp_path / "q", tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").glob("*.safetensors*")) == [
        "model.safetensors"
    ]


def test_shard_plan_is_huggingface_hubs_rule() -> None:
    from nybble.checkpoint._output import shard_plan
    from nybble.safetensors_io import Entry

    sizes = [3, 4, 12, 2, 5, 5, 1]
    entries = [Entry(f"t{i}", "U8", (s,)) for i, s in enumerate(sizes)]
    plan = [[e.name for e in shard] for shard in shard_plan(entries, 10)]
    # t2 (12 > 10) alone, listed before the shard being filled (3+4+2); then 5+5, 1
    assert plan == [["t2"], ["t0", "t1", "t3"], ["t4", "t5"], ["t6"]]


def test_targets(tmp_path: Path) -> None:
    _, tensors = make_checkpoint(tmp_path / "dense", "qwen2")
    r = quantize_checkpoint(tmp_path / "dense", tmp_path / "a", targets=["q_proj", "mlp.down_proj"])
    assert sorted(r.weights["quantized"]) == sorted(
        n for n in tensors if n.endswith(("q_proj.weight", "down_proj.weight"))
    )
    r = quantize_checkpoint(tmp_path / "dense", tmp_path / "b", targets=["model.layers.1.*"])
    assert r.weights["quantized"] and all(".layers.1." in n for n in r.weights["quantized"])
    # biases and norms never qualify; embeddings only when named
    r = quantize_checkpoint(tmp_path / "dense", tmp_path / "c", targets=["embed_tokens"])
    assert r.weights["quantized"] == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="nothing_here"):
        quantize_checkpoint(tmp_path / "dense", tmp_path / "d", targets=["nothing_here"])
    with pytest.raises(ValueError):
        quantize_checkpoint(
            tmp_path / "dense", tmp_path / "d", targets=["q_proj"], layout="nybble", codebook="nf5"
        )  # type: ignore[arg-type]
    make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="lm_head"):
        quantize_checkpoint(tmp_path / "llama", tmp_path / "e", layout="bnb", targets=["lm_head"])
    with pytest.raises(ValueError, match="int8"):
        quantize_checkpoint(tmp_path / "llama", tmp_path / "e", layout="bnb", codebook="int8")
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()


def test_a_lone_safetensors_file_and_a_checkpoint_without_config(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "dense", "llama")
    r = quantize_checkpoint(tmp_path / "dense" / "model.safetensors", tmp_path / "q")
    assert sorted(os.listdir(tmp_path / "q")) == ["model.safetensors"]  # no config, no extras
    assert r.count("quantized") == 14
    with pytest.raises(FormatError) as e:
        quantize_checkpoint(tmp_path / "dense" / "model.safetensors", tmp_path / "b", layout="bnb")
    assert e.value.source.endswith("config.json")


def test_existing_output_and_overwrite(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "dense", "llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("old")
    with pytest.raises(FormatError) as e:
        quantize_checkpoint(tmp_path / "dense", tmp_path / "out")
    assert e.value.source == str(tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    quantize_checkpoint(tmp_path / "dense", tmp_path / "out", overwrite=True)
    assert "keep.txt" not in os.listdir(tmp_path / "out")
    assert "model.safetensors" in os.listdir(tmp_path / "out")
    (tmp_path / "file").write_text("x")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "file", overwrite=True)
    assert (tmp_path / "file").is_dir()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # never in place: replacing the input would delete it (test_checkpoint_traps.py, beside this)
    before = _tensors(tmp_path / "out")
    with pytest.raises(ValueError, match="is the input"):
        quantize_checkpoint(tmp_path / "out", tmp_path / "out", overwrite=True, layout="bnb")
    assert _tensors(tmp_path / "out") == before


def test_stale_staging_directories_of_dead_runs_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    stale = tmp_path / f".out.{pid}.abc123.tmp"
    (stale / "inner").mkdir(parents=True)
    live = tmp_path / f".out.{os.getpid()}.def456.tmp"
    live.mkdir()
    other = tmp_path / f".other.{pid}.x1.tmp"
    other.mkdir()
    remove_stale(tmp_path, "out")
    assert not stale.exists() and live.exists() and other.exists()


def test_progress_bar_only_on_a_terminal(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "dense", "llama")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    quantize_checkpoint(tmp_path / "dense", tmp_path / "a", progress=ProgressBar("quantize", tty))
    quantize_checkpoint(tmp_path / "dense", tmp_path / "b", progress=ProgressBar("quantize", pipe))
    assert "100%" in tty.getvalue() and tty.getvalue().endswith("\n")
    assert pipe.getvalue() == ""


def test_memory_follows_the_largest_tensor_not_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 weights of 2 MB each: with the in-flight budget at its floor, the Python-visible
    peak stays within a few tasks' worth, far below the 32 MB checkpoint."""
    rng = np.random.default_rng(0)
    tensors = {
        f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((512, 1024)).astype(F32)
        for i in range(16)
    }
    write_checkpoint(tmp_path / "dense", make_config("llama"), tensors, extra_files=False)
    monkeypatch.setattr(_pipeline, "MIN_BUDGET", 0)
    largest = 512 * 1024 * 4
    tracemalloc.start()
    try:
        quantize_checkpoint(tmp_path / "dense", tmp_path / "q")
        dequantize_checkpoint(tmp_path / "q", tmp_path / "d", dtype="float32")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * largest, peak
    assert sum(t.nbytes for t in tensors.values()) == 16 * largest


def test_reading_checks_every_index_entry(tmp_path: Path) -> None:
    _, tensors = make_checkpoint(tmp_path / "dense", "llama", shards=3)
    with Checkpoint(tmp_path / "dense") as ckpt:
        assert set(ckpt.names()) == set(tensors)
        assert ckpt.nbytes == sum(t.nbytes for t in tensors.values())
        assert sorted(f.name for f in ckpt.extra_files()[0]) == [
            "README.md",
            "generation_config.json",
            "tokenizer.json",
        ]
        first = ckpt.names()[0]
        assert ckpt.read(first).tobytes() == tensors[first].tobytes()
        with pytest.raises(KeyError):
            ckpt.read("nope")
