"""The checkpoint subcommands (`nybble quantize / dequantize / merge / inspect`): exit codes,
one-line errors, JSON reports, and real runs killed with SIGKILL at random moments, which
must leave OUT either absent (or as it was) or complete."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nybble.cli import main
from tests.checkpoint.test_checkpoint_fixtures import (
    make_checkpoint,
    make_config,
    write_adapter,
    write_checkpoint,
)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_commands_and_their_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, tensors = make_checkpoint(tmp_path / "dense", "llama", shards=2)
    d = str(tmp_path)
    code, out, err = _run(
        capsys, "quantize", f"{d}/dense", f"{d}/q", "--format", "bnb", "--double-quant"
    )
    assert code == 0 and err == "" and out.startswith(f"{d}/q: 14 quantized, 7 copied")
    code, out, _ = _run(capsys, "dequantize", f"{d}/q", f"{d}/back", "--dtype", "bf16", "--json")
    report = json.loads(out)
    assert code == 0 and report["dequantized"] == 14 and report["action"] == "dequantize"
    assert "model.safetensors" in report["files"] and report["bytes_written"] > 0
    write_adapter(tmp_path / "ad", tensors)
    code, out, _ = _run(capsys, "merge", f"{d}/q", f"{d}/ad", f"{d}/m", "--max-shard-size", "50KB")
    assert code == 0 and "6 merged" in out
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    code, out, _ = _run(capsys, "inspect", f"{d}/q", "--reference", f"{d}/dense")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["tensor", "kind", "format"]
    q_row = next(
        line for line in lines if line.startswith("model.layers.0.self_attn.q_proj.weight ")
    )
    assert "nf4 bs64 dq (bnb)" in q_row
    code, out, _ = _run(capsys, "inspect", f"{d}/q/model.safetensors", "--json", "--summary")
    summary = json.loads(out)
    assert code == 0 and "entries" not in summary
    assert summary["kinds"]["attention"]["parameters"] == sum(
        v.size for k, v in tensors.items() if "self_attn" in k
    )
    assert summary["total"]["bits_per_parameter"] < 16


def test_bad_input_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_checkpoint(tmp_path / "dense", "llama")
    d = str(tmp_path)
    (tmp_path / "exists").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not a header}")
    cases = [
        ("quantize", f"{d}/dense", f"{d}/exists"),
        ("quantize", f"{d}/broken", f"{d}/o1"),
        ("quantize", f"{d}/dense", f"{d}/o2", "--targets", "nope"),
        ("quantize", f"{d}/dense", f"{d}/o3", "--blocksize", "48"),
        ("quantize", f"{d}/dense", f"{d}/o4", "--max-shard-size", "lots"),
        ("dequantize", f"{d}/missing", f"{d}/o5"),
        ("dequantize", f"{d}/dense", f"{d}/o6", "--dtype", "int4"),
        ("merge", f"{d}/dense", f"{d}/dense", f"{d}/o7"),
        ("inspect", f"{d}/broken"),
    ]
    for argv in cases:
        code, out, err = _run(capsys, *argv)
        assert code == 1, argv
        assert err.count("\n") == 1 and err.startswith(f"nybble {argv[0]}: error: "), err
        assert "Traceback" not in err and out == ""
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 8))
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(SystemExit) as e:
        main(["quantize", f"{d}/dense"])
    assert e.value.code == 2


def test_device_cuda_without_cupy_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    make_checkpoint(tmp_path / "dense", "llama")
    code, _, err = _run(
        capsys, "quantize", str(tmp_path / "dense"), str(tmp_path / "o"), "--device", "cuda"
    )
    assert code == 1 and "CuPy" in err and err.count("\n") == 1


# --- kills ---------------------------------------------------------------------------------

KILLS = 24
KILLS_OVER_AN_EXISTING_OUT = 12


def _snapshot(directory: Path) -> dict[str, bytes] | None:
    if not directory.exists():
        return None
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _start(*argv: str) -> subprocess.Popen[bytes]:
    """A run to be killed."""
    return subprocess.Popen(
        [sys.executable, "-m", "nybble", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _complete(*argv: str) -> None:
    """A run that must succeed."""
    done = subprocess.run(
        [sys.executable, "-m", "nybble", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def _wait_for_staging(out: Path, p: subprocess.Popen[bytes], limit: float) -> float:
    """Seconds until the run's staging directory appears beside OUT (or it ends)."""
    start = time.monotonic()
    while time.monotonic() - start < limit and p.poll() is None:
        if any(x.name.startswith(f".{out.name}.") for x in out.parent.iterdir()):
            break
        time.sleep(0.001)
    return time.monotonic() - start


def _kill_runs(
    argv: list[str],
    out: Path,
    kills: int,
    timing: tuple[float, float],
    before: dict[str, bytes] | None,
    after: dict[str, bytes],
    seed: int,
) -> None:
    """Kills `kills` runs: every other one at a random moment of the whole run, the others
    at a random moment after the output's staging directory appears (while files are being
    written and renamed). `timing`: (whole run, writing) in seconds."""
    rng = random.Random(seed)
    outcomes = {"before": 0, "after": 0}
    total, writing = timing
    for i in range(kills):
        p = _start(*argv)
        if i % 2:
            _wait_for_staging(out, p, total * 3)
            time.sleep(rng.uniform(0.0, writing * 1.2))
        else:
            time.sleep(rng.uniform(0.0, total * 1.1))
        p.send_signal(signal.SIGKILL)
        p.wait()
        seen = _snapshot(out)
        assert seen in (before, after), f"kill {i} (seed {seed}) left {sorted(seen or {})}"
        outcomes["before" if seen == before else "after"] += 1
        if seen == after:
            _restore(out, before)
    # a finished run removes what the killed ones left beside OUT
    _complete(*argv, "--force")
    assert _snapshot(out) == after
    assert [x.name for x in out.parent.iterdir() if x.name.startswith(f".{out.name}.")] == []
    assert outcomes["before"] > 0


def _restore(out: Path, files: dict[str, bytes] | None) -> None:
    shutil.rmtree(out, ignore_errors=True)
    if files is not None:
        out.mkdir()
        for name, data in files.items():
            (out / name).write_bytes(data)


def test_killed_runs_leave_nothing_or_a_complete_output(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    config = make_config("llama")
    tensors = {
        f"model.layers.{i}.mlp.{p}.weight": rng.standard_normal((512, 1024)).astype(np.float32)
        for i in range(6)
        for p in ("up_proj", "down_proj")
    }
    write_checkpoint(tmp_path / "dense", config, tensors)
    out = tmp_path / "out"
    argv = [
        "quantize",
        str(tmp_path / "dense"),
        str(out),
        "--format",
        "bnb",
        "--max-shard-size",
        "400KB",
    ]
    start = time.monotonic()
    _complete(*argv)
    total = time.monotonic() - start
    timing = (total, max(0.05, total - _import_seconds()))
    after = _snapshot(out)
    assert after is not None and len([n for n in after if n.endswith(".safetensors")]) > 4
    seed = int(time.strftime("%Y%m%d"))
    _restore(out, None)
    _kill_runs(argv, out, KILLS, timing, None, after, seed)
    # over an existing OUT with --force: the old one or the new one, whole
    _restore(out, None)
    old_argv = ["quantize", str(tmp_path / "dense"), str(out), "--max-shard-size", "400KB"]
    _complete(*old_argv)
    before = _snapshot(out)
    assert before is not None and before != after
    _kill_runs([*argv, "--force"], out, KILLS_OVER_AN_EXISTING_OUT, timing, before, after, seed + 1)


def _import_seconds() -> float:
    """How long the command takes to start (Python, numpy, nybble), measured."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "nybble", "--help"], capture_output=True, check=True)
    return time.monotonic() - start
