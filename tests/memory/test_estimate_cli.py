"""`nybble estimate`: table, JSON, GPU verdict, plot, and one-line errors with exit code 1."""

from __future__ import annotations

import importlib.util
import io
import json
import re
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
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}))
    assert main(["estimate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "intermediate_size" in err and str(path) in err and err.count("\n") == 1


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


# --- a CLI that explains itself (issue 19) ----------------------------------------------


def test_help_shows_defaults_gpus_units_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    for needle in ("default: 2048", "default: 16", "default: plain", "rtx4090", "H100 80GB"):
        assert needle in out, needle
    assert "24GB = 24GiB" in out and "examples:" in out and "--context" in out
    assert 'pip install "nybble[plot]"' in out


@pytest.mark.parametrize("name", ["h100", "H100-80GB", "a100", "rtx4090", "RTX 4090", "A100-40G"])
def test_gpu_names_are_read_loosely(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tiny", "-s", "64", "--json", "--gpu", name]) == 0
    gpu = json.loads(capsys.readouterr().out)["gpu"]
    assert gpu["fits"] is True and gpu["bytes"] > 20 * 2**30


def test_a_misspelt_gpu_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tiny", "--gpu", "rtx4900"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean" in err and "rtx4090" in err


def test_gpu_sizes_are_binary_like_the_labels(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tiny", "-s", "64", "--json", "--gpu", "24GB"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"]["bytes"] == 24 * 2**30


def test_outside_part_margin_and_context_override(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tiny", "-s", "64", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["breakdown"]["outside_allocator"] == d["context_bytes"] == 742 * 2**20
    assert d["total_bytes"] == sum(d["breakdown"].values())
    assert d["margin_bytes"] > 0
    assert main(["estimate", "tiny", "-s", "64", "--json", "--context", "1GiB"]) == 0
    e = json.loads(capsys.readouterr().out)
    assert e["context_bytes"] == e["breakdown"]["outside_allocator"] == 2**30
    assert e["total_bytes"] - d["total_bytes"] == 2**30 - 742 * 2**20
    assert e["context_source"] == "given"


def test_table_shows_the_outside_part_and_the_margin(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tiny", "-s", "64"]) == 0
    out = capsys.readouterr().out
    assert "outside allocator" in out and "allocator cache" in out and "margin:" in out


def test_when_nothing_fits_the_smallest_change_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "qwen3-0.6b", "-s", "2048", "--no-grad-checkpointing"]
    assert main([*args, "--gpu", "rtx4060", "--json"]) == 0
    gpu = json.loads(capsys.readouterr().out)["gpu"]
    assert gpu["fits"] is False
    settings = [x["setting"] for x in gpu["suggestions"]]
    assert settings[0] == "grad_checkpointing"
    assert all(x["required_bytes"] <= gpu["bytes"] for x in gpu["suggestions"])
    assert main([*args, "--gpu", "rtx4060"]) == 0
    assert "smallest change that fits: turn gradient checkpointing on" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["tiny", "--gpu", "99999999999999999999"],
        ["tiny", "--gpu", "1e400"],
        ["tiny", "--context", "-1"],
        ["tiny", "--batch", "99999999999999999999"],
        ["tiny", "--lora-dropout", "nan"],
        ["tiny", "--loop", "weird"],
    ],
)
def test_absurd_values_end_in_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(["estimate", *args])
    except SystemExit as e:  # argparse refuses choices itself: usage, exit 2
        rc = int(e.code or 0) if isinstance(e.code, int) else 2
        assert rc == 2
        return
    assert rc == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_special_files_are_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import time

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        t0 = time.monotonic()
        assert main(["estimate", path]) == 1
        assert time.monotonic() - t0 < 5
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_hub_id_from_the_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from nybble.memory import MODEL_PRESETS

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["estimate", "Qwen/Qwen3-4B", "-s", "64"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err and "Qwen/Qwen3-4B" in err
    snapshot = tmp_path / "models--Qwen--Qwen3-4B" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(MODEL_PRESETS["qwen3-4b"]))
    (tmp_path / "models--Qwen--Qwen3-4B" / "refs").mkdir()
    (tmp_path / "models--Qwen--Qwen3-4B" / "refs" / "main").write_text("0123abcd")
    assert main(["estimate", "Qwen/Qwen3-4B", "-s", "64", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["model"] == "Qwen/Qwen3-4B" and d["parameters"] == 4_022_468_096


def test_missing_matplotlib_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "mem.png"
    assert main(["estimate", "tiny", "-s", "64", "--plot", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nybble[plot]" in err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_the_installed_entry_point() -> None:
    """`nybble estimate` as a user runs it: the console script of the installed package."""
    import shutil
    import subprocess

    exe = shutil.which("nybble") or str(Path(sys.executable).parent / "nybble")
    if not Path(exe).exists():
        pytest.skip("the nybble console script is not installed here")
    done = subprocess.run(
        [exe, "estimate", "tiny", "-s", "64", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total_bytes"] > 0
    bad = subprocess.run(
        [exe, "estimate", "tiny", "--gpu", "lots"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    usage = subprocess.run([exe, "estimate"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2


# --- first contact (issue 39) ---------------------------------------------------------------


def _help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    return capsys.readouterr().out


def test_a_bare_gpu_size_is_gib_as_on_the_label(capsys: pytest.CaptureFixture[str]) -> None:
    for text, want in (("24", 24 * 2**30), ("0.5", 2**29), (" 80 ", 80 * 2**30)):
        assert main(["estimate", "tiny", "-s", "64", "--json", "--gpu", text]) == 0
        gpu = json.loads(capsys.readouterr().out)["gpu"]
        assert gpu["bytes"] == want and gpu["fits"] is (want > 2**30)
    help_text = " ".join(_help(capsys).split())
    assert "in GiB (24, 24GB or 24GiB" in help_text and "24 = 24GiB" in help_text


def test_a_bare_context_needs_its_unit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tiny", "--context", "751"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "751MiB" in err and "unit" in err


def test_help_has_no_doubled_or_empty_defaults_and_states_units(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = " ".join(_help(capsys).split())
    for wrong in ("(default: None)", "(default: True)", "(default: False)"):
        assert wrong not in text, wrong
    assert not re.search(r"default[^()]*\) \(default:", text)  # a default said twice
    options = text.split(" options: ", 1)[1].split(" sizes: ", 1)[0]
    for needle in (
        "its memory in GiB",  # --gpu
        "4 or 8 bits a weight",  # --quant
        "weights per quantization scale",  # --blocksize
        "it is on by default",  # --no-grad-checkpointing
        "by default they are quantized to 8 bits",  # --no-double-quant
        "sequences per training step",  # --batch
        "tokens per sequence (default: 2048)",  # --seq-len
        "4 bytes a value",  # --lora-dtype
        "a probability from 0",  # --lora-dropout
        "with its unit (751MiB, 0.75GiB)",  # --context
        "memory (GiB) against sequence length (tokens)",  # --plot
    ):
        assert needle in options, needle


def test_a_gpu_given_as_a_size_is_named_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "tiny", "-s", "64", "--gpu", "24GB"]) == 0
    out = capsys.readouterr().out
    assert "a GPU of 24.00 GiB: fits" in out and "24.00 GiB, 24.00 GiB" not in out
    assert main(["estimate", "tiny", "-s", "64", "--gpu", "rtx4090"]) == 0
    assert "rtx4090 (RTX 4090 24GB, 23.99 GiB): fits" in capsys.readouterr().out


def test_a_model_type_it_does_not_model_is_named_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nybble.memory import MODEL_PRESETS

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(MODEL_PRESETS["tiny"], model_type="gemma2")))
    assert main(["estimate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "model_type: 'gemma2' is not one" in err and "model_type: model_type" not in err


def test_the_verdict_says_when_only_the_replayed_total_would_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 39's run needed 3.65 GiB: a GPU of 3.6 GiB gets no "fits"."""
    args = ["estimate", "llama-3.2-1b", "-s", "512", "--gpu", "3.6"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "a GPU of 3.60 GiB: does NOT fit" in out
    assert "the table's total (3.40 GiB) alone would fit" in out
    assert "note: the verdicts count, beyond the total: one more block" in out


def test_a_smaller_batch_keeps_the_effective_batch() -> None:
    """docs/estimator.md: the suggestion that lowers the batch accumulates gradients over the
    steps that keep the effective batch (6 = 3 x 2, never "batch 4 ... effective batch 8")."""
    from nybble.memory import estimate_memory

    for batch in (6, 5, 8):
        est = estimate_memory("qwen3-0.6b", batch=batch, seq_len=2048)
        gpu = (est.required_bytes + est._at(batch=1).required_bytes) // 2
        found = [x for x in est.suggestions(gpu) if x.setting == "batch"]
        assert found, batch
        b = found[0].value
        assert batch % b == 0 and b < batch and found[0].required_bytes <= gpu
        assert (
            f"over {batch // b} steps (the effective batch stays {batch})" in found[0].description
        )
        assert est.max_batch(gpu) >= b


def test_a_mixture_of_experts_that_cannot_fit_says_why_and_what_to_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["estimate", "mixtral-8x7b", "-s", "512", "--gpu", "h100"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "does NOT fit" in out
    assert "the fused experts are not quantized" in out and "bitsandbytes does not quantize" in out
    assert "the unquantized fused experts alone take" in out
    assert "Left in bfloat16" in out  # what to change


def test_the_package_namespace_shows_the_public_api() -> None:
    import nybble

    shown = dir(nybble)
    for helper in ("Any", "TYPE_CHECKING", "importlib", "annotations", "_core", "tensor"):
        assert helper not in shown, helper
    assert set(nybble.__all__) <= set(shown) and "__version__" in shown
    assert nybble.__all__ == [
        "AdamW",
        "FormatError",
        "LoraAdapter",
        "LoraConfig",
        "LoraLinear",
        "NF4Tensor",
        "NonFiniteError",
        "QLoraLinear",
        "bnb",
        "dequantize",
        "estimate_memory",
        "quantize",
        "reference",
    ]
    for name in shown:  # every name shown is there, the lazy ones loaded on first use
        assert getattr(nybble, name) is not None
