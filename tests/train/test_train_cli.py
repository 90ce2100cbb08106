"""`nybble train`: a run writes the adapter (PEFT files), the losses, the loss curve and a
checkpoint; a run killed with SIGKILL at several points and resumed ends with exactly the
losses of an uninterrupted run; errors exit 1 with one line, usage errors 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nybble import LoraAdapter, safetensors_io
from nybble.cli import main
from nybble.train import TransformerConfig

FAST = ["--batch-size", "2", "--seq-len", "16", "--no-plot"]


def nybble(*args: str) -> list[str]:
    return [sys.executable, "-m", "nybble", "train", *args]


def results(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "losses.json").read_text())
    return data


def test_a_run_writes_its_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "30", "--save-base", "--json", *FAST]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 30 and summary["mode"] == "lora"
    r = results(out)
    assert len(r["losses"]) == 30 and r["final_loss"] == r["losses"][-1]
    assert r["final_loss"] < r["first_loss"]
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter",
        "base",
        "checkpoint.safetensors",
        "config.json",
        "losses.json",
    ]
    assert TransformerConfig.from_hf(out) == TransformerConfig.tiny()
    base = safetensors_io.load(out / "base" / "model.safetensors")
    adapter = LoraAdapter.from_pretrained(out / "adapter", base)
    assert len(adapter) == 14  # 7 projections x 2 layers (all-linear)


def test_the_loss_curve(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--steps", "6", "--batch-size", "2", "--seq-len", "8"]
    assert main(args) == 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_everything_but_the_plot_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "run"
    args = ["--steps", "2", "--save-base", "--batch-size", "2", "--seq-len", "16"]
    assert main(["train", "--out", str(out), *args]) == 0
    err = capsys.readouterr().err
    assert err.count("loss.png skipped") == 1 and "nybble[plot]" in err
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert (out / "base" / "model.safetensors").exists() and not (out / "loss.png").exists()


def test_full_fine_tuning_and_qlora(tmp_path: Path) -> None:
    assert main(["train", "--out", str(tmp_path / "full"), "--full", "--steps", "5", *FAST]) == 0
    assert (tmp_path / "full" / "model" / "model.safetensors").exists()
    assert results(tmp_path / "full")["mode"] == "full"
    args = ["--quant", "nf4", "--targets", "q_proj,v_proj", "--lora-r", "4", "--steps", "5"]
    assert main(["train", "--out", str(tmp_path / "q"), *args, *FAST]) == 0
    config = json.loads((tmp_path / "q" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    "args",
    [
        ["--steps", "0"],
        ["--targets", ","],
        ["--lora-r", "0"],
        ["--lora-r", "65"],
        ["--lr", "-1"],
        ["--config", "/nonexistent/config.json"],
        ["--full", "--quant", "nf4"],
        ["--seq-len", "100000"],
        ["--batch-size", "1000000000000"],
        ["--lr", "1e308"],
        ["--targets", "bogus_proj"],
        ["--epochs", "0"],
    ],
)
def test_errors_exit_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    assert main(["train", "--out", str(tmp_path / "run"), "--no-plot", *args]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("nybble train: error:")


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train", "--quant", "fp8"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["train", "--steps", "many"])
    assert e.value.code == 2


def test_an_existing_run_needs_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "run")
    assert main(["train", "--out", out, "--steps", "4", *FAST]) == 0
    assert main(["train", "--out", out, "--steps", "4", *FAST]) == 1
    capsys.readouterr()
    # the run's settings are part of the checkpoint: another rank cannot resume it
    assert main(["train", "--out", out, "--resume", "--lora-r", "4", "--steps", "8", *FAST]) == 1
    assert "lora" in capsys.readouterr().err
    assert main(["train", "--out", out, "--resume", "--steps", "8", "--seq-len", "8"]) == 1
    assert main(["train", "--out", out, "--resume", "--steps", "8", *FAST]) == 0
    assert len(results(tmp_path / "run")["losses"]) == 8


def test_killed_and_resumed_runs_end_with_the_same_losses(tmp_path: Path) -> None:
    """SIGKILL at three points of a 1000-step run (checkpoints every 25 steps), resumed each
    time: every loss, the final one and the held-out one equal the uninterrupted run's. (The
    kills come early in the run, so a slow reader of the progress lines still kills it
    before it ends.)"""
    args = ["--steps", "1000", "--save-every", "25", "--log-every", "1", *FAST]
    straight = tmp_path / "straight"
    subprocess.run(nybble("--out", str(straight), *args), check=True, capture_output=True)
    want = results(straight)

    out = tmp_path / "killed"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for kill_at in (30, 130, 230):
        child = subprocess.Popen(
            nybble("--out", str(out), "--resume", *args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stderr is not None
        for line in child.stderr:
            if line.startswith(f"step {kill_at}/"):
                child.send_signal(signal.SIGKILL)
                break
        child.wait()
        child.stderr.close()
        assert child.returncode == -signal.SIGKILL, "the run ended before it was killed"
        assert not (out / "losses.json").exists()
    subprocess.run(nybble("--out", str(out), "--resume", *args), check=True, capture_output=True)
    got = results(out)
    assert got["losses"] == want["losses"]
    assert got["final_loss"] == want["final_loss"]
    assert got["held_out_loss"] == want["held_out_loss"]
    assert safetensors_io.load(out / "adapter" / "adapter_model.safetensors").keys() == (
        safetensors_io.load(straight / "adapter" / "adapter_model.safetensors").keys()
    )
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_model_larger_than_memory_is_refused_before_it_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    fields = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "vocab_size": 256,
              "num_hidden_layers": 1_000_000}  # fmt: skip
    config.write_text(json.dumps(fields))
    started = time.perf_counter()
    assert main(["train", "--out", str(tmp_path / "run"), "--config", str(config)]) == 1
    assert time.perf_counter() - started < 5
    err = capsys.readouterr().err
    assert "more than this machine's" in err and err.count("\n") == 1


def test_a_large_model_on_the_cpu_is_announced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import nybble.cli.train as cli

    monkeypatch.setattr(cli, "_physical_memory", lambda: 2**50)
    built: list[object] = []
    monkeypatch.setattr(
        cli, "Trainer", lambda *a, **k: built.append(a) or (_ for _ in ()).throw(KeyboardInterrupt)
    )
    config = tmp_path / "config.json"
    fields = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "num_hidden_layers": 32}  # fmt: skip
    config.write_text(json.dumps(fields))
    assert main(["train", "--out", str(tmp_path / "run"), "--config", str(config)]) == 130
    assert "8.03B parameters on the CPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    "record",
    [
        {"losses": 5},
        {"losses": [None]},
        {"losses": ["x"]},
        "deep",
    ],
)
def test_a_corrupt_checkpoint_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record: object
) -> None:
    from nybble import safetensors_io
    from nybble.train.trainer import CHECKPOINT_KEY

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "2", "--no-plot", *FAST]) == 0
    path = out / "checkpoint.safetensors"
    with safetensors_io.SafeTensorsFile(path) as f:
        tensors = {k: np.array(f.get(k)) for k in f.keys()}
        meta = json.loads(f.metadata[CHECKPOINT_KEY])
    if record == "deep":
        text = "[" * 100_000 + "]" * 100_000
    else:
        meta["extra"].update(record)  # type: ignore[arg-type]
        text = json.dumps(meta)
    safetensors_io.save(tensors, path, {CHECKPOINT_KEY: text})
    capsys.readouterr()
    code = main(["train", "--out", str(out), "--resume", "--steps", "4", "--no-plot", *FAST])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err


def test_the_help_shows_only_defaults_that_say_something(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: True)" not in text
    assert "(default: False)" not in text and "(default: 2 x r) (default" not in text
