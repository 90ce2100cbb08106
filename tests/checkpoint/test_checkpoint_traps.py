"""The checkpoint tools' traps (issue 39): an output that would replace or delete an input is
refused before anything is touched; the files copied beside the weights keep their mode and
never come from outside the input (links) nor from special files; errors a user can act on
(dtypes nybble does not read, shapes numpy cannot hold, sizes, a name held twice);
`inspect --summary` shows the error figures it computed; dequantizing a dense checkpoint says
there is nothing to do."""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nybble import safetensors_io
from nybble.checkpoint import (
    dequantize_checkpoint,
    inspect_checkpoint,
    merge_adapter,
    parse_size,
    quantize_checkpoint,
)
from nybble.cli import main
from nybble.errors import FormatError
from tests.checkpoint.test_checkpoint_fixtures import (
    make_checkpoint,
    make_config,
    random_weights,
    write_adapter,
    write_checkpoint,
)


def _tree(root: Path) -> dict[str, Any]:
    """Every entry under `root` (links not followed): its kind, mode and content."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if p.is_symlink():
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[str(p.relative_to(root))] = ("file", st.st_mode, p.read_bytes())
            else:
                out[str(p.relative_to(root))] = ("other", st.st_mode)
    return out


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- 1. an output must be apart from every input ----------------------------------------------


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """PAR/model (dense), PAR/q (4-bit), PAR/adapter, and links to them beside PAR."""
    par = tmp_path / "PAR"
    _, tensors = make_checkpoint(par / "model", "llama")
    quantize_checkpoint(par / "model", par / "q")
    write_adapter(par / "adapter", tensors)
    (tmp_path / "link-to-par").symlink_to(par)
    (tmp_path / "link-to-model").symlink_to(par / "model")
    return tmp_path


#: Each tool, as called with (root, the input's name under PAR, target).
TOOLS: dict[str, Callable[[Path, str, Path, bool], Any]] = {
    "quantize": lambda root, i, t, force: quantize_checkpoint(root / "PAR" / i, t, overwrite=force),
    "dequantize": lambda root, i, t, force: dequantize_checkpoint(
        root / "PAR" / i, t, overwrite=force
    ),
    "merge (base)": lambda root, i, t, force: merge_adapter(
        root / "PAR" / i, root / "PAR" / "adapter", t, overwrite=force
    ),
    "merge (adapter)": lambda root, i, t, force: merge_adapter(
        root / "PAR" / "model", root / "PAR" / i, t, overwrite=force
    ),
}
INPUT_OF = {
    "quantize": "model",
    "dequantize": "q",
    "merge (base)": "q",
    "merge (adapter)": "adapter",
}


def _targets(root: Path, name: str) -> dict[str, tuple[Path, str]]:
    """Outputs that are, hold or lie inside PAR/<name>, spelled in several ways."""
    par = root / "PAR"
    return {
        "the parent": (par, "contains"),
        "the grandparent": (root, "contains"),
        "the input itself": (par / name, "is"),
        "the input, spelled with ..": (par / "q" / ".." / name, "is"),
        "the parent through a link": (root / "link-to-par", "contains"),
        "the input through a link": (root / "link-to-par" / name, "is"),
        "inside the input": (par / name / "out", "lies inside"),
        "deep inside the input": (par / name / "a" / "b", "lies inside"),
        "inside the input through a link": (root / "link-to-par" / name / "out", "lies inside"),
    }


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("force", [False, True])
def test_an_output_that_is_holds_or_lies_inside_an_input_is_refused(
    inputs: Path, tool: str, force: bool
) -> None:
    name = INPUT_OF[tool]
    before = _tree(inputs)
    for what, (target, how) in _targets(inputs, name).items():
        with pytest.raises(ValueError, match="target") as e:
            TOOLS[tool](inputs, name, target, force)
        assert not isinstance(e.value, FormatError), what
        message = str(e.value)
        assert f" {how} the " in message and "apart from" in message, (what, message)
        assert _tree(inputs) == before, f"{tool} to {what} changed the inputs"


def test_a_lone_file_input_and_outputs_beside_it(inputs: Path) -> None:
    shard = inputs / "PAR" / "model" / "model.safetensors"
    before = _tree(inputs)
    for target in (shard, shard.parent, inputs / "PAR", inputs / "link-to-model"):
        with pytest.raises(ValueError, match="apart from the input"):
            quantize_checkpoint(shard, target, overwrite=True)
    assert _tree(inputs) == before
    # Beside the input is fine, and so is a name that merely starts like it.
    quantize_checkpoint(shard, shard.parent / "beside")
    quantize_checkpoint(inputs / "PAR" / "model", inputs / "PAR" / "model-q")
    quantize_checkpoint(inputs / "PAR" / "model", inputs / "PAR" / "mod")
    dequantize_checkpoint(inputs / "PAR" / "q", inputs / "PAR" / "q2")
    merge_adapter(inputs / "PAR" / "model", inputs / "PAR" / "adapter", inputs / "PAR" / "ad")


def test_the_command_line_refuses_such_outputs_in_one_line(
    inputs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    par = str(inputs / "PAR")
    before = _tree(inputs)
    cases = [
        ("quantize", f"{par}/model", par, "--force"),
        ("quantize", f"{par}/model", f"{par}/model", "--force"),
        ("dequantize", f"{par}/q", f"{par}/q/x"),
        ("merge", f"{par}/model", f"{par}/adapter", par, "--force"),
        ("merge", f"{par}/model", f"{par}/adapter", f"{par}/adapter", "--force"),
    ]
    for argv in cases:
        code, out, err = _run(capsys, *argv)
        assert code == 1 and out == "", argv
        assert err.count("\n") == 1 and err.startswith(f"nybble {argv[0]}: error: target "), err
    assert _tree(inputs) == before


# --- 2. the files copied beside the weights ---------------------------------------------------


def _with_odd_files(directory: Path, outside: Path) -> None:
    """Files of every kind beside a checkpoint's weights."""
    (directory / "secret.json").write_text('{"token": "x"}')
    (directory / "secret.json").chmod(0o600)
    (directory / "group.txt").write_text("g")
    (directory / "group.txt").chmod(0o640)
    (directory / "script.sh").write_text("#!/bin/sh\n")
    (directory / "script.sh").chmod(0o755)
    outside.write_text("private")
    outside.chmod(0o600)
    (directory / "shadow.txt").symlink_to(outside)
    (directory / "absolute.txt").symlink_to("/etc/passwd")
    (directory / "up.txt").symlink_to("../" + outside.name)
    (directory / "inside-link.json").symlink_to("secret.json")
    (directory / "broken.txt").symlink_to("nowhere")
    (directory / "subdir").mkdir()
    (directory / "subdir" / "inner.txt").write_text("i")
    os.mkfifo(directory / "fifo")


#: What the output holds beside its weights, and the notes on what was left out.
COPIED = {
    "README.md",
    "generation_config.json",
    "tokenizer.json",
    "secret.json",
    "group.txt",
    "script.sh",
    "inside-link.json",
}
LEFT_OUT = {"shadow.txt", "absolute.txt", "up.txt", "broken.txt", "subdir", "fifo", "socket"}


@pytest.fixture
def odd(tmp_path: Path) -> Path:
    _, tensors = make_checkpoint(tmp_path / "dense", "llama")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q")
    write_adapter(tmp_path / "adapter", tensors)
    for name in ("dense", "q"):
        _with_odd_files(tmp_path / name, tmp_path / f"outside-{name}.txt")
    return tmp_path


@pytest.mark.parametrize("tool", ["quantize", "dequantize", "merge"])
def test_copied_files_keep_their_mode_and_never_come_from_outside(
    odd: Path, tool: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = odd
    source = d / ("q" if tool == "dequantize" else "dense")
    with socket.socket(socket.AF_UNIX) as s:
        monkeypatch.chdir(source)  # a relative name: socket paths are limited to ~107 bytes
        s.bind("socket")
        monkeypatch.undo()
        argv = {
            "quantize": ["quantize", str(source), str(d / "out"), "--json"],
            "dequantize": ["dequantize", str(source), str(d / "out"), "--json"],
            "merge": ["merge", str(source), str(d / "adapter"), str(d / "out"), "--json"],
        }[tool]
        code, out, err = _run(capsys, *argv)
    assert code == 0, err
    written = {p.name for p in (d / "out").iterdir()}
    weights = {"config.json", "model.safetensors"}
    assert written == COPIED | weights
    for name in COPIED - {"inside-link.json"}:
        assert (d / "out" / name).stat().st_mode == (source / name).stat().st_mode, name
        assert (d / "out" / name).read_bytes() == (source / name).read_bytes()
    # A link to a file inside the directory: a copy of that file, with its mode.
    link = d / "out" / "inside-link.json"
    assert not link.is_symlink() and link.read_bytes() == (source / "secret.json").read_bytes()
    assert stat.S_IMODE(link.stat().st_mode) == 0o600
    for f in (d / "out").iterdir():
        assert b"private" not in f.read_bytes() and b"root:" not in f.read_bytes()
    notes = json.loads(out)["notes"]
    assert {n.split()[2] for n in notes} == LEFT_OUT, notes
    assert all(n.startswith("not copied: ") for n in notes)
    assert sorted(err.splitlines()) == sorted(f"nybble {tool}: note: {n}" for n in notes)


def test_a_fifo_beside_the_weights_never_blocks_a_run(tmp_path: Path) -> None:
    """A FIFO (no writer ever comes) and a link to one: noted, never opened."""
    make_checkpoint(tmp_path / "dense", "llama")
    os.mkfifo(tmp_path / "dense" / "pipe")
    (tmp_path / "dense" / "pipe-link").symlink_to("pipe")
    done = subprocess.run(
        [sys.executable, "-m", "nybble", "quantize", str(tmp_path / "dense"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "not copied: pipe (a FIFO" in done.stderr
    assert "not copied: pipe-link (a FIFO" in done.stderr
    assert not (tmp_path / "o" / "pipe").exists()


def test_the_hugging_face_cache_layout_is_copied(tmp_path: Path) -> None:
    """In the Hub's cache every file of a snapshot is a link into the repository's blobs:
    those are copied (and only those: a link elsewhere is still left out)."""
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "abc123"
    make_checkpoint(tmp_path / "plain", "llama")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted((tmp_path / "plain").iterdir()):
        blob = repo / "blobs" / f"sha-{f.name}"
        f.rename(blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (tmp_path / "elsewhere.txt").write_text("private")
    (snapshot / "elsewhere.txt").symlink_to("../../../elsewhere.txt")
    report = quantize_checkpoint(snapshot, tmp_path / "out")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"tokenizer.json", "generation_config.json", "README.md"} <= names
    assert "elsewhere.txt" not in names and report.notes == [
        "not copied: elsewhere.txt (a symbolic link to a file outside the checkpoint's directory)"
    ]
    # blobs as a link to another directory is not the cache's layout: left out.
    (repo / "blobs").rename(tmp_path / "real-blobs")
    (repo / "blobs").symlink_to(tmp_path / "real-blobs")
    report = quantize_checkpoint(snapshot, tmp_path / "out2")
    assert "tokenizer.json" not in {p.name for p in (tmp_path / "out2").iterdir()}
    assert "not copied: tokenizer.json (a symbolic link to a file outside" in "\n".join(
        report.notes
    )


# --- 6. errors a user can act on --------------------------------------------------------------


def _add_tensor(path: Path, name: str, dtype: str, shape: list[int], data: bytes) -> None:
    """Appends a tensor to a safetensors file by rewriting its header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    header[name] = {
        "dtype": dtype,
        "shape": shape,
        "data_offsets": [len(body), len(body) + len(data)],
    }
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + body + data)


@pytest.mark.parametrize("dtype", ["F6_E2M3", "F6_E3M2"])
def test_a_dtype_nybble_does_not_read_is_named(
    tmp_path: Path, dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make_checkpoint(tmp_path / "dense", "llama")
    shard = tmp_path / "dense" / "model.safetensors"
    _add_tensor(shard, "model.mx.weight", dtype, [2, 4], b"\0" * 6)
    for call in (
        lambda: safetensors_io.SafeTensorsFile(shard),
        lambda: quantize_checkpoint(tmp_path / "dense", tmp_path / "o"),
        lambda: inspect_checkpoint(tmp_path / "dense"),
    ):
        with pytest.raises(FormatError) as e:
            call()
        assert e.value.field == "model.mx.weight" and e.value.source == str(shard)
        assert f"dtype {dtype}, which nybble does not read" in e.value.problem
        assert "F32, F16, BF16" in e.value.problem
    code, _, err = _run(capsys, "quantize", str(tmp_path / "dense"), str(tmp_path / "o"))
    assert code == 1 and "model.mx.weight: dtype" in err and "does not read" in err


@pytest.mark.parametrize(
    "shape", [[2**63, 0], [2**61, 0], [2**31, 2**31, 0], [1] * 65 + [0], [0] * 70]
)
def test_a_shape_numpy_cannot_hold_is_named(tmp_path: Path, shape: list[int]) -> None:
    """An empty tensor of a huge shape is valid safetensors; numpy cannot make it."""
    make_checkpoint(tmp_path / "dense", "llama")
    shard = tmp_path / "dense" / "model.safetensors"
    _add_tensor(shard, "model.huge.weight", "F32", shape, b"")
    for call in (
        lambda: safetensors_io.load(shard),
        lambda: quantize_checkpoint(tmp_path / "dense", tmp_path / "o"),
        lambda: inspect_checkpoint(tmp_path / "dense"),
    ):
        with pytest.raises(FormatError) as e:
            call()
        assert e.value.field == "model.huge.weight"
        assert f"shape {shape}" in e.value.problem and "numpy" in e.value.problem


def test_sizes_are_read_exactly_and_huge_ones_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1GiB") == 2**30
    assert parse_size("5.1GB") == 5_100_000_000  # no float rounding
    assert parse_size("1.5kib") == 1536 and parse_size(" 7 ") == 7
    assert parse_size(str(2**64 - 1)) == 2**64 - 1
    for bad in ("9" * 400, "9" * 5000 + "GB", 2**64, 2**200, str(2**64), "20000000TB"):
        with pytest.raises(ValueError, match="max_shard_size must be below 2\\*\\*64"):
            parse_size(bad)
    with pytest.raises(ValueError, match="max_shard_size must be at least 1 byte"):
        parse_size("0." + "0" * 5000 + "1")
    make_checkpoint(tmp_path / "dense", "llama")
    with pytest.raises(ValueError, match="max_shard_size"):
        quantize_checkpoint(tmp_path / "dense", tmp_path / "o", max_shard_size="9" * 400)
    d = str(tmp_path)
    code, _, err = _run(capsys, "quantize", f"{d}/dense", f"{d}/o", "--max-shard-size", "9" * 400)
    assert code == 1 and "max_shard_size must be below" in err and len(err) < 300
    assert not (tmp_path / "o").exists()


def test_the_shard_size_help_says_what_a_gb_is(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("quantize", "dequantize", "merge"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "GB = 10^9 bytes" in text and "GiB = 2^30 bytes" in text, command


def test_a_name_held_twice_is_named_with_where(tmp_path: Path) -> None:
    # In the input: two shards holding one name.
    make_checkpoint(tmp_path / "dense", "llama", shards=2)
    index = json.loads((tmp_path / "dense" / "model.safetensors.index.json").read_text())
    name, first = next(iter(index["weight_map"].items()))
    second = next(f for f in sorted(set(index["weight_map"].values())) if f != first)
    shard = tmp_path / "dense" / second
    tensors = safetensors_io.load(shard)
    tensors[name] = safetensors_io.load(tmp_path / "dense" / first)[name]
    safetensors_io.save(tensors, shard, {"format": "pt"})
    with pytest.raises(FormatError) as e:
        quantize_checkpoint(tmp_path / "dense", tmp_path / "o")
    assert e.value.field == name and "appears twice" in e.value.problem
    assert first in e.value.problem and second in e.value.problem
    # In the output: a tensor of the input named as a quantized weight's own tensor.
    config = make_config("llama")
    weights = random_weights(config)
    target = "model.layers.0.mlp.up_proj.weight"
    for layout, part in (("bnb", "absmax"), ("bnb", "quant_map"), ("nybble", "codes")):
        clash = {**weights, f"{target}.{part}": np.ones(16, np.float32)}
        write_checkpoint(tmp_path / f"clash-{part}", config, clash)
        for size in ("1KB", "5GB"):  # the two in one shard, or in two
            with pytest.raises(FormatError) as e:
                quantize_checkpoint(
                    tmp_path / f"clash-{part}",
                    tmp_path / "o",
                    layout=layout,  # type: ignore[arg-type]
                    max_shard_size=size,
                )
            assert e.value.field == f"{target}.{part}"
            assert "two tensors of this name" in e.value.problem and target in e.value.problem
            assert not (tmp_path / "o").exists()
    # Dequantizing: a dense tensor named as a quantized weight.
    make_checkpoint(tmp_path / "plain", "llama")
    quantize_checkpoint(tmp_path / "plain", tmp_path / "q")
    shard = tmp_path / "q" / "model.safetensors"
    tensors = safetensors_io.load(shard)
    tensors[target] = np.zeros((2, 2), np.float32)
    safetensors_io.save(tensors, shard, {"format": "pt"})
    with pytest.raises(FormatError) as e:
        dequantize_checkpoint(tmp_path / "q", tmp_path / "o")
    assert e.value.field == target and "two tensors of this name" in e.value.problem


# --- 7. inspect --summary shows the errors it computed ----------------------------------------


def test_inspect_summary_shows_the_error_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_checkpoint(tmp_path / "dense", "llama")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q")
    d = str(tmp_path)
    result = inspect_checkpoint(tmp_path / "q", tmp_path / "dense")
    total = result.error_total
    assert total is not None and set(result.errors) == {"dense", "nf4 bs64 (nybble)"}
    compared = [e for e in result.entries if e.error is not None]
    assert total.weights == len(compared) == len(result.entries)
    assert total.max_abs == max(e.error.max_abs for e in compared if e.error)
    # the totals are those of all weights taken as one tensor, in float64
    from nybble.checkpoint import Checkpoint

    with Checkpoint(tmp_path / "dense") as ref:
        want = np.concatenate(
            [np.asarray(ref.read(e.name), np.float64).reshape(-1) for e in compared]
        )
    err = np.concatenate(
        [_dequantized(tmp_path / "q", e.name) - _flat(tmp_path / "dense", e.name) for e in compared]
    )
    assert total.relative_rmse == pytest.approx(
        np.sqrt(np.mean(err**2)) / np.sqrt(np.mean(want**2)), rel=1e-9
    )
    assert total.mean_abs == pytest.approx(np.mean(np.abs(err)), rel=1e-9)
    assert result.errors["dense"].relative_rmse == 0.0 and result.errors["dense"].snr_db is None
    nf4 = result.errors["nf4 bs64 (nybble)"]
    assert nf4.max_block_relative is not None and nf4.max_block_relative < 0.16
    for argv in (["--summary"], []):
        code, out, _ = _run(capsys, "inspect", f"{d}/q", "--reference", f"{d}/dense", *argv)
        assert code == 0
        line = next(
            x for x in out.splitlines() if x.startswith("nf4 bs64 (nybble)  ") and "0." in x
        )
        assert f"{nf4.relative_rmse:.4g}" in line and f"{nf4.snr_db:.1f}" in line
        assert "rel rmse" in out and "vs reference" in out
    code, out, _ = _run(
        capsys, "inspect", f"{d}/q", "--reference", f"{d}/dense", "--summary", "--json"
    )
    summary = json.loads(out)
    assert "entries" not in summary
    assert summary["error_total"]["relative_rmse"] == pytest.approx(total.relative_rmse)
    assert summary["errors"]["nf4 bs64 (nybble)"]["weights"] == nf4.weights
    # without a reference: no error figures, none computed
    assert inspect_checkpoint(tmp_path / "q").error_total is None


def _flat(directory: Path, name: str) -> np.ndarray:
    from nybble.checkpoint import Checkpoint

    with Checkpoint(directory) as c:
        return np.asarray(c.read(name), np.float64).reshape(-1)


def _dequantized(directory: Path, name: str) -> np.ndarray:
    from nybble.checkpoint import Checkpoint, find_groups, load_group

    with Checkpoint(directory) as c:
        groups = find_groups(c.names(), directory)
        if name in groups:
            q = load_group(groups[name], c.read, c.file_of)
            return np.asarray(q.dequantize("float32"), np.float64).reshape(-1)
        return np.asarray(c.read(name), np.float64).reshape(-1)


# --- 8. dequantizing a dense checkpoint -------------------------------------------------------


def test_dequantizing_a_dense_checkpoint_says_there_is_nothing_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_checkpoint(tmp_path / "dense", "llama", shards=2)
    with pytest.raises(FormatError, match="holds no quantized weight") as e:
        dequantize_checkpoint(tmp_path / "dense", tmp_path / "o")
    assert e.value.source == str(tmp_path / "dense")
    code, out, err = _run(capsys, "dequantize", str(tmp_path / "dense"), str(tmp_path / "o"))
    assert code == 1 and out == "" and "nothing to dequantize" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(SystemExit):
        main(["dequantize", "--help"])
    assert "without any quantized weight" in " ".join(capsys.readouterr().out.split())
