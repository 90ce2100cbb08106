"""`nybble estimate`: table, JSON, GPU verdict, plot, and one-line errors with exit code 1."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest

from nybble.cli import main


def test_table_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "qwen3-4b", "--gpu", "rtx4090"]) == 0
    out = capsys.readouterr().out
    for word in ("quantized weights", "optimizer states", "logits loss", "total", "rtx4090"):
        assert word in out
    assert "largest batch" in out and "longest seq_len" in out


def test_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "llama-3.1-8b", "--json", "--gpu", "24GiB", "-b", "2", "-s", "1024"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["parameters"] == 8_030_261_248
    assert d["settings"]["batch"] == 2 and d["settings"]["seq_len"] == 1024
    assert d["total_bytes"] == sum(d["breakdown"].values())
    assert d["allocated_peak_bytes"] <= d["reserved_peak_bytes"] < d["total_bytes"]
    assert isinstance(d["gpu"]["fits"], bool) and d["gpu"]["bytes"] == 24 * 2**30


def test_options_reach_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "qwen3-0.6b", "--json", "-s", "512"]
    assert main(base) == 0
    a = json.loads(capsys.readouterr().out)
    assert main([*base, "--no-grad-checkpointing", "--targets", "q_proj,v_proj", "-r", "8"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert b["settings"]["grad_checkpointing"] is False
    assert b["settings"]["targets"] == ["q_proj", "v_proj"] and b["settings"]["lora_r"] == 8
    assert b["lora_parameters"] < a["lora_parameters"]


def test_config_json_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nybble.memory import MODEL_PRESETS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MODEL_PRESETS["mistral-7b"]))
    assert main(["estimate", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] > 7e9


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["gpt-17"], "qwen3-4b"),
        (["qwen3-4b", "--lora-r", "0"], "lora_r"),
        (["qwen3-4b", "--batch", "-2"], "batch"),
        (["qwen3-4b", "--seq-len", "0"], "seq_len"),
        (["qwen3-4b", "--gpu", "24 parsecs"], "24 parsecs"),
        (["qwen3-4b", "--quant", "nf3"], "nf3"),
        (["qwen3-4b", "--framework", "nope"], "peft-bnb"),
        (["/nonexistent/config.json"], "config.json"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["estimate", *args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nybble estimate: error:")
    assert needle in err
    assert "Traceback" not in err


def test_missing_config_field_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    assert main(["estimate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "'intermediate_size'" in err and err.count("\n") == 1


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mem.png"
    rc = main(["estimate", "qwen3-0.6b", "--plot", str(out), "--gpu", "rtx4090"])
    if importlib.util.find_spec("matplotlib") is None:
        assert rc == 1
        assert "matplotlib" in capsys.readouterr().err
        assert not out.exists()
    else:
        assert rc == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_closed_pipe_is_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """`nybble estimate ... | head`: the reader leaving early ends the command quietly."""

    class ClosedPipe(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["estimate", "tiny", "--json"]) == 0
